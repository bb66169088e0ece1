"""Warmup family ``dsa_indexer``: GLM-5 / DeepSeek-V3.2 DSA prefill chunk metadata, sparse-MLA indices.

Why:
    Two plain ``@triton.jit`` kernels of DSA models are first compiled by a request, not by
    engine start (gpu-baseline, H200, vLLM 0.24: ``build_prefill_chunk_metadata`` costs
    1.17 s on its first call, inside the tiny DeepSeek-V3.2's first request):

    - ``_build_prefill_chunk_metadata_kernel`` (``v1/attention/backends/mla/indexer.py``),
      launched by ``build_prefill_chunk_metadata`` for every prefill chunk of the indexer.
      Its runtime-specialized arguments are ``query_slice_start`` / ``query_slice_stop``
      (Triton int classes: ``1``, multiple of 16, other) and the 16-byte alignment of
      ``uncompressed_seq_lens[start_idx:end_idx]``: decodes come first in a batch, so that
      int32 view is misaligned whenever ``start_idx % 4 != 0``. Capture never builds
      prefill metadata (MRV2's prefill warmup step, 0.29+, compiles its one batch's key),
      so each (start, stop, alignment) class is a first-request compile.
    - ``_convert_req_index_to_global_index_kernel`` (``v1/attention/backends/mla/sparse_utils.py``),
      launched by FLASHMLA_SPARSE through ``triton_convert_req_index_to_global_index``.
      FULL CUDA-graph capture compiles the decode variant; the FP8-KV prefill-workspace
      variant (``HAS_PREFILL=True``) only ever appears at runtime, and with eager execution
      (or piecewise-only graphs) every variant does.

How:
    Through vLLM's own entry functions, called the way the production callers call them
    (``DeepseekV32IndexerMetadataBuilder.build`` -> ``split_indexer_prefill_chunks`` ->
    ``build_prefill_chunk_metadata``; ``FlashMLASparseImpl._forward_*``), so launch options,
    constexprs and argument dtypes (int32 ``query_start_loc`` / ``seq_lens``) are the
    production ones. Small fresh tensors on the runner's device under
    ``torch.inference_mode()``; the block table passed in is a row slice of the runner's
    real one for that KV-cache group (read only: neither kernel writes it, and nothing here
    touches KV blocks). DCP arguments (0.25+) come from the live indexer metadata builder;
    the convert variants from the live FLASHMLA_SPARSE builder (KV dtype, mixed-batch
    choice), the CUDA-graph mode and the entry's signature. 0.30+ changed the convert call
    (BLOCK_STRIDE_ROWS, index groups): only its FP8 prefill-workspace call is modelled
    there. No collectives.

Upstream:
    vLLM 0.25-0.26 ``sparse_mla_triton_warmup_if_needed`` warms the chunk kernel for
    ``qs_start`` in {0, 1} x ``qs_stop`` in {16, 15} x aligned/+4 B (8 keys, default DCP
    arguments); 0.27-0.29 ``sparse_mla_triton_warmup`` ->
    ``_BUILD_PREFILL_CHUNK_METADATA_KERNEL.warmup`` (0.28: ``qs_start`` in {0, 1},
    ``qs_stop`` in {1, 15, 16}); 0.30+ the JIT warmup registry (0.33: all 3 x 3 classes, and
    the convert kernel for flat/BF16 KV caches only). Each is gated as upstream gates it
    (``enable_jit_warmup``, pooling, backends). This family computes the keys upstream warms
    (calling upstream's own ``get_warmup_keys`` where it exists), warms only the rest and
    names the covered keys in a ``[upstream]`` skipped step, unless forced.

Remove when:
    The oldest supported vLLM warms every ``qs_start`` class of the chunk kernel (0.33's
    registry does) and the FP8-KV prefill-workspace variant of the convert kernel (0.33 does
    not: it registers the convert kernel only for flat KV caches).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step
from kwarm_ext.vllm_compat import Missing

logger = logging.getLogger("kwarm")

INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
SPARSE_MLA_BACKEND = "FLASHMLA_SPARSE"
CHUNK_KERNEL = "_build_prefill_chunk_metadata_kernel"
CONVERT_KERNEL = "_convert_req_index_to_global_index_kernel"

_INDEXER = "vllm.v1.attention.backends.mla.indexer"
_SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"
_FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"
_KERNEL_WARMUP = "vllm.model_executor.warmup.kernel_warmup"
_UPSTREAM_SPARSE = "vllm.model_executor.warmup.sparse_mla_triton_warmup"

# (query_slice_start, query_slice_stop): every pair of Triton int classes production can
# reach (stop > start, so stop == 1 only with start == 0; 0 is in the multiple-of-16 class).
QUERY_SLICES = ((0, 1), (0, 16), (0, 15), (1, 16), (1, 15), (5, 16), (5, 7))
# Decode rows ahead of the prefill rows: seq_lens[start_idx:] at +0 B (aligned) or +4 B.
DECODES_AHEAD = {True: 0, False: 1}
# The prefill rows of the warm batch: one chunk of 16 query tokens, so every slice fits.
PREFILL_QUERY_LENS = (8, 8)
PREFILL_CONTEXT_LENS = (3, 21)
DECODE_SEQ_LEN = 9
# The convert kernel's warm batch: request 0 decodes, request 1 prefills (a mixed batch).
CONVERT_REQ_IDS = (0, 0, 1, 1)
CONVERT_PREFILL_IDS = (-1, -1, 0, 0)


def applies(view) -> str | None:
    if view.has_backend(INDEXER_BACKEND):
        return None
    return f"no {INDEXER_BACKEND} attention backend"


def plan(view, forced: bool) -> list:
    return [*_planned(_chunk_steps, "prefill_chunk_metadata", CHUNK_KERNEL, view, forced),
            *_planned(_convert_steps, "convert_req_index", CONVERT_KERNEL, view, forced)]


def _planned(steps_of, name: str, kernel: str, view, forced: bool) -> list:
    """`steps_of`'s steps; an unexpected error while planning one kernel becomes that
    kernel's failing step (a warning naming it), not the whole family's failure."""
    try:
        return steps_of(view, forced)
    except Exception as exc:
        def fail(error=exc):
            raise error
        return [Step(name, kernel, run=fail)]


# -- Triton's specialization classes ------------------------------------------------------

def int_class(value: int) -> str:
    """Triton's value class of a non-constexpr int argument."""
    if value == 1:
        return "one"
    return "div16" if value % 16 == 0 else "other"


