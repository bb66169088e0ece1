"""The kernel_warmup hook against the real ``vllm.v1.worker.gpu_worker``."""
from __future__ import annotations

import json
import logging

import pytest
import wrapt

from conftest import MATRIX, clean_env, cpu_triton_env, require, run_py

gpu_worker = require("vllm.v1.worker.gpu_worker")


@pytest.fixture
def unpatched():
    from kwarm_ext import patches

    patches.unpatch(gpu_worker)
    yield gpu_worker
    patches.unpatch(gpu_worker)


def test_patch_wraps_the_real_attribute_once(unpatched):
    from vllm.model_executor.warmup import kernel_warmup as defining_module

    from kwarm_ext import patches

    assert patches.patch(gpu_worker) is True
    assert isinstance(gpu_worker.kernel_warmup, wrapt.FunctionWrapper)
    assert gpu_worker.kernel_warmup.__wrapped__ is defining_module.kernel_warmup
    assert patches.patch(gpu_worker) is False  # a second patch does not double-wrap
    assert gpu_worker.kernel_warmup.__wrapped__ is defining_module.kernel_warmup
    assert patches.unpatch(gpu_worker) is True
    assert gpu_worker.kernel_warmup is defining_module.kernel_warmup


def test_wrapper_runs_ahead_families_then_original_then_kwarm(unpatched, monkeypatch):
    # vLLM's real kernel_warmup needs a GPU worker; a recording stand-in takes its place
    # at the same attribute so that the order and the pass-through can be observed.
    from kwarm_ext import patches, warmup

    calls = []

    def original(worker, *, process_local_only=False):
        calls.append(("vllm", worker, process_local_only))
        return "vllm-result"

    monkeypatch.setattr(gpu_worker, "kernel_warmup", original)
    monkeypatch.setattr(warmup, "ahead", lambda worker: calls.append(("ahead", worker)))
    monkeypatch.setattr(warmup, "run", lambda worker: calls.append(("kwarm", worker)))
    patches.patch(gpu_worker)
    assert gpu_worker.kernel_warmup("W", process_local_only=True) == "vllm-result"
    assert calls == [("ahead", "W"), ("vllm", "W", True), ("kwarm", "W")]


def test_a_failing_ahead_phase_is_one_warning_and_vllms_warmup_still_runs(unpatched, monkeypatch, kwarm_log):
    from kwarm_ext import patches, warmup

    calls = []
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker: calls.append(("vllm", worker)) or "r")
    monkeypatch.setattr(warmup, "ahead", lambda worker, **kw: 1 / 0)
    monkeypatch.setattr(warmup, "run", lambda worker: calls.append(("kwarm", worker)))
    patches.patch(gpu_worker)
    assert gpu_worker.kernel_warmup("W") == "r"
    assert calls == [("vllm", "W"), ("kwarm", "W")]
    warnings = [r.getMessage() for r in kwarm_log.records if r.levelname == "WARNING"]
    assert warnings == ["kwarm: warmup ahead of vLLM's failed, vLLM's own warmup runs as before: "
                        "ZeroDivisionError: division by zero"]


def test_original_exception_propagates_and_kwarm_does_not_run(unpatched, monkeypatch):
    from kwarm_ext import patches, warmup

    ran = []

    def original(worker):
        raise ValueError("vLLM's own failure")

    monkeypatch.setattr(gpu_worker, "kernel_warmup", original)
    monkeypatch.setattr(warmup, "ahead", lambda worker: None)
    monkeypatch.setattr(warmup, "run", lambda worker: ran.append(worker))
    patches.patch(gpu_worker)
    with pytest.raises(ValueError, match="vLLM's own failure"):
        gpu_worker.kernel_warmup("W")
    assert ran == []


IMPORT_ORDER = """
import os, sys, json
order = sys.argv[1]
if order == "before":
    import vllm.v1.worker.gpu_worker as g
    assert "kwarm_ext.activation" not in sys.modules
os.environ["KWARM_ENABLE"] = "1"
import kwarm_ext
first = kwarm_ext.activate("test")
second = kwarm_ext.activate("test")
import vllm.v1.worker.gpu_worker as g
from vllm.model_executor.warmup import kernel_warmup as real
from kwarm_ext import patches
print(json.dumps({"active": [first, second], "patched": patches.is_patched(g),
                  "inner_is_real": g.kernel_warmup.__wrapped__ is real.kernel_warmup}))
"""


