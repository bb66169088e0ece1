"""KWARM_BUDGET: parsing, the seconds it gives, and learning the step sizes eager_gemm warms exactly."""
from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest

from kwarm_ext import budget, config, manifest, manifest_files
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.manifest import Stamp


@pytest.mark.parametrize("raw, parsed", [
    (None, ("percent", 2.0)), ("auto", ("percent", 2.0)), ("", ("percent", 2.0)),
    ("5", ("seconds", 5.0)), ("2.5s", ("seconds", 2.5)), ("0", ("seconds", 0.0)),
    ("25%", ("percent", 25.0)), ("unlimited", ("unlimited", None)),
])
def test_budget_values(raw, parsed):
    env = {} if raw is None else {"KWARM_BUDGET": raw}
    settings = config.parse(env, known_families=("eager_gemm",))
    assert settings.budget == parsed and settings.problems == ()


@pytest.mark.parametrize("raw", ["-1", "banana", "1e10", "2000%", "nan"])
def test_a_bad_budget_is_one_warning_and_the_default(raw):
    settings = config.parse({"KWARM_BUDGET": raw}, known_families=("eager_gemm",))
    assert settings.budget == ("percent", 2.0)
    assert len(settings.problems) == 1 and "KWARM_BUDGET" in settings.problems[0]


def test_seconds_of_a_budget():
    assert budget.seconds_for(("percent", 10.0), 100.0)[0] == pytest.approx(10.0)
    assert budget.seconds_for(("percent", 10.0), 5.0)[0] == budget.FLOOR_S == 1.0, "at least 1 s"
    assert budget.seconds_for(("percent", 10.0), None)[0] == budget.FLOOR_S
    assert budget.seconds_for(("seconds", 0.5), 100.0) == (0.5, "0.5 s")
    assert budget.seconds_for(("unlimited", None), 100.0) == (None, "unlimited")
    assert "10% of 100.0 s before warmup" in budget.seconds_for(("percent", 10.0), 100.0)[1]


def test_the_clock_runs_out_and_unlimited_never_does():
    try:
        budget.begin(("seconds", 0.0))
        assert budget.left() <= 0
        budget.begin(("seconds", 60.0))
        assert 59 < budget.left() <= 60
        assert budget.begin(("unlimited", None)) == "unlimited"
        assert budget.left() == float("inf")
    finally:
        budget.reset()


def test_a_family_that_compiled_gives_its_time_back(monkeypatch, kwarm_env):
    # on a cold cache the compiles, which always run, spent the whole budget before eager_gemm's
    # fill; a family's time on a start where it compiled is not charged (kwarm_ext.warmup)
    import contextlib
    import sys
    import time as clock

    from kwarm_ext import families, monitor, warmup
    from test_faults import stand_in_worker

    compiled = []

    @contextlib.contextmanager
    def capture():  # Triton's compile hook cannot fire without a GPU: its events are stood in for
        yield compiled

    module = types.ModuleType("kwarm_budget_family")
    module.applies = lambda view: None
    module.plan = lambda view, forced: [families.Step("compile", "k", run=lambda: clock.sleep(0.3) or ["v"])]
    monkeypatch.setitem(sys.modules, "kwarm_budget_family", module)
    registry = {"fam": families.Family("fam", "kwarm_budget_family", "t")}
    monkeypatch.setattr(warmup, "FAMILIES", registry)
    monkeypatch.setattr(families, "FAMILIES", registry)
    monkeypatch.setattr(monitor, "capture", capture)
    kwarm_env()
    view = warmup.engine.build(stand_in_worker())
    try:
        budget.begin(("seconds", 0.5))
        warmup._run_family("fam", view, config.get())
        assert budget.left() < 0.25, "no compile: its 0.3 s spent the budget"
        compiled.append(monitor.Compiled("m", "k", "key"))
        budget.begin(("seconds", 0.5))
        result = warmup._run_family("fam", view, config.get())
        assert result.compiled and budget.left() > 0.45, "a compiling family's time is given back"
        # twenty in 0.3 s (15 ms each): loaded from Triton's disk cache, a warm restart: charged
        compiled.extend([monitor.Compiled("m", "k", f"key{i}") for i in range(19)])
        budget.begin(("seconds", 0.5))
        result = warmup._run_family("fam", view, config.get())
        assert len(result.compiled) == 20 and budget.left() < 0.25, "loads are not compiles"
        budget.begin(("unlimited", None))
        budget.credit(5.0)
        assert budget.left() == float("inf")
        # auto: credits stop at 14% of the time before warmup (the cold bound is 15% of vLLM's start)
        monkeypatch.setattr(budget, "process_age_s", lambda: 100.0)
        budget.begin(("percent", 8.0))
        budget.credit(30.0)
        assert 13.5 < budget.left() <= 14.0
        # past the limit (compiles that took longer than it), optional work keeps the floor
        monkeypatch.setattr(budget, "process_age_s", lambda: 10.0)
        budget.begin(("percent", 8.0))
        assert budget.left() <= budget.FLOOR_S
        clock.sleep(0.3)  # the limit (1.4 s from begin: 14% of 10 s) is now 1.1 s away
        budget._deadline -= 2.0  # a compiling family's 2 s, stood in for: the budget is spent
        assert budget.left() < 0
        budget.credit(2.3)
        assert budget.FLOOR_S - 0.1 < budget.left() <= budget.FLOOR_S, "the floor from now, past the limit"
        budget.begin(("seconds", 2.0))
        budget.credit(30.0)
        assert budget.left() > 31, "an explicit number of seconds: every credit"
    finally:
        budget.reset()


