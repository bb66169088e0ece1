"""dsa_indexer, part 3: DeepGEMM's indexer kernels (``fp8_fp4_mqa_logits``,
``get_paged_mqa_logits_metadata``, ``fp8_fp4_paged_mqa_logits``) at the shapes the engine's
indexer layers run (see the package docstring)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step
from kwarm_ext.kernels.attention_groups import groups_of as _groups
from kwarm_ext.kernels.attention_groups import metadata_builder as _builder
from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.kernels.model_runner import runner_models
from kwarm_ext.vllm_compat import Missing, resolve_or_none
from kwarm_ext.kernels.dsa_indexer.metadata_processes import warm_metadata
from kwarm_ext.kernels.dsa_indexer.logits_dtype import production_logits_dtype, torch_dtype, upcast_as_production
from kwarm_ext.kernels.dsa_indexer.common import (
    INDEXER_BACKEND, METADATA_ROW_ALIGN, MIN_CAPABILITY, MQA_LOGITS, PAGED_METADATA,
    PAGED_MQA_LOGITS, PREFILL_ROWS, _DEEP_GEMM, _ENTRY_OWNERS, _INDEXER, _LEGACY_NAMES,
    _SPARSE_ATTN_INDEXER, _device, _first_attr, _full_graphs, _need,
    _synchronize, logger)


# -- DeepGEMM: fp8_fp4_mqa_logits, get_paged_mqa_logits_metadata, fp8_fp4_paged_mqa_logits ------

@dataclasses.dataclass(frozen=True)
class DeepGemmEntries:
    """The ``vllm.utils.deep_gemm`` wrappers as production's modules import them, with the
    keywords production passes that this release's signatures take, and per wrapper why it
    cannot be called the way production calls it (absent, renamed, another signature)."""

    fns: dict  # wrapper name -> function
    problems: dict  # wrapper name -> reason
    mqa_clean_logits: bool = False  # fp8_fp4_mqa_logits(..., clean_logits=False) (0.20-0.28)
    mqa_max_seqlen_k: bool = False  # fp8_fp4_mqa_logits(..., max_seqlen_k) (0.33+), positional
    paged_clean_logits: bool = False  # fp8_fp4_paged_mqa_logits(..., clean_logits=False) (<= 0.28)
    paged_indices: bool = False  # fp8_fp4_paged_mqa_logits(..., indices=None) (0.28+)
    metadata_indices: bool = False  # get_paged_mqa_logits_metadata(..., indices=None) (0.28+)
    mqa_logits_dtype: bool = False  # fp8_fp4_mqa_logits(..., logits_dtype=...) (0.34+)
    paged_logits_dtype: bool = False  # fp8_fp4_paged_mqa_logits(..., logits_dtype=...) (0.34+)

    @property
    def mqa_logits(self):
        return self.fns.get(MQA_LOGITS)

    @property
    def paged_mqa_logits(self):
        return self.fns.get(PAGED_MQA_LOGITS)

    @property
    def paged_metadata(self):
        return self.fns.get(PAGED_METADATA)


def deep_gemm_entries() -> DeepGemmEntries:
    """Resolve the three wrappers and bind production's call shapes to their signatures."""
    fns, problems = {}, {}
    for name, owner in _ENTRY_OWNERS.items():
        try:
            fns[name] = _resolve_entry(name, owner)
        except Missing as exc:
            problems[name] = str(exc)
    takes = {name: vllm_compat.params(fn) for name, fn in fns.items()}
    mqa = takes.get(MQA_LOGITS, {})
    if MQA_LOGITS in fns and "clean_logits" not in mqa and "max_seqlen_k" not in mqa:
        signature = inspect.signature(fns.pop(MQA_LOGITS))
        problems[MQA_LOGITS] = f"{MQA_LOGITS}{signature} takes neither clean_logits nor max_seqlen_k"
    entries = DeepGemmEntries(
        fns, problems, mqa_clean_logits="clean_logits" in mqa,
        mqa_max_seqlen_k="clean_logits" not in mqa and "max_seqlen_k" in mqa,
        paged_clean_logits="clean_logits" in takes.get(PAGED_MQA_LOGITS, {}),
        paged_indices="indices" in takes.get(PAGED_MQA_LOGITS, {}),
        metadata_indices="indices" in takes.get(PAGED_METADATA, {}), mqa_logits_dtype="logits_dtype" in mqa,
        paged_logits_dtype="logits_dtype" in takes.get(PAGED_MQA_LOGITS, {}))
    bindings = {
        MQA_LOGITS: lambda fn: vllm_compat.bind(fn, *_mqa_logits_args(entries, *([None] * 5), max_seqlen_k=0),
                                                **_mqa_logits_kwargs(entries)),
        PAGED_METADATA: lambda fn: vllm_compat.bind(fn, None, 0, 0, **_metadata_kwargs(entries)),
        PAGED_MQA_LOGITS: lambda fn: vllm_compat.bind(fn, *([None] * 6), **_paged_kwargs(entries, 0)),
    }
    for name, fn in list(fns.items()):
        try:
            bindings[name](fn)
        except Missing as exc:
            problems[name] = str(exc)
            del fns[name]
    return entries