@dataclasses.dataclass(frozen=True)
class ChunkCase:
    """One ``_build_prefill_chunk_metadata_kernel`` key class: slice classes and alignment."""

    qs_start: int
    qs_stop: int
    aligned: bool

    @property
    def key(self) -> tuple:
        return int_class(self.qs_start), int_class(self.qs_stop), self.aligned

    def label(self, aligned: bool | None = None) -> str:
        aligned = self.aligned if aligned is None else aligned
        return (f"qs_start={self.qs_start}({int_class(self.qs_start)}) "
                f"qs_stop={self.qs_stop}({int_class(self.qs_stop)}) "
                f"seq_lens={'aligned' if aligned else 'misaligned'}")


CHUNK_CASES = tuple(ChunkCase(s, e, a) for a in (True, False) for s, e in QUERY_SLICES)


# -- the live engine -----------------------------------------------------------------------

def _groups(view, backend: str) -> list:
    """The runner's AttentionGroups whose backend is `backend`."""
    out = []
    for per_group in getattr(view.runner, "attn_groups", None) or ():
        for group in per_group:
            try:
                name = group.backend.get_name()
            except Exception:  # get_name may raise NotImplementedError
                continue
            if name == backend:
                out.append(group)
    return out


def _builder(group):
    builders = getattr(group, "metadata_builders", None)
    if builders:
        return builders[0]
    get = getattr(group, "get_metadata_builder", None)
    return get() if get is not None else None


def _vllm_config(view):
    return getattr(view.worker, "vllm_config", None) or getattr(view.runner, "vllm_config", None)


def _device(view):
    import torch

    device = getattr(view.runner, "device", None) or view.device
    if device is None:
        raise Missing("runner has no device")
    return torch.device(device)


def block_table(view, group_id: int, num_reqs: int):
    """Rows of the runner's real block table of KV-cache group `group_id` (what
    ``CommonAttentionMetadata.block_table_tensor`` is a slice of)."""
    runner = view.runner
    tables = getattr(getattr(runner, "input_batch", None), "block_table", None)
    if tables is not None:  # V1: MultiGroupBlockTable
        return tables[group_id].get_device_tensor(num_reqs)
    v2 = getattr(getattr(runner, "block_tables", None), "input_block_tables", None)
    if v2 is not None:  # V2 (v1/worker/gpu/block_table.py)
        return v2[group_id][:num_reqs]
    raise Missing("runner has neither input_batch.block_table (V1) nor block_tables (V2)")


