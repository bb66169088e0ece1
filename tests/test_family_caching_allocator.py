"""The ``caching_allocator`` family: noted at the end of kwarm's warmup, refilled after
``compile_or_warm_up_model``, through kwarm's real ``warmup.run`` / ``warmup.after_capture``.

torch's CUDA caching allocator cannot exist on this machine (no GPU driver): its statistics
(``torch.cuda.memory_stats``, ``torch.cuda.mem_get_info``) and the 1 MiB CUDA allocations of
``reserve`` are stood in for, and only those. What the refill saves on the GPU is measured by
``bench/gemm_warm_match.py`` and the engine benchmark.
"""
from __future__ import annotations

import json
import types

import pytest

from kwarm_ext import warmup
from kwarm_ext.kernels import caching_allocator as ca
from test_faults import stand_in_worker

MIB = 1 << 20


def test_small_pool_free_is_reserved_minus_allocated():
    assert ca.small_pool_free({"reserved_bytes.small_pool.current": 10 * MIB,
                               "allocated_bytes.small_pool.current": 4 * MIB}) == 6 * MIB
    assert ca.small_pool_free({}) == 0


@pytest.mark.parametrize("noted, now, device_free, expected", [
    (48 * MIB, 2 * MIB, 80 << 30, 46 * MIB),             # back to what was free before capture
    (48 * MIB + 5, 2 * MIB, 80 << 30, 46 * MIB),         # whole 1 MiB blocks only
    (2 * MIB, 48 * MIB, 80 << 30, 0),                    # already more than before: nothing
    (8 << 30, 0, 80 << 30, 1 << 30),                     # at most 1 GiB
    (48 * MIB, 0, 20 * MIB, 10 * MIB),                   # at most half the free device memory
])
def test_refill_bytes(noted, now, device_free, expected):
    assert ca.refill_bytes(noted, now, device_free) == expected


@pytest.fixture
def gpu_allocator(monkeypatch):
    """Stand-ins for the CUDA driver's side: the allocator's statistics and its allocations."""
    import torch

    state = types.SimpleNamespace(free_small=48 * MIB, reserved=[])

    def memory_stats(device):
        assert device == "cuda:0"
        return {"reserved_bytes.small_pool.current": state.free_small + 6 * MIB,
                "allocated_bytes.small_pool.current": 6 * MIB}

    def reserve(device, nbytes):
        state.reserved.append((device, nbytes))
        state.free_small += nbytes

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 << 30, 141 << 30))
    monkeypatch.setattr(ca, "reserve", reserve)
    monkeypatch.setattr(ca, "_noted", {})
    return state


def test_noted_before_capture_and_refilled_after(gpu_allocator, kwarm_env, kwarm_log, tmp_path):
    report_path = tmp_path / "report.json"
    kwarm_env(KWARM_WARMUPS="caching_allocator", KWARM_REPORT=str(report_path))
    worker = stand_in_worker(device="cuda:0")
    report = warmup.run(worker)
    family = next(f for f in report["families"] if f["name"] == "caching_allocator")
    assert family["status"] == "ran", family
    assert family["steps"][0]["variants"] == ["48 MiB cached free before capture"]

    gpu_allocator.free_small = 2 * MIB  # capture_model's empty_cache, then vLLM's own dummy run
    part = warmup.after_capture(worker)
    assert gpu_allocator.reserved == [("cuda:0", 46 * MIB)]
    refill = part["families"][0]
    assert refill["name"] == "caching_allocator" and refill["status"] == "ran", refill
    assert refill["steps"][0]["variants"] == ["46 MiB refilled: 2 -> 48 MiB cached free (48 MiB before capture)"]
    written = json.loads(report_path.read_text())
    assert written["after_capture"]["families"][0]["steps"][0]["status"] == "ran"
    assert any(m.startswith("kwarm: after CUDA-graph capture, ") and "caching_allocator" in m
               for m in kwarm_log.messages(0))
    assert kwarm_log.messages() == [], "no warning"

    assert warmup.after_capture(worker)["families"][0]["reason"] == "no engine view", \
        "one after-capture run per warmup run"


def test_refill_needs_the_note(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    worker = stand_in_worker(device="cuda:0")
    report = warmup.run(worker)
    ca._noted.clear()  # as if the kernel_warmup hook had not run the note
    step = warmup.after_capture(worker)["families"][0]["steps"][0]
    assert step["status"] == "skipped"
    assert step["reason"] == "nothing noted before the capture (kwarm's warmup did not run)"
    assert gpu_allocator.reserved == [] and report["families"]


def test_not_on_cuda_is_a_skip_and_disabled_is_disabled(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    worker = stand_in_worker(device="cpu")
    report = warmup.run(worker)
    family = next(f for f in report["families"] if f["name"] == "caching_allocator")
    assert family["reason"] == "runner device cpu is not CUDA"
    assert warmup.after_capture(worker)["families"][0]["reason"] == "runner device cpu is not CUDA"

    kwarm_env(KWARM_WARMUPS="-caching_allocator")
    warmup.run(worker)
    assert warmup.after_capture(worker)["families"][0]["reason"] == "disabled by KWARM_WARMUPS"
    assert gpu_allocator.reserved == []
