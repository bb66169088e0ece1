"""kwarm's GPU memory bound (kwarm_ext/memory.py) and what the warmup does with it: the bound
vLLM's own numbers give, a family that shrinks its plan to fit and says so, and an out-of-memory
inside a step that is one warning, after which the blocks it grew go back and the next step runs.

No CUDA device exists here, so torch's CUDA caching allocator is the one stand-in
(:class:`Allocator`: reserved segments, a per-process cap that raises torch's real
``OutOfMemoryError``, empty_cache, peak statistics); the warmup runner, its steps, eager_gemm's
capture planning and torch's exception are the real ones."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from kwarm_ext import memory, warmup
from kwarm_ext.families import Family, Plan, Step

GiB = 1 << 30


class Allocator:
    """torch.cuda's memory functions over one simulated device of `total` bytes."""

    def __init__(self, total=80 * GiB, others=0, allocated=0, reserved=None):
        self.total, self.others = total, others
        self.allocated = allocated
        self.reserved = allocated if reserved is None else reserved
        self.fraction, self.empty_calls = 1.0, 0
        self.fragmented = 0  # cached bytes empty_cache cannot return (segments that hold a live block)
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # what torch.cuda offers
    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def mem_get_info(self):
        return self.total - self.others - self.reserved, self.total

    def memory_allocated(self):
        return self.allocated

    def memory_reserved(self):
        return self.reserved

    def max_memory_allocated(self):
        return self.peak_allocated

    def max_memory_reserved(self):
        return self.peak_reserved

    def reset_peak_memory_stats(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def synchronize(self):
        pass

    def empty_cache(self):
        self.empty_calls += 1
        self.reserved = min(self.reserved, self.allocated + self.fragmented)

    def set_per_process_memory_fraction(self, fraction):
        if not 0 <= fraction <= 1:  # torch's own check
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def get_per_process_memory_fraction(self):
        return self.fraction

    # what a step does
    def alloc(self, n):
        if self.reserved - self.allocated < n:  # a new segment, under the cap (cached blocks freed first)
            grow = n - (self.reserved - self.allocated)
            if self.reserved + grow > self.fraction * self.total:  # torch frees its cached blocks and retries
                self.reserved, grow = self.allocated, n
            if self.reserved + grow > self.fraction * self.total or self.reserved + grow > self.total - self.others:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n / GiB:.2f} GiB")
            self.reserved += grow
        self.allocated += n
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n):
        self.allocated -= n


@pytest.fixture
def device(monkeypatch):
    """A simulated 80 GiB device with 60 GiB allocated (weights and KV cache) and 2 GiB cached."""
    alloc = Allocator(allocated=60 * GiB, reserved=62 * GiB)
    monkeypatch.setattr(memory, "_cuda", lambda: types.SimpleNamespace(cuda=alloc))
    monkeypatch.setattr(memory, "_graphs_taken_from_kv_cache", lambda: True)
    memory._state.clear()
    yield alloc
    memory._state.clear()


def worker(**attrs):
    return types.SimpleNamespace(**attrs)


def test_the_bound_is_vllms_activation_headroom_and_never_more_than_the_device_has(device):
    bound, how = memory.headroom(worker(peak_activation_memory=5 * GiB, cudagraph_memory_estimate=GiB))
    assert bound == 5 * GiB and "activation headroom" in how
    # after CUDA-graph capture the graphs hold their estimate: the transient part alone
    bound, how = memory.headroom(worker(peak_activation_memory=5 * GiB, cudagraph_memory_estimate=GiB),
                                 after_capture=True)
    assert bound == 4 * GiB and "CUDA graphs" in how
    # --kv-cache-memory-bytes: vLLM skipped profiling, the requested memory bounds it
    bound, how = memory.headroom(worker(requested_memory=0.92 * 80 * GiB))
    assert bound == int(0.92 * 80 * GiB) - 62 * GiB and "requested memory" in how
    # a neighbour took the rest of the device: cut to what is free plus torch's cached blocks
    device.others = 16 * GiB
    bound, how = memory.headroom(worker(peak_activation_memory=5 * GiB))
    assert bound == 2 * GiB + 2 * GiB and "cut to the device's free memory" in how