def _resolve_entry(name: str, owner: str):
    """`name` as production's module `owner` imports it, else from vllm.utils.deep_gemm."""
    try:
        return vllm_compat.resolve(f"{owner}:{name}", f"{_DEEP_GEMM}:{name}")
    except Missing:
        legacy = _LEGACY_NAMES.get(name)
        if legacy and vllm_compat.has(f"{owner}:{legacy}", f"{_DEEP_GEMM}:{legacy}"):
            raise Missing(f"this vLLM calls DeepGEMM's {legacy} (the call shape before {name}), "
                          "which is not modelled") from None
        raise


def _mqa_logits_args(entries, q, kv, weights, ks, ke, *, max_seqlen_k) -> tuple:
    return (q, kv, weights, ks, ke, *((max_seqlen_k,) if entries.mqa_max_seqlen_k else ()))


def _mqa_logits_kwargs(entries, logits_dtype=None) -> dict:
    kwargs = {"clean_logits": False} if entries.mqa_clean_logits else {}
    if entries.mqa_logits_dtype and logits_dtype is not None:
        kwargs["logits_dtype"] = logits_dtype  # 0.34+: production's (IndexerShape.logits_dtype)
    return kwargs


def _metadata_kwargs(entries) -> dict:
    return {"indices": None} if entries.metadata_indices else {}  # None: no varlen rows (SM90)


def _paged_kwargs(entries, max_model_len: int, logits_dtype=None) -> dict:
    kwargs = {"max_model_len": max_model_len}
    if entries.paged_logits_dtype and logits_dtype is not None:
        kwargs["logits_dtype"] = logits_dtype
    if entries.paged_clean_logits:
        kwargs["clean_logits"] = False
    if entries.paged_indices:
        kwargs["indices"] = None
    return kwargs


def deep_gemm_unavailable(view) -> str | None:
    """Why DeepGEMM cannot run here, or None. Mirrors production's gate
    (``current_platform.is_cuda() and has_deep_gemm()``: VLLM_USE_DEEP_GEMM=0 does not turn
    the indexer's DeepGEMM calls off) plus the GPU generation DeepGEMM needs."""
    try:
        has = vllm_compat.resolve(f"{_DEEP_GEMM}:has_deep_gemm", "vllm.utils.import_utils:has_deep_gemm")
    except Missing as exc:
        return f"DeepGEMM availability unknown: {exc}"
    if not has():
        return "DeepGEMM is not installed or does not import (has_deep_gemm() is False)"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return (f"not a CUDA platform ({type(current_platform).__name__}): the indexer's "
                "DeepGEMM kernels are CUDA-only")
    capability = current_platform.get_device_capability(_device(view).index or 0)
    if capability is None:
        return "GPU capability unknown"
    if tuple(capability)[:2] < MIN_CAPABILITY:
        major, minor = tuple(capability)[:2]
        return (f"GPU capability {major}.{minor} < 9.0: DeepGEMM's MQA-logits kernels need "
                "Hopper (SM90) or newer")
    return None


