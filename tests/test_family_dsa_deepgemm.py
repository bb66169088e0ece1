"""The dsa_indexer family's DeepGEMM steps against the real vLLM, on CPU.

The family warms DeepGEMM's indexer kernels through vLLM's wrappers in
``vllm.utils.deep_gemm`` (``fp8_fp4_mqa_logits``, ``get_paged_mqa_logits_metadata``,
``fp8_fp4_paged_mqa_logits``). DeepGEMM is a CUDA library that JIT-compiles for SM90+; it
cannot run here. So each release (0.20.0, 0.22.0, 0.24.0, 0.26.0, 0.28.0, 0.33.0) runs once in
a fresh interpreter that:

1. resolves the wrappers as the family does and binds production's call shape to their real
   signatures (symbol level: every release, 0.33.0 included);
2. plans the family on this CPU, where DeepGEMM cannot run, and records the skip reasons;
3. swaps in stand-ins, each labelled ``STAND-IN`` in the scenario, and plans and runs the
   family, then drives production itself with the same stand-ins: the real
   ``DeepseekV32IndexerMetadataBuilder`` (``build``) and the real ``sparse_attn_indexer`` op
   (through ``SparseAttnIndexer.forward_cuda``) on small batches (prefill, plain decode,
   MTP decode, FULL-graph capture batches). Both call the same real wrappers, so the
   recorded calls show what production passes and what the warmup passes.

Real vLLM objects: the wrappers and their ``_lazy_init`` fast path, the metadata builder
(constructed on CPU), ``CommonAttentionMetadata``, ``build_prefill_chunk_metadata`` (Triton
interpreter), ``sparse_attn_indexer`` / ``SparseAttnIndexer``, ``DeepseekV32IndexerCache``
(its ``get_kv_cache_spec`` gives the builder's spec), ``AttentionGroup`` and the backend.

Stand-ins, and why:
- DeepGEMM itself: ``vllm.utils.deep_gemm._<wrapper>_impl`` become recording fakes returning
  tensors of the real output shapes (the CUDA library cannot load without a GPU);
- the platform: ``is_cuda`` and ``get_device_capability`` (9.0 = H200; 8.0 and 10.0 for the
  skip paths), and ``num_compute_units`` = 132 (the H200's SMs) for the builder;
- ``has_deep_gemm`` (0.26+ trial-imports DeepGEMM's CUDA extension, absent here);
- the CUDA ops around the DeepGEMM calls in ``sparse_attn_indexer`` (K-cache insert/gather,
  top-k): no-ops; the workspace manager: plain allocations of the requested shapes; the
  forward context: a namespace holding the built metadata;
- the vLLM config: a namespace with the fields these objects read (a real ``VllmConfig``
  needs a model directory and a device);
- the indexer module that owns the cache: an ``nn.Module`` carrying ``n_head`` /
  ``head_dim`` and the real cache and op (the real ``Indexer`` builds quantized linear
  layers that need the parallel state); the bound cache is a real-shaped uint8 tensor
  ``[4 blocks, 64, 132]`` (FP8: 128 bytes + a 4-byte fp32 scale per token).

The tests compare DeepGEMM JIT keys computed from the recorded calls (``jit_key``): the
template parameters DeepGEMM's SM90 kernels are specialized on (read in the wheels'
``include/deep_gemm/impls/sm90_fp8_*mqa_logits.cuh`` and
``scheduler/*paged_mqa_logits.cuh``) plus the dtypes and keywords production passes.
"""
from __future__ import annotations

import pytest

from conftest import MATRIX, REPO, PerRelease, cpu_triton_env, marked_json, run_py
from conftest import plan_steps as steps
from conftest import release_version as v

CONFIG = str(REPO / "bench" / "models" / "tiny-deepseek-v32" / "config.json")  # index 64 x 128, top-k 256
MARK = "KWARM-DG-RESULT "
RELEASES = (*MATRIX, "0.33.0")
SEQS = 100  # max_num_seqs: four 32-row metadata classes (32, 64, 96, 128)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]