def test_begin_caps_the_allocator_and_end_lifts_the_cap_and_returns_the_blocks(device):
    bound = memory.begin(worker(peak_activation_memory=4 * GiB))
    assert bound["headroom"] == 4 * GiB and bound["base_allocated"] == 60 * GiB
    assert device.fraction == pytest.approx(64 / 80), "capped at the allocated bytes plus the bound"
    device.alloc(3 * GiB)
    assert memory.room() == GiB
    assert memory.fits(2 * GiB, "a batch") == ("a batch needs 2.00 GiB, 1.00 GiB left of kwarm's memory bound "
                                              "(vLLM's activation headroom 4.00 GiB)")
    assert memory.fits(GiB, "a batch") is None
    with pytest.raises(torch.OutOfMemoryError):
        device.alloc(2 * GiB)
    device.free(3 * GiB)
    memory.end()
    assert device.fraction == 1.0 and device.reserved == device.allocated == 60 * GiB
    assert memory.room() is None, "no bound once the warmup ended"


def test_helper_processes_with_cuda_contexts_fit_the_bound_beside_torchs_reserved_blocks(device):
    """Compile processes' CUDA contexts are outside torch's allocator, which the cap does not see:
    at DeepSeek-V3.2 dimensions and 0.92, 15 of them (612 MiB each) beside torch's cached blocks
    took the device 1.8 GB above vLLM alone's peak. Cached blocks are returned first; the contexts
    then take what the cap leaves, less one for the step's own tensors."""
    assert memory.processes_that_fit(15) == (15, None), "no bound: every process"
    memory.begin(worker(peak_activation_memory=4 * GiB))  # cap: 64 GiB reserved
    device.alloc(GiB)
    device.free(GiB)  # 1 GiB cached, unused: returned before the count
    fit, why = memory.processes_that_fit(15)
    assert device.reserved == 60 * GiB and fit == 4 * GiB // memory.CUDA_CONTEXT_BYTES - 1 == 5
    assert why == "5 of 15 compile processes fit kwarm's memory bound (4.00 GiB left beside torch's 60.00 GiB reserved, 640 MiB a process)"
    assert memory.processes_that_fit(3) == (3, None)
    assert memory.processes_that_fit(5) == (5, None), "as many as fit: all of them"
    device.fragmented = GiB  # a cached GiB empty_cache cannot return counts against the cap
    device.alloc(GiB)
    device.free(GiB)
    assert memory.processes_that_fit(15)[0] == 3 * GiB // memory.CUDA_CONTEXT_BYTES - 1 == 3
    device.fragmented = 0
    device.alloc(int(3.5 * GiB))  # a step holds most of the bound: no process fits
    assert memory.processes_that_fit(15)[0] == 0
    memory.end()


def test_the_bound_where_vllm_says_less_or_nothing(device, monkeypatch):
    """The edges of :func:`memory.headroom`: a requested memory below what torch already holds
    leaves no room (never a negative bound); CUDA graphs kept out of vLLM's KV-cache sizing are
    not taken off the bound after capture; with no vLLM number at all, half the device's free."""
    bound, how = memory.headroom(worker(requested_memory=50 * GiB))
    assert bound == 0 and "requested memory 50.00 GiB less torch's reserved 62.00 GiB" in how
    monkeypatch.setattr(memory, "_graphs_taken_from_kv_cache", lambda: False)
    bound, how = memory.headroom(worker(peak_activation_memory=5 * GiB, cudagraph_memory_estimate=GiB),
                                 after_capture=True)
    assert bound == 5 * GiB and "CUDA graphs" not in how
    bound, how = memory.headroom(worker())
    assert bound == 9 * GiB and how == "half the device's free 18.00 GiB"


