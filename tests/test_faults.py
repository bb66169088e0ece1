"""Fail-open: whatever kwarm's warmup raises, vLLM's kernel_warmup result comes back and one
warning names the step; KWARM_STRICT=1 lets the error through.

A real vLLM Worker needs a GPU, so these tests hand the hook a stand-in worker carrying the
attributes the engine view reads; the hook itself is the real wrapper around the real
``vllm.v1.worker.gpu_worker`` attribute.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import types

import pytest

from conftest import require
from kwarm_ext import families, patches, warmup

gpu_worker = require("vllm.v1.worker.gpu_worker")


class _Group:
    def __init__(self, name):
        self.backend = types.SimpleNamespace(get_name=lambda: name)


def stand_in_worker(**runner_overrides):
    runner = types.SimpleNamespace(
        attn_groups=[[_Group("GDN_ATTN")], [_Group("TRITON_ATTN")]],
        compilation_config=types.SimpleNamespace(static_forward_context={}, cudagraph_mode=None),
        device="cpu", max_num_reqs=16, is_pooling_model=False)
    for k, v in runner_overrides.items():
        if v is None:
            delattr(runner, k)
        else:
            setattr(runner, k, v)
    model_config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(model_type="qwen3_next"),
                                         hf_config=types.SimpleNamespace(architectures=["Qwen3NextForCausalLM"]),
                                         enforce_eager=False)
    vllm_config = types.SimpleNamespace(model_config=model_config,
                                        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2048),
                                        parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    return types.SimpleNamespace(model_runner=runner, vllm_config=vllm_config)


@pytest.fixture
def hooked(monkeypatch, kwarm_env):
    """gpu_worker.kernel_warmup = kwarm's wrapper around a stand-in original."""
    patches.unpatch(gpu_worker)
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker: "vllm-result")
    patches.patch(gpu_worker)
    yield kwarm_env
    patches.unpatch(gpu_worker)


@pytest.fixture
def test_family(monkeypatch):
    """Replace the registry with one family whose behaviour each test sets."""
    module = types.ModuleType("kwarm_test_family")
    module.applies = lambda view: None
    module.plan = lambda view, forced: [families.Step("ok", "k_ok", run=lambda: ["v1"]),
                                        families.Step("boom", "k_boom", run=module.boom)]
    module.boom = lambda: ["v"]
    monkeypatch.setitem(sys.modules, "kwarm_test_family", module)
    registry = {"testfam": families.Family("testfam", "kwarm_test_family", "t")}
    monkeypatch.setattr(warmup, "FAMILIES", registry)
    monkeypatch.setattr(families, "FAMILIES", registry)  # what KWARM_WARMUPS is checked against
    return module


def test_clean_run_reports_steps(hooked, test_family, kwarm_log, tmp_path):
    report = tmp_path / "r.json"
    hooked(KWARM_REPORT=str(report), KWARM_LOG_LEVEL="DEBUG")  # the detail line is DEBUG's
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    assert kwarm_log.messages() == []
    data = json.loads(report.read_text())
    fam = data["families"][0]
    assert fam["status"] == "ran" and [s["status"] for s in fam["steps"]] == ["ran", "ran"]
    assert data["view"]["model_type"] == "qwen3_next"
    assert data["view"]["backends"] == [["GDN_ATTN"], ["TRITON_ATTN"]]
    summary = [m for m in kwarm_log.messages(0) if "warmup done" in m]
    assert len(summary) == 1 and "ran testfam;" in summary[0] and summary[0] == data["summary"]
    detail = details_of(kwarm_log)
    assert len(detail) == 1 and "testfam" in detail[0] and "2 kernels" in detail[0]
    assert detail[0] == f"kwarm: warmup detail on rank 0: {data['detail']}" and data["left_to_requests"] == []


def test_a_summary_steps_labels_are_the_familys_summary_text(hooked, test_family, kwarm_log):
    test_family.plan = lambda view, forced: [
        families.Step("ok", "k_ok", run=lambda: ["v1"]),
        families.Step("s", "k_s", run=lambda: ["89 kernels new", "on 15 processes"], summary=True),
        families.Step("s2", "k_s2", run=lambda: ["never shown"], summary=True, skip="not here")]
    hooked(KWARM_LOG_LEVEL="DEBUG")
    gpu_worker.kernel_warmup(stand_in_worker())
    summary = details_of(kwarm_log)
    assert len(summary) == 1 and "testfam " in summary[0]
    assert summary[0].split("testfam ", 1)[1].split(": ", 1)[1].startswith("89 kernels new; on 15 processes;")


def details_of(kwarm_log) -> list:
    """The per-family detail lines (DEBUG) of the records."""
    return [r.getMessage() for r in kwarm_log.records
            if r.getMessage().startswith("kwarm: warmup detail on rank ") and r.levelno == logging.DEBUG]


