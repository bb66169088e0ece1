"""dsa_indexer, part 1: ``_build_prefill_chunk_metadata_kernel`` (the indexer's prefill chunk
metadata), every ``qs_start``/``qs_stop`` integer class and seq-lens alignment, and on 0.34+
engines whose indexer runs ShardQ, every alignment of the token positions it passes (see the
package docstring)."""
from __future__ import annotations

import dataclasses
import functools
import itertools

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step
from kwarm_ext.kernels.attention_groups import block_table
from kwarm_ext.kernels.attention_groups import groups_of as _groups
from kwarm_ext.kernels.attention_groups import metadata_builder as _builder
from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.surfaces.triton.compat import int_class
from kwarm_ext.vllm_compat import Missing, resolve_or_none
from kwarm_ext.kernels.dsa_indexer.common import (
    CHUNK_KERNEL, DECODES_AHEAD, DECODE_SEQ_LEN, INDEXER_BACKEND, PREFILL_CONTEXT_LENS,
    PREFILL_QUERY_LENS, QUERY_SLICES, _INDEXER, _KERNEL_WARMUP, _UPSTREAM_SPARSE, _device,
    _first_attr, _jit_warmup_enabled, _need, _registry_keys, _synchronize,
    _upstream_keys)


# -- Triton's specialization classes ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChunkCase:
    """One ``_build_prefill_chunk_metadata_kernel`` key class: slice classes and alignment, and
    ShardQ's positions (0.34+): None where production passes none, else whether the address of
    the chunk's positions is 16-byte aligned (``positions[query_start_loc[start_idx]:]``, one
    int32 per token ahead of the chunk: misaligned whenever their count % 4 != 0, independently
    of seq_lens's alignment where decodes have several tokens or a chunk starts later)."""

    qs_start: int
    qs_stop: int
    aligned: bool
    positions: bool | None = None

    @property
    def key(self) -> tuple:
        return int_class(self.qs_start), int_class(self.qs_stop), self.aligned, self.positions

    def label(self, aligned: bool | None = None, positions: bool | None = None) -> str:
        aligned = self.aligned if aligned is None else aligned
        positions = self.positions if positions is None else positions
        return (f"qs_start={self.qs_start}({int_class(self.qs_start)}) "
                f"qs_stop={self.qs_stop}({int_class(self.qs_stop)}) "
                f"seq_lens={'aligned' if aligned else 'misaligned'}"
                + ("" if positions is None else f" positions={'aligned' if positions else 'misaligned'}"))


CHUNK_CASES = tuple(ChunkCase(s, e, a) for a in (True, False) for s, e in QUERY_SLICES)
# 0.34+, an indexer on ShardQ (``use_shardq``: tensor parallelism, sparse_mla_shard_q, no DCP/PCP,
# no FULL mixed CUDA graphs) passes positions on its prefill steps: these classes too.
SHARDQ_CASES = tuple(ChunkCase(s, e, a, p) for p in (True, False) for a in (True, False) for s, e in QUERY_SLICES)


# -- _build_prefill_chunk_metadata_kernel ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChunkArgs:
    """What production passes besides the batch: the indexer group and its builder's values."""

    group_id: int
    compress_ratio: int
    dcp: dict  # dcp_rank / dcp_world_size / cp_kv_cache_interleave_size (0.25+), else {}
    shardq: bool = False  # 0.34+: the builder's use_shardq (production passes positions)

    @property
    def cases(self) -> tuple:
        return CHUNK_CASES + (SHARDQ_CASES if self.shardq else ())

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
    shardq = bool(getattr(builder, "use_shardq", False)) and "positions" in vllm_compat.params(fn)
    return ChunkArgs(_need(group, "kv_cache_group_id", "attention group"), int(ratio), dcp, shardq)


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
    positions: object = None  # the step's positions tensor passed (ShardQ cases), else None


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
    extra, positions, positions_aligned = {}, None, None
    if case.positions is not None:
        positions = _positions(query_lens, seq_lens, start_idx, case.positions, device)
        extra["positions"] = positions
        positions_aligned = positions[query_start_loc_cpu[start_idx]:].data_ptr() % 16 == 0
    metadata = vllm_compat.call(
        fn, start_idx, end_idx, query_start_loc, query_start_loc_cpu, seq_lens_dev, compressed,
        compressed_cpu, table, args.compress_ratio,
        query_slice=query_slice, skip_kv_gather=query_slice.start > 0, **args.dcp, **extra)
    return ChunkResult(case.label(aligned, positions_aligned), aligned, metadata, start_idx, query_lens,
                       seq_lens, query_slice, positions)