def _impl_missing(name: str) -> str | None:
    """Why the wrapper `name` would raise (its DeepGEMM symbol is absent), or None. Runs
    vLLM's own ``_lazy_init`` (which imports DeepGEMM and, only where it is unset, points
    DG_JIT_CACHE_DIR at VLLM_CACHE_ROOT/deep_gemm)."""
    dg = vllm_compat.resolve(_DEEP_GEMM)
    lazy = getattr(dg, "_lazy_init", None)
    if lazy is not None:
        try:
            lazy()
        except Exception as exc:
            return f"DeepGEMM failed to initialize: {type(exc).__name__}: {exc}"
    impl = f"_{name}_impl"
    if hasattr(dg, impl) and getattr(dg, impl) is None:
        return f"DeepGEMM has no {name} (vllm.utils.deep_gemm.{impl} is None after _lazy_init)"
    return None


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    """What the indexer's DeepGEMM calls are specialized on, read from one bound
    ``DeepseekV32IndexerCache`` layer and the indexer module that owns it."""

    heads: int  # query heads of the indexer on this rank (replicated across TP)
    head_dim: int
    block_size: int  # tokens per block of the bound indexer cache (the paged kernel's BLOCK_KV)
    cache_width: int  # bytes per token of the bound cache (FP8: head_dim + 4-byte fp32 scale)
    use_fp4: bool  # MXFP4 indexer cache (SparseAttnIndexer.use_fp4_cache)
    max_model_len: int
    logits_dtype: str | None = None  # DeepGEMM's logits dtype production asks for (0.34+; None: fp32)

    def label(self) -> str:
        return (f"heads={self.heads} head_dim={self.head_dim} block_size={self.block_size} "
                f"cache={'mxfp4' if self.use_fp4 else 'fp8'}{self.logits_label()}")

    def logits_label(self) -> str:
        return f" logits={self.logits_dtype}" if self.logits_dtype else ""


def indexer_shapes(view, groups) -> dict:
    """{IndexerShape: its first bound cache tensor} over the indexer groups' layers."""
    hf = getattr(getattr(_vllm_config(view), "model_config", None), "hf_config", None)
    model_config = getattr(_vllm_config(view), "model_config", None)
    owners = None
    out: dict = {}
    for group in groups:
        for name in getattr(group, "layer_names", None) or ():
            layer = view.forward_context.get(name)
            kv = getattr(layer, "kv_cache", None)
            kv = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
            if kv is None or not hasattr(kv, "shape") or kv.dim() != 3 or kv.numel() == 0:
                raise Missing(f"indexer cache {name} has no bound 3-D kv_cache")
            if owners is None:
                owners = _indexer_modules(view, {id(view.forward_context.get(n))
                                                 for g in groups for n in g.layer_names})
            owner, op = owners.get(id(layer), (None, None))
            heads = _first_attr(owner, "n_local_heads", "n_head", default=None) if owner is not None else None
            heads = heads if heads is not None else getattr(hf, "index_n_heads", None)
            head_dim = next((getattr(m, "head_dim") for m in (op, owner)
                             if m is not None and isinstance(getattr(m, "head_dim", None), int)),
                            getattr(hf, "index_head_dim", None))
            if heads is None or head_dim is None:
                raise Missing(f"indexer head count / head_dim of {name} not readable "
                              "(indexer module, hf_config.index_n_heads / index_head_dim)")
            width = int(kv.shape[-1])
            use_fp4 = getattr(op, "use_fp4_cache", None)
            if use_fp4 is None:  # no SparseAttnIndexer found: the cache layout tells
                use_fp4 = width != head_dim + 4 and width == head_dim // 2 + head_dim // 32
            if not use_fp4 and width != head_dim + 4:
                raise Missing(f"indexer cache {name}: {width} B/token is not the FP8 layout "
                              f"(head_dim {head_dim} + 4-byte scale)")
            max_len = getattr(op, "max_model_len", None) or getattr(model_config, "max_model_len", None)
            if max_len is None:
                raise Missing("max_model_len not readable (SparseAttnIndexer, model_config)")
            shape = IndexerShape(int(heads), int(head_dim), int(kv.shape[1]), width, bool(use_fp4),
                                 int(max_len), production_logits_dtype(op, view))
            out.setdefault(shape, kv)
    if not out:
        raise Missing(f"no layer in the {INDEXER_BACKEND} groups")
    return out