def _jit_warmup_enabled(view) -> bool:
    kernel_config = getattr(_vllm_config(view), "kernel_config", None)
    return bool(getattr(kernel_config, "enable_jit_warmup", True))


def _full_graphs(view) -> bool:
    """Whether CUDA-graph capture runs decode batches with attention metadata (FULL modes)."""
    if view.enforce_eager:
        return False
    return "FULL" in (view.cudagraph_mode or "").upper()


def _registry_keys(view, kernel) -> list | None:
    """Compile keys the runner's JIT warmup registry (0.30+) holds for `kernel`, or None."""
    registry = getattr(view.runner, "jit_warmup_registry", None)
    registrations = getattr(registry, "_registrations", None)
    if not isinstance(registrations, dict) or not _jit_warmup_enabled(view):
        return None
    if kernel not in registrations:
        return None
    keys = []
    for args, kwargs in registrations[kernel]:
        if not args and not kwargs and "vllm_config" in vllm_compat.params(kernel.get_warmup_keys):
            kwargs = {"vllm_config": getattr(registry, "vllm_config", None) or _vllm_config(view)}
        keys.extend(kernel.get_warmup_keys(*args, **kwargs))
    return keys


def _first_attr(obj, *names, default=None):
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


# -- _build_prefill_chunk_metadata_kernel ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChunkArgs:
    """What production passes besides the batch: the indexer group and its builder's values."""

    group_id: int
    compress_ratio: int
    dcp: dict  # dcp_rank / dcp_world_size / cp_kv_cache_interleave_size (0.25+), else {}

    @property
    def dcp_classes(self) -> tuple:
        if not self.dcp:
            return ("div16", "one", "one")  # the kernel's own defaults, rank 0 / world 1 / 1
        return tuple(int_class(v) for v in self.dcp.values())


def chunk_args(view, fn) -> ChunkArgs:
    groups = _groups(view, INDEXER_BACKEND)
    if not groups:
        raise Missing(f"no {INDEXER_BACKEND} attention group on the runner")
    group = groups[0]
    builder = _builder(group)
    ratio = _first_attr(builder, "compress_ratio", default=1)
    dcp = {}
    if "dcp_rank" in vllm_compat.params(fn):
        world = _first_attr(builder, "dcp_world_size")
        rank = _first_attr(builder, "dcp_rank")
        interleave = _first_attr(builder, "compressed_cp_interleave_size", "cp_kv_cache_interleave_size")
        if None in (world, rank, interleave):
            parallel = getattr(_vllm_config(view), "parallel_config", None)
            world = getattr(parallel, "decode_context_parallel_size", 1)
            interleave = getattr(parallel, "cp_kv_cache_interleave_size", 1)
            rank = 0 if world == 1 else _dcp_rank()
        dcp = {"dcp_rank": int(rank), "dcp_world_size": int(world),
               "cp_kv_cache_interleave_size": int(interleave)}
    return ChunkArgs(_need(group, "kv_cache_group_id", "attention group"), int(ratio), dcp)


def _dcp_rank() -> int:
    from vllm.distributed.parallel_state import get_dcp_group

    return get_dcp_group().rank_in_group


@dataclasses.dataclass
class ChunkResult:
    label: str
    aligned: bool  # what the seq_lens view really was
    metadata: object
    start_idx: int
    query_lens: list
    seq_lens: list
    query_slice: slice


def run_chunk_case(fn, args: ChunkArgs, device, table_rows, case: ChunkCase) -> ChunkResult:
    """One production-shaped ``build_prefill_chunk_metadata`` call: `DECODES_AHEAD` decode
    rows, then the prefill rows, chunk [start_idx, end_idx), query slice of `case`."""
    import torch

    decodes = DECODES_AHEAD[case.aligned]
    query_lens = [1] * decodes + list(PREFILL_QUERY_LENS)
    seq_lens = [DECODE_SEQ_LEN] * decodes + [c + q for c, q in zip(PREFILL_CONTEXT_LENS, PREFILL_QUERY_LENS)]
    start_idx, end_idx = decodes, len(query_lens)
    query_start_loc_cpu = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    query_start_loc = query_start_loc_cpu.to(device)
    seq_lens_dev = seq_lens_cpu.to(device)
    if args.compress_ratio > 1:
        compressed_cpu = seq_lens_cpu // args.compress_ratio
        compressed = compressed_cpu.to(device)
    else:
        compressed_cpu, compressed = seq_lens_cpu, seq_lens_dev
    table = table_rows(len(query_lens))
    aligned = seq_lens_dev[start_idx:end_idx].data_ptr() % 16 == 0
    query_slice = slice(case.qs_start, case.qs_stop)
    metadata = vllm_compat.call(
        fn, start_idx, end_idx, query_start_loc, query_start_loc_cpu, seq_lens_dev, compressed,
        compressed_cpu, table, args.compress_ratio,
        query_slice=query_slice, skip_kv_gather=query_slice.start > 0, **args.dcp)
    return ChunkResult(case.label(aligned), aligned, metadata, start_idx, query_lens, seq_lens, query_slice)


