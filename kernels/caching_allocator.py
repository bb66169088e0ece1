"""Warmup family ``caching_allocator``: leave torch's CUDA caching allocator whole free
blocks for the first request, on each stream it allocates on, after vLLM's CUDA-graph capture.

Why:
    ``capture_model`` ends with ``torch.accelerator.empty_cache()`` (V1 and V2 runners,
    0.20-0.33), after kwarm's warmup. What vLLM allocates afterwards (its post-capture dummy
    run and sampler warmup, 16 tokens here) leaves the small pool (allocations of at most
    1 MiB, carved from 2 MiB segments) with free space, but in pieces: the first request's
    larger small allocations do not fit and start a new segment with ``cudaMalloc``, which
    its repeat does not pay. Measured on the GPU host (engine benchmark, vLLM 0.24.0, its
    allocator counters): request 0 (a 200-token prefill) of both tiny models made one new
    small-pool segment, the repeat none, while the small pool held 11-13 MiB cached free. In
    the cProfile diffs of request 0 and its repeat, the tiny Qwen3-Next's 43 ``torch.empty``
    calls took 2.0 ms more (its GDN layers' ``fused_post_conv_prep`` allocates 0.8 MB
    tensors), the tiny DeepSeek-V3.2's 43 ``empty_strided_cuda`` 0.6 ms more. Counting free
    bytes, as a first version of this family did, misses it.

    A model with shared experts allocates on a second stream: vLLM's auxiliary stream
    (``vllm.utils.torch_utils.aux_stream``, 0.24-0.33), on which ``SharedExperts`` runs the
    shared experts beside the routed ones; the caching allocator keeps each stream's blocks
    apart. At published dimensions (vLLM 0.29.0 block-FP8 DeepSeek-V3.2 and GLM-5, the engine
    benchmark's ``--alloc-stacks 0``), request 0 started a 2 MiB small-pool and a 20 MiB
    large-pool segment there, both for ``per_token_group_quant_fp8``'s output in
    ``SharedExperts.maybe_forward_async`` (allocations of 1-10 MiB share 20 MiB segments),
    though this family had left 45 MiB free on the model's stream. (A first version reserved
    on the V2 runner's ``output_copy_stream`` instead, where request 0 started no segment.)

    DSA models on ``FLASH_ATTN_MLA_SPARSE`` (vLLM 0.28+, Hopper, BF16 KV cache) hold a third
    kind: FlashAttention 3's split-KV scratch (``out_accum``) in the backend's ``forward_mqa``,
    which runs every token of a "decode" as its own one-token query (the backend counts a request
    of at most ``reorder_batch_threshold`` new tokens, 256 for 64-128 heads, as a decode). It
    grows with the tokens of the batch: request 0 (200 tokens) of the block-FP8 DeepSeek-V3.2
    and GLM-5 on vLLM 0.29.0 started a 1400 MiB and a 700 MiB large-pool segment for it, 28
    splits x heads x 200 x 512 x 4 bytes; capture's decode batches allocate theirs in the
    graphs' private pool, and V2's ``warmup_kernels`` prefill (16 x 2 tokens) far less.

    A long prefill's larger allocations (above 9 MiB: MoE and GDN intermediates) come from
    the large pool, which ``empty_cache`` left empty. On vLLM 0.29.0 with the published-size
    Qwen3-Next, cold (cProfile of the first 4x333-token prefill against its repeat, no Triton
    compile), its 51 ``empty_strided_cuda`` calls took 10.5 ms more: new segments.

How:
    Once ``Worker.compile_or_warm_up_model`` has returned (capture, vLLM's post-capture
    dummy run and sampler warmup done; ``kwarm_ext.patches`` wraps it), on each stream of
    :data:`STREAMS` this process has, allocate blocks of 1 MiB (the largest small-pool size)
    and of 9 MiB (two to a 20 MiB large-pool segment), all alive at once, then free them.
    Blocks that fit in the existing free pieces take no new memory; the others start segments
    now, at startup. Either way each pool then holds at least that much free in whole pieces,
    which a request's smaller allocations on that stream can use. At most 96 MiB of device
    memory (vLLM's memory profile leaves 150 MiB of headroom); skipped when less than 1 GiB is
    free.

    Sparse MQA scratch: through the layer's own ``forward_mqa`` (one layer per attention group),
    a one-request batch of T new tokens for T from ``reorder_batch_threshold`` (capped by the
    ``topk_indices_buffer``'s rows) down to 1, on the model's stream; FlashAttention 3 sizes and
    allocates its scratch as for a request, so its largest one stays cached (1792 MiB at
    DeepSeek-V3.2's 128 heads, 896 MiB at GLM-5's 64, the most a prompt of at most 256 tokens
    allocates there, which the first such prompt allocates anyway), and each kernel variant
    those batches choose is launched once (lazy module loading). The batch's top-k indices are
    all -1 (no KV entry read; the indexer rewrites ``topk_indices_buffer`` every forward), its
    block-table row is the runner's own, nothing writes the KV cache.

    The largest eager step: one ``runner._dummy_run`` (vLLM's own, bound by
    ``model_runner.dummy_runner``) at ``max_num_batched_tokens``, where no CUDA graph runs; its
    activations, freed, stay cached: at most what vLLM's memory profile set aside for that very
    step, and what the first request of that size would leave cached anyway. A request's
    allocations then split those blocks. Every rank runs the same step (its collectives line up):
    only a worker without peers skips it for want of free memory.

Upstream: none (0.20-0.33); vLLM keeps only the sampler's buffers it allocates after capture,
and no warmup of 0.28-0.33 runs FLASH_ATTN_MLA_SPARSE's forward_mqa outside capture at the
decode threshold (the V2 runner's warmup_kernels, 0.29+, runs 16 x 2 tokens).

Remove when:
    vLLM stops emptying the allocator's cache after capture, or warms the prefill path after it
    (the pools and the largest step), and runs its sparse MQA at the decode threshold after
    capture (the scratch).
"""
from __future__ import annotations