def _indexer_modules(view, cache_ids: set) -> dict:
    """{id(indexer cache layer): (module holding n_head, SparseAttnIndexer op)}, from the
    runner's model and drafter: the modules whose ``k_cache`` is one of the layers."""
    out: dict = {}
    for model in runner_models(view.runner):
        for module in model.modules():
            cache = getattr(module, "k_cache", None)
            if id(cache) not in cache_ids:
                continue
            owner, op = out.get(id(cache), (None, None))
            if hasattr(module, "n_head") or hasattr(module, "n_local_heads"):
                owner = module
            if hasattr(module, "use_fp4_cache") or type(module).__name__ == "SparseAttnIndexer":
                op = module
            out[id(cache)] = (owner, op)
    return out


@dataclasses.dataclass(frozen=True)
class DecodeArgs:
    """What the indexer metadata builder decides for decode (``DeepseekV32IndexerMetadataBuilder``)."""

    next_n: int  # 1 + num_speculative_tokens
    native: tuple  # native[d - 1]: a step whose longest decode is d runs the kernel with next_n=d
    varlen: bool  # 0.28+ SM100: one row per token with `indices`
    num_sms: int
    block_size: int  # kv_cache_spec.num_states (0.33) / storage_block_size: the metadata's block_kv
    max_reqs: int
    max_tokens: int

    def kernel_next_n(self, d: int) -> int:
        return d if self.native[d - 1] else 1

    def rows(self, d: int) -> int:
        """The most context_lens rows a step whose longest decode is d can have."""
        if self.native[d - 1]:
            return min(self.max_reqs, self.max_tokens // d)
        return min(self.max_reqs * d, self.max_tokens)  # flattened: one row per token


def decode_args(view, builder) -> DecodeArgs:
    spec = _need(builder, "kv_cache_spec", "indexer metadata builder")
    block = _first_attr(spec, "num_states", "storage_block_size", "block_size")
    spec_tokens = _first_attr(builder, "num_speculative_tokens")
    if spec_tokens is None:
        speculative = getattr(_vllm_config(view), "speculative_config", None)
        spec_tokens = getattr(speculative, "num_speculative_tokens", 0) if speculative else 0
    next_n = 1 + int(spec_tokens)
    flatten = bool(_need(builder, "use_flattening", "indexer metadata builder"))
    per_step = resolve_or_none(f"{_INDEXER}:_supports_native_decode")  # 0.28+
    native = tuple(d == 1 or (not flatten and (per_step is None or bool(per_step(d))))
                   for d in range(1, next_n + 1))
    scheduler = getattr(_vllm_config(view), "scheduler_config", None)
    max_reqs = view.max_num_reqs or getattr(scheduler, "max_num_seqs", None)
    max_tokens = view.max_num_batched_tokens or getattr(scheduler, "max_num_batched_tokens", None)
    if None in (block, max_reqs, max_tokens):
        raise Missing("indexer block size / max_num_seqs / max_num_batched_tokens not readable")
    return DecodeArgs(next_n, native, bool(getattr(builder, "supports_varlen", False)),
                      int(_need(builder, "num_sms", "indexer metadata builder")), int(block),
                      int(max_reqs), int(max_tokens))


@dataclasses.dataclass(frozen=True)
class MetadataVariant:
    """One ``get_paged_mqa_logits_metadata`` JIT key: kAlignedBatchSize and the SM slots."""

    rows: int  # context_lens rows: the top of one 32-row class
    next_n: int  # context_lens columns (0.28+: SM90 next_n=4 halves the slots)
    slots: int

    @property
    def key(self) -> tuple:
        return self.rows, self.slots

    def label(self) -> str:
        return (f"rows {self.rows - METADATA_ROW_ALIGN + 1}-{self.rows} (aligned batch {self.rows}) "
                f"next_n={self.next_n} slots={self.slots}")


def _slots(num_sms: int, next_n: int) -> int:
    """Scheduler slots the metadata is built for: 0.28+'s wrapper derives them from next_n."""
    fn = resolve_or_none(f"{_DEEP_GEMM}:_paged_mqa_logits_schedule_slots")
    return int(fn(num_sms, next_n)) if fn is not None else num_sms


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def decode_variants(args: DecodeArgs) -> tuple[list, list]:
    """(paged kernel next_n values, metadata variants) every decode step can reach."""
    rows: dict = {}
    for d in range(1, args.next_n + 1):
        k = args.kernel_next_n(d)
        rows[k] = max(rows.get(k, 0), args.rows(d))
    metadata: dict = {}
    for k, most in sorted(rows.items()):
        slots = _slots(args.num_sms, k)
        for top in range(METADATA_ROW_ALIGN, _align(most, METADATA_ROW_ALIGN) + 1, METADATA_ROW_ALIGN):
            metadata.setdefault((top, slots), MetadataVariant(top, k, slots))
    return sorted(rows), list(metadata.values())


def captured_decode(view, args: DecodeArgs) -> tuple[set, set, str]:
    """(kernel next_n values, metadata keys, how known) FULL decode CUDA-graph capture
    compiles: uniform batches of next_n tokens per request, one per capture size."""
    if not _full_graphs(view):
        return set(), set(), ""
    d = args.next_n
    k = args.kernel_next_n(d)
    compilation = getattr(_vllm_config(view), "compilation_config", None)
    sizes = getattr(compilation, "cudagraph_capture_sizes", None) or ()
    keys = set()
    for size in sizes:
        reqs = min(-(-int(size) // d), args.max_reqs)
        rows = reqs if args.native[d - 1] else reqs * d
        keys.add((_align(rows, METADATA_ROW_ALIGN), _slots(args.num_sms, k)))
    return {k}, keys, "" if sizes else "capture sizes not readable"


@dataclasses.dataclass
class DeepGemmCall:
    label: str
    output: object
    inputs: dict


def run_mqa_logits(entries: DeepGemmEntries, gather_shapes, device, shape: IndexerShape) -> DeepGemmCall:
    """One prefill-chunk call as ``sparse_attn_indexer`` makes it (FP8 cache): Q rows of
    one request against the K rows gathered into the workspace, without clean-up."""
    import torch
    from vllm.platforms import current_platform

    fp8 = current_platform.fp8_dtype()
    (k_shape, k_dtype), (s_shape, s_dtype) = gather_shapes(PREFILL_ROWS, shape.head_dim, fp8, False)
    k = _zeros(k_shape, k_dtype, device)
    k_scale = _zeros(s_shape, s_dtype, device).view(torch.float32).squeeze(-1)
    q = _zeros((PREFILL_ROWS, shape.heads, shape.head_dim), fp8, device)
    weights = torch.zeros(PREFILL_ROWS, shape.heads, dtype=torch.float32, device=device)
    ks = torch.zeros(PREFILL_ROWS, dtype=torch.int32, device=device)
    ke = torch.arange(1, PREFILL_ROWS + 1, dtype=torch.int32, device=device)  # causal: token i sees i+1 keys
    inputs = {"q": q, "k": k, "k_scale": k_scale, "weights": weights, "cu_seqlen_ks": ks, "cu_seqlen_ke": ke}
    output = entries.mqa_logits(*_mqa_logits_args(entries, (q, None), (k, k_scale), weights, ks, ke,
                                                  max_seqlen_k=PREFILL_ROWS),
                                **_mqa_logits_kwargs(entries, torch_dtype(shape.logits_dtype)))
    extra = "clean_logits=False" if entries.mqa_clean_logits else f"max_seqlen_k={PREFILL_ROWS}"
    extra += shape.logits_label() + upcast_as_production(output, ke - ks)
    return DeepGemmCall(f"heads={shape.heads} head_dim={shape.head_dim} q={_dtype_name(fp8)} "
                        f"k_scale=float32 {extra}", output, inputs)


def run_paged_metadata(entries: DeepGemmEntries, device, args: DecodeArgs, variant: MetadataVariant) -> DeepGemmCall:
    """The builder's call: 2-D int32 context lengths (rows x next_n), its block size, its SMs."""
    import torch

    context_lens = torch.ones(variant.rows, variant.next_n, dtype=torch.int32, device=device)
    output = entries.paged_metadata(context_lens, args.block_size, args.num_sms, **_metadata_kwargs(entries))
    return DeepGemmCall(variant.label(), output, {"context_lens": context_lens})


def run_paged_mqa_logits(entries: DeepGemmEntries, quant_view, device, args: DecodeArgs,
                         shape: IndexerShape, kv_cache, next_n: int) -> DeepGemmCall:
    """One decode request of `next_n` query tokens as ``sparse_attn_indexer`` makes it: Q
    [1, next_n, H, D], the bound cache's quant view, context lengths [1, next_n] (token j sees
    j+1 keys), a block table pointing at the null block 0 only, the builder's metadata."""
    import torch
    from vllm.platforms import current_platform

    fp8 = current_platform.fp8_dtype()
    q = _zeros((1, next_n, shape.heads, shape.head_dim), fp8, device)
    kv = quant_view(kv_cache, shape.head_dim, shape.use_fp4)
    weights = torch.zeros(next_n, shape.heads, dtype=torch.float32, device=device)
    seq_lens = torch.arange(1, next_n + 1, dtype=torch.int32, device=device).view(1, next_n)
    table = torch.zeros(1, -(-shape.max_model_len // shape.block_size), dtype=torch.int32, device=device)
    schedule = entries.paged_metadata(seq_lens, args.block_size, args.num_sms, **_metadata_kwargs(entries))
    output = entries.paged_mqa_logits((q, None), kv, weights, seq_lens, table, schedule,
                                      **_paged_kwargs(entries, shape.max_model_len, torch_dtype(shape.logits_dtype)))
    inputs = {"q": q, "kv_cache": kv, "weights": weights, "context_lens": seq_lens, "block_table": table,
              "schedule_metadata": schedule}
    return DeepGemmCall(f"next_n={next_n} {shape.label()}{upcast_as_production(output, seq_lens)}", output, inputs)


def described_metadata_call(entries, args: DecodeArgs, variant: MetadataVariant) -> dict | None:
    """:func:`run_paged_metadata` as a call the compile processes make (``processes.start_calls``):
    the wrapper by name, the context lengths by shape; None where the wrapper has no importable name."""
    fn = entries.paged_metadata
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    return {"fn": f"{module}:{qualname}", "args": [{"tensor": [variant.rows, variant.next_n], "dtype": "int32",
                                                    "fill": 1}, args.block_size, args.num_sms],
            "kwargs": _metadata_kwargs(entries)}


def _zeros(shape, dtype, device):
    """Zeros of `dtype` (fp8 included: made as bytes and viewed)."""
    import torch

    if dtype.is_floating_point and torch.finfo(dtype).bits == 8:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _warm(view, calls) -> list:
    import torch

    device = _device(view)
    logger.debug("kwarm: dsa_indexer: DeepGEMM JIT cache DG_JIT_CACHE_DIR=%s",
                 os.environ.get("DG_JIT_CACHE_DIR", "-"))
    with torch.inference_mode():
        labels = [call(device).label for call in calls]
    _synchronize(device)
    return labels


DG_STEPS = (("mqa_logits", MQA_LOGITS), ("paged_mqa_logits", PAGED_MQA_LOGITS),
            ("paged_mqa_logits_metadata", PAGED_METADATA))


def _deep_gemm_steps(view, forced: bool) -> list:
    """Prefill logits, decode logits and decode schedule metadata. `forced` changes nothing:
    no upstream release warms these; what FULL decode capture compiles is left to it."""
    def skipped(reason, names=DG_STEPS):
        return [Step(name, kernel, skip=reason) for name, kernel in names]

    reason = deep_gemm_unavailable(view)
    if reason is not None:
        return skipped(reason)
    try:
        gather_shapes = vllm_compat.resolve(f"{_SPARSE_ATTN_INDEXER}:_gather_workspace_shapes")
        quant_view = vllm_compat.resolve(f"{_SPARSE_ATTN_INDEXER}:kv_cache_as_quant_view")
    except Missing as exc:
        return skipped(str(exc))
    groups = _groups(view, INDEXER_BACKEND)
    if not groups:
        return skipped(f"no {INDEXER_BACKEND} attention group on the runner")
    try:
        shapes = indexer_shapes(view, groups)
    except Missing as exc:
        return skipped(str(exc))
    if any(s.use_fp4 for s in shapes):
        return skipped("MXFP4 indexer cache (SM100): its DeepGEMM call shape is not modelled")
    mx = resolve_or_none(f"{_DEEP_GEMM}:mqa_logits_use_mx_scales")  # 0.33+
    if mx is not None and mx():
        return skipped("MX-scaled MQA-logits inputs (SM100, 0.33+): not modelled")

    entries = deep_gemm_entries()
    why = _why_not(entries, MQA_LOGITS)
    if why:
        steps = skipped(why, DG_STEPS[:1])
    else:
        calls = [lambda device, s=s: run_mqa_logits(entries, gather_shapes, device, s) for s in shapes]
        steps = [Step("mqa_logits", MQA_LOGITS, run=functools.partial(_warm, view, calls))]
    return steps + _decode_steps(view, entries, quant_view, shapes, groups)


def _why_not(entries: DeepGemmEntries, *names: str) -> str | None:
    """Why a step that calls `names` cannot run: a wrapper this release lacks or calls
    differently, or DeepGEMM's own symbol missing behind it."""
    for name in names:
        why = entries.problems.get(name) or _impl_missing(name)
        if why:
            return why
    return None


def _decode_steps(view, entries, quant_view, shapes: dict, groups) -> list:
    (paged_name, paged_kernel), (md_name, md_kernel) = DG_STEPS[1:]
    try:
        args = decode_args(view, _builder(groups[0]))
    except Missing as exc:
        return [Step(paged_name, paged_kernel, skip=str(exc)), Step(md_name, md_kernel, skip=str(exc))]
    if args.varlen:
        why = "varlen decode (SM100: one row per token, with indices) is not modelled"
        return [Step(paged_name, paged_kernel, skip=why), Step(md_name, md_kernel, skip=why)]
    next_ns, metadata = decode_variants(args)
    cap_next_n, cap_keys, unknown = captured_decode(view, args)
    steps = []

    why = _why_not(entries, PAGED_METADATA, PAGED_MQA_LOGITS)
    todo = [k for k in next_ns if k not in cap_next_n]
    if why:
        steps.append(Step(paged_name, paged_kernel, skip=why))
    elif todo:
        calls = [lambda device, s=s, kv=kv, k=k: run_paged_mqa_logits(entries, quant_view, device, args, s, kv, k)
                 for s, kv in shapes.items() for k in todo]
        steps.append(Step(paged_name, paged_kernel, run=functools.partial(_warm, view, calls)))
    if not why and cap_next_n & set(next_ns):
        steps.append(Step(f"{paged_name}[captured]", paged_kernel,
                          skip="compiled by FULL CUDA-graph capture: next_n="
                               + ",".join(map(str, sorted(cap_next_n & set(next_ns))))))

    why = _why_not(entries, PAGED_METADATA)
    todo_md = [m for m in metadata if m.key not in cap_keys]
    done_md = [m for m in metadata if m.key in cap_keys]
    if why:
        steps.append(Step(md_name, md_kernel, skip=why))
    elif todo_md:
        calls = [lambda device, m=m: run_paged_metadata(entries, device, args, m) for m in todo_md]
        described = [described_metadata_call(entries, args, m) for m in todo_md[1:]]
        steps.append(Step(md_name, md_kernel, run=functools.partial(warm_metadata, view, calls, described, _warm)))
    if not why and done_md:
        steps.append(Step(f"{md_name}[captured]", md_kernel,
                          skip=f"compiled by FULL CUDA-graph capture: {len(done_md)} of {len(metadata)} "
                               f"row classes (aligned batch <= {max(m.rows for m in done_md)})"))
    if unknown and _full_graphs(view):
        logger.debug("kwarm: dsa_indexer: %s; warming every metadata row class", unknown)
    return steps