@pytest.mark.parametrize("order", ["before", "after"])
def test_activation_wraps_whether_gpu_worker_is_imported_before_or_after(order):
    proc = run_py(IMPORT_ORDER.replace("sys.argv[1]", repr(order)), env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # patched once: __wrapped__ is the real function, not another wrapper
    assert result == {"active": [True, True], "patched": True, "inner_is_real": True}


@pytest.mark.parametrize("release", [v for v in MATRIX if v != "0.24.0"] + ["0.33.0"])
def test_hook_target_exists_and_wraps_in_each_release(release):
    """kwarm's patches on each release's real worker module, activated through the API (the
    .pth door itself: tests/test_doors.py), so that the run forks from the release's fork server."""
    code = """
    import json, os
    os.environ["KWARM_ENABLE"] = "1"
    import kwarm_ext
    assert kwarm_ext.activate("api")
    import vllm, vllm.v1.worker.gpu_worker as g, vllm.engine.arg_utils as a
    from kwarm_ext import patches
    import importlib, importlib.util
    serve = [p for p in (patches.SERVE_HTTP, patches.SERVE_HTTP_LAUNCHERS) if p.when()]
    server = importlib.import_module(serve[0].module)  # the API server's module `vllm serve` runs
    print(json.dumps({"version": vllm.__version__, "patched": patches.is_patched(g),
                      "after_capture": patches.is_after_capture_patched(g),
                      "before_profile": patches.is_before_profile_patched(g),
                      "engine_config": patches.ENGINE_CONFIG.applied(a),
                      "serve_http": [len(serve), serve[0].applied(server)]}))
    """
    proc = run_py(code, env=cpu_triton_env(), release=release)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"version": release, "patched": True,
                                                                 "after_capture": True, "before_profile": True,
                                                                 "engine_config": True, "serve_http": [1, True]}


def _worker_module(original):
    """A module with a ``Worker`` class whose ``compile_or_warm_up_model`` is `original`: the
    real method captures CUDA graphs (GPU only); the wrapping is the real one."""
    import types

    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"compile_or_warm_up_model": original})
    return module


def test_after_capture_wrapper_runs_after_vllms_method_once(monkeypatch):
    from kwarm_ext import patches, warmup

    calls = []

    def original(self):
        calls.append("vllm")
        return "compilation-times"

    module = _worker_module(original)
    monkeypatch.setattr(warmup, "after_capture", lambda worker: calls.append(("kwarm", worker)))
    assert patches.patch_after_capture(module) is True
    assert patches.patch_after_capture(module) is False, "wrapped once"
    worker = module.Worker()
    assert worker.compile_or_warm_up_model() == "compilation-times"
    assert calls == ["vllm", ("kwarm", worker)]


def test_after_capture_failure_is_one_warning_and_vllms_error_is_vllms(monkeypatch, kwarm_log, kwarm_env):
    from kwarm_ext import patches, warmup

    kwarm_env()
    module = _worker_module(lambda self: "ok")
    monkeypatch.setattr(warmup, "after_capture", lambda worker: 1 / 0)
    patches.patch_after_capture(module)
    assert module.Worker().compile_or_warm_up_model() == "ok"
    assert [m for m in kwarm_log.messages() if "after-capture" in m] == [
        "kwarm: after-capture steps failed, the engine starts without them: ZeroDivisionError: division by zero"]

    def fails(self):
        raise ValueError("vLLM's own failure")

    ran = []
    module = _worker_module(fails)
    monkeypatch.setattr(warmup, "after_capture", ran.append)
    patches.patch_after_capture(module)
    with pytest.raises(ValueError, match="vLLM's own failure"):
        module.Worker().compile_or_warm_up_model()
    assert ran == []


def test_ahead_families_run_before_vllms_profile_run_once_per_worker(monkeypatch, kwarm_env, kwarm_log):
    """deep_gemm (an ``ahead`` family) runs before ``Worker.determine_available_memory`` (vLLM's
    profile run compiles DeepGEMM kernels one by one); kernel_warmup's wrapper then finds it done,
    and the worker's detail line lists it once."""
    import types

    from kwarm_ext import patches, warmup
    from test_faults import stand_in_worker

    kwarm_env(KWARM_WARMUPS="deep_gemm,runner", KWARM_LOG_LEVEL="DEBUG")  # the detail line is DEBUG's
    planned, calls = [], []
    real_ahead = warmup.ahead
    monkeypatch.setattr(warmup, "ahead", lambda worker, **kw: planned.append([r.name for r in real_ahead(worker)
                                                                                 if r.reason != "disabled by KWARM_WARMUPS"]) or [])
    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"determine_available_memory": lambda self: calls.append(list(planned)) or 7})
    module.kernel_warmup = lambda worker: calls.append("vllm kernel_warmup")
    assert patches.patch_before_profile(module) is True and patches.is_before_profile_patched(module)
    assert patches.patch(module) is True
    worker = module.Worker()
    vars(worker).update(vars(stand_in_worker()))
    assert worker.determine_available_memory() == 7
    assert calls == [[["deep_gemm"]]], "planned before vLLM's profile run"
    module.kernel_warmup(worker)
    assert planned == [["deep_gemm"], []], "kernel_warmup's wrapper does not plan it again"
    assert calls[-1] == "vllm kernel_warmup"
    done = [r.getMessage() for r in kwarm_log.records if "warmup done" in r.getMessage()]
    assert len(done) == 1 and "): ran runner; " in done[0]
    detail = [r.getMessage() for r in kwarm_log.records if "warmup detail" in r.getMessage()]
    assert len(detail) == 1 and detail[0].count("deep_gemm") == 1 and "runner device cpu is not CUDA" in detail[0]