def _warm_chunks(view, fn, args: ChunkArgs, cases) -> list:
    import torch

    device = _device(view)

    def table_rows(n):
        return block_table(view, args.group_id, n)

    with torch.inference_mode():
        labels = [run_chunk_case(fn, args, device, table_rows, case).label for case in cases]
    _synchronize(device)
    return labels


def upstream_chunk_keys(view, args: ChunkArgs) -> tuple[set, list]:
    """(key classes upstream vLLM warms for the chunk kernel on this engine, their sources)."""
    covered: set = set()
    sources: list = []
    if view.is_pooling_model:
        return covered, sources
    warmup_ns = _resolve_or_none(_KERNEL_WARMUP)
    max_tokens = view.max_num_batched_tokens or 0
    # 0.25-0.26: fixed cases with the kernel's default DCP arguments and compress ratio 1.
    if warmup_ns is not None and hasattr(warmup_ns, "sparse_mla_triton_warmup_if_needed"):
        upstream = _resolve_or_none(_UPSTREAM_SPARSE)
        dsv4 = getattr(upstream, "_DEEPSEEK_V4_SPARSE_MLA_BACKENDS", frozenset())
        q = max(0, min(8, max_tokens))
        if q > 0 and not any(view.has_backend(b) for b in dsv4) and args.compress_ratio == 1 \
                and args.dcp_classes == ("div16", "one", "one"):
            offsets = getattr(upstream, "_PREFILL_CHUNK_METADATA_QUERY_SLICE_OFFSETS",
                              ((0, 0), (0, -1), (1, 0), (1, -1)))
            covered |= {(int_class(s), int_class(2 * q + t), a) for s, t in offsets for a in (True, False)}
            sources.append("sparse_mla_triton_warmup_if_needed")
    kernel = _resolve_or_none(f"{_INDEXER}:_BUILD_PREFILL_CHUNK_METADATA_KERNEL")
    if kernel is None or not hasattr(kernel, "get_warmup_keys"):
        return covered, sources
    # 0.27-0.29: sparse_mla_triton_warmup(worker) -> kernel.warmup(vllm_config).
    if (warmup_ns is not None and hasattr(warmup_ns, "sparse_mla_triton_warmup")
            and _jit_warmup_enabled(view) and max_tokens > 0):
        keys = _upstream_keys("sparse_mla_triton_warmup", kernel.get_warmup_keys, _vllm_config(view))
        if keys is not None:
            covered |= _chunk_key_classes(keys, args)
            sources.append("sparse_mla_triton_warmup")
    # 0.30+: the runner's JIT warmup registry.
    keys = _upstream_keys("JIT warmup registry", _registry_keys, view, kernel)
    if keys is not None:
        covered |= _chunk_key_classes(keys, args)
        sources.append("JIT warmup registry")
    return covered, sources


def _chunk_key_classes(keys, args: ChunkArgs) -> set:
    """Upstream CompileKeys (0.27+) as ChunkCase key classes, those matching production's
    compress ratio, DCP classes and (no PCP) aligned cu_seq_lens."""
    out = set()
    for k in keys:
        ratio = _first_attr(k, "COMPRESS_RATIO", "compress_ratio", default=1)
        dcp = tuple(int_class(_first_attr(k, up, low, default=d)) for up, low, d in (
            ("DCP_RANK", "dcp_rank", 0), ("DCP_WORLD", "dcp_world", 1),
            ("DCP_INTERLEAVE", "dcp_interleave", 1)))
        variant = k.input_variant
        if (ratio != args.compress_ratio or dcp != args.dcp_classes
                or not _aligned(variant, "cu_compressed_seq_lens")):
            continue
        out.add((int_class(k.query_slice_start), int_class(k.query_slice_stop),
                 _aligned(variant, "uncompressed_seq_lens")))
    return out


