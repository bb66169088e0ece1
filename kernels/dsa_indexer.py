"""Warmup family ``dsa_indexer``: GLM-5 / DeepSeek-V3.2 DSA prefill chunk metadata, sparse-MLA
indices, and the indexer's DeepGEMM logits kernels.

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

    And the indexer's DeepGEMM kernels, which DeepGEMM JIT-compiles (nvcc, cached in
    ``DG_JIT_CACHE_DIR``) at first use, invisible to Triton's compile hook and to vLLM's JIT
    monitor (gpu-baseline, H200, vLLM 0.26: the first 1 x 200-token request took 3.77 s vs
    0.032 s for its repeat, 2.76 s of it inside ``deep_gemm._C.fp8_fp4_mqa_logits``):

    - ``fp8_fp4_mqa_logits`` (every prefill chunk of ``sparse_attn_indexer``): nothing at
      engine start runs a prefill through the indexer (the profile run returns early,
      capture records decode batches only), so the first prompt always compiles it;
    - ``fp8_fp4_paged_mqa_logits`` and ``get_paged_mqa_logits_metadata`` (decode; the
      metadata is built eagerly by ``DeepseekV32IndexerMetadataBuilder.build``). FULL decode
      CUDA-graph capture compiles the logits kernel for the capture batches' ``next_n`` and
      the metadata kernel for the captured batch classes; eager engines, piecewise-only
      graphs, MTP steps shorter than ``1 + num_speculative_tokens`` (short prefills count as
      decodes), and decode batches beyond the captured sizes compile at runtime.

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

    DeepGEMM: through the wrappers of ``vllm.utils.deep_gemm`` as production's modules import
    them (``sparse_attn_indexer`` and the indexer metadata module), with production's
    keywords as each release's signature takes them (``clean_logits=False`` 0.20-0.28,
    ``max_seqlen_k`` 0.33; ``indices=None`` 0.28+; a wrapper whose signature does not bind
    is a skipped step). What specializes DeepGEMM's JIT (SM90 templates of the vendored
    DeepGEMM 2.5-2.8, ``include/deep_gemm/impls/sm90_fp8_*mqa_logits.cuh`` and
    ``scheduler/*paged_mqa_logits.cuh``; runtime values are sizes, lengths, pointers):

    - prefill ``<heads, head_dim, [compressed logits], BLOCK_Q = 128 / heads, BLOCK_KV,
      stages, SMs, threads, logits dtype>``: no sequence length, so one call per indexer
      shape (Q ``[2, H, D]`` fp8, K ``[2, D]`` fp8 and fp32 scales shaped by production's
      ``_gather_workspace_shapes``, fp32 weights, int32 ``cu_seqlen_ks/ke``);
    - decode logits ``<next_n, heads, head_dim, BLOCK_KV = cache block size,
      2-D context_lens, varlen, ..., [KV multicast = next_n == 4 on SM90], logits dtype>``:
      one call per kernel ``next_n`` (Q ``[1, next_n, H, D]``, the bound cache through
      production's ``kv_cache_as_quant_view``, context lengths ``[[1 .. next_n]]``, a block
      table of zeros, so only the null block 0, which no request owns, is read; the kernel
      writes only its fresh logits);
    - metadata ``<aligned batch = align(rows, 32), SPLIT_KV, SM slots, varlen>``: one call
      per 32-row class up to the most rows a decode step can have, per slot count.

    Heads and head_dim come from the indexer module owning the bound
    ``DeepseekV32IndexerCache`` (``n_head``: replicated across TP ranks in every release),
    block size and bytes per token from the bound cache, the FP8/MXFP4 layout and
    ``max_model_len`` from its ``SparseAttnIndexer``; the SM count, ``next_n = 1 +
    num_speculative_tokens``, flattening and the metadata block size from the live metadata
    builder. A step whose longest decode is ``d`` runs the kernel with ``next_n = d`` when
    native (``use_flattening`` off; 0.28+ also ``_supports_native_decode(d)``: SM90 takes
    1, 2, 4) and else flattens to ``next_n = 1`` with one row per token. Under FULL decode
    graphs the capture's ``next_n`` and its batch classes (from ``cudagraph_capture_sizes``,
    ``min(max_num_seqs, cdiv(size, next_n))`` requests) are left to capture, named in
    ``[captured]`` skipped steps. DeepGEMM caches: none of ``DG_JIT_CACHE_DIR``,
    ``TRITON_CACHE_DIR``, ``VLLM_CACHE_ROOT`` is written here (vLLM's ``_lazy_init`` sets
    ``DG_JIT_CACHE_DIR`` where unset). Skipped steps, with the reason: no DeepGEMM
    (``has_deep_gemm()``; ``VLLM_USE_DEEP_GEMM=0`` does not turn the indexer's DeepGEMM off,
    so it does not gate this), not CUDA, capability < 9.0, a wrapper's DeepGEMM symbol
    missing after ``_lazy_init``, an older release's ``fp8_mqa_logits`` names, and the SM100
    shapes that are not modelled (MXFP4 indexer cache, 0.28+ varlen decode, 0.33 MX inputs).

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
    No release (0.20-0.33) warms the indexer's DeepGEMM kernels: ``deep_gemm_warmup`` covers
    the FP8 GEMMs only and the 0.30+ JIT warmup registry holds Triton/CuTe/TileLang kernels.
    The V2 model runner's ``warmup_kernels`` (MRV2, after kwarm) runs one real prefill step
    and decode steps of ``1 + num_speculative_tokens`` tokens, which compile the prefill key
    and that one decode shape; kwarm warms them anyway (DeepGEMM's in-process cache makes the
    later call free) since nothing else there covers other ``next_n`` or batch classes.

Remove when:
    The oldest supported vLLM warms every ``qs_start`` class of the chunk kernel (0.33's
    registry does) and the FP8-KV prefill-workspace variant of the convert kernel (0.33 does
    not: it registers the convert kernel only for flat KV caches); and warms the indexer's
    ``fp8_fp4_mqa_logits``, its paged logits for every native ``next_n`` and the metadata
    kernel for every batch class (none does yet).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import os

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step
from kwarm_ext.kernels.attention_groups import block_table, groups_of as _groups, metadata_builder as _builder
from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.kernels.runner import runner_models
from kwarm_ext.triton_compat import int_class
from kwarm_ext.vllm_compat import Missing

logger = logging.getLogger("kwarm")

INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
SPARSE_MLA_BACKEND = "FLASHMLA_SPARSE"
CHUNK_KERNEL = "_build_prefill_chunk_metadata_kernel"
CONVERT_KERNEL = "_convert_req_index_to_global_index_kernel"
TRITON_KERNELS = (CHUNK_KERNEL, CONVERT_KERNEL)  # what this family compiles at start (besides DeepGEMM's)

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

# DeepGEMM: the wrappers of vllm.utils.deep_gemm that production calls (their names are the
# steps' kernel names), the modules production imports them into, and their pre-FP4 names.
MQA_LOGITS = "fp8_fp4_mqa_logits"
PAGED_MQA_LOGITS = "fp8_fp4_paged_mqa_logits"
PAGED_METADATA = "get_paged_mqa_logits_metadata"
_DEEP_GEMM = "vllm.utils.deep_gemm"
_SPARSE_ATTN_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
_ENTRY_OWNERS = {MQA_LOGITS: _SPARSE_ATTN_INDEXER, PAGED_MQA_LOGITS: _SPARSE_ATTN_INDEXER,
                 PAGED_METADATA: _INDEXER}
_LEGACY_NAMES = {MQA_LOGITS: "fp8_mqa_logits", PAGED_MQA_LOGITS: "fp8_paged_mqa_logits"}
MIN_CAPABILITY = (9, 0)  # DeepGEMM's MQA-logits kernels: SM90 (Hopper), SM100, SM120
# get_paged_mqa_logits_metadata's JIT key has kAlignedBatchSize = align(context_lens rows, 32).
METADATA_ROW_ALIGN = 32
# The warm prefill call: query rows (two tokens of one request) and gathered K rows.
PREFILL_ROWS = 2


def applies(view) -> str | None:
    if view.has_backend(INDEXER_BACKEND):
        return None
    return f"no {INDEXER_BACKEND} attention backend"


def plan(view, forced: bool) -> list:
    return [*_planned(_chunk_steps, "prefill_chunk_metadata", CHUNK_KERNEL, view, forced),
            *_planned(_convert_steps, "convert_req_index", CONVERT_KERNEL, view, forced),
            *_planned(_deep_gemm_steps, "mqa_logits", MQA_LOGITS, view, forced)]


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

def _device(view):
    import torch

    device = getattr(view.runner, "device", None) or view.device
    if device is None:
        raise Missing("runner has no device")
    return torch.device(device)


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
        metadata_indices="indices" in takes.get(PAGED_METADATA, {}))
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


def _mqa_logits_kwargs(entries) -> dict:
    return {"clean_logits": False} if entries.mqa_clean_logits else {}


def _metadata_kwargs(entries) -> dict:
    return {"indices": None} if entries.metadata_indices else {}  # None: no varlen rows (SM90)


def _paged_kwargs(entries, max_model_len: int) -> dict:
    kwargs = {"max_model_len": max_model_len}
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

    def label(self) -> str:
        return (f"heads={self.heads} head_dim={self.head_dim} block_size={self.block_size} "
                f"cache={'mxfp4' if self.use_fp4 else 'fp8'}")


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
                                 int(max_len))
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
    per_step = _resolve_or_none(f"{_INDEXER}:_supports_native_decode")  # 0.28+
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
    fn = _resolve_or_none(f"{_DEEP_GEMM}:_paged_mqa_logits_schedule_slots")
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
                                **_mqa_logits_kwargs(entries))
    extra = "clean_logits=False" if entries.mqa_clean_logits else f"max_seqlen_k={PREFILL_ROWS}"
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
                                      **_paged_kwargs(entries, shape.max_model_len))
    inputs = {"q": q, "kv_cache": kv, "weights": weights, "context_lens": seq_lens, "block_table": table,
              "schedule_metadata": schedule}
    return DeepGemmCall(f"next_n={next_n} {shape.label()}", output, inputs)


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
    mx = _resolve_or_none(f"{_DEEP_GEMM}:mqa_logits_use_mx_scales")  # 0.33+
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
        steps.append(Step(md_name, md_kernel, run=functools.partial(_warm, view, calls)))
    if not why and done_md:
        steps.append(Step(f"{md_name}[captured]", md_kernel,
                          skip=f"compiled by FULL CUDA-graph capture: {len(done_md)} of {len(metadata)} "
                               f"row classes (aligned batch <= {max(m.rows for m in done_md)})"))
    if unknown and _full_graphs(view):
        logger.debug("kwarm: dsa_indexer: %s; warming every metadata row class", unknown)
    return steps


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