def test_the_summary_line_is_short_and_counts_what_ran(hooked, kwarm_log, tmp_path, monkeypatch):
    """One short INFO line: the families that ran, the skipped and failed counts, the compiles, the
    longest family, what was left to the requests and the report; the per-family detail on DEBUG;
    the report has the line, the detail and what was left, item by item."""
    import time

    from kwarm_ext import monitor, surfaces

    built = []  # the compile callbacks of the surface watched now (the monitor's, in a step)

    class Surface:
        label = "stand-in surface"

        def watch(self, on_built):
            built.append(on_built)
            return lambda: built.remove(on_built)

    def compiles(n):
        for i in range(n):
            built[-1](monitor.Compiled("m", f"m.kernel_{i}", f"key{i}"))
        return [f"{n} compiled"]

    monkeypatch.setattr(surfaces, "every", lambda: [Surface()])
    plans = {
        "slow": lambda view, forced: [families.Step("a", "k_a", run=lambda: compiles(2)),
                                      families.Step("b", "k_b", run=lambda: time.sleep(0.2) or ["b"])],
        "fast": lambda view, forced: [families.Step("c", "k_c", run=lambda: compiles(1)),
                                      families.Step("d", "k_d", run=lambda: 1 / 0),
                                      families.Step("e", "k_e", skip="upstream runs it")],
        "gemms": lambda view, forced: families.Plan(
            [families.Step("fill", "k_f", run=lambda: ["f"])],
            lambda: {"summary": "fill 3 problems (340 left to the requests: KWARM_BUDGET)", "left_to_requests": [
                {"step": "fill", "count": 340, "what": "GEMM problems", "why": "KWARM_BUDGET"}]}),
        "elsewhere": None, "broken": lambda view, forced: {}["no plan"], "off": None}
    registry = {}
    for name, plan in plans.items():
        module = types.ModuleType(f"kwarm_test_{name}")
        module.applies = (lambda view: "not this model") if name == "elsewhere" else (lambda view: None)
        module.plan = plan
        monkeypatch.setitem(sys.modules, module.__name__, module)
        registry[name] = families.Family(name, module.__name__, name)
    monkeypatch.setattr(warmup, "FAMILIES", registry)
    monkeypatch.setattr(families, "FAMILIES", registry)
    report = tmp_path / "r.json"
    hooked(KWARM_REPORT=str(report), KWARM_WARMUPS="-off", KWARM_BUDGET="600", KWARM_LOG_LEVEL="DEBUG")
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"

    data = json.loads(report.read_text())
    done = [r for r in kwarm_log.records if "warmup done" in r.getMessage()]
    assert len(done) == 1 and done[0].levelno == logging.INFO
    line = done[0].getMessage()
    slow = next(f for f in data["families"] if f["name"] == "slow")
    assert line == (f"kwarm: warmup done in {data['total_s']:.2f} s on rank 0 (budget 600 s): ran slow, fast, gemms; "
                    f"2 skipped; 1 failed; 3 compiled; largest slow {slow['seconds']:.1f} s; left to requests: "
                    f"1 failed steps, 340 GEMM problems; report {report}"), line
    assert len(line) - len(str(report)) < 200
    assert data["summary"] == line
    assert data["left_to_requests"] == [
        {"family": "fast", "step": "d", "count": 1, "what": "failed steps",
         "why": "ZeroDivisionError: division by zero"},
        {"family": "gemms", "step": "fill", "count": 340, "what": "GEMM problems", "why": "KWARM_BUDGET"},
        {"family": "broken", "count": 1, "what": "failed families", "why": "KeyError: 'no plan'"}]
    # the detail: every family's own text, as the one long line had it
    detail = details_of(kwarm_log)
    assert detail == [f"kwarm: warmup detail on rank 0: {data['detail']}"]
    for text in ("budget 600 s; ran slow ", "2 kernels, 2 variants, 2 compiled", "1 steps skipped (upstream runs it); "
                 "1 steps failed", "gemms ", "fill 3 problems (340 left to the requests: KWARM_BUDGET)",
                 "skipped elsewhere (not this model), off (disabled by KWARM_WARMUPS); failed broken (KeyError"):
        assert text in data["detail"], (text, data["detail"])
    assert kwarm_log.messages() == ["kwarm: warmup step fast.d failed, skipped: ZeroDivisionError: division by zero",
                                    "kwarm: warmup family broken (plan) failed, skipped: KeyError: 'no plan'"]


def test_no_report_no_path_and_no_view_is_left_to_the_requests(hooked, test_family, kwarm_log, monkeypatch):
    """Without KWARM_REPORT the line names no report; a warmup without an engine view leaves its
    families to the requests."""
    from kwarm_ext import engine

    monkeypatch.setattr(engine, "build", lambda worker: 1 / 0)
    hooked()
    report = warmup.run(stand_in_worker())
    line = [m for m in kwarm_log.messages(0) if "warmup done" in m]
    assert line == [report["summary"]] and "report" not in line[0].split("): ", 1)[1]
    assert line[0].endswith("): ran -; 1 skipped; 0 failed; 0 compiled")
    assert report["left_to_requests"] == [{"family": "testfam", "count": 1, "what": "skipped families",
                                           "why": "no engine view"}]


