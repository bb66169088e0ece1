"""The ``caching_allocator`` family: run after ``compile_or_warm_up_model``, not in kwarm's
warmup, through kwarm's real ``warmup.run`` / ``warmup.after_capture``.

torch's CUDA caching allocator cannot exist on this machine (no GPU driver): its statistics
(``torch.cuda.memory_stats``, ``torch.cuda.mem_get_info``) and the 1 MiB CUDA allocations of
``reserve`` are stood in for, and only those; ``reserve`` itself runs on the CPU allocator.
What the step saves on the GPU is measured by the engine benchmark (``alloc`` per request).
"""
from __future__ import annotations

import contextlib
import json
import types

import pytest

from kwarm_ext import warmup
from kwarm_ext.kernels import caching_allocator as ca
from test_faults import stand_in_worker

MIB = 1 << 20


def test_small_pool_reads_segments_and_free_bytes():
    assert ca.small_pool({"segment.small_pool.current": 7, "reserved_bytes.small_pool.current": 14 * MIB,
                          "allocated_bytes.small_pool.current": 3 * MIB}) == (7, 11.0)
    assert ca.small_pool({}) == (0, 0.0)


def test_reserve_holds_all_blocks_at_once_then_frees_them():
    import weakref

    import torch

    held, alive, most_alive = [], weakref.WeakSet(), []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        held.append(tensor.nbytes)
        alive.add(tensor)
        most_alive.append(len(alive))
        return tensor

    torch.empty = empty
    try:
        ca.reserve("cpu", 3)
        ca.reserve("cpu", 2, ca.LARGE_BLOCK)
    finally:
        torch.empty = real_empty
    assert held == [MIB] * 3 + [9 * MIB] * 2
    assert most_alive == [1, 2, 3, 1, 2], "each block allocated while the others are held"
    assert len(alive) == 0, "all freed on return"
    assert 2 * ca.LARGE_BLOCK <= 20 * MIB and ca.LARGE_BLOCK < 10 * MIB, "two to a 20 MiB large-pool segment"


@pytest.fixture
def gpu_allocator(monkeypatch):
    """Stand-ins for the CUDA driver's side: the allocator's statistics and its allocations.
    The small pool holds 6 MiB allocated and 11 MiB free, in pieces; a reserve of n blocks
    adds n // 2 new segments (two 1 MiB blocks each)."""
    import torch

    state = types.SimpleNamespace(segments=8, large=3, free=11 * MIB, reserved=[], device_free=80 << 30,
                                  stream=None)

    def memory_stats(device):
        assert device == "cuda:0"
        return {"segment.small_pool.current": state.segments, "segment.large_pool.current": state.large,
                "reserved_bytes.small_pool.current": state.free + 6 * MIB,
                "allocated_bytes.small_pool.current": 6 * MIB}

    def reserve(device, blocks, size=MIB):
        state.reserved.append((device, state.stream, blocks, size // MIB))
        if size == MIB:
            state.segments += blocks // 2
            state.free += blocks // 2 * 2 * MIB
        else:
            state.large += blocks // 2

    @contextlib.contextmanager
    def on_stream(stream):
        state.stream = stream
        try:
            yield
        finally:
            state.stream = None

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state.device_free, 141 << 30))
    monkeypatch.setattr(ca, "reserve", reserve)
    monkeypatch.setattr(ca, "on_stream", on_stream)
    return state


def test_runs_after_capture_only(gpu_allocator, kwarm_env, kwarm_log, tmp_path):
    report_path = tmp_path / "report.json"
    kwarm_env(KWARM_WARMUPS="caching_allocator", KWARM_REPORT=str(report_path))
    worker = stand_in_worker(device="cuda:0")
    report = warmup.run(worker)
    assert "caching_allocator" not in [f["name"] for f in report["families"]], "not in kwarm's warmup"
    assert gpu_allocator.reserved == []

    part = warmup.after_capture(worker)  # what patches' compile_or_warm_up_model wrapper calls
    assert gpu_allocator.reserved == [("cuda:0", None, ca.RESERVE_BLOCKS, 1), ("cuda:0", None, 4, 9)]
    family = part["families"][0]
    assert family["name"] == "caching_allocator" and family["status"] == "ran", family
    text = "model stream 32 x 1 MiB + 4 x 9 MiB: 16 small, 2 large segments new; small pool 11 -> 43 MiB cached free"
    assert family["steps"][0]["variants"] == [text] and family["details"] == {"summary": text}
    written = json.loads(report_path.read_text())
    assert written["after_capture"]["families"][0]["steps"][0]["status"] == "ran"
    assert any(m.startswith("kwarm: after CUDA-graph capture, ") and "caching_allocator " in m and f" s: {text}" in m
               for m in kwarm_log.messages(0)), kwarm_log.messages(0)
    assert kwarm_log.messages() == [], "no warning"

    assert warmup.after_capture(worker)["families"][0]["reason"] == "no engine view", \
        "one after-capture run per warmup run"


def test_low_device_memory_reserves_nothing(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    gpu_allocator.device_free = 512 * MIB
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    step = warmup.after_capture(worker)["families"][0]["steps"][0]
    assert step["variants"] == ["nothing reserved: 512 MiB free on the device"]
    assert gpu_allocator.reserved == []


def test_not_on_cuda_is_a_skip_and_disabled_is_disabled(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    worker = stand_in_worker(device="cpu")
    warmup.run(worker)
    assert warmup.after_capture(worker)["families"][0]["reason"] == "runner device cpu is not CUDA"

    kwarm_env(KWARM_WARMUPS="-caching_allocator")
    warmup.run(worker)
    assert warmup.after_capture(worker)["families"][0]["reason"] == "disabled by KWARM_WARMUPS"
    assert gpu_allocator.reserved == []


def test_vllms_aux_stream_gets_its_own_reserve_once_created(gpu_allocator, kwarm_env, monkeypatch):
    # the shared experts run on vLLM's aux stream, whose blocks the allocator keeps apart:
    # request 0 started a small and a large segment there (BENCHMARKS.md, --alloc-stacks 0)
    import vllm.utils.torch_utils as torch_utils

    kwarm_env(KWARM_WARMUPS="caching_allocator")
    monkeypatch.setattr(torch_utils, "_aux_stream", None)
    assert torch_utils.aux_stream() is None, "vLLM creates none without CUDA"
    assert [label for label, *_ in ca.streams()] == ["model stream"], "none created: the model's stream only"

    aux = object()  # the torch.cuda.Stream vLLM's aux_stream() created
    monkeypatch.setattr(torch_utils, "_aux_stream", aux)
    assert torch_utils.aux_stream() is aux, "what kwarm reads is what vLLM's aux_stream() hands out"
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    step = warmup.after_capture(worker)["families"][0]["steps"][0]
    assert gpu_allocator.reserved == [("cuda:0", None, 32, 1), ("cuda:0", None, 4, 9),
                                      ("cuda:0", aux, 4, 1), ("cuda:0", aux, 2, 9)]
    assert step["variants"] == ["model stream 32 x 1 MiB + 4 x 9 MiB: 16 small, 2 large segments new; "
                                "aux stream 4 x 1 MiB + 2 x 9 MiB: 2 small, 1 large segments new; "
                                "small pool 11 -> 47 MiB cached free"]