import contextlib
import sys
import time

from kwarm_ext.families import Plan, Step
from kwarm_ext.kernels.attention_groups import (block_table, bound_kv_cache, dataclass_instance, group_id_of,
                                                group_layer, groups_of, metadata_builder, model_dtype)
from kwarm_ext.kernels.model_runner import dummy_runner, eager_range, one_process, synchronize
from kwarm_ext.vllm_compat import Missing

NAME = "caching_allocator"
KERNEL = "CUDA caching allocator (small and large pools)"
BLOCK = 1 << 20  # the largest small-pool allocation (torch's kSmallSize): two per 2 MiB segment
LARGE_BLOCK = 9 << 20  # under torch's kMinLargeAlloc (10 MiB): two per 20 MiB large-pool segment
RESERVE_BLOCKS = 32
AUX_STREAM = ("vllm.utils.torch_utils", "_aux_stream")  # what aux_stream() created, None until then
# (label, where the stream is: None, the current one; else (module, attribute), 1 MiB blocks, 9 MiB blocks)
STREAMS = (("model stream", None, RESERVE_BLOCKS, 4), ("aux stream", AUX_STREAM, 4, 2))
MIN_DEVICE_FREE = 1 << 30
LARGEST_STEP_KERNEL = "CUDA caching allocator (large pool, the largest eager step's activations)"
SPARSE_MQA_BACKEND = "FLASH_ATTN_MLA_SPARSE"
SPARSE_MQA_KERNEL = "FlashAttention 3 sparse MQA scratch (FLASH_ATTN_MLA_SPARSE forward_mqa)"


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if not (view.device or "").startswith("cuda"):
        return f"runner device {view.device or 'unknown'} is not CUDA"
    return None


def plan(view, forced) -> Plan:
    """The steps, planned once CUDA-graph capture is done (the family runs after it); the
    details: the summary line's text, what the reserve found and added."""
    details: dict = {}
    steps = [Step(f"sparse MQA scratch, {group_label(group)}", SPARSE_MQA_KERNEL,
                  run=lambda group=group: _sparse_mqa_scratch(view, group, details))
             for group in groups_of(view, SPARSE_MQA_BACKEND)]
    steps.append(Step("small and large pools", KERNEL, run=lambda: _reserve(view, details)))
    steps.append(_largest_step(view, details))
    return Plan(steps, lambda: summary(details))


