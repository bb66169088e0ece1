"""How ``eager_gemm`` makes cuBLAS choose its kernels: a pass's GEMM calls captured into CUDA
graphs that are never replayed, on the calling thread and one side stream, within ``KWARM_BUDGET``.

Why one thread: every thread that calls cuBLAS gets a cuBLAS handle of its own from torch's
handle pool, which keeps it for the life of the process, and a workspace per (handle, stream).
Measured on the GPU host (H100, CUDA 13, torch 2.14, ``bench/cublas_threads_memory.py``): 16
threads, each on its own stream, left 1032 MiB of device memory outside torch's allocator (64.5
MiB a handle) and 512 MiB of workspaces inside it, none of it returned after the threads ended;
cuBLAS's kernels, loaded over a 174-count grid of 10 weight shapes, took 72 MiB. That memory is
taken after vLLM sized its KV cache, from the margin vLLM leaves or a neighbouring server's share:
with 4 capture threads (4 handles and workspaces: about 0.4 GB), kwarm's engine at
``--gpu-memory-utilization 0.92`` held 0.26-0.5 GB more than vLLM alone's at the same stages of
its start (published-size Qwen3-Next, vLLM 0.33.0, H100, nvidia-smi every 0.5 s). What threads
bought was small: a kernel grid of 907 problems, whose time is mostly the driver loading
kernels, took as long on 8 threads as on one (0.9 s); the budgeted fill ran about 2x faster on 8
(16,280 problems in 1.55 s, published-size Qwen3-Next, vLLM 0.29.0), so one thread warms about
half as many of its counts in the same budget. ``bench/gemm_capture_threads.py`` on the H100
(DeepSeek-V3.2's bf16 shapes, this module's grid and fill): one thread kept 180 MiB outside torch
against 426 on 4, its grid took 0.47-0.50 s against 0.31 and its fill 1.16-1.47 s against 0.76.
The calling thread's handle exists already (vLLM's profile run made it); one side
stream, kept for the process, adds one workspace (32 MiB on Hopper).

Why a memory bound: the CUDA graph keeps a memory pool for the outputs of its captured calls,
about twice the largest. At published-size DeepSeek-V3.2 those outputs reach 1.2 GB at 16,384
tokens; where kwarm's bound does not hold one pool, the GEMMs run instead, one output at a time.
"""
from __future__ import annotations

import contextlib

from kwarm_ext import budget, config

_capture_stream = None  # the one side stream kwarm's captures use: one cuBLAS workspace, not one a pass


def capture(calls: list, order: list, budgeted: bool, torch, device_type: str | None) -> tuple:
    """``(warmed, left, mode)``: :func:`warm` in :func:`session` on this thread; run instead where
    capture fails."""
    try:
        with session(torch, device_type) as mode:
            return warm(calls, order, budgeted) + (mode,)
    except Exception as exc:  # capture refused: run them instead (stricter CI sees it)
        if device_type != "cuda" or config.strict():
            raise
        return warm(calls, order, budgeted) + (f"run (capture failed: {type(exc).__name__}: {exc})",)


def warm(calls: list, order: list, budgeted: bool) -> tuple[int, int]:
    """Warm `order`; returns (problems warmed, problems left when the budget ran out)."""
    warmed = 0
    for n, (i, m) in enumerate(order):
        if budgeted and budget.left() <= 0:
            return warmed, sum(calls[j][0].calls for j, _ in order[n:])
        calls[i][1](m)
        warmed += calls[i][0].calls
    return warmed, 0


@contextlib.contextmanager
def session(torch, device_type: str | None):
    """Yields how the GEMMs run: "captured" (a CUDA graph, discarded) or "run". Capture uses a
    side stream whose cuBLAS workspace exists before capture begins, and thread-local capture
    mode, so that vLLM's other threads are not affected."""
    if device_type != "cuda" or not torch.cuda.is_available():
        yield "run"
        return
    stream = capture_stream(torch)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        a = torch.zeros((8, 8), dtype=torch.bfloat16, device="cuda")
        torch.addmm(a, a, a), torch.mm(a, a), torch.bmm(a[None], a[None])  # workspaces, outside capture
        stream.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            yield "captured into a CUDA graph, not run"
        finally:
            try:
                graph.capture_end()
            finally:
                del graph  # its memory pool goes with it, also after a failed capture
    torch.cuda.current_stream().wait_stream(stream)


def capture_stream(torch):
    """The side stream every capture of this process uses (made on the current device, once)."""
    global _capture_stream
    if _capture_stream is None or _capture_stream.device != torch.device("cuda", torch.cuda.current_device()):
        _capture_stream = torch.cuda.Stream()
    return _capture_stream
