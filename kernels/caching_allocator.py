"""Warmup family ``caching_allocator``: give torch's CUDA caching allocator back the small
blocks that vLLM's CUDA-graph capture released, before the first request.

Why:
    ``capture_model`` ends with ``torch.accelerator.empty_cache()`` (V1 and V2 runners,
    0.20-0.33), after kwarm's warmup and vLLM's own dummy runs. Every cached segment goes
    back to the driver, so the first request's allocations of at most 1 MiB (the allocator's
    small pool, 2 MiB segments) each start a new segment with ``cudaMalloc``, a cost the
    repeat does not pay. Measured on the GPU host: a first 200-token prefill of the tiny
    Qwen3-Next spent 2.3 ms more than its repeat in 15 ``torch.empty`` calls of its GDN layers'
    ``fused_post_conv_prep`` (0.8 MB each; engine benchmark, call 12); torch alone
    (``bench/gemm_warm_match.py``), 15 such tensors after ``empty_cache`` took 0.66 ms against
    0.12 ms, and 0.12 ms when 64 blocks of 1 MiB had been allocated and freed first (a single
    256 MB block did not help: 0.59 ms, since it lands in the large pool).

How:
    Two steps. ``note``, at the end of kwarm's warmup (before capture), reads how many bytes
    the small pool holds cached and free (``torch.cuda.memory_stats``: reserved minus
    allocated). ``refill``, once ``Worker.compile_or_warm_up_model`` has returned (capture,
    vLLM's post-capture dummy run and sampler warmup done; ``kwarm_ext.patches`` wraps it),
    allocates the difference to what the small pool holds free now in 1 MiB blocks and frees
    them: the segments stay cached for the requests. That is at most what the engine held
    before the capture, within the activation memory vLLM's profile run accounted for; capped
    at 1 GiB and at half the free device memory. The large pool is left alone: its blocks are
    split for any larger request, and what vLLM emptied there can be GiBs.

Upstream: none (0.20-0.33); vLLM keeps only the sampler's buffers it allocates after capture.

Remove when:
    vLLM stops emptying the allocator's cache after capture, or refills it itself.
"""
from __future__ import annotations

from kwarm_ext.families import Step

NAME = "caching_allocator"
KERNEL = "CUDA caching allocator (small pool)"
BLOCK = 1 << 20  # the largest small-pool allocation (torch's kSmallSize): two per 2 MiB segment
MAX_REFILL = 1 << 30
_noted: dict = {}  # device -> small-pool bytes cached free at the end of kwarm's warmup


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if not (view.device or "").startswith("cuda"):
        return f"runner device {view.device or 'unknown'} is not CUDA"
    return None


def plan(view, forced) -> list:
    return [Step("note", KERNEL, run=lambda: _note(view.device))]


def plan_after_capture(view, forced) -> list:
    if view.device not in _noted:
        return [Step("refill", KERNEL, skip="nothing noted before the capture (kwarm's warmup did not run)")]
    return [Step("refill", KERNEL, run=lambda: _refill(view.device))]


def small_pool_free(stats: dict) -> int:
    """Bytes the small pool holds cached but not allocated, from ``torch.cuda.memory_stats``."""
    return max(0, stats.get("reserved_bytes.small_pool.current", 0) - stats.get("allocated_bytes.small_pool.current", 0))


def refill_bytes(noted: int, now: int, device_free: int) -> int:
    """What to allocate and free again: the small pool's free cache back to `noted`, in whole
    blocks, at most MAX_REFILL and half of `device_free`."""
    want = min(noted - now, MAX_REFILL, device_free // 2)
    return max(0, want) // BLOCK * BLOCK


def reserve(device: str, nbytes: int) -> None:
    """Allocate `nbytes` in small-pool blocks on `device` and free them: the allocator keeps them."""
    import torch

    blocks = [torch.empty(BLOCK, dtype=torch.uint8, device=device) for _ in range(nbytes // BLOCK)]
    del blocks


def _free_now(device: str) -> int:
    import torch

    return small_pool_free(torch.cuda.memory_stats(device))


def _note(device: str) -> list:
    _noted[device] = _free_now(device)
    return [f"{_mib(_noted[device])} MiB cached free before capture"]


def _refill(device: str) -> list:
    import torch

    noted, now = _noted[device], _free_now(device)
    nbytes = refill_bytes(noted, now, torch.cuda.mem_get_info(device)[0])
    if nbytes:
        reserve(device, nbytes)
    return [f"{_mib(nbytes)} MiB refilled: {_mib(now)} -> {_mib(_free_now(device))} MiB cached free "
            f"({_mib(noted)} MiB before capture)"]


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f}"
