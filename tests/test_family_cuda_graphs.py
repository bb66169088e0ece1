"""The ``cuda_graphs`` family: after ``compile_or_warm_up_model``, every captured CUDA graph is
uploaded once, through kwarm's real ``warmup.run`` / ``warmup.after_capture``.

CUDA graphs and the driver cannot exist on this machine: ``torch.cuda.CUDAGraph`` is stood in
for by a class with its ``raw_cuda_graph_exec``, and ``cuGraphUpload`` by a recorder, and only
those. The gc scan, the counting, the summary and the failure policy are kwarm's real code.
What the upload saves is measured on the GPU (engine benchmark, BENCHMARKS.md).
"""
from __future__ import annotations

import types

import pytest

from kwarm_ext import warmup
from kwarm_ext.kernels import cuda_graphs as cg
from test_faults import stand_in_worker


class Graph:
    """Stands in for torch.cuda.CUDAGraph: an exec handle once instantiated, else it raises."""

    def __init__(self, handle):
        self.handle = handle

    def raw_cuda_graph_exec(self):
        if self.handle is None:
            raise RuntimeError("capture_end has not been called")
        return self.handle


def test_captured_graphs_finds_each_live_object():
    a, b = Graph(11), Graph(12)
    holder = {"x": a, "y": [a, b]}
    found = cg.captured_graphs(Graph)
    assert sorted(g.handle for g in found) == [11, 12]
    del holder, a, b, found
    import gc

    gc.collect()
    assert cg.captured_graphs(Graph) == []


def test_upload_all_counts_uploaded_uninstantiated_and_failed():
    calls = []

    def upload(handle, stream):
        calls.append((handle, stream))
        return 0 if handle != 13 else 700  # CUDA_ERROR_ILLEGAL_ADDRESS for one graph

    counts = cg.upload_all([Graph(11), Graph(None), Graph(0), Graph(12), Graph(13)], upload, 99)
    assert calls == [(11, 99), (12, 99), (13, 99)]
    assert counts == {"graphs": 5, "uploaded": 2, "not_instantiated": 2, "failed": 1, "error": 700}


def ours(part: dict) -> dict:
    """This family's entry of an after-capture report."""
    return next(f for f in part["families"] if f["name"] == "cuda_graphs")


@pytest.fixture
def gpu_graphs(monkeypatch):
    """Stand-ins for the CUDA side: torch.cuda.CUDAGraph is `Graph`, the driver's upload records."""
    import torch

    # a class of this test's own: graphs other tests left alive are not found
    state = types.SimpleNamespace(uploads=[], code=0, synced=[], Graph=type("Graph", (Graph,), {}))

    def upload(handle, stream):
        state.uploads.append((handle, stream))
        return state.code

    monkeypatch.setattr(torch.cuda, "CUDAGraph", state.Graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: state.synced.append(device))
    monkeypatch.setattr(cg, "driver_upload", lambda: upload)
    return state


def test_uploads_after_capture_only(gpu_graphs, kwarm_env, kwarm_log):
    kwarm_env(KWARM_WARMUPS="cuda_graphs")
    graphs = [gpu_graphs.Graph(21), gpu_graphs.Graph(22), gpu_graphs.Graph(None)]
    worker = stand_in_worker(device="cuda:0")
    report = warmup.run(worker)
    assert "cuda_graphs" not in [f["name"] for f in report["families"]], "not in kwarm's warmup"
    assert gpu_graphs.uploads == []

    family = ours(warmup.after_capture(worker))
    assert sorted(gpu_graphs.uploads) == [(21, 7), (22, 7)] and gpu_graphs.synced == ["cuda:0"]
    assert family["status"] == "ran", family
    assert family["details"]["summary"].startswith("2 of 3 graphs uploaded (found in ")
    assert family["details"]["summary"].endswith("), 1 not instantiated")
    assert kwarm_log.messages() == [], "no warning"
    del graphs


def test_every_upload_failing_is_one_warning_naming_the_step(gpu_graphs, kwarm_env, kwarm_log):
    kwarm_env(KWARM_WARMUPS="cuda_graphs")
    gpu_graphs.code = 999
    graphs = [gpu_graphs.Graph(31)]
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    family = ours(warmup.after_capture(worker))
    assert family["steps"][0]["status"] == "failed"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and "cuda_graphs" in warnings[0] and "CUresult 999" in warnings[0], warnings
    del graphs


def test_no_graph_eager_and_cpu(gpu_graphs, kwarm_env):
    kwarm_env(KWARM_WARMUPS="cuda_graphs")
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    assert ours(warmup.after_capture(worker))["details"]["summary"] == "no captured CUDA graph found"

    eager = stand_in_worker(device="cuda:0")
    eager.vllm_config.model_config.enforce_eager = True
    warmup.run(eager)
    assert ours(warmup.after_capture(eager))["reason"] == "enforce_eager: no CUDA graphs"

    cpu = stand_in_worker(device="cpu")
    warmup.run(cpu)
    assert ours(warmup.after_capture(cpu))["reason"] == "runner device cpu is not CUDA"
    assert gpu_graphs.uploads == []
