"""Scenario of tests/test_family_dsa_deepgemm.py, run once per release in a fresh interpreter
(``run_scenario``) under Triton's interpreter on CPU.

Arguments (JSON): the path of the tiny DeepSeek-V3.2's config.json, max_num_seqs and the CUDA-graph
capture sizes. It resolves the family's DeepGEMM wrappers, plans the family on this CPU, then
with the stand-ins (each labelled ``STAND-IN``; the test module's docstring says why) plans and
runs it and drives production's builder and indexer op on small batches, recording every call
that reaches DeepGEMM. Prints one ``KWARM-DG-RESULT`` line of JSON.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import sys
import types

import torch
import vllm

# Production's modules, imported before any platform stand-in (0.26's attention package picks
# its flash-attention import from the platform at import time).
from vllm.utils import deep_gemm as dg
import vllm.utils.import_utils as import_utils
from vllm.model_executor.layers import sparse_attn_indexer as sai
from vllm.v1.attention.backends.mla import indexer as vi
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.utils import AttentionGroup
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.model_executor.models import config as models_config
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.config.attention import AttentionConfig
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import dsa_indexer as fam

NS = types.SimpleNamespace
MAX_MODEL_LEN, BLOCK, TOKENS, NUM_BLOCKS = 8192, 64, 8192, 4
PREFIX = "model.layers.0.self_attn.indexer.k_cache"
# Set by configure() from the command line: the model config, its indexer's heads, head dim and
# top-k, max_num_seqs and the CUDA-graph capture sizes.
hf = H = D = TOPK = SEQS = CAPTURE_SIZES = None


def configure(config_path, seqs, capture_sizes):
    global hf, H, D, TOPK, SEQS, CAPTURE_SIZES
    hf = NS(**json.load(open(config_path)))
    H, D, TOPK = hf.index_n_heads, hf.index_head_dim, hf.index_topk
    SEQS, CAPTURE_SIZES = seqs, capture_sizes


def symbols(out):
    """1. The wrappers as the family resolves them, against vLLM's and production's bindings."""
    entries = fam.deep_gemm_entries()
    owners = {fam.MQA_LOGITS: sai, fam.PAGED_MQA_LOGITS: sai, fam.PAGED_METADATA: vi}
    out["problems"] = dict(entries.problems)
    out["entries"] = {
        name: {"module": fn.__module__, "qualname": fn.__qualname__,
               "is_vllm_wrapper": fn is getattr(dg, name, None),
               "is_production_binding": fn is getattr(owners[name], name, None),
               "params": list(inspect.signature(fn).parameters)}
        for name, fn in entries.fns.items()}
    out["flags"] = {f.name: getattr(entries, f.name) for f in dataclasses.fields(entries)
                    if f.name not in ("fns", "problems")}
    out["has_deep_gemm"] = bool(import_utils.has_deep_gemm())


# -- the engine: a real builder, cache layer, op and attention group ------------------------------
def attention_config(logits_dtype="auto"):
    """STAND-IN for AttentionConfig (its fields the op and builder read), with vLLM's own
    resolvers where the release has them (0.34's resolve_indexer_logits_dtype: "auto" -> the
    default the op passes; DeepSeek-V3.2's config hook resolves "auto" before, to float32 off SM100)."""
    config = NS(use_fp4_indexer_cache=False, sparse_mla_prefill_workspace_factor=5, hisparse_config=None,
                indexer_kv_dtype="auto", indexer_logits_dtype=logits_dtype)
    for name in ("resolve_indexer_kv_dtype", "resolve_indexer_logits_dtype"):
        real = getattr(AttentionConfig, name, None)
        setattr(config, name, functools.partial(real, config) if real else lambda default: default)
    return config


def make_config(spec_tokens=0, logits_dtype="auto"):
    speculative = NS(num_speculative_tokens=spec_tokens, enable_adaptive_verification=False) if spec_tokens else None
    return NS(  # STAND-IN for VllmConfig: the fields the builder, cache layer and op read
        scheduler_config=NS(max_num_batched_tokens=TOKENS, max_num_seqs=SEQS),
        model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=MAX_MODEL_LEN),
        parallel_config=NS(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                           prefill_context_parallel_size=1, tensor_parallel_size=1,
                           data_parallel_size=1, enable_expert_parallel=False,
                           pcp_shard_decode_requests=False),
        speculative_config=speculative, num_speculative_tokens=spec_tokens,
        attention_config=attention_config(logits_dtype),
        cache_config=NS(block_size=BLOCK),
        compilation_config=NS(static_forward_context={}, custom_ops=["all"], enabled_custom_ops=set(),
                              disabled_custom_ops=set(), cudagraph_mode=None,
                              cudagraph_capture_sizes=list(CAPTURE_SIZES)),
        # 0.33's op registers Triton warmups when enable_jit_warmup (no registry here)
        kernel_config=NS(enable_jit_warmup=False, sparse_indexer_topk_backend="auto"))