def _aligned(variant, name: str) -> bool:
    try:
        return bool(variant.is_aligned(name))
    except KeyError:  # not a variant axis of this release: a fresh (aligned) tensor
        return True


def _chunk_steps(view, forced: bool) -> list:
    name = "prefill_chunk_metadata"
    try:
        fn = vllm_compat.resolve(f"{_INDEXER}:build_prefill_chunk_metadata")
        args = chunk_args(view, fn)
        vllm_compat.bind(fn, *([None] * 9), query_slice=None, skip_kv_gather=False, **args.dcp)
    except Missing as exc:
        return [Step(name, CHUNK_KERNEL, skip=str(exc))]
    covered, sources = (set(), []) if forced else upstream_chunk_keys(view, args)
    todo = [c for c in CHUNK_CASES if c.key not in covered]
    done = [c for c in CHUNK_CASES if c.key in covered]
    steps = []
    if todo:
        steps.append(Step(name, CHUNK_KERNEL, run=functools.partial(_warm_chunks, view, fn, args, todo)))
    if done:
        which = f"all {len(done)} key classes" if not todo else \
            f"{len(done)} of {len(CHUNK_CASES)} key classes: {_describe(done)}"
        steps.append(Step(f"{name}[upstream]", CHUNK_KERNEL,
                          skip=f"covered by upstream {' + '.join(sources)} ({which})"))
    return steps


def _describe(cases) -> str:
    """Cases as query slices and seq_lens alignments, e.g. ``[0:16) [1:15) x aligned+misaligned``."""
    by_slice: dict = {}
    for case in cases:
        by_slice.setdefault(f"[{case.qs_start}:{case.qs_stop})", set()).add(case.aligned)
    names = {frozenset({True, False}): "aligned+misaligned", frozenset({True}): "aligned",
             frozenset({False}): "misaligned"}
    if len({frozenset(a) for a in by_slice.values()}) == 1:
        return f"query slices {' '.join(by_slice)} x seq_lens {names[frozenset(next(iter(by_slice.values())))]}"
    return ", ".join(f"query slice {s} seq_lens {names[frozenset(a)]}" for s, a in by_slice.items())


# -- _convert_req_index_to_global_index_kernel -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConvertVariant:
    """One production call shape of ``triton_convert_req_index_to_global_index``."""

    name: str
    has_prefill: bool  # HAS_PREFILL (HAS_PREFILL_WORKSPACE=True)
    count_valid: bool  # COUNT_VALID (return_valid_counts=True)

    def label(self, block_size: int, topk: int, width: int) -> str:
        return (f"{self.name}: HAS_PREFILL={self.has_prefill} COUNT_VALID={self.count_valid} "
                f"BLOCK_SIZE={block_size} topk={topk} max_num_blocks_per_req={width}")


@dataclasses.dataclass(frozen=True)
class ConvertArgs:
    group_id: int
    block_size: int
    topk: int
    block_stride_rows: object  # None, or the 0.30+ BLOCK_STRIDE_ROWS argument
    strided: bool  # the entry takes BLOCK_STRIDE_ROWS (0.30+ call shape)


def convert_variants(view, group) -> tuple[list, list]:
    """(variants only a request reaches, variants FULL decode capture compiles), per
    FlashMLASparseImpl's forward paths: BF16 KV, FP8 KV mixed batch, FP8 KV separate
    prefill/decode (the FP8 cache's prefill tokens map into the BF16 workspace)."""
    builder = _builder(group)
    fp8 = _need(builder, "use_fp8_kv_cache", "FLASHMLA_SPARSE metadata builder")
    mixed = _first_attr(builder, "fp8_use_mixed_batch")  # 0.30+: decided at init
    if mixed is None:  # 0.20-0.29: decided per build() from the head count
        min_heads = vllm_compat.resolve(f"{_FLASHMLA_SPARSE}:MIN_HEADS_FOR_BF16_PREFILL")
        heads = _need(builder, "num_heads", "FLASHMLA_SPARSE metadata builder")
        mixed = heads < min_heads and not getattr(builder, "is_deepseek_v4", False)
    # 0.24+ passes return_valid_counts=True on the paths whose BF16 kernel takes topk_length.
    impl = vllm_compat.resolve(f"{_FLASHMLA_SPARSE}:FlashMLASparseImpl")
    counts = "topk_length" in vllm_compat.params(impl._bf16_flash_mla_kernel)
    if fp8 and not mixed:
        return ([ConvertVariant("prefill-workspace", True, counts)],
                [ConvertVariant("decode", False, counts)])
    if fp8:
        return [], [ConvertVariant("fp8-mixed-batch", False, False)]
    return [], [ConvertVariant("bf16", False, counts)]


