"""The capacity of cuBLASLt's heuristics cache, which ``eager_gemm`` raises before it warms.

cuBLAS remembers its choice per exact problem in one cache per
process, 8192 entries by default (least recently used out first), and ``eager_gemm`` makes
far more (tiny DeepSeek-V3.2: about 29,000). Warmed in ascending order, the small token counts
were out of the cache again by the first request, which paid the choice once more: 0.13-0.15 ms
per ``torch.mm`` at M = 200 in request 0 of the engine benchmark, a count
``eager_gemm`` had run. Before warming on CUDA, ``eager_gemm`` raises the cache's capacity
(``cublasLtHeuristicsCacheSetCapacity``, on the cuBLASLt library torch loaded) to what it
warms plus the default 8192 for everything else, about 360 bytes of host memory per entry
(tiny DeepSeek-V3.2: 37,312 entries, about 13 MB); a capacity already larger
(``CUBLASLT_HEURISTICS_CACHE_CAPACITY``) is kept. The exact pass warms each shape's counts from
the largest down, so that where the capacity cannot be raised the smallest, most frequent
counts are the ones left in the cache. Measured on the GPU host (``bench/gemm_warm_match.py``):
a problem warmed before 9,000 others cost 0.82 ms on its next call (5 shapes), 0.18 ms with
the capacity raised (0.15 ms when nothing came in between); in the engine benchmark request
0's GEMMs then cost what their repeat did. Ruled out on the way: the input's layout,
the thread, the stream, the pointer alignment, ``empty_cache`` and CUDA-graph capture.

Not a family (no ``applies``/``plan``): ``eager_gemm``'s first step calls it.

Remove when:
    ``eager_gemm`` goes, or cuBLASLt's default capacity holds what it warms.
"""
from __future__ import annotations

from kwarm_ext.families import Step

DEFAULT_HEURISTICS_CACHE = 8192  # cuBLASLt's default capacity: room kept for everything else


def reserve_heuristics_cache(entries: int, libraries=None) -> tuple:
    """Raise the capacity of cuBLASLt's heuristics cache to at least `entries`, in every
    cuBLASLt library loaded in this process (torch's). Returns (before, after, reason):
    the capacities, or (before or None, None, why not). Never lowers a capacity."""
    import ctypes

    libs = libraries_loaded() if libraries is None else libraries
    if not libs:
        return None, None, "no cuBLASLt library loaded"
    befores, afters = [], []
    for lib in libs:
        capacity = ctypes.c_size_t()
        if lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(capacity)) != 0:
            return None, None, "cublasLtHeuristicsCacheGetCapacity failed"
        befores.append(capacity.value)
        if capacity.value < entries:
            status = lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(entries))
            if status != 0:
                return capacity.value, None, f"cublasLtHeuristicsCacheSetCapacity returned status {status}"
            lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(capacity))
        afters.append(capacity.value)
    return min(befores), min(afters), None


def libraries_loaded() -> list:
    """The cuBLASLt libraries this process has loaded (from /proc/self/maps), opened again
    by path (the same loaded copy), that have the heuristics-cache functions."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublasLt.so" in line})
    except OSError:
        return []
    libs = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "cublasLtHeuristicsCacheSetCapacity") and hasattr(lib, "cublasLtHeuristicsCacheGetCapacity"):
            libs.append(lib)
    return libs


def cache_step(problems: int, device_type: str | None, details: dict) -> Step:
    """``eager_gemm``'s first step: room in cuBLASLt's heuristics cache for the `problems` the others warm."""
    if device_type != "cuda":
        return Step("heuristics_cache", "cuBLASLt heuristics cache",
                    skip=f"runner device {device_type or 'unknown'} is not CUDA ({problems} GEMM problems)")
    return Step("heuristics_cache", "cuBLASLt heuristics cache", run=reserve_step(problems, details))


def reserve_step(problems: int, details: dict):
    def step():
        before, after, reason = reserve_heuristics_cache(problems + DEFAULT_HEURISTICS_CACHE)
        details["heuristics_cache"] = {"problems": problems, "before": before, "after": after, "reason": reason}
        return [f"capacity {before} -> {after} ({problems} problems to warm)" if after is not None
                else f"capacity not raised: {reason}"]

    return step
