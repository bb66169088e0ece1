"""dsa_indexer, part 2: ``_convert_req_index_to_global_index_kernel`` (sparse MLA's index
conversion) at every variant a request can reach (see the package docstring)."""
from __future__ import annotations

import dataclasses
import functools

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step
from kwarm_ext.kernels.attention_groups import block_table
from kwarm_ext.kernels.attention_groups import groups_of as _groups
from kwarm_ext.kernels.attention_groups import metadata_builder as _builder
from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.vllm_compat import Missing, resolve_or_none
from kwarm_ext.kernels.dsa_indexer.common import (
    CONVERT_KERNEL, CONVERT_PREFILL_IDS, CONVERT_REQ_IDS, INDEXER_BACKEND, SPARSE_MLA_BACKEND,
    _FLASHMLA_SPARSE, _SPARSE_UTILS, _device, _first_attr, _full_graphs, _need, _registry_keys,
    _synchronize, _upstream_keys)


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
    kernel = resolve_or_none(f"{_SPARSE_UTILS}:_CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL")
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
