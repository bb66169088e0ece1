"""kwarm's GPU memory: what each warmup step takes, and the bound it keeps to.

Why: kwarm's warmup runs after vLLM has allocated the KV cache, in memory vLLM did not size for
it. With a published-size Qwen3-Next (vocabulary 151936, vLLM 0.33.0 + FlashInfer, one H100, two
servers at ``--gpu-memory-utilization 0.42``) the kwarm server reached 79 GB where vLLM alone
reached 26 GB, and its neighbour died of an out-of-memory (issue 58). At vLLM's default 0.92 that
memory does not exist.

The bound (:func:`begin`): kwarm's warmup may hold, above what torch had allocated when it began
(weights, KV cache, vLLM's buffers), at most the headroom vLLM itself keeps for transient
activations, so that its peak is never above what vLLM alone reaches while serving:

- where vLLM sized the KV cache from ``--gpu-memory-utilization`` (0.20-0.34's
  ``Worker.determine_available_memory``): ``Worker.peak_activation_memory``, the torch peak of
  vLLM's profile run less what stayed allocated after it (``transient_peak_headroom``), plus the
  CUDA graphs' estimate where vLLM took it from the KV cache; after CUDA-graph capture the
  graphs hold that estimate, and the bound is the transient part alone;
- where the KV cache size was given (``--kv-cache-memory-bytes``: vLLM skips that profiling), what
  vLLM's requested memory (``Worker.requested_memory``, utilization x total) leaves beside what
  torch has reserved, and with no requested memory known, half of the device's free memory;
- never more than the device has free plus torch's cached, unused blocks.

It is enforced, not only reported: for the warmup's duration torch's caching allocator is capped
(``torch.cuda.set_per_process_memory_fraction``) at what it had reserved or at the allocated bytes
plus the bound, whichever is larger, so an allocation past it is an ``OutOfMemoryError`` inside
one kwarm step (one warning, the step skipped, the next runs) and never memory taken from the KV
cache or a neighbour. Families size their work to :func:`room` (``eager_gemm``'s CUDA graph).
After each family the allocator's cached blocks that kwarm grew are returned
(``torch.cuda.empty_cache``), and the cap is lifted when the warmup ends.

Per step (:func:`measure`): torch's peak allocated and reserved bytes (peak statistics reset
before the step: vLLM reads them only inside its own profiling, which is over, and on 0.34 kwarm
runs inside ``_outside_kv_cache_transient_window``, which resets them after), what was allocated
before, and the device's free memory before and after. The report keeps them per step; the
summary line names the largest.

Elsewhere (no CUDA, tests on the CPU) everything here is a no-op that returns ``None``.
"""
from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("kwarm")
GiB = 1 << 30

_state: dict = {}  # the running warmup's bound: {"limit", "base", "headroom", "how", "fraction", ...}


def _cuda():
    """torch, where a CUDA device is in use; else None (nothing to measure or bound)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch
    except Exception:  # noqa: BLE001  (no torch, a broken driver: nothing to bound)
        pass
    return None


def gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def headroom(worker, after_capture: bool = False, torch=None) -> tuple[int | None, str]:
    """(bytes, how it was derived) kwarm's warmup may hold above what torch had allocated when it
    began; (None, why) where no bound can be derived (no CUDA)."""
    torch = torch or _cuda()
    if torch is None:
        return None, "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    device_room = free + max(0, reserved - allocated)
    peak = getattr(worker, "peak_activation_memory", None)
    if isinstance(peak, (int, float)) and peak > 0:
        graphs = getattr(worker, "cudagraph_memory_estimate", 0) or 0
        applied = graphs if _graphs_taken_from_kv_cache() else 0
        bound = int(peak - applied) if after_capture else int(peak)
        how = (f"vLLM's activation headroom {gib(peak)}"
               + (f" less its CUDA graphs' {gib(applied)}" if after_capture and applied else ""))
    else:
        requested = getattr(worker, "requested_memory", None)
        if isinstance(requested, (int, float)) and requested > 0:
            bound = int(requested - reserved)
            how = f"vLLM's requested memory {gib(requested)} less torch's reserved {gib(reserved)}"
        else:
            bound = free // 2
            how = f"half the device's free {gib(free)}"
    bound = max(0, bound)
    if bound > device_room:
        bound, how = device_room, how + f", cut to the device's free memory {gib(device_room)}"
    return bound, how


def _graphs_taken_from_kv_cache() -> bool:
    """vLLM's ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` (0.2x+: on by default): the CUDA graphs'
    estimate is part of ``peak_activation_memory``."""
    try:
        import vllm.envs as envs

        return bool(getattr(envs, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", False))
    except Exception:  # noqa: BLE001
        return False


def begin(worker, after_capture: bool = False) -> dict | None:
    """Start bounding kwarm's warmup on `worker`'s device; returns the bound for the report
    (None without CUDA). Fails open: an error is one warning and the warmup runs unbounded."""
    end()
    torch = _cuda()
    if torch is None:
        return None
    from kwarm_ext.log import fail_open

    with fail_open("could not bound kwarm's GPU memory, its warmup runs unbounded"):
        bound, how = headroom(worker, after_capture, torch)
        free, total = torch.cuda.mem_get_info()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        cap = max(reserved, allocated + bound)
        state = {"headroom": bound, "how": how, "base_allocated": allocated, "base_reserved": reserved,
                 "free": free, "total": total, "cap_reserved": cap, "previous_fraction": _fraction(torch)}
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        _state.update(state)
        _state["enforced"] = True
        return {k: v for k, v in _state.items() if k != "previous_fraction"}
    return None


def _fraction(torch) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(get()) if get else 1.0
    except Exception:  # noqa: BLE001
        return 1.0


def end(release_blocks: bool = True) -> None:
    """Lift the cap and, with `release_blocks`, return the cached blocks kwarm's warmup grew
    (idempotent)."""
    if not _state:
        return
    state = dict(_state)
    _state.clear()
    torch = _cuda()
    if torch is None:
        return
    from kwarm_ext.log import fail_open

    with fail_open("could not lift kwarm's GPU memory cap"):
        if state.get("enforced"):
            torch.cuda.set_per_process_memory_fraction(state.get("previous_fraction", 1.0))
        if release_blocks:
            release(torch)


def room() -> int | None:
    """Bytes kwarm's warmup may still allocate under its bound (None: unbounded, no CUDA)."""
    torch = _cuda()
    if torch is None or not _state:
        return None
    return max(0, _state["base_allocated"] + _state["headroom"] - torch.cuda.memory_allocated())


