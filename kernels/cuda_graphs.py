"""Warmup family ``cuda_graphs``: upload every CUDA graph vLLM captured to the device, after
capture, so that the first replay of each graph is not also its upload.

Why:
    vLLM captures one CUDA graph per batch size (FULL decode graphs, PIECEWISE pieces) in
    ``capture_model`` and does not replay them before serving. A ``cudaGraphExec_t`` is
    uploaded to the device on its first launch unless ``cudaGraphUpload`` did it before
    (CUDA runtime API, "Graph Management"), so the first request of each new batch size pays
    that upload inside ``cudaGraphLaunch``. On the GPU host (vLLM 0.24.0, Qwen3-Next with the
    published dimensions, warm restart with a manifest, no compile left) the first request
    and the first batch of 4 and 8 decodes still cost 5-17 ms more than their repeats; the
    engine benchmark's ``--cuda-profile`` shows where (BENCHMARKS.md, "First requests").

How:
    Once ``Worker.compile_or_warm_up_model`` has returned (``kwarm_ext.patches``), find the
    process's ``torch.cuda.CUDAGraph`` objects (one ``gc`` scan: vLLM keeps them in its V1
    ``CUDAGraphWrapper`` entries, the V2 runner's graph manager and the micro-batch
    wrappers, whose layouts differ by release), and call the driver's ``cuGraphUpload`` for
    each instantiated one on the worker's current stream, then synchronize. Nothing runs:
    an upload maps the graph's resources, it does not execute its nodes. Graphs that are not
    instantiated (capture not ended) are left alone.

Upstream: none (0.20-0.33).

Remove when:
    vLLM uploads or replays its graphs after capture, or PyTorch uploads at instantiation.
"""
from __future__ import annotations

from kwarm_ext.families import Step

NAME = "cuda_graphs"
KERNEL = "captured CUDA graphs (cuGraphUpload)"
_details: dict = {}  # the last upload's outcome, for the summary line


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if not (view.device or "").startswith("cuda"):
        return f"runner device {view.device or 'unknown'} is not CUDA"
    if view.enforce_eager:
        return "enforce_eager: no CUDA graphs"
    return None


def plan(view, forced) -> list:
    """The one step, planned once CUDA-graph capture is done (the family runs after it)."""
    _details.clear()
    return [Step("upload", KERNEL, run=lambda: _upload_captured(view.device))]


def details() -> dict:
    return dict(_details)


def captured_graphs(graph_type) -> list:
    """Every live object of `graph_type` (``torch.cuda.CUDAGraph``) in the process, each once."""
    import gc

    # type(), not isinstance(): isinstance reads ``__class__``, which some objects compute
    # (torch.distributed's deprecated aliases warn when it is read).
    return [obj for obj in gc.get_objects() if issubclass(type(obj), graph_type)]


def upload_all(graphs, upload, stream) -> dict:
    """``upload(exec_handle, stream)`` for each graph whose ``raw_cuda_graph_exec()`` answers.
    Returns counts: uploaded, not instantiated (the handle raised), failed (driver error
    codes, the first one kept)."""
    counts = {"graphs": len(graphs), "uploaded": 0, "not_instantiated": 0, "failed": 0, "error": None}
    for graph in graphs:
        try:
            handle = graph.raw_cuda_graph_exec()
        except Exception:  # not captured, or captured with keep_graph and not instantiated
            counts["not_instantiated"] += 1
            continue
        if not handle:
            counts["not_instantiated"] += 1
            continue
        code = upload(handle, stream)
        if code == 0:
            counts["uploaded"] += 1
        else:
            counts["failed"] += 1
            counts["error"] = counts["error"] or code
    return counts


def driver_upload():
    """The driver's ``cuGraphUpload(CUgraphExec, CUstream) -> CUresult`` through ctypes
    (libcuda is loaded in every process that runs CUDA; the runtime's cudaGraphExec_t is the
    driver's CUgraphExec)."""
    import ctypes

    fn = ctypes.CDLL("libcuda.so.1").cuGraphUpload
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lambda handle, stream: fn(ctypes.c_void_p(handle), ctypes.c_void_p(stream))


def _upload_captured(device: str) -> list:
    import time

    import torch

    t0 = time.perf_counter()
    graphs = captured_graphs(torch.cuda.CUDAGraph)
    found_s = time.perf_counter() - t0
    if not graphs:
        text = "no captured CUDA graph found"
    else:
        counts = upload_all(graphs, driver_upload(), torch.cuda.current_stream(device).cuda_stream)
        torch.cuda.synchronize(device)
        text = (f"{counts['uploaded']} of {counts['graphs']} graphs uploaded "
                f"(found in {found_s:.2f} s)")
        if counts["not_instantiated"]:
            text += f", {counts['not_instantiated']} not instantiated"
        if counts["failed"] and not counts["uploaded"]:
            raise RuntimeError(f"cuGraphUpload returned CUresult {counts['error']} for all {counts['failed']} graphs")
        if counts["failed"]:
            text += f", {counts['failed']} failed (CUresult {counts['error']})"
        _details.update(counts)
    _details["summary"] = text
    return [text]