def test_raising_step_is_isolated(hooked, test_family, kwarm_log, tmp_path):
    def boom():
        raise RuntimeError("kernel exploded")

    test_family.boom = boom
    report = tmp_path / "r.json"
    hooked(KWARM_REPORT=str(report))
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    assert kwarm_log.messages() == ["kwarm: warmup step testfam.boom failed, skipped: RuntimeError: kernel exploded"]
    steps = json.loads(report.read_text())["families"][0]["steps"]
    assert [s["status"] for s in steps] == ["ran", "failed"]  # the other step still ran


def test_raising_step_propagates_under_strict(hooked, test_family):
    def boom():
        raise RuntimeError("kernel exploded")

    test_family.boom = boom
    hooked(KWARM_STRICT="1")
    with pytest.raises(RuntimeError, match="kernel exploded"):
        gpu_worker.kernel_warmup(stand_in_worker())


class _Exploding:
    @property
    def model_runner(self):
        raise RuntimeError("runner unavailable")


def test_engine_view_read_that_raises(hooked, test_family, kwarm_log):
    assert gpu_worker.kernel_warmup(_Exploding()) == "vllm-result"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1
    assert warnings[0].startswith("kwarm: engine view incomplete, families may skip: missing model_runner "
                                  "(RuntimeError: runner unavailable)")


def test_engine_view_build_that_raises(hooked, test_family, kwarm_log, monkeypatch):
    from kwarm_ext import engine

    monkeypatch.setattr(engine, "build", lambda worker: 1 / 0)
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    assert kwarm_log.messages() == ["kwarm: engine view failed, skipped: ZeroDivisionError: division by zero"]


def test_missing_runner_attribute_is_recorded_not_raised(hooked, test_family, kwarm_log, tmp_path):
    report = tmp_path / "r.json"
    hooked(KWARM_REPORT=str(report))
    worker = stand_in_worker(compilation_config=None)
    worker.vllm_config.compilation_config = types.SimpleNamespace()  # no static_forward_context either
    assert gpu_worker.kernel_warmup(worker) == "vllm-result"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and "static_forward_context" in warnings[0]
    view = json.loads(report.read_text())["view"]
    assert "static_forward_context" in view["missing"] and view["layers"] == {}


def test_family_applies_that_raises(hooked, test_family, kwarm_log):
    test_family.applies = lambda view: view.nope
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and warnings[0].startswith("kwarm: warmup family testfam (applies) failed")


def test_disabled_family_is_skipped_with_reason(hooked, test_family, kwarm_log, tmp_path):
    report = tmp_path / "r.json"
    hooked(KWARM_WARMUPS="-testfam", KWARM_REPORT=str(report))
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    fam = json.loads(report.read_text())["families"][0]
    assert (fam["status"], fam["reason"], fam["steps"]) == ("skipped", "disabled by KWARM_WARMUPS", [])
    assert kwarm_log.messages() == []


def test_unwritable_report_is_one_warning(hooked, test_family, kwarm_log, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    hooked(KWARM_REPORT=str(blocker / "sub" / "r.json"))
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    warnings = kwarm_log.messages()
    # said as the settings load: a folder that cannot be created (a file stands in its way)
    assert len(warnings) == 1 and "is invalid (its folder" in warnings[0] and "no report is written" in warnings[0]


def test_a_report_that_fails_to_write_is_one_warning(hooked, test_family, kwarm_log, tmp_path):
    """A report path the settings accept but the write refuses (a link planted there): one warning."""
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "r.json").symlink_to(tmp_path / "elsewhere.json")
    hooked(KWARM_REPORT=str(folder / "r.json"))
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and warnings[0].startswith("kwarm: report failed, skipped")
    assert not (tmp_path / "elsewhere.json").exists()


def test_long_warmups_log_their_start_and_progress(hooked, test_family, kwarm_log, monkeypatch):
    """A line as each family starts (what it will run), and one every PROGRESS_EVERY_S inside it."""
    import time

    monkeypatch.setattr(warmup, "PROGRESS_EVERY_S", 0.05)
    test_family.boom = lambda: time.sleep(0.3) or ["v"]
    hooked()
    gpu_worker.kernel_warmup(stand_in_worker())
    info = kwarm_log.messages(0)
    assert "kwarm: testfam: 2 of 2 steps to run (ok, boom)" in info
    beats = [m for m in info if m.startswith("kwarm: testfam: still warming (step boom, ")]
    assert 2 <= len(beats) <= 10, info
    assert info.index("kwarm: testfam: 2 of 2 steps to run (ok, boom)") < info.index(beats[0])
    n = len(beats)
    time.sleep(0.2)
    assert len([m for m in kwarm_log.messages(0) if "still warming" in m]) == n, "silent once the family is done"