def test_compiles_left_beside_the_profile_run_are_waited_for_as_it_returns(monkeypatch, kwarm_env, kwarm_log):
    """deep_gemm may leave its compile processes running beside vLLM's profile run (its
    torch.compile first): they are waited for the moment the runner's ``profile_run`` returns,
    before ``determine_available_memory`` reads the memory it used; the shadow goes with the call,
    and the wait joins deep_gemm's seconds and summary once."""
    import types

    from kwarm_ext import patches, warmup
    from kwarm_ext.kernels import deep_gemm

    kwarm_env(KWARM_WARMUPS="deep_gemm")
    calls = []
    monkeypatch.setattr(warmup, "ahead", lambda worker, before_profile_run=False: calls.append(
        ("ahead", before_profile_run)) or warmup._ahead.setdefault(
        id(worker), ([warmup.FamilyResult("deep_gemm", status="ran", seconds=1.0)], 1.0))[0])
    monkeypatch.setattr(deep_gemm, "finish",  # as the real one: its labels once, then [] (nothing pending)
                        lambda worker: calls.append("finish") or (["waited 2.0 s"] if calls.count("finish") == 1 else []))

    class Runner:
        def profile_run(self):
            calls.append("profile_run")

    def determine_available_memory(self):
        calls.append("profiling starts")
        self.model_runner.profile_run()
        calls.append("free memory read")
        return 7

    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"determine_available_memory": determine_available_memory})
    patches.patch_before_profile(module)
    worker = module.Worker()
    worker.model_runner = Runner()
    assert worker.determine_available_memory() == 7
    assert calls == [("ahead", True), "profiling starts", "profile_run", "finish", "free memory read", "finish"]
    assert "profile_run" not in vars(worker.model_runner), "the shadow is gone with the call"
    (result,), seconds = warmup._ahead.pop(id(worker))
    assert result.details["summary"] == "waited 2.0 s" and result.seconds >= 1.0 and seconds >= 1.0
    assert any("deep_gemm: done beside vLLM's profile run: waited 2.0 s" in m for m in kwarm_log.messages(logging.INFO))


def test_a_runner_that_takes_no_shadow_is_one_warning_and_the_wait_comes_after(monkeypatch, kwarm_env, kwarm_log):
    import types

    from kwarm_ext import patches, warmup
    from kwarm_ext.kernels import deep_gemm

    kwarm_env(KWARM_WARMUPS="deep_gemm")
    calls = []
    monkeypatch.setattr(warmup, "ahead", lambda worker, before_profile_run=False: warmup._ahead.setdefault(
        id(worker), ([warmup.FamilyResult("deep_gemm", status="ran")], 0.0))[0])
    monkeypatch.setattr(deep_gemm, "finish", lambda worker: calls.append("finish") or [])

    class Runner:  # no instance dict: nothing can be shadowed on it
        __slots__ = ()

        def profile_run(self):
            calls.append("profile_run")

    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"determine_available_memory":
                                        lambda self: self.model_runner.profile_run() or calls.append("read") or 7})
    patches.patch_before_profile(module)
    worker = module.Worker()
    worker.model_runner = Runner()
    assert worker.determine_available_memory() == 7
    assert calls == ["profile_run", "read", "finish"]
    (warning,) = [m for m in kwarm_log.messages() if "profile_run" in m]
    assert warning.startswith("kwarm: could not shadow the model runner's profile_run, kwarm's ahead work is "
                              "waited for after vLLM's memory profiling: TypeError: ")
    warmup._ahead.pop(id(worker))


def test_a_failing_ahead_before_the_profile_run_is_one_warning(monkeypatch, kwarm_env, kwarm_log):
    import types

    from kwarm_ext import patches, warmup

    kwarm_env()
    monkeypatch.setattr(warmup, "ahead", lambda worker, **kw: 1 / 0)
    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"determine_available_memory": lambda self: 42})
    patches.patch_before_profile(module)
    assert module.Worker().determine_available_memory() == 42
    assert [m for m in kwarm_log.messages() if "profile run" in m] == [
        "kwarm: warmup ahead of vLLM's profile run failed, it runs before vLLM's kernel warmup instead: "
        "ZeroDivisionError: division by zero"]