def test_the_cap_never_falls_below_what_torch_holds_and_end_restores_the_operators_fraction(device):
    """Capping below torch's reserved bytes would fail allocations vLLM's own cached blocks could
    serve; and a fraction the operator (or vLLM) set before kwarm is what the warmup leaves."""
    device.fraction = 0.95
    bound = memory.begin(worker(peak_activation_memory=GiB))  # 60 + 1 allocated < 62 reserved
    assert bound["cap_reserved"] == 62 * GiB and device.fraction == pytest.approx(62 / 80)
    memory.end()
    assert device.fraction == 0.95


def test_measure_gives_each_steps_peak_and_its_height_above_the_warmups_base(device):
    with memory.measure() as outside:
        device.alloc(GiB)
    assert outside["peak_allocated"] == 61 * GiB and "above_base" not in outside, "no bound: no base"
    device.free(GiB)
    memory.begin(worker(peak_activation_memory=4 * GiB))
    device.alloc(GiB)  # held from an earlier step: the base is the warmup's, not the step's
    with memory.measure() as used:
        device.alloc(2 * GiB)
        device.free(2 * GiB)
    assert used["allocated_before"] == 61 * GiB and used["peak_allocated"] == 63 * GiB
    assert used["above_base"] == 3 * GiB
    device.free(GiB)
    memory.end()


def test_release_collects_tensors_held_only_by_a_reference_cycle(device):
    import gc

    class Tensor:
        def __init__(self, n):
            device.alloc(n)
            self.n, self.cycle = n, self

        def __del__(self):
            device.free(self.n)

    Tensor(GiB)
    gc.disable()
    try:
        assert device.allocated == 61 * GiB
        memory.release()
        assert device.allocated == device.reserved == 60 * GiB
    finally:
        gc.enable()