def test_process_age_is_this_process():
    """The age of the process that asks, not of the machine or a parent (issue 59: any age under a
    day passed): a child asks after 1.5 s of its own life."""
    code = "import time; time.sleep(1.5); from kwarm_ext import budget; print(budget.process_age_s())"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    lived = time.monotonic() - t0
    age = float(proc.stdout.strip().splitlines()[-1])
    assert 1.4 <= age <= lived + 0.1, (age, lived)  # /proc's clock ticks are 10 ms
    mine = budget.process_age_s()
    assert mine is not None and mine > lived, "this test process started before the child"


# ---------------------------------------------------------------------------- learned step sizes

STAMP = Stamp(triton="3.6.0", arch="cuda:90", torch="2.11.0", vllm="0.24.0", tp_size=1, model="m")


class Runner:
    """STAND-IN for vLLM's GPU model runner (it needs a GPU): only ``execute_model``."""

    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.calls.append((scheduler_output, intermediate_tensors))
        return "output"


def test_steps_are_recorded_and_the_runner_still_runs():
    runner, recorder = Runner(), learn.Recorder(("vllm.",))
    assert learn.record_steps(runner, recorder)
    assert not learn.record_steps(runner, recorder), "wrapped once"
    for n in (7, 1332, 7, None, 0, "x"):
        out = runner.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=n), intermediate_tensors=1)
        assert out == "output"
    assert len(runner.calls) == 6 and runner.calls[0][1] == 1
    assert recorder.take_unsaved_counts() == [7, 1332] and recorder.take_unsaved_counts() == []
    assert learn.record_steps(object(), recorder) is False, "no execute_model: nothing recorded"


def test_step_sizes_are_merged_bounded_and_survive_a_round_trip(tmp_path):
    path = str(tmp_path / "m.json")
    assert manifest_files.save(path, STAMP, token_counts=[604, 1332]).added == 2
    assert manifest_files.save(path, STAMP, token_counts=[1332, 37]).added == 1
    assert sorted(manifest_files.load(path).token_counts) == [37, 604, 1332]
    full = manifest.Manifest(STAMP)
    full.merge(token_counts=range(1, manifest.MAX_TOKEN_COUNTS + 100))
    assert len(full.token_counts) == manifest.MAX_TOKEN_COUNTS


@pytest.mark.parametrize("raw, kept", [
    ([5, -1, 0, 2 ** 30, "7", 7.0, True, 9], [5, 9]),
    ("not a list", []),
])
def test_bad_step_sizes_are_dropped_with_one_problem(raw, kept):
    text = manifest_files._dumps({**manifest.Manifest(STAMP).as_json(), "token_counts": raw})
    parsed = manifest.parse(text)
    assert parsed.token_counts == kept
    assert [label for label, _ in parsed.problems] == ["token_counts"]