def test_every_patch_in_the_table_applies_once_and_removes_cleanly():
    """The contract of the one patch table, on the real vLLM modules: each target exists,
    a second apply does not double-wrap, remove restores the very original, twice is a no-op."""
    import importlib

    from kwarm_ext import patches

    for entry in patches.PATCHES:
        try:
            module = importlib.import_module(entry.module)
        except ModuleNotFoundError:
            assert entry.when is not None and not entry.when(), entry.target
            continue  # another release's module (vLLM 0.33's launchers), absent from this one
        entry.remove(module)  # whatever an earlier test left
        if entry.when is not None and not entry.when():  # not needed in this process: never applied
            assert entry.apply(module) is False and not entry.applied(module), entry.target
            continue
        original = entry.current(module)
        assert original is not None, entry.target
        assert entry.apply(module) is True and entry.applied(module), entry.target
        assert entry.apply(module) is False, f"{entry.target}: wrapped twice"
        assert entry.remove(module) is True and not entry.applied(module), entry.target
        assert entry.current(module) is original, f"{entry.target}: not the original after remove"
        assert entry.remove(module) is False
    assert {e.target for e in patches.PATCHES} == {
        "triton.runtime.jit.serialize_specialization_data", "vllm.v1.worker.gpu_worker.kernel_warmup",
        "vllm.v1.worker.gpu_worker.Worker.determine_available_memory", "vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model",
        "vllm.v1.worker.gpu_worker.Worker.load_model", "vllm.v1.worker.gpu_worker.warmup_kernels",
        "vllm.model_executor.model_loader.base_loader.initialize_model",
        "vllm.v1.engine.input_processor.InputProcessor.__init__", "vllm.engine.arg_utils.EngineArgs.create_engine_config",
        "vllm.v1.structured_output.StructuredOutputManager.__init__",
        "vllm.v1.structured_output.StructuredOutputManager.grammar_init",
        "vllm.entrypoints.openai.api_server.serve_http", "vllm.entrypoints.launchers.api_server.entry.serve_http",
        "flashinfer.jit.core.JitSpec.build_and_load"}


SERVING_THREADS = """
import json, os, types
os.environ.pop("OMP_NUM_THREADS", None)
import torch
from torch._dynamo.utils import counters
from vllm.utils import torch_utils
from kwarm_ext import patches, warmup

set_threads = getattr(torch_utils, "set_torch_threads_for_runtime", None)  # 0.28+
warmup.after_capture = lambda worker: None  # kwarm's after-capture families need a GPU worker


def first_request_compiles(patched):
    torch._dynamo.reset()
    torch.set_num_threads(2)  # start-up's count: vLLM's parallel weight loading and warmups

    @torch.compile(dynamic=True, backend="eager")  # as vLLM's compile_native custom-op forwards
    def forward_native(x):
        return torch.nn.functional.silu(x) * 2

    def compile_or_warm_up_model(self):  # the order of vLLM 0.28-0.32's real method
        forward_native(torch.ones(4))     # warmups compile it
        if set_threads is not None:
            set_threads()                 # then serving's thread count
        return "compilation times"

    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"compile_or_warm_up_model": compile_or_warm_up_model})
    if patched:
        assert patches.patch_after_capture(module)
    assert module.Worker().compile_or_warm_up_model() == "compilation times"
    before = counters["stats"]["unique_graphs"]
    forward_native(torch.ones(5))         # the first request
    return {"compiled": counters["stats"]["unique_graphs"] - before, "threads": torch.get_num_threads()}


print(json.dumps({"has": set_threads is not None, "vllm": first_request_compiles(False),
                  "kwarm": first_request_compiles(True)}))
"""


@pytest.mark.parametrize("release", ["0.24.0", "0.28.0", "0.33.0"])
def test_startup_compiles_stay_valid_for_the_first_request(release):
    """vLLM 0.28-0.32 lower torch's thread count for serving after the warmups: Dynamo's guard on
    it recompiles every function torch.compile'd at start-up on the first request (measured on
    vLLM 0.29.0, BENCHMARKS.md). With kwarm's compile_or_warm_up_model wrapper the count is
    serving's before the warmups, so nothing compiles again. vLLM's real set_torch_threads_for_runtime,
    torch's real Dynamo; the worker method is a stand-in with 0.28-0.32's order."""
    proc = run_py(SERVING_THREADS, env=cpu_triton_env(), release=release)  # the release's fork server
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if release == "0.24.0":  # no such function: vLLM keeps start-up's count, nothing to do
        assert result == {"has": False, "vllm": {"compiled": 0, "threads": 2}, "kwarm": {"compiled": 0, "threads": 2}}
    else:
        assert result == {"has": True, "vllm": {"compiled": 1, "threads": 1}, "kwarm": {"compiled": 0, "threads": 1}}