def convert_args(view, group, fn) -> ConvertArgs:
    names = getattr(group, "layer_names", None) or ()
    layer = view.forward_context.get(names[0]) if names else None
    builder = _builder(group)
    spec = _first_attr(builder, "kv_cache_spec") or _need(group, "kv_cache_spec", "attention group")
    buffer = getattr(getattr(layer, "impl", None), "topk_indices_buffer", None)
    topk = buffer.shape[1] if buffer is not None else _first_attr(builder, "topk_tokens")
    if topk is None:
        hf = getattr(getattr(_vllm_config(view), "model_config", None), "hf_config", None)
        topk = getattr(hf, "index_topk", None)
    if topk is None:
        raise Missing("index top-k not readable (impl.topk_indices_buffer, builder.topk_tokens, index_topk)")
    strided = "BLOCK_STRIDE_ROWS" in vllm_compat.params(fn)
    rows = None
    if strided:  # 0.30+: the FP8 path passes _fp8_kv_pages(kv_cache, block_size)[1]
        pages = vllm_compat.resolve(f"{_FLASHMLA_SPARSE}:_fp8_kv_pages")
        kv = getattr(layer, "kv_cache", None)
        kv = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
        if kv is None:
            raise Missing("FLASHMLA_SPARSE layer has no bound kv_cache")
        rows = pages(kv, spec.block_size)[1]
    return ConvertArgs(_need(group, "kv_cache_group_id", "attention group"), int(spec.block_size),
                       int(topk), rows, strided)


@dataclasses.dataclass
class ConvertResult:
    label: str
    output: object  # (out, valid_counts) or out
    inputs: dict


def run_convert_variant(fn, args: ConvertArgs, device, table, variant: ConvertVariant) -> ConvertResult:
    """One production-shaped launch: request 0 decodes, request 1 prefills; top-k indices
    spread over two KV blocks with one invalid (-1) column."""
    import torch

    n = len(CONVERT_REQ_IDS)
    req_id = torch.tensor(CONVERT_REQ_IDS, dtype=torch.int32, device=device)
    token_indices = torch.arange(n * args.topk, dtype=torch.int32, device=device).view(n, args.topk)
    token_indices = token_indices.remainder(2 * args.block_size)
    token_indices[:, -1] = -1
    inputs = {"req_id": req_id, "block_table": table, "token_indices": token_indices}
    kwargs = {"BLOCK_SIZE": args.block_size, "NUM_TOPK_TOKENS": args.topk}
    if args.strided:
        kwargs["BLOCK_STRIDE_ROWS"] = args.block_stride_rows
    if variant.has_prefill:
        inputs["prefill_workspace_request_ids"] = torch.tensor(CONVERT_PREFILL_IDS, dtype=torch.int32,
                                                               device=device)
        inputs["prefill_workspace_starts"] = torch.zeros(1, dtype=torch.int32, device=device)
        kwargs.update(HAS_PREFILL_WORKSPACE=True,
                      prefill_workspace_request_ids=inputs["prefill_workspace_request_ids"],
                      prefill_workspace_starts=inputs["prefill_workspace_starts"])
    if variant.count_valid:
        kwargs["return_valid_counts"] = True
    output = vllm_compat.call(fn, req_id, table, token_indices, **kwargs)
    return ConvertResult(variant.label(args.block_size, args.topk, table.shape[1]), output, inputs)


def _warm_convert(view, fn, args: ConvertArgs, variants) -> list:
    import torch

    device = _device(view)
    with torch.inference_mode():
        table = block_table(view, args.group_id, 2)
        labels = [run_convert_variant(fn, args, device, table, v).label for v in variants]
    _synchronize(device)
    return labels