def summary(details: dict) -> dict:
    """The summary line's details: what each step that ran found and added."""
    parts = [*details.get("sparse_mqa", ()), *filter(None, [details.get("pools"), details.get("largest_step")])]
    return {"summary": "; ".join(parts)} if parts else {}


def group_label(group) -> str:
    return f"KV-cache group {getattr(group, 'kv_cache_group_id', '?')}"


def sparse_mqa_tokens(view, group) -> list:
    """The batch sizes (new tokens of one request) the sparse MQA step runs, largest first: what
    ``FLASH_ATTN_MLA_SPARSE`` counts as a decode, up to the rows of its ``topk_indices_buffer``."""
    threshold = getattr(metadata_builder(group), "reorder_batch_threshold", None)
    if not isinstance(threshold, int) or threshold < 1:
        raise Missing(f"{group_label(group)}: its metadata builder has no reorder_batch_threshold")
    layer = group_layer(view, group)
    buffer = getattr(getattr(layer, "impl", None), "topk_indices_buffer", None)
    if buffer is None:
        raise Missing(f"{group_label(group)}: no layer with impl.topk_indices_buffer in the forward context")
    return list(range(min(threshold, buffer.shape[0]), 0, -1))


def sparse_mqa(view, group, counts: list) -> None:
    """For each of `counts`, one batch of one request with that many new tokens through the
    group's first layer's ``forward_mqa``, its top-k indices all -1."""
    import torch

    layer = group_layer(view, group)
    impl, kv_cache = layer.impl, bound_kv_cache(layer)
    device = kv_cache.device
    dtype = model_dtype(view) or kv_cache.dtype
    builder = metadata_builder(group)
    block_size = getattr(getattr(builder, "kv_cache_spec", None), "block_size", None) or kv_cache.shape[1]
    table = block_table(view, group_id_of(group, group_label(group)), 1)
    for tokens in counts:
        impl.topk_indices_buffer[:tokens].fill_(-1)
        q_nope = torch.zeros(tokens, impl.num_heads, impl.kv_lora_rank, dtype=dtype, device=device)
        q_rope = torch.zeros(tokens, impl.num_heads, impl.qk_rope_head_dim, dtype=dtype, device=device)
        metadata = dataclass_instance(
            builder.metadata_cls, num_reqs=1, max_query_len=tokens, max_seq_len=tokens, num_actual_tokens=tokens,
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device), block_table=table,
            req_id_per_token=torch.zeros(tokens, dtype=torch.int32, device=device),
            seq_lens=torch.full((1,), tokens, dtype=torch.int32, device=device), block_size=block_size,
            topk_tokens=impl.topk_indices_buffer.shape[1], num_decodes=0, num_prefills=1, num_decode_tokens=0,
            prefill=None, causal=True)
        impl.forward_mqa((q_nope, q_rope), kv_cache, metadata, layer)


def _sparse_mqa_scratch(view, group, details: dict) -> list:
    import torch

    device = view.device
    short = short_of_memory(device)
    if short:
        text = f"{group_label(group)}: nothing run: {short}"
    else:
        tokens = sparse_mqa_tokens(view, group)
        before = torch.cuda.memory_stats(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            sparse_mqa(view, group, tokens)
        torch.cuda.synchronize(device)
        after = torch.cuda.memory_stats(device)
        grown = {key: after.get(key, 0) - before.get(key, 0)
                 for key in ("reserved_bytes.large_pool.current", "segment.large_pool.current")}
        text = (f"{group_label(group)}: {len(tokens)} batches of {tokens[0]}..{tokens[-1]} tokens through "
                f"forward_mqa in {time.perf_counter() - t0:.2f} s: large pool "
                f"+{grown['reserved_bytes.large_pool.current'] >> 20} MiB "
                f"({grown['segment.large_pool.current']} segments new)")
    details.setdefault("sparse_mqa", []).append(text)
    return [text]


def short_of_memory(device: str) -> str | None:
    """"N MiB free on the device" where less than MIN_DEVICE_FREE is free, else None."""
    import torch

    free_device = torch.cuda.mem_get_info(device)[0]
    return f"{free_device >> 20} MiB free on the device" if free_device < MIN_DEVICE_FREE else None


def reserve(device: str, blocks: int, size: int = BLOCK) -> None:
    """Allocate `blocks` blocks of `size` bytes on `device` (on the current stream), all alive
    at once, and free them: the allocator keeps what it had to add."""
    import torch

    held = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(blocks)]
    del held


