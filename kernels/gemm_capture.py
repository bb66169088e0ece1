"""How ``eager_gemm`` makes cuBLAS choose its kernels: a pass's GEMM calls captured into CUDA
graphs that are never replayed, on several threads, within ``KWARM_BUDGET``.

Why threads: cuBLAS's choice of a kernel for a new problem is CPU work (about 0.21 ms a problem
on the GPU host, vLLM 0.29.0, one thread) that torch runs without the GIL. Measured on the GPU
host (vLLM 0.29.0, cold): 16,280 problems of the published-size Qwen3-Next in 1.55 s on 8
threads, 28,487 of the tiny DeepSeek-V3.2 in 3.4 s; a kernel grid of 907 problems, whose time is
mostly the driver loading kernels, took as long on 8 threads as on one (0.9 s).

Why a memory bound: each thread's CUDA graph keeps its own memory pool for the outputs of its
captured calls, about twice the largest each. With 8 threads the published-size DeepSeek-V3.2
(outputs up to 1.2 GB at 16,384 tokens) ran out of device memory beside three other engines.
"""
from __future__ import annotations

import contextlib

from kwarm_ext import budget, config
from kwarm_ext.surfaces.triton import compile as triton_compile

CAPTURE_THREADS = 8  # at most this many threads capture one pass
PROBLEMS_PER_THREAD = 64  # at least this many problems per capture thread


def capture(calls: list, order: list, budgeted: bool, torch, device_type: str | None, threads: int = 1) -> tuple:
    """``(warmed, left, mode)``: :func:`warm` in :func:`session` on `threads` threads, else on
    this one; run instead where capture fails."""
    note = ""
    if threads > 1:
        try:
            return on_threads(calls, order, budgeted, torch, device_type, threads)
        except Exception as exc:  # a thread's capture refused: all of it again on this thread
            if config.strict():
                raise
            note = f" (on {threads} threads failed: {type(exc).__name__}: {str(exc).split('. ')[0]})"
    try:
        with session(torch, device_type) as mode:
            return warm(calls, order, budgeted) + (mode + note,)
    except Exception as exc:  # capture refused: run them instead (stricter CI sees it)
        if device_type != "cuda" or config.strict():
            raise
        return warm(calls, order, budgeted) + (f"run (capture failed: {type(exc).__name__}: {exc}){note}",)


def capture_threads(device_type: str | None, problems: int, tp_size=None, free_bytes=None, out_bytes: int = 0) -> int:
    """On CUDA, this rank's share of the cores up to :data:`CAPTURE_THREADS`, at least
    :data:`PROBLEMS_PER_THREAD` problems each, and as many as `free_bytes` (what kwarm's memory
    bound leaves, ``kwarm_ext.memory.room``) hold at twice the largest output each (a thread's CUDA
    graph keeps its own memory pool: 8 threads at published-size DeepSeek-V3.2, 1.2 GB outputs, ran
    out of memory beside three other engines); 1 elsewhere (CPU GEMMs run, nothing is chosen)."""
    if device_type != "cuda":
        return 1
    room = CAPTURE_THREADS if free_bytes is None else free_bytes // max(1, 2 * out_bytes)
    return max(1, min(CAPTURE_THREADS, triton_compile.compile_threads(tp_size), problems // PROBLEMS_PER_THREAD, room))


def on_threads(calls: list, order: list, budgeted: bool, torch, device_type: str | None, threads: int) -> tuple:
    """``(warmed, left, mode)`` of `order` dealt round-robin to `threads` threads, each in its own
    :func:`session` under inference mode on this thread's device. Each share keeps the pass's
    order (a budget cut leaves each as evenly covered). A thread's exception is raised here."""
    import threading

    device = torch.cuda.current_device() if device_type == "cuda" else None
    results: list = [None] * threads

    def work(k):
        try:
            if device is not None:
                torch.cuda.set_device(device)  # a new thread starts on device 0
            with torch.inference_mode(), session(torch, device_type) as mode:
                results[k] = warm(calls, order[k::threads], budgeted) + (mode,)
        except Exception as exc:  # raised on the calling thread below, without this thread's frames
            results[k] = exc.with_traceback(None)

    workers = [threading.Thread(target=work, args=(k,), name=f"kwarm-eager-gemm-{k}") for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for result in results:
        if isinstance(result, Exception):
            raise result
    return (sum(r[0] for r in results), sum(r[1] for r in results), f"{results[0][2]} on {threads} threads")


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
    stream = torch.cuda.Stream()
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