def test_eager_gemm_with_less_memory_than_one_graph_runs_its_gemms_and_says_so(device, monkeypatch):
    """eager_gemm's capture keeps a CUDA graph's pool of about twice the largest output: with
    less than one pool under the bound it runs the GEMMs one output at a time, and says so."""
    from kwarm_ext.kernels import eager_gemm, gemm_capture

    fake_torch = types.SimpleNamespace(cuda=device)
    memory.begin(worker(peak_activation_memory=5 * GiB))
    room = eager_gemm._capture_room(fake_torch, "cuda")
    assert room == 5 * GiB

    seen = {}

    def capture(calls, order, budgeted, torch_, how):
        seen.update(how=how)
        return len(order), 0, "captured into a CUDA graph, not run" if how == "cuda" else "run"

    monkeypatch.setattr(gemm_capture, "capture", capture)
    monkeypatch.setattr(eager_gemm, "_shared_inputs", lambda torch_, targets: None)
    target = eager_gemm.Target("linear", "w 2048x2048", 1, 64, 1, prepare=lambda buffers: (lambda m: None),
                               out_bytes=GiB)
    details: dict = {}
    step = eager_gemm._pass("exact", [(target, list(range(1, 2000)))], "cuda", False, details)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(inference_mode=torch.inference_mode, cuda=device))
    labels = step()
    assert seen == {"how": "cuda"} and labels[-1].endswith("captured into a CUDA graph, not run")
    device.alloc(4 * GiB + GiB // 2)  # half a GiB left: not one graph's pool
    labels = step()
    assert seen["how"] is None and "one CUDA graph needs 2048" in labels[-1]


def test_an_out_of_memory_inside_a_step_is_one_warning_and_the_next_step_runs(device, monkeypatch, caplog,
                                                                                 kwarm_env):
    kwarm_env()
    module = types.ModuleType("kwarm_test_memory_family")
    module.applies = lambda view: None
    def greedy():  # its tensors die with its frame, as a real step's do
        held = 0
        try:
            for _ in range(10):
                device.alloc(GiB)
                held += GiB
        finally:
            device.free(held)
        return ["never"]

    def small():
        device.alloc(GiB // 4)
        device.free(GiB // 4)
        return ["small"]

    module.plan = lambda view, forced: Plan([Step("greedy", "k", run=greedy), Step("small", "k", run=small)])
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(warmup.FAMILIES, "memtest", Family("memtest", module.__name__, "test"))
    memory.begin(worker(peak_activation_memory=4 * GiB))
    with caplog.at_level(logging.WARNING, logger="kwarm"):
        result = warmup._run_family("memtest", types.SimpleNamespace(), __import__("kwarm_ext.config").config.get())
    greedy_step, small_step = result.steps
    assert greedy_step["status"] == "failed" and "OutOfMemoryError" in greedy_step["reason"]
    assert small_step["status"] == "ran" and small_step["variants"] == ["small"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "memtest.greedy" in warnings[0] and "OutOfMemoryError" in warnings[0]
    assert greedy_step["memory"]["peak_allocated"] <= 64 * GiB, "never above the bound"
    assert result.memory["step"] == "greedy"
    assert device.empty_calls == 1, "the failed step's blocks went back before the next step"
    assert device.reserved == 60 * GiB + GiB // 4, "the next step grew from there, not from the failed one's peak"
    memory.end()
    assert device.reserved == device.allocated == 60 * GiB, "the allocator's extra blocks went back"
    assert device.fraction == 1.0


def test_a_family_that_grew_the_allocator_returns_its_blocks_unless_they_are_its_product(device, monkeypatch,
                                                                                          kwarm_env):
    kwarm_env()
    module = types.ModuleType("kwarm_test_memory_family2")
    module.applies = lambda view: None

    def grow():
        device.alloc(3 * GiB)
        device.free(3 * GiB)
        return ["grew"]

    module.plan = lambda view, forced: [Step("grow", "k", run=grow)]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    from kwarm_ext import config

    monkeypatch.setitem(warmup.FAMILIES, "grower", Family("grower", module.__name__, "test"))
    result = warmup._run_family("grower", types.SimpleNamespace(), config.get())
    assert result.steps[0]["memory"]["peak_reserved"] == 63 * GiB
    assert device.reserved == 60 * GiB, "returned after the family"
    monkeypatch.setitem(warmup.FAMILIES, "grower", Family("grower", module.__name__, "test", keeps_memory=True))
    warmup._run_family("grower", types.SimpleNamespace(), config.get())
    assert device.reserved == 63 * GiB, "the caching allocator family's blocks are what it warms"


def test_a_failed_steps_tensors_are_freed_before_the_next_step_not_kept_by_its_traceback(device, monkeypatch,
                                                                                           kwarm_env):
    """A real step's tensors live in its frames, which the out-of-memory error's traceback keeps, in
    a cycle with kwarm's record of the error: they must be gone (and their blocks returned) before
    the next step runs, not whenever Python's garbage collector gets to them."""
    import gc

    kwarm_env()

    class Tensor:  # frees its bytes when it dies, as torch's do
        def __init__(self, n):
            self.n = 0
            device.alloc(n)
            self.n = n

        def __del__(self):
            device.free(self.n)

    module = types.ModuleType("kwarm_test_memory_frames")
    module.applies = lambda view: None

    def greedy():
        held = []
        for _ in range(10):
            held.append(Tensor(GiB))  # the fifth raises: four GiB live in this frame
        return ["never"]

    seen = []

    def small():
        seen.append((device.allocated, device.reserved))
        return ["small"]

    module.plan = lambda view, forced: Plan([Step("greedy", "k", run=greedy), Step("small", "k", run=small)])
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(warmup.FAMILIES, "memframes", Family("memframes", module.__name__, "test"))
    memory.begin(worker(peak_activation_memory=4 * GiB))
    gc.disable()  # what the collector would do some time later must not be what frees them
    try:
        result = warmup._run_family("memframes", types.SimpleNamespace(), __import__("kwarm_ext.config").config.get())
    finally:
        gc.enable()
    assert [s["status"] for s in result.steps] == ["failed", "ran"]
    assert seen == [(60 * GiB, 60 * GiB)], "the failed step's tensors and blocks were gone before the next step"
    memory.end()