SCENARIO = r'''
import contextlib, dataclasses, functools, inspect, itertools, json, types
import torch
import vllm

NS = types.SimpleNamespace
VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
OUT = {"version": vllm.__version__}

# Production's modules, imported before any platform stand-in (0.26's attention package picks
# its flash-attention import from the platform at import time).
from vllm.utils import deep_gemm as dg
import vllm.utils.import_utils as import_utils
from vllm.model_executor.layers import sparse_attn_indexer as sai
from vllm.v1.attention.backends.mla import indexer as vi
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.utils import AttentionGroup
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import dsa_indexer as fam

hf = NS(**json.load(open(CONFIG)))
MAX_MODEL_LEN, BLOCK, TOKENS, NUM_BLOCKS = 8192, 64, 8192, 4
H, D, TOPK = hf.index_n_heads, hf.index_head_dim, hf.index_topk
PREFIX = "model.layers.0.self_attn.indexer.k_cache"

# -- 1. symbols ---------------------------------------------------------------------------------
entries = fam.deep_gemm_entries()
owners = {fam.MQA_LOGITS: sai, fam.PAGED_MQA_LOGITS: sai, fam.PAGED_METADATA: vi}
OUT["problems"] = dict(entries.problems)
OUT["entries"] = {
    name: {"module": fn.__module__, "qualname": fn.__qualname__,
           "is_vllm_wrapper": fn is getattr(dg, name, None),
           "is_production_binding": fn is getattr(owners[name], name, None),
           "params": list(inspect.signature(fn).parameters)}
    for name, fn in entries.fns.items()}
OUT["flags"] = {f.name: getattr(entries, f.name) for f in dataclasses.fields(entries)
                if f.name not in ("fns", "problems")}
OUT["has_deep_gemm"] = bool(import_utils.has_deep_gemm())

# -- the engine: a real builder, cache layer, op and attention group ------------------------------
def make_config(spec_tokens=0):
    speculative = NS(num_speculative_tokens=spec_tokens, enable_adaptive_verification=False) if spec_tokens else None
    return NS(  # STAND-IN for VllmConfig: the fields the builder, cache layer and op read
        scheduler_config=NS(max_num_batched_tokens=TOKENS, max_num_seqs=SEQS),
        model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=MAX_MODEL_LEN),
        parallel_config=NS(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                           prefill_context_parallel_size=1, tensor_parallel_size=1,
                           data_parallel_size=1, enable_expert_parallel=False,
                           pcp_shard_decode_requests=False),
        speculative_config=speculative, num_speculative_tokens=spec_tokens,
        attention_config=NS(use_fp4_indexer_cache=False, resolve_indexer_kv_dtype=lambda default: default,
                            sparse_mla_prefill_workspace_factor=5, hisparse_config=None),
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


def make_engine(*, spec_tokens=0, fp4=False, capability=(9, 0), eager=True, mode="FULL_AND_PIECEWISE"):
    config = make_config(spec_tokens)
    width = D // 2 + D // 32 if fp4 else D + D // 128 * 4
    with set_current_vllm_config(config), platform(capability):
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


IMPLS = {
    "_fp8_fp4_mqa_logits_impl": recorder(
        "mqa_logits", lambda q, kv, w, ks, ke, *a, **k: torch.zeros(q[0].shape[0], kv[0].shape[0])),
    "_get_paged_mqa_logits_metadata_impl": recorder(
        "metadata", lambda lens, block, slots, **k: torch.zeros(slots + 1, 2, dtype=torch.int32)),
    "_fp8_fp4_paged_mqa_logits_impl": recorder(
        "paged", lambda q, kv, w, lens, table, meta, max_len, *a, **k:
        torch.zeros(q[0].shape[0] * q[0].shape[1], max_len)),
}


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


sai.current_workspace_manager = lambda: Workspace()  # STAND-IN
sai.ops = NS(indexer_k_quant_and_cache=noop, cp_gather_indexer_k_quant_cache=noop,  # STAND-IN: CUDA ops
             top_k_per_row_prefill=noop, top_k_per_row_decode=noop)
if hasattr(sai, "get_indexer_topk"):
    sai.get_indexer_topk = lambda backend: noop  # STAND-IN: 0.33's top-k dispatch (CUDA ops)
for name in ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk", "cooperative_topk"):
    setattr(torch.ops._C, name, noop)  # STAND-IN: 0.20 calls torch.ops._C directly


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


# -- 2. on this CPU, without stand-ins -----------------------------------------------------------
with platform():
    engine = make_engine()
OUT["cpu"] = planned(engine, stand_in=False)

# -- 3. with the stand-ins ----------------------------------------------------------------------
plans, prod, cache_ptrs = {}, {}, {}
with deep_gemm():
    for name, kw in {"eager": {}, "full": {"eager": False}, "piecewise": {"eager": False, "mode": "PIECEWISE"},
                     "mtp2": {"spec_tokens": 1}, "mtp2_full": {"spec_tokens": 1, "eager": False},
                     "mtp4": {"spec_tokens": 3}, "mtp4_full": {"spec_tokens": 3, "eager": False},
                     "sm80": {"capability": (8, 0)}, "sm100": {"capability": (10, 0)},
                     "fp4": {"fp4": True}}.items():
        engine = make_engine(**kw)
        plans[name] = planned(engine)
        cache_ptrs[name] = engine.cache.kv_cache.data_ptr()
        if name in ("eager", "mtp2", "mtp4", "sm100"):
            prod[name] = engine
    engine = make_engine()
    saved = [m.has_deep_gemm for m in (import_utils, dg)]
    with platform():
        import_utils.has_deep_gemm = dg.has_deep_gemm = lambda: False  # STAND-IN: DeepGEMM absent
        OUT["absent"] = [s.skip for s in fam.plan(engine.view, False) if s.kernel in (fam.MQA_LOGITS, fam.PAGED_MQA_LOGITS, fam.PAGED_METADATA)]
    import_utils.has_deep_gemm, dg.has_deep_gemm = saved
OUT["cache_ptrs"] = cache_ptrs

# DeepGEMM importable but without the symbols (STAND-IN _lazy_init: the real one would load the CUDA library)
with deep_gemm({name: None for name in IMPLS}, lazy_init=lambda: None):
    plans["no_impl"] = planned(make_engine())


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


with deep_gemm():
    with rebound(fam.PAGED_MQA_LOGITS, paged_of_another_release):
        plans["other_signature"] = planned(make_engine())
    with rebound(fam.MQA_LOGITS, None):
        dg.fp8_mqa_logits = sai.fp8_mqa_logits = legacy_fp8_mqa_logits  # the pre-FP4 name
        plans["legacy_name"] = planned(make_engine())
        del dg.fp8_mqa_logits, sai.fp8_mqa_logits
OUT["plans"] = plans


class BrokenRunner:
    device = torch.device("cpu")

    @property
    def attn_groups(self):
        raise RuntimeError("attn_groups broke")


broken = NS(view=EngineView(backends=[["DEEPSEEK_V32_INDEXER"]], device="cpu", runner=BrokenRunner()),
            capability=(9, 0), cache=None)
with deep_gemm():
    OUT["broken_runner"] = planned(broken)

# -- 4. production's calls on small batches ------------------------------------------------------
batches = {
    "eager": {"mixed": ([1, 1, 5], [9, 20, 12]), "decode40": ([1] * 40, [9] * 40),
              "decode100": ([1] * 100, [9] * 100)},
    "mtp2": {"mixed": ([2, 2, 2, 5], [9, 20, 30, 12]), "d1": ([1] * 3, [9, 10, 11]),
             "wide": ([2] * 40, [9] * 40)},
    "mtp4": {"d4": ([4, 4], [9, 20]), "d3": ([3, 3], [9, 20]), "d2": ([2, 2], [9, 20]),
             "wide": ([4] * 30, [9] * 30), "mixed": ([4, 4, 6], [9, 20, 12])},
    "sm100": {"mixed": ([1, 1, 5], [9, 20, 12])},
}
OUT["production"] = {name: {batch: production(prod[name], *args) for batch, args in bs.items()}
                     for name, bs in batches.items()}

# FULL decode capture: one uniform batch per capture size, as the runner's dummy run builds it
# (min(max_num_seqs, cdiv(size, next_n)) requests of next_n tokens each).
OUT["capture"] = {}
for name, spec_tokens in (("full", 0), ("mtp2_full", 1), ("mtp4_full", 3)):
    engine = make_engine(spec_tokens=spec_tokens, eager=False)
    n = 1 + spec_tokens
    OUT["capture"][name] = [production(engine, [n] * min(SEQS, -(-size // n)), [n + 8] * min(SEQS, -(-size // n)))
                            for size in CAPTURE_SIZES]

print("KWARM-DG-RESULT " + json.dumps(OUT, default=repr))
'''