def small_pool(stats: dict) -> tuple:
    """(segments, MiB cached free) of the small pool, from ``torch.cuda.memory_stats``."""
    free = stats.get("reserved_bytes.small_pool.current", 0) - stats.get("allocated_bytes.small_pool.current", 0)
    return stats.get("segment.small_pool.current", 0), max(0, free) / (1 << 20)


def streams() -> list:
    """``[(label, stream or None, 1 MiB blocks, 9 MiB blocks)]`` of :data:`STREAMS` this process
    has: a module's stream counts once created (reading it creates none)."""
    out = []
    for label, where, small, large in STREAMS:
        stream = None if where is None else getattr(sys.modules.get(where[0]), where[1], None)
        if where is None or stream is not None:
            out.append((label, stream, small, large))
    return out


def on_stream(stream):
    """The context in which allocations go to `stream` (None: the current stream)."""
    import torch

    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _reserve(view, details: dict) -> list:
    import torch

    device = view.device
    short = short_of_memory(device)
    if short:
        text = f"nothing reserved: {short}"
    else:
        parts = []
        first = small_pool(torch.cuda.memory_stats(device))
        for label, stream, small, large in streams():
            before = torch.cuda.memory_stats(device)
            with on_stream(stream):
                reserve(device, small)
                reserve(device, large, LARGE_BLOCK)
            after = torch.cuda.memory_stats(device)
            new = {pool: after.get(f"segment.{pool}_pool.current", 0) - before.get(f"segment.{pool}_pool.current", 0)
                   for pool in ("small", "large")}
            parts.append(f"{label} {small} x 1 MiB + {large} x 9 MiB: {new['small']} small, "
                         f"{new['large']} large segments new")
        last = small_pool(torch.cuda.memory_stats(device))
        text = f"{'; '.join(parts)}; small pool {first[1]:.0f} -> {last[1]:.0f} MiB cached free"
    details["pools"] = text
    return [text]


# ---------------------------------------------------------------------------- the largest eager step

def _largest_step(view, details: dict) -> Step:
    """The step that leaves the large pool holding what the largest step allocates: one
    ``_dummy_run`` at the most tokens a step schedules (:func:`largest_step`)."""
    name = "largest eager step"
    try:
        run = dummy_runner(view.runner)
    except Missing as exc:
        return Step(name, LARGEST_STEP_KERNEL, skip=str(exc))
    tokens = eager_range(view)[1]
    if tokens < 1:
        return Step(name, LARGEST_STEP_KERNEL, skip="no max_num_batched_tokens")
    return Step(name, LARGEST_STEP_KERNEL, run=lambda: largest_step(view, run, tokens, details))


def largest_step(view, run, tokens: int, details: dict) -> list:
    """vLLM's own eager dummy step at `tokens` (``max_num_batched_tokens``), after capture: its
    activations, freed, stay cached in the large pool, where a request's larger allocations
    (above 9 MiB: MoE and GDN intermediates of a long prefill) find a block to split instead of
    starting a segment."""
    import torch

    device = view.device
    short = short_of_memory(device) if one_process() else None  # with peers every rank runs it: collectives
    if short:
        text = f"no eager step: {short}"
    else:
        before = torch.cuda.memory_stats(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            run(tokens)
        synchronize(torch.device(device))
        after = torch.cuda.memory_stats(device)
        grown = {key: after.get(key, 0) - before.get(key, 0)
                 for key in ("reserved_bytes.large_pool.current", "segment.large_pool.current")}
        text = (f"one eager step of {tokens} tokens (vLLM's _dummy_run) in {time.perf_counter() - t0:.2f} s: "
                f"large pool +{grown['reserved_bytes.large_pool.current'] >> 20} MiB cached "
                f"({grown['segment.large_pool.current']} segments new)")
    details["largest_step"] = text
    return [text]