@contextlib.contextmanager
def platform(capability=(9, 0)):
    """STAND-IN for a CUDA GPU of `capability`: vLLM's platform answers CUDA, the builder
    reads 132 SMs, and has_deep_gemm() is True."""
    cls = type(current_platform)
    saved = {k: cls.__dict__.get(k) for k in ("is_cuda", "get_device_capability")}
    mods = [m for m in (import_utils, dg, vi, sai) if hasattr(m, "has_deep_gemm")]
    saved_has = [m.has_deep_gemm for m in mods]
    saved_units = vi.num_compute_units
    cls.is_cuda = classmethod(lambda c: True)
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(*capability))
    for m in mods:
        m.has_deep_gemm = lambda: True
    vi.num_compute_units = lambda index: 132
    clear_platform_caches()
    try:
        yield
    finally:
        clear_platform_caches()
        for k, v in saved.items():
            if v is None:
                delattr(cls, k)
            else:
                setattr(cls, k, v)
        for m, f in zip(mods, saved_has):
            m.has_deep_gemm = f
        vi.num_compute_units = saved_units


def clear_platform_caches():
    """Forget platform answers vLLM caches per process (0.33's mqa_logits_use_mx_scales)."""
    for module in (dg, vi, sai):
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper) and value.__module__ == module.__name__:
                value.cache_clear()


class IndexerModule(torch.nn.Module):
    """STAND-IN for the model's Indexer module: what the family reads from it (n_head,
    head_dim) and the real cache layer and op it owns."""

    def __init__(self, cache, op):
        super().__init__()
        self.n_head, self.head_dim = H, D
        self.k_cache, self.indexer_op = cache, op


def make_engine(*, spec_tokens=0, fp4=False, capability=(9, 0), eager=True, mode="FULL_AND_PIECEWISE",
                logits_dtype="auto"):
    config = make_config(spec_tokens, logits_dtype)
    width = D // 2 + D // 32 if fp4 else D + D // 128 * 4
    with set_current_vllm_config(config), platform(capability):
        # 0.34: DeepSeek-V3.2's config hook resolves "auto" (bfloat16 where the logits kernels
        # take MX inputs, SM100; float32 elsewhere), as verify_and_update_config does
        set_logits_dtype = getattr(models_config, "_set_deepseek_indexer_logits_dtype", None)
        if set_logits_dtype is not None:
            set_logits_dtype(config)
        cache = DeepseekV32IndexerCache(head_dim=width, dtype=torch.uint8, prefix=PREFIX,
                                        cache_config=config.cache_config)
        cache.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK, width, dtype=torch.uint8)  # the bound cache
        op_kwargs = {"use_fp4_cache": True} if fp4 else {}
        op = sai.SparseAttnIndexer(cache, 128, "ue8m0", TOPK, D, MAX_MODEL_LEN, MAX_MODEL_LEN * 40,
                                   torch.zeros(TOKENS, TOPK, dtype=torch.int32), **op_kwargs)
        spec = cache.get_kv_cache_spec(config)
        builder_cls = vi.DeepseekV32IndexerMetadataBuilder
        extra = ({"block_table_width": MAX_MODEL_LEN // BLOCK}
                 if "block_table_width" in inspect.signature(builder_cls.__init__).parameters else {})
        builder = builder_cls(spec, [PREFIX], config, torch.device("cpu"), **extra)
    group = AttentionGroup(backend=vi.DeepseekV32IndexerBackend, layer_names=[PREFIX],
                           kv_cache_spec=spec, kv_cache_group_id=1)
    group.metadata_builders = [builder]
    model = torch.nn.Module()
    model.indexer = IndexerModule(cache, op)
    runner = NS(attn_groups=[[group]], device=torch.device("cpu"), vllm_config=config, model=model,
                is_pooling_model=False)
    view = EngineView(vllm_version=vllm.__version__, runner_kind="V1", model_type=hf.model_type,
                      backends=[["FLASHMLA_SPARSE"], ["DEEPSEEK_V32_INDEXER"]], device="cpu",
                      max_num_batched_tokens=TOKENS, max_num_reqs=SEQS, enforce_eager=eager,
                      cudagraph_mode="NONE" if eager else mode, is_pooling_model=False,
                      worker=NS(vllm_config=config, model_runner=runner), runner=runner,
                      forward_context={PREFIX: cache})
    return NS(view=view, builder=builder, cache=cache, op=op, config=config, capability=capability)


# -- STAND-IN for DeepGEMM: the wrappers' _impl globals record their calls ---------------------
CALLS = []


def describe(x):
    if isinstance(x, torch.Tensor):
        out = {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""),
               "stride": list(x.stride()), "contiguous": x.is_contiguous(), "ptr": x.data_ptr()}
        if x.dtype in (torch.int32, torch.int64) and x.numel() <= 1024:
            out["values"] = x.tolist()
        return out
    if isinstance(x, (tuple, list)):
        return [describe(y) for y in x]
    return {"value": x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)}