def _positions(query_lens, seq_lens, start_idx: int, aligned: bool, device):
    """ShardQ's int32 positions of the step's tokens (each token's position in its request),
    placed so that the chunk's part, which build_prefill_chunk_metadata slices from the chunk's
    first token on, is 16-byte aligned or not, as `aligned` says."""
    import torch

    values = [s - q + j for q, s in zip(query_lens, seq_lens) for j in range(q)]
    ahead = sum(query_lens[:start_idx])
    pad = (-ahead) % 4 if aligned else (1 - ahead) % 4
    buffer = torch.zeros(pad + len(values), dtype=torch.int32, device=device)
    buffer[pad:] = torch.tensor(values, dtype=torch.int32, device=device)
    return buffer[pad:]


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
    warmup_ns = resolve_or_none(_KERNEL_WARMUP)
    max_tokens = view.max_num_batched_tokens or 0
    # 0.25-0.26: fixed cases with the kernel's default DCP arguments and compress ratio 1.
    if warmup_ns is not None and hasattr(warmup_ns, "sparse_mla_triton_warmup_if_needed"):
        upstream = resolve_or_none(_UPSTREAM_SPARSE)
        dsv4 = getattr(upstream, "_DEEPSEEK_V4_SPARSE_MLA_BACKENDS", frozenset())
        q = max(0, min(8, max_tokens))
        if q > 0 and not any(view.has_backend(b) for b in dsv4) and args.compress_ratio == 1 \
                and args.dcp_classes == ("div16", "one", "one"):
            offsets = getattr(upstream, "_PREFILL_CHUNK_METADATA_QUERY_SLICE_OFFSETS",
                              ((0, 0), (0, -1), (1, 0), (1, -1)))
            covered |= {(int_class(s), int_class(2 * q + t), a, None) for s, t in offsets for a in (True, False)}
            sources.append("sparse_mla_triton_warmup_if_needed")
    kernel = resolve_or_none(f"{_INDEXER}:_BUILD_PREFILL_CHUNK_METADATA_KERNEL")
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
    compress ratio, DCP classes and (no PCP) aligned cu_seq_lens. A 0.34 key with
    ``has_positions`` (ShardQ) is the class of aligned positions: upstream's warmup compiles
    them at an aligned address (``TritonWarmupTensor``), its key has no positions alignment."""
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
                 _aligned(variant, "uncompressed_seq_lens"), True if getattr(k, "has_positions", False) else None))
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
        extra = {"positions": None} if args.shardq else {}
        vllm_compat.bind(fn, *([None] * 9), query_slice=None, skip_kv_gather=False, **args.dcp, **extra)
    except Missing as exc:
        return [Step(name, CHUNK_KERNEL, skip=str(exc))]
    covered, sources = (set(), []) if forced else upstream_chunk_keys(view, args)
    todo = [c for c in args.cases if c.key not in covered]
    done = [c for c in args.cases if c.key in covered]
    steps = []
    if todo:
        steps.append(Step(name, CHUNK_KERNEL, run=functools.partial(_warm_chunks, view, fn, args, todo)))
    if done:
        which = f"all {len(done)} key classes" if not todo else \
            f"{len(done)} of {len(args.cases)} key classes: {_describe(done)}"
        steps.append(Step(f"{name}[upstream]", CHUNK_KERNEL,
                          skip=f"covered by upstream {' + '.join(sources)} ({which})"))
    return steps


def _describe(cases) -> str:
    """Cases as query slices and seq_lens alignments, e.g. ``query slices [0:16) [1:15) x seq_lens
    aligned+misaligned``; ShardQ's (0.34+) after ``; positions aligned:`` / ``misaligned:``."""
    parts = []
    for positions in (None, True, False):
        group = [c for c in cases if c.positions is positions]
        if group:
            prefix = "" if positions is None else f"positions {'aligned' if positions else 'misaligned'}: "
            parts.append(prefix + _describe_slices(group))
    return "; ".join(parts)


def _describe_slices(cases) -> str:
    by_slice: dict = {}
    for case in cases:
        by_slice.setdefault(f"[{case.qs_start}:{case.qs_stop})", set()).add(case.aligned)
    names = {frozenset({True, False}): "aligned+misaligned", frozenset({True}): "aligned",
             frozenset({False}): "misaligned"}
    if len({frozenset(a) for a in by_slice.values()}) == 1:
        return f"query slices {' '.join(by_slice)} x seq_lens {names[frozenset(next(iter(by_slice.values())))]}"
    return ", ".join(f"query slice {s} seq_lens {names[frozenset(a)]}" for s, a in by_slice.items())