# One more process's CUDA context on the device: 612 MiB measured per DeepGEMM compile process
# (nvidia-smi, H100, CUDA 13, torch 2.14, vLLM 0.33.0 at DeepSeek-V3.2 dimensions), rounded up.
CUDA_CONTEXT_BYTES = 640 << 20


def processes_that_fit(wanted: int) -> tuple[int, str | None]:
    """How many of `wanted` helper processes, each with a CUDA context of its own, fit kwarm's
    bound beside what torch holds; (count, why fewer, or None).

    Why: their contexts are outside torch's caching allocator, so its cap does not stop them. At
    DeepSeek-V3.2's dimensions and ``--gpu-memory-utilization 0.92`` (H100, vLLM 0.33.0) the
    dsa_indexer's 15 compile processes took 612 MiB each beside torch's 67.8 GiB reserved: the
    device reached 79505 MiB, 1.8 GB above vLLM alone's serving peak. torch's cached, unused
    blocks are returned first; one context's worth is kept for the calling step's own tensors."""
    torch = _cuda()
    if torch is None or not _state:
        return wanted, None
    release(torch, collect=False)
    held = torch.cuda.memory_reserved()
    left = max(0, _state["cap_reserved"] - held)
    fit = max(0, left // CUDA_CONTEXT_BYTES - 1)
    if fit >= wanted:
        return wanted, None
    return fit, (f"{fit} of {wanted} compile processes fit kwarm's memory bound ({gib(left)} left beside "
                 f"torch's {gib(held)} reserved, {CUDA_CONTEXT_BYTES >> 20} MiB a process)")


def fits(need: int, what: str) -> str | None:
    """None when `need` bytes fit :func:`room`, else the one-line reason to skip `what`."""
    left = room()
    if left is None or need <= left:
        return None
    return (f"{what} needs {gib(need)}, {gib(left)} left of kwarm's memory bound "
            f"({_state.get('how', 'unknown')})")


def reserved() -> int | None:
    """Bytes torch's caching allocator holds on this device (None without CUDA)."""
    torch = _cuda()
    return None if torch is None else torch.cuda.memory_reserved()


def release(torch=None, collect: bool = True) -> None:
    """Return torch's cached, unused blocks to the device (what a step grew); `collect` first
    collects Python's garbage (tensors in reference cycles: a failed step's frames)."""
    torch = torch or _cuda()
    if torch is None:
        return
    if collect:
        import gc

        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def measure():
    """Yields a dict that, once the block is done, holds the block's memory: ``peak_allocated``,
    ``peak_reserved`` (bytes, torch's peak statistics, reset before the block),
    ``allocated_before``, ``free_before``, ``free_after`` and, under a bound, ``above_base``
    (the peak above what was allocated when kwarm's warmup began). Empty without CUDA."""
    out: dict = {}
    torch = _cuda()
    if torch is None:
        yield out
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out.update(allocated_before=torch.cuda.memory_allocated(), free_before=torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001  (a measurement never fails the step)
        out.clear()
    try:
        yield out
    finally:
        if out:
            try:
                torch.cuda.synchronize()
                out.update(peak_allocated=torch.cuda.max_memory_allocated(),
                           peak_reserved=torch.cuda.max_memory_reserved(),
                           free_after=torch.cuda.mem_get_info()[0])
                if _state:
                    out["above_base"] = max(0, out["peak_allocated"] - _state["base_allocated"])
            except Exception:  # noqa: BLE001
                pass


def largest(measured) -> tuple[str, dict] | None:
    """The ``(name, memory)`` pair of `measured` whose peak reserved is largest; None where none
    was measured (an empty or missing memory)."""
    measured = [(name, used) for name, used in measured if (used or {}).get("peak_reserved")]
    return max(measured, key=lambda item: item[1]["peak_reserved"]) if measured else None
