"""Fail-open: whatever kwarm's warmup raises, vLLM's kernel_warmup result comes back and one
warning names the step; KWARM_STRICT=1 lets the error through.

A real vLLM Worker needs a GPU, so these tests hand the hook a stand-in worker carrying the
attributes the engine view reads; the hook itself is the real wrapper around the real
``vllm.v1.worker.gpu_worker`` attribute.
"""
from __future__ import annotations

import json
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
    hooked(KWARM_REPORT=str(report))
    assert gpu_worker.kernel_warmup(stand_in_worker()) == "vllm-result"
    assert kwarm_log.messages() == []
    data = json.loads(report.read_text())
    fam = data["families"][0]
    assert fam["status"] == "ran" and [s["status"] for s in fam["steps"]] == ["ran", "ran"]
    assert data["view"]["model_type"] == "qwen3_next"
    assert data["view"]["backends"] == [["GDN_ATTN"], ["TRITON_ATTN"]]
    summary = [m for m in kwarm_log.messages(0) if "warmup done" in m]
    assert len(summary) == 1 and "testfam" in summary[0] and "2 kernels" in summary[0]


def test_a_summary_steps_labels_are_the_familys_summary_text(hooked, test_family, kwarm_log):
    test_family.plan = lambda view, forced: [
        families.Step("ok", "k_ok", run=lambda: ["v1"]),
        families.Step("s", "k_s", run=lambda: ["89 kernels new", "on 15 processes"], summary=True),
        families.Step("s2", "k_s2", run=lambda: ["never shown"], summary=True, skip="not here")]
    hooked()
    gpu_worker.kernel_warmup(stand_in_worker())
    summary = [m for m in kwarm_log.messages(0) if "warmup done" in m]
    assert len(summary) == 1 and "testfam " in summary[0]
    assert summary[0].split("testfam ", 1)[1].split(": ", 1)[1].startswith("89 kernels new; on 15 processes;")


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