SCENARIOS = PerRelease(lambda release: _scenario(release))
_prefetch = SCENARIOS.autouse_fixture()


scenario = SCENARIOS.result  # the results for one release (one subprocess per release per session)


def _scenario(release: str) -> tuple[bool, object]:
    head = f"CONFIG = {CONFIG!r}\nSEQS = {SEQS!r}\nCAPTURE_SIZES = {CAPTURE_SIZES!r}\n"
    proc = run_py(head + SCENARIO, env=cpu_triton_env(), release=release, timeout=600)
    return marked_json(proc, MARK)


DG_STEP_NAMES = ("mqa_logits", "paged_mqa_logits", "paged_mqa_logits_metadata")


# -- DeepGEMM JIT keys of recorded calls --------------------------------------------------------

def _val(arg):
    """A scalar's value, or 'tensor' for a tensor argument."""
    return arg["value"] if "value" in arg else "tensor"


def jit_key(call: dict) -> tuple:
    """What DeepGEMM specializes the JIT on (SM90 templates, vendored 2.5.0-2.8.1), plus the
    dtypes, ranks and keywords production passes.

    - ``sm90_fp8_mqa_logits<kNumHeads, kHeadDim, [kIsCompressedLogits,] BLOCK_Q=128/H, BLOCK_KV,
      stages, kNumSMs, threads, logits dtype>``: heads and head_dim of Q, whether compressed
      logits were asked for (max_seqlen_k > 0), clean_logits (a separate clean kernel);
    - ``sm90_fp8_paged_mqa_logits<kNextN, kNumHeads, kHeadDim, BLOCK_KV, kIsContextLens2D,
      kIsVarlen, stages, SPLIT_KV, threads, [kNumKVMulticast = next_n == 4,] logits dtype>``;
    - ``smxx_paged_mqa_logits_metadata<kAlignedBatchSize = align(rows, 32), SPLIT_KV,
      kNumSMs (the slots the wrapper passes), kIsVarlen>``.
    The batch sizes, sequence lengths and pointers are runtime arguments."""
    args, kwargs = call["args"], call["kwargs"]
    if call["impl"] == "mqa_logits":
        (q, q_sf), (k, k_sf), weights, ks, ke = args[:5]
        max_seqlen_k = args[5]["value"] if len(args) > 5 else kwargs.get("max_seqlen_k", {"value": 0})["value"]
        return ("mqa_logits", q["dtype"], tuple(q["shape"][1:]), _val(q_sf), k["dtype"], k["shape"][1],
                k_sf["dtype"], len(k_sf["shape"]), weights["dtype"], weights["shape"][1], ks["dtype"],
                ke["dtype"], _val(kwargs.get("clean_logits", {"value": None})), max_seqlen_k > 0)
    if call["impl"] == "paged":
        (q, q_sf), kv, weights, lens, table, schedule, max_len = args[:7]
        return ("paged", q["dtype"], tuple(q["shape"][1:]), _val(q_sf), kv["dtype"], tuple(kv["shape"][1:]),
                weights["dtype"], weights["shape"][1], lens["dtype"], tuple(lens["shape"][1:]),
                table["dtype"], len(table["shape"]), schedule["dtype"], max_len["value"],
                _val(kwargs.get("clean_logits", {"value": None})), _val(kwargs.get("indices", {"value": None})))
    lens, block, slots = args[:3]
    return ("metadata", lens["dtype"], len(lens["shape"]), -(-lens["shape"][0] // 32) * 32, block["value"],
            slots["value"], _val(kwargs.get("indices", {"value": None})))


def keys(calls, impl=None) -> set:
    return {jit_key(c) for c in calls if impl is None or c["impl"] == impl}


def warm_calls(result: dict, plan: str, step: str | None = None) -> list:
    return [c for s in result["plans"][plan] if step is None or s["name"] == step for c in s["calls"]]


def production_calls(result: dict, config: str) -> list:
    return [c for calls in result["production"][config].values() for c in calls]


def signature(arg):
    """The structure of an argument: tuple nesting, None, and each tensor's dtype, rank,
    contiguity and innermost stride (what DeepGEMM's host code asserts on)."""
    if isinstance(arg, list):
        return tuple(signature(a) for a in arg)
    if "value" in arg:
        return type(arg["value"]).__name__ if arg["value"] is not None else None
    return (arg["dtype"], len(arg["shape"]), arg["contiguous"], arg["stride"][-1])


# -- symbols ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_wrappers_resolve_and_bind(release):
    """Each release's production binding is vLLM's own wrapper, and the family's call shape
    binds to its real signature (0.33 replaces clean_logits with max_seqlen_k; 0.28 adds indices)."""
    result = scenario(release)
    assert result["version"] == release
    assert result["problems"] == {}
    assert set(result["entries"]) == {"fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                      "get_paged_mqa_logits_metadata"}
    for name, entry in result["entries"].items():
        assert entry["module"] == "vllm.utils.deep_gemm" and entry["qualname"] == name
        assert entry["is_vllm_wrapper"] and entry["is_production_binding"], name
    assert result["flags"] == {
        "mqa_clean_logits": v(release) < (0, 33), "mqa_max_seqlen_k": v(release) >= (0, 33),
        "paged_clean_logits": v(release) < (0, 33), "paged_indices": v(release) >= (0, 28),
        "metadata_indices": v(release) >= (0, 28)}
    params = result["entries"]["fp8_fp4_mqa_logits"]["params"]
    assert params[:5] == ["q", "kv", "weights", "cu_seqlen_ks", "cu_seqlen_ke"]
    assert params[5] == ("max_seqlen_k" if v(release) >= (0, 33) else "clean_logits")
    assert result["entries"]["get_paged_mqa_logits_metadata"]["params"][:3] == ["context_lens", "block_size", "num_sms"]


# -- fail-open --------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_skips_on_this_cpu(release):
    """No stand-ins: DeepGEMM cannot run here, so every DeepGEMM step is a skip with the
    reason (0.26+'s has_deep_gemm() trial-imports the CUDA extension; 0.20-0.24 only look
    for the package, so there it is the platform that says no)."""
    result = scenario(release)
    cpu = result["cpu"]
    assert [s["name"] for s in cpu] == list(DG_STEP_NAMES)
    expected = ("DeepGEMM is not installed or does not import (has_deep_gemm() is False)" if not result["has_deep_gemm"] else
                "not a CUDA platform (UnspecifiedPlatform): the indexer's DeepGEMM kernels are CUDA-only")
    assert {s["skip"] for s in cpu} == {expected}
    assert result["has_deep_gemm"] == (v(release) < (0, 26))
    assert all(not s["calls"] for s in cpu)


@pytest.mark.parametrize("release", RELEASES)
def test_skips_where_deep_gemm_is_absent(release):
    assert scenario(release)["absent"] == ["DeepGEMM is not installed or does not import (has_deep_gemm() is False)"] * 3


@pytest.mark.parametrize("release", RELEASES)
def test_skips_below_sm90(release):
    sm80 = scenario(release)["plans"]["sm80"]
    assert [s["name"] for s in sm80] == list(DG_STEP_NAMES)
    for s in sm80:
        assert s["skip"] == "GPU capability 8.0 < 9.0: DeepGEMM's MQA-logits kernels need Hopper (SM90) or newer"


@pytest.mark.parametrize("release", RELEASES)
def test_skips_where_deep_gemm_lacks_the_symbols(release):
    got = steps(scenario(release), "no_impl")
    assert "DeepGEMM has no fp8_fp4_mqa_logits" in got["mqa_logits"]["skip"]
    assert "DeepGEMM has no get_paged_mqa_logits_metadata" in got["paged_mqa_logits_metadata"]["skip"]
    assert got["paged_mqa_logits"]["skip"] is not None
    assert not any(s["calls"] for s in got.values())


@pytest.mark.parametrize("release", RELEASES)
def test_a_wrapper_with_another_signature_skips_its_step_only(release):
    got = steps(scenario(release), "other_signature")
    assert got["paged_mqa_logits"]["skip"].startswith(
        "paged_of_another_release(q, kv_cache, weights, context_lens) does not take this call")
    assert got["mqa_logits"]["labels"] and got["paged_mqa_logits_metadata"]["labels"]
    assert {c["impl"] for c in got["mqa_logits"]["calls"]} == {"mqa_logits"}


@pytest.mark.parametrize("release", RELEASES)
def test_a_legacy_wrapper_name_is_a_skip(release):
    got = steps(scenario(release), "legacy_name")
    assert got["mqa_logits"]["skip"] == ("this vLLM calls DeepGEMM's fp8_mqa_logits (the call shape before "
                                         "fp8_fp4_mqa_logits), which is not modelled")
    assert got["paged_mqa_logits"]["labels"]


@pytest.mark.parametrize("release", RELEASES)
def test_an_mxfp4_indexer_cache_is_a_skip(release):
    fp4 = scenario(release)["plans"]["fp4"]
    assert [(s["name"], s["skip"]) for s in fp4] == [
        (n, "MXFP4 indexer cache (SM100): its DeepGEMM call shape is not modelled") for n in DG_STEP_NAMES]


@pytest.mark.parametrize("release", RELEASES)
def test_sm100_runs_only_the_modelled_call_shapes(release):
    """On SM100 (stand-in capability 10.0) 0.28+ decodes varlen (indices) and 0.33 passes
    MX-scaled inputs: the family skips what it does not model, and production's calls show
    that those shapes differ; what it does run matches production."""
    result = scenario(release)
    got = steps(result, "sm100")
    production = production_calls(result, "sm100")
    prod = {c["impl"]: c for c in production}
    if v(release) < (0, 28):
        assert all(s["skip"] is None and s["labels"] for s in got.values())
        assert keys(production) <= keys(warm_calls(result, "sm100"))
    elif v(release) < (0, 33):
        varlen = "varlen decode (SM100: one row per token, with indices) is not modelled"
        assert got["paged_mqa_logits"]["skip"] == got["paged_mqa_logits_metadata"]["skip"] == varlen
        assert prod["paged"]["kwargs"]["indices"]["dtype"] == "int32"  # production: varlen rows
        assert keys([prod["mqa_logits"]]) == keys(warm_calls(result, "sm100", "mqa_logits"))
    else:
        mx = "MX-scaled MQA-logits inputs (SM100, 0.33+): not modelled"
        assert {s["skip"] for s in got.values()} == {mx}
        q_scale, weights = prod["mqa_logits"]["args"][0][1], prod["mqa_logits"]["args"][2]
        assert (q_scale["dtype"], weights["dtype"]) == ("int32", "bfloat16")  # unit MX scales, bf16 weights


def test_unexpected_planning_error_fails_its_step():
    """An unexpected error while planning the DeepGEMM steps (here: the runner) is one failing
    step, for warmup.py to log and isolate, not an exception out of plan()."""
    broken = scenario("0.24.0")["broken_runner"]
    assert [(s["name"], s["skip"], s["error"]) for s in broken] == [
        ("mqa_logits", None, "RuntimeError: attn_groups broke")]


@pytest.mark.parametrize("release", RELEASES)
def test_no_step_fails(release):
    for plan, planned in scenario(release)["plans"].items():
        for step in planned:
            assert step["error"] is None, (plan, step)


# -- what is warmed -----------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("config", ["eager", "mtp2", "mtp4"])
def test_warmup_covers_every_production_key(release, config):
    """Production (the real builder and indexer op) on prefill, plain-decode and MTP batches
    compiles no DeepGEMM key the warmup did not."""
    result = scenario(release)
    production = production_calls(result, config)
    assert {c["impl"] for c in production} == {"mqa_logits", "paged", "metadata"}
    assert keys(production) <= keys(warm_calls(result, config))


@pytest.mark.parametrize("release", RELEASES)
def test_warm_calls_have_production_structure(release):
    """Argument by argument, the warmup's calls reach DeepGEMM with the structure production's
    do: tuple nesting, None scales, dtypes, ranks, contiguity, keyword names and values."""
    result = scenario(release)
    warm = {c["impl"]: c for c in warm_calls(result, "eager")}
    for call in result["production"]["eager"]["mixed"]:
        mine = warm[call["impl"]]
        assert [signature(a) for a in mine["args"]] == [signature(a) for a in call["args"]], call["impl"]
        assert set(mine["kwargs"]) == set(call["kwargs"]), call["impl"]
        for name, arg in call["kwargs"].items():
            if "value" in arg:
                assert mine["kwargs"][name]["value"] == arg["value"], (call["impl"], name)
    # the values that are not batch sizes: heads, head_dim, block size, SMs, max_model_len
    prod = {c["impl"]: c for c in result["production"]["eager"]["mixed"]}
    assert warm["mqa_logits"]["args"][0][0]["shape"][1:] == prod["mqa_logits"]["args"][0][0]["shape"][1:] == [64, 128]
    assert warm["paged"]["args"][1]["shape"][1:] == prod["paged"]["args"][1]["shape"][1:] == [64, 1, 132]
    assert warm["paged"]["args"][6] == prod["paged"]["args"][6] == {"value": 8192}
    assert warm["metadata"]["args"][1:3] == prod["metadata"]["args"][1:3] == [{"value": 64}, {"value": 132}]


@pytest.mark.parametrize("release", RELEASES)
def test_decode_variants_per_release(release):
    """Kernel next_n values and metadata (aligned batch, slots) classes, from the builder:
    SM90 runs next_n 1 and 2 natively; next_n=4 flattens in 0.20-0.26 (up to 4 x 100 rows)
    and runs natively in 0.28+ (with half the slots), where a 3-deep step flattens."""
    result = scenario(release)

    def paged_next_n(plan):
        return sorted({k[2][0] for k in keys(warm_calls(result, plan, "paged_mqa_logits"), "paged")})

    def metadata(plan):
        return {(k[3], k[5]) for k in keys(warm_calls(result, plan, "paged_mqa_logits_metadata"))}

    plain = {(rows, 132) for rows in (32, 64, 96, 128)}
    assert paged_next_n("eager") == [1] and metadata("eager") == plain
    assert paged_next_n("mtp2") == [1, 2] and metadata("mtp2") == plain
    if v(release) < (0, 28):
        assert paged_next_n("mtp4") == [1]
        assert metadata("mtp4") == {(rows, 132) for rows in range(32, 417, 32)}
    else:
        assert paged_next_n("mtp4") == [1, 2, 4]
        assert metadata("mtp4") == {(rows, 132) for rows in range(32, 321, 32)} | {(rows, 66) for rows in (32, 64, 96, 128)}
    # production agrees: 0.28+ runs a 4-deep step natively with 66 slots, a 3-deep one flattened
    prod = result["production"]["mtp4"]
    d4 = {c["impl"]: jit_key(c) for c in prod["d4"]}
    d3 = {c["impl"]: jit_key(c) for c in prod["d3"]}
    assert d4["paged"][2][0] == (4 if v(release) >= (0, 28) else 1)
    assert d4["metadata"][5] == (66 if v(release) >= (0, 28) else 132)
    assert d3["paged"][2][0] == 1


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("config", ["full", "mtp2_full", "mtp4_full"])
def test_full_decode_graphs_leave_captured_keys_to_capture(release, config):
    """With FULL decode CUDA graphs the family warms only what capture does not compile:
    no key both here and in capture (the real builder and op on the runner's uniform capture
    batches), and together they hold everything the eager plan warms and production reaches."""
    result = scenario(release)
    eager = config.replace("_full", "") if config != "full" else "eager"
    capture = [c for calls in result["capture"][config] for c in calls]
    got = steps(result, config)
    assert "paged_mqa_logits[captured]" in got and "paged_mqa_logits_metadata[captured]" in got
    assert not keys(warm_calls(result, config, "paged_mqa_logits"), "paged") & keys(capture, "paged")
    assert not keys(warm_calls(result, config, "paged_mqa_logits_metadata")) & keys(capture, "metadata")
    together = keys(warm_calls(result, config)) | keys(capture)
    assert keys(warm_calls(result, eager)) <= together
    assert keys(production_calls(result, eager)) <= together


@pytest.mark.parametrize("release", RELEASES)
def test_decode_warmup_reads_only_the_null_block(release):
    """The paged kernel reads the real bound cache through production's quant view, with a
    block table of zeros (the null block, which no request owns) and context lengths within
    one block; it writes only its fresh logits."""
    result = scenario(release)
    for plan in ("eager", "mtp2", "mtp4"):
        for call in warm_calls(result, plan, "paged_mqa_logits"):
            if call["impl"] != "paged":
                continue
            q, kv, lens, table = call["args"][0][0], call["args"][1], call["args"][3], call["args"][4]
            assert kv["ptr"] == result["cache_ptrs"][plan]
            assert set(sum(table["values"], [])) == {0}
            assert max(sum(lens["values"], [])) <= kv["shape"][1]
            assert lens["values"] == [list(range(1, q["shape"][1] + 1))]  # token j sees j + 1 keys


@pytest.mark.parametrize("release", RELEASES)
def test_prefill_warmup_is_one_call(release):
    """The prefill kernel's key holds no batch size or sequence length: production's chunks
    (plain and MTP engines) share one key, the one the single warm call compiles."""
    result = scenario(release)
    prod = {jit_key(c) for config in ("eager", "mtp2", "mtp4") for c in production_calls(result, config)
            if c["impl"] == "mqa_logits"}
    for plan in ("eager", "full", "mtp2", "mtp4_full"):
        calls = warm_calls(result, plan, "mqa_logits")
        assert [c["impl"] for c in calls] == ["mqa_logits"]
        assert keys(calls) == prod
