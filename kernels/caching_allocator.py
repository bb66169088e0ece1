"""Warmup family ``caching_allocator``: leave torch's CUDA caching allocator whole free
small-pool blocks for the first request, after vLLM's CUDA-graph capture.

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

How:
    Once ``Worker.compile_or_warm_up_model`` has returned (capture, vLLM's post-capture
    dummy run and sampler warmup done; ``kwarm_ext.patches`` wraps it), allocate
    ``RESERVE_BLOCKS`` blocks of 1 MiB (the largest small-pool size) on the current stream,
    all alive at once, then free them. Blocks that fit in the existing free pieces take no
    new memory; the others start segments now, at startup. Either way the small pool then
    holds at least that much free in pieces of 1 MiB or more, which any smaller
    allocations of a request can use. At most 32 MiB of device memory (vLLM's memory profile
    leaves 150 MiB of headroom); skipped when less than 1 GiB is free.

Upstream: none (0.20-0.33); vLLM keeps only the sampler's buffers it allocates after capture.

Remove when:
    vLLM stops emptying the allocator's cache after capture, or warms the prefill path after it.
"""
from __future__ import annotations

from kwarm_ext.families import Plan, Step

NAME = "caching_allocator"
KERNEL = "CUDA caching allocator (small pool)"
BLOCK = 1 << 20  # the largest small-pool allocation (torch's kSmallSize): two per 2 MiB segment
RESERVE_BLOCKS = 32
MIN_DEVICE_FREE = 1 << 30


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
    return Plan([Step("small pool", KERNEL, run=lambda: _reserve(view.device, details))], lambda: dict(details))


def reserve(device: str, blocks: int) -> None:
    """Allocate `blocks` 1 MiB blocks on `device`, all alive at once, and free them: the
    allocator keeps what it had to add."""
    import torch

    held = [torch.empty(BLOCK, dtype=torch.uint8, device=device) for _ in range(blocks)]
    del held


def small_pool(stats: dict) -> tuple:
    """(segments, MiB cached free) of the small pool, from ``torch.cuda.memory_stats``."""
    free = stats.get("reserved_bytes.small_pool.current", 0) - stats.get("allocated_bytes.small_pool.current", 0)
    return stats.get("segment.small_pool.current", 0), max(0, free) / (1 << 20)


def _reserve(device: str, details: dict) -> list:
    import torch

    free_device = torch.cuda.mem_get_info(device)[0]
    if free_device < MIN_DEVICE_FREE:
        text = f"nothing reserved: {free_device >> 20} MiB free on the device"
    else:
        before = small_pool(torch.cuda.memory_stats(device))
        reserve(device, RESERVE_BLOCKS)
        after = small_pool(torch.cuda.memory_stats(device))
        text = (f"{RESERVE_BLOCKS} x 1 MiB small-pool blocks: {after[0] - before[0]} new segments, "
                f"{before[1]:.0f} -> {after[1]:.0f} MiB cached free")
    details["summary"] = text
    return [text]
