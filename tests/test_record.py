"""Recording: kwarm's one post-compile hook, shared by counting and recording, chained with
the hooks around it (vLLM's JIT monitor included), and what a recorded entry holds.

The hook-slot tests call the installed hook directly (no compile). The recording tests
compile for an sm90 target in a fresh interpreter, with tests/replay_kernels.FakeDriver
standing in for the GPU driver that cannot exist on this machine.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import clean_env, require, run_py

knobs = require("triton.knobs")
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.surfaces.triton import hook

TESTS = Path(__file__).resolve().parent


def triton_env(tmp_path, **extra) -> dict:
    """A fresh interpreter that can import tests/replay_kernels.py, with its own Triton cache."""
    env = clean_env(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def last_json(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def slot():
    """Triton's hook slot, emptied for the test and restored after it."""
    saved, saved_listener = knobs.runtime.jit_post_compile_hook, knobs.compilation.listener
    knobs.runtime.jit_post_compile_hook = knobs.compilation.listener = None
    yield knobs.runtime
    for listener in list(hook._listeners):
        hook.unlisten(listener)
    knobs.runtime.jit_post_compile_hook, knobs.compilation.listener = saved, saved_listener
    hook._state.prev, hook._state.installed = None, False
    hook._state.prev_listener, hook._state.listening = None, False


def fire(runtime, name="k", jit_function=None):
    fn = type("Info", (), {"module": "m", "name": name, "jit_function": jit_function})()
    return runtime.jit_post_compile_hook(key=f"key-{name}", fn=fn, compile={}, repr="", is_manual_warmup=False,
                                         already_compiled=False)


def test_hook_chains_the_hook_that_was_there_before(slot):
    calls = []
    slot.jit_post_compile_hook = lambda **kw: calls.append(("before", kw["key"])) or "prev-result"
    with hook.capture() as events:
        assert fire(slot) == "prev-result"
    assert [e.key for e in events] == ["key-k"] and calls == [("before", "key-k")]
    assert slot.jit_post_compile_hook is not hook._hook  # removed, the earlier hook restored
    assert fire(slot) == "prev-result"


def test_counting_and_recording_share_one_hook(slot):
    recorded = []
    hook.listen(recorded.append)
    with hook.capture() as events:
        assert slot.jit_post_compile_hook is hook._hook
        fire(slot)
    assert len(events) == 1 and len(recorded) == 1  # one call reached both listeners
    assert slot.jit_post_compile_hook is hook._hook  # the recorder keeps it installed
    hook.unlisten(recorded.append)
    assert slot.jit_post_compile_hook is None


def test_vllm_jit_monitor_chains_kwarm_and_both_see_each_compile(slot, monkeypatch):
    jit_monitor = pytest.importorskip("vllm.triton_utils.jit_monitor")
    warned = []
    monkeypatch.setattr(jit_monitor, "_log_jit_compile", lambda name, kwargs: warned.append(name))
    recorded = []
    hook.listen(recorded.append)
    jit_monitor._setup_triton_jit_hook()  # what vLLM does after warmup: save the slot, chain it
    assert slot.jit_post_compile_hook is not hook._hook and hook.is_installed()
    fire(slot, "late")
    assert warned == ["late"] and len(recorded) == 1
    hook.listen(recorded.append)  # a second listener does not stack a second kwarm hook
    fire(slot, "later")
    assert warned == ["late", "later"] and len(recorded) == 3
    hook.unlisten(recorded.append)
    hook.unlisten(recorded.append)
    fire(slot, "off")  # vLLM's hook still calls kwarm's, which now only passes through
    assert warned[-1] == "off" and len(recorded) == 3


def test_triton_says_which_compiles_were_disk_cache_loads_through_a_chained_listener(slot):
    """Triton's compilation listener says cache_hit just before the hook, in the same thread: kwarm
    holds that slot while it listens, chained to the listener before it, and tells each event
    whether Triton loaded it (None where the listener spoke of another function, or not at all)."""
    before = []
    knobs.compilation.listener = lambda **kw: before.append(kw["cache_hit"])
    kernel, other = object(), object()
    src = type("Src", (), {"fn": kernel})()
    with hook.capture() as events:
        knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
        fire(slot, "loaded", kernel)
        knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
        fire(slot, "built", kernel)
        knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
        fire(slot, "another", other)
        fire(slot, "unsaid", kernel)  # the listener's word was taken by the hook before
    assert [(e.name, e.cache_hit) for e in events] == [
        ("loaded", True), ("built", False), ("another", None), ("unsaid", None)]
    assert before == [True, False, True]
    assert knobs.compilation.listener is not hook._compilation_listener  # given back
    knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert before == [True, False, True, False]