def upstream_convert_variants(view, args: ConvertArgs) -> tuple[set, list]:
    """((HAS_PREFILL, COUNT_VALID) pairs upstream warms for this block size and top-k, sources)."""
    kernel = _resolve_or_none(f"{_SPARSE_UTILS}:_CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL")
    keys = _upstream_keys("JIT warmup registry", _registry_keys, view, kernel) if kernel is not None else None
    if not keys:
        return set(), []
    rows = args.block_stride_rows or args.block_size
    covered = {(bool(k.has_prefill_workspace), bool(k.count_valid)) for k in keys
               if k.block_size == args.block_size and k.num_topk_tokens == args.topk
               and getattr(k, "block_stride_rows", rows) == rows
               and getattr(k, "dcp_size", 1) == 1 and not getattr(k, "has_idx_mapping", False)}
    return covered, ["JIT warmup registry"]


def _convert_steps(view, forced: bool) -> list:
    name = "convert_req_index"
    groups = _groups(view, SPARSE_MLA_BACKEND)
    if not groups:
        others = sorted({b for g in view.backends for b in g} - {INDEXER_BACKEND})
        return [Step(name, CONVERT_KERNEL,
                     skip=f"no {SPARSE_MLA_BACKEND} group (main MLA backend: {', '.join(others) or '-'})")]
    group = groups[0]
    try:
        fn = vllm_compat.resolve(f"{_SPARSE_UTILS}:triton_convert_req_index_to_global_index")
        todo, steps = _convert_todo(view, fn, *convert_variants(view, group))
        if not todo:
            return steps
        args = convert_args(view, group, fn)
        keywords = dict(BLOCK_SIZE=0, NUM_TOPK_TOKENS=0, HAS_PREFILL_WORKSPACE=True,
                        prefill_workspace_request_ids=None, prefill_workspace_starts=None,
                        return_valid_counts=True)
        if args.strided:
            keywords["BLOCK_STRIDE_ROWS"] = None
        vllm_compat.bind(fn, None, None, None, **keywords)
    except Missing as exc:
        return [Step(name, CONVERT_KERNEL, skip=str(exc))]
    if not forced:
        covered, sources = upstream_convert_variants(view, args)
        done = [v for v in todo if (v.has_prefill, v.count_valid) in covered]
        todo = [v for v in todo if v not in done]
        if done:
            which = ", ".join(v.name for v in done)
            steps.append(Step(f"{name}[upstream]", CONVERT_KERNEL,
                              skip=f"covered by upstream {' + '.join(sources)}: {which}"))
    if todo:
        steps.insert(0, Step(name, CONVERT_KERNEL, run=functools.partial(_warm_convert, view, fn, args, todo)))
    return steps


def _convert_todo(view, fn, runtime: list, captured: list) -> tuple[list, list]:
    """(variants to warm, skipped steps naming the others and why)."""
    name = "convert_req_index"
    if "BLOCK_STRIDE_ROWS" in vllm_compat.params(fn):
        # 0.30+: only the FP8 prefill-workspace call is modelled; decode and BF16 calls go
        # through index groups, flat row views and their own conversion helpers there.
        variants = runtime + captured
        unmodelled = [v.name for v in variants if not v.has_prefill]
        skipped = [Step(f"{name}[unmodelled]", CONVERT_KERNEL,
                        skip=f"{', '.join(unmodelled)}: this release's call shape (BLOCK_STRIDE_ROWS, "
                             "index groups) is not modelled")] if unmodelled else []
        return [v for v in variants if v.has_prefill], skipped
    if not _full_graphs(view):
        return runtime + captured, []
    skipped = [Step(f"{name}[captured]", CONVERT_KERNEL,
                    skip=f"compiled by FULL CUDA-graph capture: {', '.join(v.name for v in captured)}")]
    return list(runtime), skipped if captured else []


# -- helpers -----------------------------------------------------------------------------------

def _upstream_keys(source: str, fn, *args):
    """Upstream's own compile keys; None (so kwarm warms them too) when they can't be read."""
    try:
        return fn(*args)
    except Exception as exc:
        logger.debug("kwarm: dsa_indexer: keys of upstream %s not readable, warming them too: %s: %s",
                     source, type(exc).__name__, exc)
        return None


def _need(obj, attr: str, what: str):
    value = getattr(obj, attr, None)
    if value is None:
        raise Missing(f"{what} has no {attr}")
    return value


def _resolve_or_none(candidate: str):
    try:
        return vllm_compat.resolve(candidate)
    except Missing:
        return None


def _synchronize(device) -> None:
    """Surface an asynchronous launch error inside this step, not a later one."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