def recorder(name, make):
    def impl(*args, **kwargs):
        CALLS.append({"impl": name, "args": [describe(a) for a in args],
                      "kwargs": {k: describe(v) for k, v in kwargs.items()}})
        return make(*args, **kwargs)
    return impl


def logits(rows, cols, dtype=torch.float32):
    """Logits as DeepGEMM's host code allocates them: of the dtype asked for (0.34's logits_dtype;
    fp32 before), each row 1024-byte aligned."""
    per_kb = 1024 // dtype.itemsize
    return torch.zeros(rows, -(-cols // per_kb) * per_kb, dtype=dtype)[:, :cols]


IMPLS = {
    "_fp8_fp4_mqa_logits_impl": recorder(
        "mqa_logits", lambda q, kv, w, ks, ke, *a, logits_dtype=torch.float32, **k:
        logits(q[0].shape[0], kv[0].shape[0], logits_dtype)),
    "_get_paged_mqa_logits_metadata_impl": recorder(
        "metadata", lambda lens, block, slots, **k: torch.zeros(slots + 1, 2, dtype=torch.int32)),
    "_fp8_fp4_paged_mqa_logits_impl": recorder(
        "paged", lambda q, kv, w, lens, table, meta, max_len, *a, logits_dtype=torch.float32, **k:
        logits(q[0].shape[0] * q[0].shape[1], max_len, logits_dtype)),
}


def record_upcasts():
    """Record every launch of 0.34's ``_upcast_logits_kernel`` (``as_fp32_logits``: bf16 logits
    for the fp32 top-k; a Triton kernel, interpreted here) in CALLS, as the key Triton compiles."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ == "_upcast_logits_kernel":
            CALLS.append({"impl": "upcast", "spec": triton_spec(self, args, kwargs)})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


def triton_spec(fnobj, args, kwargs) -> list:
    """Triton's specialization of one launch: [name, type, specialization] per argument,
    constexprs by value."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(fnobj.fn).parameters
    bound = {**dict(zip(params, args)), **{k: v for k, v in kwargs.items() if k in params}}
    return [[name, "constexpr", repr(bound[name])] if "constexpr" in str(p.annotation) else
            [name, *map(str, native_specialize_impl(BaseBackend, bound[name], False, True, True))]
            for name, p in params.items()]


@contextlib.contextmanager
def deep_gemm(impls=IMPLS, lazy_init=None):
    saved = {name: getattr(dg, name) for name in (*impls, "_lazy_init")}
    for name, impl in impls.items():
        setattr(dg, name, impl)
    if lazy_init is not None:
        dg._lazy_init = lazy_init
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(dg, name, value)


def planned(engine, stand_in=True):
    """Each DeepGEMM step of the family's plan and the calls its run made."""
    out = []
    ctx = (lambda: platform(engine.capability)) if stand_in else contextlib.nullcontext
    with ctx():
        steps = fam.plan(engine.view, False)
    for step in steps:
        if step.kernel not in (fam.MQA_LOGITS, fam.PAGED_MQA_LOGITS, fam.PAGED_METADATA):
            continue
        CALLS.clear()
        record = {"name": step.name, "kernel": step.kernel, "skip": step.skip, "labels": None, "error": None}
        if step.skip is None:
            try:
                with ctx():
                    record["labels"] = list(step.run())
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
        record["calls"] = list(CALLS)
        out.append(record)
    return out


# -- production: the builder's build() and the indexer op's forward on a batch -----------------
class Workspace:
    """STAND-IN for vLLM's workspace manager: fresh buffers of the requested specs."""

    def get_simultaneous(self, *specs):
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


def noop(*args, **kwargs):
    return None


def install_stand_ins():
    """STAND-INs for what surrounds the DeepGEMM calls in sparse_attn_indexer (CUDA ops, the
    workspace manager)."""
    sai.current_workspace_manager = lambda: Workspace()  # STAND-IN
    sai.ops = NS(indexer_k_quant_and_cache=noop, cp_gather_indexer_k_quant_cache=noop,  # STAND-IN: CUDA ops
                 top_k_per_row_prefill=noop, top_k_per_row_decode=noop)
    if hasattr(sai, "get_indexer_topk"):
        sai.get_indexer_topk = stand_in_topk  # STAND-IN: 0.33+'s top-k dispatch (CUDA ops)
    for name in ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk"):
        setattr(torch.ops._C, name, noop)  # STAND-IN: 0.20 calls torch.ops._C directly


def stand_in_topk(backend):
    """STAND-IN for 0.33+'s decode top-k selector: vLLM's own ``SparseIndexerTopk`` (0.34's
    ``takes_bf16_logits`` decides whether decode's bf16 logits are upcast first), its kernels
    (CUDA ops) not run."""
    from vllm.model_executor.layers import indexer_topk

    real = getattr(indexer_topk, "SparseIndexerTopk", None)
    if real is None:
        return noop
    return type("StandInTopk", (real,), {"forward": noop})(backend)


def common_metadata(query_lens, seq_lens):
    n = len(query_lens)
    table = torch.zeros(n, MAX_MODEL_LEN // BLOCK, dtype=torch.int32)
    table[:, 0] = torch.arange(n) % (NUM_BLOCKS - 1) + 1
    qsl_cpu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    computed = seq_cpu - torch.tensor(query_lens, dtype=torch.int32)
    values = dict(query_start_loc=qsl_cpu.clone(), query_start_loc_cpu=qsl_cpu, seq_lens=seq_cpu.clone(),
                  seq_lens_cpu=seq_cpu, num_computed_tokens_cpu=computed, _seq_lens_cpu=seq_cpu,
                  _num_computed_tokens_cpu=computed, seq_lens_cpu_upper_bound=seq_cpu, num_reqs=n,
                  num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                  block_table_tensor=table, slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
                  causal=True)
    fields = dataclasses.fields(CommonAttentionMetadata)
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required <= set(values), required - set(values)
    return CommonAttentionMetadata(**{f.name: values[f.name] for f in fields if f.name in values})


def production(engine, query_lens, seq_lens):
    """The DeepGEMM calls production makes for one batch: build() then the op's forward."""
    CALLS.clear()
    with platform(engine.capability), deep_gemm():
        metadata = engine.builder.build(0, common_metadata(query_lens, seq_lens))
        sai.get_forward_context = lambda: NS(attn_metadata={PREFIX: metadata},  # STAND-IN
                                             cudagraph_runtime_mode=CUDAGraphMode.NONE)
        tokens = sum(query_lens)
        fp8 = current_platform.fp8_dtype()
        q = torch.zeros(tokens, H, D, dtype=torch.uint8).view(fp8)
        engine.op.forward_cuda(torch.zeros(tokens, 16), q, torch.zeros(tokens, D), torch.zeros(tokens, H))
    return list(CALLS)


@contextlib.contextmanager
def rebound(name, fn):
    """A release whose wrapper `name` differs (STAND-IN), as production's modules import it."""
    holders = [m for m in (dg, sai, vi) if hasattr(m, name)]
    saved = [getattr(m, name) for m in holders]
    for m in holders:
        if fn is None:
            delattr(m, name)
        else:
            setattr(m, name, fn)
    try:
        yield
    finally:
        for m, f in zip(holders, saved):
            setattr(m, name, f)


def paged_of_another_release(q, kv_cache, weights, context_lens):
    raise AssertionError("must not be called")


def legacy_fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke):
    raise AssertionError("must not be called")

class BrokenRunner:
    device = torch.device("cpu")

    @property
    def attn_groups(self):
        raise RuntimeError("attn_groups broke")


ENGINES = {"eager": {}, "full": {"eager": False}, "piecewise": {"eager": False, "mode": "PIECEWISE"},
           "mtp2": {"spec_tokens": 1}, "mtp2_full": {"spec_tokens": 1, "eager": False},
           "mtp4": {"spec_tokens": 3}, "mtp4_full": {"spec_tokens": 3, "eager": False},
           "sm80": {"capability": (8, 0)}, "sm100": {"capability": (10, 0)},
           "fp4": {"fp4": True}, "bf16": {"logits_dtype": "bfloat16"}}  # bf16: 0.34's indexer_logits_dtype


def stand_in_plans(out):
    """3. The family's plan and steps with the stand-ins, per engine; returns the engines
    production is driven on."""
    plans, prod, cache_ptrs = {}, {}, {}
    with deep_gemm():
        for name, kw in ENGINES.items():
            engine = make_engine(**kw)
            plans[name] = planned(engine)
            cache_ptrs[name] = engine.cache.kv_cache.data_ptr()
            if name in ("eager", "mtp2", "mtp4", "sm100", "bf16"):
                prod[name] = engine
        engine = make_engine()
        saved = [m.has_deep_gemm for m in (import_utils, dg)]
        with platform():
            import_utils.has_deep_gemm = dg.has_deep_gemm = lambda: False  # STAND-IN: DeepGEMM absent
            out["absent"] = [s.skip for s in fam.plan(engine.view, False)
                             if s.kernel in (fam.MQA_LOGITS, fam.PAGED_MQA_LOGITS, fam.PAGED_METADATA)]
        import_utils.has_deep_gemm, dg.has_deep_gemm = saved
    out["cache_ptrs"] = cache_ptrs

    # DeepGEMM importable but without the symbols (STAND-IN _lazy_init: the real one would load the CUDA library)
    with deep_gemm({name: None for name in IMPLS}, lazy_init=lambda: None):
        plans["no_impl"] = planned(make_engine())

    with deep_gemm():
        with rebound(fam.PAGED_MQA_LOGITS, paged_of_another_release):
            plans["other_signature"] = planned(make_engine())
        with rebound(fam.MQA_LOGITS, None):
            dg.fp8_mqa_logits = sai.fp8_mqa_logits = legacy_fp8_mqa_logits  # the pre-FP4 name
            plans["legacy_name"] = planned(make_engine())
            del dg.fp8_mqa_logits, sai.fp8_mqa_logits
    out["plans"] = plans

    broken = NS(view=EngineView(backends=[["DEEPSEEK_V32_INDEXER"]], device="cpu", runner=BrokenRunner()),
                capability=(9, 0), cache=None)
    with deep_gemm():
        out["broken_runner"] = planned(broken)
    return prod


BATCHES = {
    "eager": {"mixed": ([1, 1, 5], [9, 20, 12]), "decode40": ([1] * 40, [9] * 40),
              "decode100": ([1] * 100, [9] * 100)},
    "mtp2": {"mixed": ([2, 2, 2, 5], [9, 20, 30, 12]), "d1": ([1] * 3, [9, 10, 11]),
             "wide": ([2] * 40, [9] * 40)},
    "mtp4": {"d4": ([4, 4], [9, 20]), "d3": ([3, 3], [9, 20]), "d2": ([2, 2], [9, 20]),
             "wide": ([4] * 30, [9] * 30), "mixed": ([4, 4, 6], [9, 20, 12])},
    "sm100": {"mixed": ([1, 1, 5], [9, 20, 12])},
    "bf16": {"mixed": ([1, 1, 5], [9, 20, 12]), "decode100": ([1] * 100, [9] * 100)},
}


def production_calls(out, prod):
    """4. Production's calls on small batches, then on FULL decode capture: one uniform batch per
    capture size, as the runner's dummy run builds it (min(max_num_seqs, cdiv(size, next_n))
    requests of next_n tokens each)."""
    out["production"] = {name: {batch: production(prod[name], *args) for batch, args in bs.items()}
                         for name, bs in BATCHES.items()}
    out["capture"] = {}
    for name, spec_tokens in (("full", 0), ("mtp2_full", 1), ("mtp4_full", 3)):
        engine = make_engine(spec_tokens=spec_tokens, eager=False)
        n = 1 + spec_tokens
        out["capture"][name] = [production(engine, [n] * min(SEQS, -(-size // n)), [n + 8] * min(SEQS, -(-size // n)))
                                for size in CAPTURE_SIZES]


def main(argv: list[str]) -> None:
    configure(*(json.loads(a) for a in argv[:3]))
    out = {"version": vllm.__version__}
    symbols(out)
    install_stand_ins()
    record_upcasts()
    with platform():  # 2. on this CPU, without stand-ins
        engine = make_engine()
    out["cpu"] = planned(engine, stand_in=False)
    prod = stand_in_plans(out)
    production_calls(out, prod)
    print("KWARM-DG-RESULT " + json.dumps(out, default=repr))


if __name__ == "__main__":
    main(sys.argv[1:])