def test_a_compilation_listener_chained_on_top_of_kwarms_keeps_the_whole_chain(slot):
    calls, kernel = [], object()
    knobs.compilation.listener = lambda **kw: calls.append("before")
    hook.listen(calls.append)
    ours = knobs.compilation.listener

    def on_top(**kw):  # installed after kwarm's, chaining it (as the benchmark's probe does)
        calls.append("top")
        return ours(**kw)

    knobs.compilation.listener = on_top
    hook.unlisten(calls.append)
    assert knobs.compilation.listener is on_top  # kwarm's stays inside it, a pass-through
    src = type("Src", (), {"fn": kernel})()
    with hook.capture() as events:  # listening again neither re-installs nor loops
        assert knobs.compilation.listener is on_top
        knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
        fire(slot, "k", kernel)
    assert calls == ["top", "before"] and [e.cache_hit for e in events] == [True]


def test_the_listener_slot_is_held_again_under_a_hook_chained_on_top_of_kwarms(slot):
    """vLLM's JIT monitor chains kwarm's hook after warmup, so the hook stays past its last
    listener while the listener's slot is given back: the next listen must take that slot again,
    or the families that run after capture lose Triton's word on disk-cache loads."""
    kernel, seen = object(), []
    hook.listen(seen.append)
    ours = slot.jit_post_compile_hook
    slot.jit_post_compile_hook = lambda **kw: ours(**kw)  # the monitor, installed after warmup
    hook.unlisten(seen.append)
    assert knobs.compilation.listener is None
    src = type("Src", (), {"fn": kernel})()
    with hook.capture() as events:
        knobs.compilation.listener(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
        fire(slot, "k", kernel)
    assert [e.cache_hit for e in events] == [True]


def test_a_hook_that_replaced_kwarms_is_chained_on_the_next_listen(slot):
    recorded, other = [], []
    hook.listen(recorded.append)
    slot.jit_post_compile_hook = lambda **kw: other.append(kw["key"])  # assigned outright
    assert not hook.is_installed()
    assert hook.ensure() is True and hook.is_installed()  # the learner's periodic check
    assert hook.ensure() is False
    slot.jit_post_compile_hook = lambda **kw: other.append(kw["key"])
    with hook.capture() as events:
        assert hook.is_installed()
        fire(slot)
    assert other == ["key-k"] and len(recorded) == 1 and len(events) == 1


def test_a_chain_that_loops_back_is_called_once(slot):
    """A hook that chains kwarm's through a global (undetectable) and is then chained by kwarm."""
    calls = []
    hook.listen(calls.append)
    saved = {"prev": slot.jit_post_compile_hook}

    def looping(**kw):
        calls.append("other")
        return saved["prev"](**kw)

    slot.jit_post_compile_hook = looping
    hook.listen(calls.append)  # kwarm re-installs on top: kwarm -> looping -> kwarm (stops)
    fire(slot)
    assert calls.count("other") == 1 and len([c for c in calls if c != "other"]) == 2


def test_listener_errors_never_reach_the_launch_but_the_chained_hooks_do(slot):
    def broken(kwargs):
        raise RuntimeError("listener bug")

    hook.listen(broken)
    assert fire(slot) is None

    def strict(**kw):  # vLLM's --jit-monitor-mode=error must still raise
        raise RuntimeError("JIT during inference")

    hook.unlisten(broken)
    slot.jit_post_compile_hook = strict
    with hook.capture():
        with pytest.raises(RuntimeError, match="JIT during inference"):
            fire(slot)


def test_recorder_ignores_foreign_and_paused_compiles(kwarm_log):
    recorder = learn.Recorder(("vllm.",))
    recorder.on_compile({"key": "k", "fn": None, "compile": {}})  # not a JITFunction: ignored
    recorder.on_compile({"garbage": object()})
    with recorder.paused():
        recorder.on_compile({"key": "k"})
    assert recorder.recorded == 0 and recorder.take_unsaved() == []
    assert kwarm_log.messages() == []


def test_recorder_is_thread_safe(monkeypatch):
    """Compiles finalize on several threads (AsyncCompileMode) while the saver takes entries."""
    import threading

    from kwarm_ext.surfaces.triton import compat as triton_compat
    from kwarm_ext.surfaces.triton.compat import CompileRecord

    monkeypatch.setattr(triton_compat, "describe_compile", lambda kw: CompileRecord(
        "vllm.x", "k", "s", kw["key"], {}, {}))
    recorder = learn.Recorder(("vllm.",))
    taken = []

    def compiles(worker):
        for i in range(500):
            recorder.on_compile({"key": f"{worker}-{i % 250}"})  # each key twice: deduplicated

    def saver():
        for _ in range(200):
            taken.extend(recorder.take_unsaved())

    threads = [threading.Thread(target=compiles, args=(w,)) for w in range(4)] + [threading.Thread(target=saver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()
    taken.extend(recorder.take_unsaved())
    assert recorder.recorded == 1000 and len(taken) == 1000 and len({e.key for e in taken}) == 1000


def test_learner_keeps_entries_whose_save_failed(tmp_path, kwarm_log, monkeypatch):
    from kwarm_ext.surfaces.triton import compat as triton_compat
    from kwarm_ext.manifest import Stamp
    from kwarm_ext.surfaces.triton.compat import CompileRecord

    monkeypatch.setattr(triton_compat, "describe_compile", lambda kw: CompileRecord(
        "vllm.x", "k", "s", "[('i32', 'D')]{'debug': False}", {"debug": False},
        {"name": "vllm.x.k", "signature": {"n": "i32"}, "constant_keys": [], "constant_vals": [],
         "attrs_keys": [], "attrs_vals": []}))
    blocker = tmp_path / "file"
    blocker.write_text("")
    learner = learn.Learner(str(blocker / "m.json"), Stamp("3.6.0", "cuda:90"), learn.Recorder(("vllm.",)), 0)
    learner.recorder.on_compile({})
    learner.save_quietly("periodic")
    learner.save_quietly("periodic")
    assert len(kwarm_log.messages()) == 1 and "saving the manifest" in kwarm_log.messages()[0]
    learner.path = str(tmp_path / "m.json")
    result = learner.save("exit")
    assert (result.added, learner.learned, learner.save("exit")) == (1, 1, None)


RECORD = """
import json, sys
import replay_kernels as rk
rk.install_fake_driver()
from triton import knobs
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.surfaces.triton import hook
from kwarm_ext.surfaces.triton import compat as triton_compat
import triton, torch

out = {"triton": triton.__version__}
if triton_compat.version_tuple() < (3, 7):
    # The Triton bug the serializer patch works around: with any hook set, a kernel taking a
    # jitted function as a constexpr fails to launch.
    knobs.runtime.jit_post_compile_hook = lambda **kw: None
    try:
        rk.apply_kernel.warmup(torch.float16, torch.float16, 5, FN=rk.relu, BLOCK=64, grid=(1,))
        out["stock_serializer"] = "ok"
    except TypeError as exc:
        out["stock_serializer"] = str(exc)
    knobs.runtime.jit_post_compile_hook = None
recorder = learn.Recorder(("vllm.", "kwarm_ext.", "replay_kernels"))
hook.listen(recorder.on_compile)
vllm_only = learn.Recorder(("vllm.",))  # the default allow-list: the test module is foreign
hook.listen(vllm_only.on_compile)
rk.choose_autotune_configs()
rk.launch_all()
out["vllm_only"] = vllm_only.recorded
entries = recorder.take_unsaved()
out["entries"] = [e.as_json() for e in entries]
out["source_keys"] = {"copy_kernel": rk.copy_kernel.cache_key, "apply_kernel": rk.apply_kernel.cache_key,
                      "relu": rk.relu.cache_key}
out["kernels"] = sorted(recorder.kernels())
print(json.dumps(out))
"""


def test_records_identity_key_options_and_specialization(tmp_path):
    out = last_json(run_py(RECORD, env=triton_env(tmp_path)))
    if "stock_serializer" in out:
        assert "JITFunction is not JSON serializable" in out["stock_serializer"]
    entries = out["entries"]
    assert out["vllm_only"] == 0
    assert {tuple(k) for k in out["kernels"]} == {("replay_kernels", n) for n in (
        "copy_kernel", "heuristic_kernel", "tuned_kernel", "apply_kernel", "cast_kernel")}
    copies = [e for e in entries if e["qualname"] == "copy_kernel"]
    assert len(copies) == 4 and all(e["source_key"] == out["source_keys"]["copy_kernel"] for e in copies)
    wide = next(e for e in copies if "num_warps" in e["launch_options"])
    assert wide["launch_options"] == {"num_warps": 8, "debug": False, "instrumentation_mode": ""}
    assert wide["key"].endswith("{'num_warps': 8, 'debug': False, 'instrumentation_mode': ''}")
    spec = wide["spec"]
    assert spec["name"] == "replay_kernels.copy_kernel" and "options" not in spec and "key" not in spec
    assert spec["signature"] == {"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr"}
    assert spec["constant_keys"] == [[3]] and spec["constant_vals"] == [128]
    one = next(e for e in copies if "('constexpr', 1)" in e["key"])  # n == 1 specializes to a constant
    assert one["spec"]["constant_vals"] == [1, 128]
    apply = next(e for e in entries if e["qualname"] == "apply_kernel")
    assert apply["spec"]["constant_vals"][0] == {"jit_function": "replay_kernels:relu"}
    assert out["source_keys"]["relu"] in apply["key"]
    cast = next(e for e in entries if e["qualname"] == "cast_kernel")  # an IntEnum and a tl dtype
    assert cast["spec"]["constant_vals"] == [1, {"tl_dtype": "fp16"}, 128]
    assert "<Scale.DOUBLE: 1>" in cast["key"] and "triton.language.float16" in cast["key"]


def test_learning_compiles_kwarms_noop_kernel_first_so_the_next_start_loads_it(monkeypatch, caplog):
    """The next start's replay launches kwarm's no-op kernel: a start without a manifest compiles it
    as learning begins (before the recorder listens), and a failure there only logs at debug."""
    import logging

    from kwarm_ext import warmup
    from kwarm_ext.surfaces.triton import learn, preload

    calls = []
    monkeypatch.setattr(preload, "warm_binder", lambda: calls.append("noop"))
    monkeypatch.setattr(learn, "begin", lambda view: calls.append("begin") or "learner")
    assert warmup._start_learning(object()) == "learner"
    assert calls == ["noop", "begin"]

    def fails():
        raise RuntimeError("no GPU driver")

    calls.clear()
    monkeypatch.setattr(preload, "warm_binder", fails)
    with caplog.at_level(logging.DEBUG, logger="kwarm"):
        assert warmup._start_learning(object()) == "learner"
    assert calls == ["begin"]
    assert [r.levelno for r in caplog.records if "no-op kernel" in r.getMessage()] == [logging.DEBUG]


CACHE_HIT = """
import json
import replay_kernels as rk
rk.install_fake_driver()
import torch
from kwarm_ext import monitor, warmup

with monitor.capture() as events:
    rk.copy_kernel.warmup(torch.float16, torch.float16, 1024, BLOCK=128, grid=(1,))
result = warmup.FamilyResult("f", "ran")
result.compiled = [{"cache_hit": e.cache_hit} for e in events]
result.seconds = SECONDS
print(json.dumps({"cache_hit": [e.cache_hit for e in events], "for_real": warmup.compiled_for_real(result)}))
"""


def test_budget_credit_follows_tritons_word_on_disk_cache_loads(tmp_path):
    """The same compile in two processes sharing a Triton cache: the first compiles (credited to
    the budget even if it was quick), the second loads (not credited even if it was slow)."""
    from kwarm_ext import warmup

    env = triton_env(tmp_path)
    first = run_py(CACHE_HIT.replace("SECONDS", "0.001"), env=env)
    assert last_json(first) == {"cache_hit": [False], "for_real": True}
    again = run_py(CACHE_HIT.replace("SECONDS", "10.0"), env=env)
    assert last_json(again) == {"cache_hit": [True], "for_real": False}
    unsaid = warmup.FamilyResult("f", "ran")  # where Triton said nothing: by time
    unsaid.compiled, unsaid.seconds = [{"kernel": "k"}] * 2, 0.2  # 0.1 s a kernel: compiled
    assert warmup.compiled_for_real(unsaid)
    unsaid.seconds = 0.02
    assert not warmup.compiled_for_real(unsaid)
    from kwarm_ext.report import short_line

    said = warmup.FamilyResult("f", "ran", compiled=[{"cache_hit": True}, {"cache_hit": False}, {}])
    assert "; 3 compiled (1 of them loaded from Triton's disk cache); largest f " in short_line([said])
