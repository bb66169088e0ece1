"""The engine benchmark's CPU-side code: table rendering on a recorded result
(tests/fixtures/bench_result.json: tiny Qwen3-Next, vLLM 0.24.0, kwarm off, cold cache,
the smoke scenario, numbers from the first measured baseline), argument parsing,
scenario construction and environment set-up. No GPU, no engine."""
from __future__ import annotations

import copy
import cProfile
import fcntl
import json
import os
import pstats
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
FIXTURE = REPO / "tests" / "fixtures" / "bench_result.json"
sys.path.insert(0, str(BENCH))

import chart  # noqa: E402
import engine_bench  # noqa: E402
import table  # noqa: E402

ROW_OFF = ("| 0.24.0 | off | cold | 127 | — | 3.13 (8), 0.038, 1.15 (3), 0.039, 1.08 (3) | 14 | 4203 | 82.4 |")


@pytest.fixture
def run():
    (loaded,) = table.load([FIXTURE])
    return loaded


def kwarm_on_run(run: dict) -> dict:
    """The fixture as a warm kwarm-on run of a kwarm without triton_attn: the qwen_gdn, runner and
    fused_moe compiles are gone, the attention kernel's are left."""
    on = copy.deepcopy(run)
    on["kwarm"], on["cache"]["label"] = "on", "warm"
    on["init_s"], on["kwarm_warmup_s"] = 31.2, 8.7
    for r in on["requests"]:
        r["kernels"] = [k for k in r["kernels"] if table.owner(k["name"]) in ("triton_attn", table.LEARN_AND_REPLAY)]
        r["jit"] = len(r["kernels"])
    on["requests"][0]["s"] = 0.29
    report = {"total_s": 8.7, "rank": 0, "pid": 1, "view": {"x": 1}, "families": [
        {"name": "runner", "status": "ran", "reason": None, "seconds": 0.6, "compiled": [{}] * 4,
         "steps": [{"status": "ran"}, {"status": "ran"}]},
        {"name": "qwen_gdn", "status": "ran", "reason": None, "seconds": 8.0, "compiled": [{}] * 9,
         "steps": [{"status": "ran"}] * 5 + [{"status": "skipped"}]},
        {"name": "dsa_indexer", "status": "skipped", "reason": "no DSA indexer layer", "seconds": 0.0,
         "compiled": [], "steps": []},
    ]}
    on["kwarm_report_summary"] = table.summarize_report(report)
    return on


# ----------------------------------------------------------------------------- table

def test_fixture_row_ratio_and_totals(run):
    text = table.render([run])
    assert ROW_OFF in text
    assert "### tiny-qwen3-next (scenario `smoke`)" in text
    assert "Requests: 0 1x200; 1 1x200 (repeat); 2 4x333; 3 4x333 (repeat); 4 1x37." in text
    assert table.total_jit(run) == 14
    assert table.pairs(run) == [(0, 1), (2, 3)]
    assert table.first_steady_ratio(run) == pytest.approx(3.1302 / 0.038)
    assert table.pair_ratio(run, 2) == pytest.approx(1.1498 / 0.0391)
    assert table.pair_ratio(run, 4) is None  # 1x37 has no repeat


def test_first_steady_counters(run):
    assert table.first_steady_counters(run) == {}  # older results have no "host"
    run["requests"][0]["host"] = {"cycles": 300, "instructions": 220, "steal_ms": 0.0}
    run["requests"][1]["host"] = {"cycles": 200, "instructions": 200, "steal_ms": 0.0}
    assert table.first_steady_counters(run) == {"cycles": 1.5, "instructions": 1.1}
    del run["requests"][1]["host"]["cycles"]  # a host without hardware counters
    assert table.first_steady_counters(run) == {"instructions": 1.1}


def test_ratio_and_totals_come_from_the_requests(run):
    run["first_steady_ratio"], run["total_jit"] = 999.0, 999
    run["requests"][1]["s"] = 0.5
    row = table.render_table([run]).splitlines()[-1]
    assert row.endswith("| 14 | 3741 | 6.26 |")  # excess (3.1302 - 0.5) + (1.1498 - 0.0391); 3.1302 / 0.5


def test_a_profiled_first_request_marks_first_steady(run):
    assert not table.first_steady_profiled(run)
    assert table.first_steady_cell(run) == "82.4"
    run["requests"][1]["profiled"] = True  # the repeat under cProfile or the allocator's recording
    assert table.first_steady_profiled(run)
    assert table.render_table([run]).splitlines()[-1].endswith("| 82.4 (profiled) |")
    assert "| 82.4 (profiled) | — | 14 |" in table.render_start_cost([run])
    del run["requests"][1]["profiled"]
    run["requests"][2]["profiled"] = True  # another pair's: the headline is untouched
    assert table.first_steady_cell(run) == "82.4"


def test_ownership_mapping(run):
    assert table.owner("_causal_conv1d_fwd_kernel") == "qwen_gdn"
    assert table.owner("layer_norm_fwd_kernel") == "qwen_gdn"
    assert table.owner("fused_recurrent_gated_delta_rule_packed_decode_kernel") == "qwen_gdn"
    assert table.owner("_zero_kv_blocks_kernel") == "runner"
    assert table.owner("vllm.v1.worker.block_table._compute_slot_mapping_kernel") == "runner"
    assert table.owner("_build_prefill_chunk_metadata_kernel") == "dsa_indexer"
    assert table.owner("_convert_req_index_to_global_index_kernel") == "dsa_indexer"
    assert table.owner("BuildPrefillChunkMetadataKernel.kernel") == "dsa_indexer"  # vLLM 0.33's name
    assert table.owner("SomeOtherKernel.kernel") == "learn-and-replay"
    assert table.owner("fused_moe_kernel") == "fused_moe"
    assert table.owner("kernel_unified_attention") == "triton_attn"
    assert table.owner("some_kernel_no_family_declares") == "learn-and-replay"
    assert table.owner_counts(run) == {"qwen_gdn": 2, "runner": 4, "fused_moe": 6, "triton_attn": 2}

    text = table.render([run])
    assert "14 compiles (fused_moe 6, qwen_gdn 2, runner 4, triton_attn 2)" in text
    assert "  - req 0 `_causal_conv1d_fwd_kernel` → qwen_gdn: key `((('*bf16', 'D')" in text
    assert "  - req 4 `_zero_kv_blocks_kernel` → runner: key `" in text
    assert text.count("`fused_moe_kernel` → fused_moe") == 6
    short = table.render([run], keys=False)
    assert "key `" not in short
    assert "  - req 0 `_compute_slot_mapping_kernel` ×2 → runner" in short
    assert "  - req 2 `kernel_unified_attention` → triton_attn" in short


def test_several_runs_one_table(run, tmp_path, capsys):
    on = kwarm_on_run(run)
    (tmp_path / "on.json").write_text(json.dumps(on))
    (tmp_path / "off.json").write_text(FIXTURE.read_text())
    (tmp_path / "x.kwarm-report.json").write_text(json.dumps({"total_s": 1.0, "families": []}))
    assert table.main([str(tmp_path / "on.json"), str(tmp_path / "off.json"),
                       str(tmp_path / "x.kwarm-report.json")]) == 0
    out = capsys.readouterr()
    assert "not an engine_bench result" in out.err
    rows = [line for line in out.out.splitlines() if line.startswith("| 0.24.0")]
    assert rows[0] == ROW_OFF  # off before on
    assert rows[1] == "| 0.24.0 | on | warm | 31 | 8.70 | 0.290 (1), 0.038, 1.15 (1), 0.039, 1.08 | 2 | 1363 | 7.63 |"
    assert out.out.count("### tiny-qwen3-next") == 1
    assert ("warmup 8.70 s: runner ran 0.600 s, 2/2 steps, 4 compiled; qwen_gdn ran 8.00 s, 5/6 steps, "
            "9 compiled; dsa_indexer skipped (no DSA indexer layer)") in out.out
    assert "kwarm on · warm Triton cache**: 2 compiles (triton_attn 2)" in out.out


def test_kwarm_on_without_report_is_flagged(run):
    on = kwarm_on_run(run)
    on["kwarm_report_summary"], on["kwarm_warmup_s"] = None, None
    text = table.render([on])
    assert "no kwarm report (the warmup hook did not run?)" in text
    assert "| 0.24.0 | on | warm | 31 | — |" in text


def test_cut_short_run(run):
    run["complete"] = False
    del run["requests"][2:]
    row = table.render_table([run]).splitlines()[-1]
    assert row == "| 0.24.0 | off | cold | 127 | — | 3.13 (8), 0.038, cut short | 8 | 3092 | 82.4 |"
    run["requests"].clear()
    assert "| — | cut short | 0 | — | — |" in table.render([run])


def test_a_start_timeout_ends_is_recorded_as_not_done(run, tmp_path):
    # gpu_run.sh's `timeout` sends SIGTERM; a start that outlasted its call says how long it ran
    out = tmp_path / "cut.json"
    cut = {key: run[key] for key in ("schema", "model", "scenario", "versions", "kwarm", "cache")}
    cut.update(init_s=None, requests=[], complete=False)
    script = (f"import functools, os, signal, sys, time; sys.path.insert(0, {str(BENCH)!r}); import engine_bench; "
              f"cut = {cut!r}; cut['init_s'] = None; "
              f"signal.signal(signal.SIGTERM, functools.partial(engine_bench.init_cut, "
              f"engine_bench.Path({str(out)!r}), cut, time.perf_counter() - 536.2)); "
              f"os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + 15, done.stderr
    assert "ended before init was done (536." in done.stdout
    (loaded,) = table.load([out])
    assert loaded["init_cut_s"] >= 536.2 and loaded["init_s"] is None
    assert table.render_table([loaded]).splitlines()[-1].startswith("| 0.24.0 | off | cold | not done at 536 | — |")
    loaded["kwarm"] = "on"
    assert "ended before init was done, at 536 s" in table.render([loaded])


def test_summarize_report_counts_steps():
    summary = table.summarize_report({"total_s": 2.5, "rank": 0, "families": [
        {"name": "runner", "status": "ran", "seconds": 1.0, "compiled": [{}, {}],
         "steps": [{"status": "ran"}, {"status": "failed"}, {"status": "skipped"}]}]})
    assert summary["total_s"] == 2.5 and summary["compiled"] == 2
    assert summary["families"][0] == {"name": "runner", "status": "ran", "reason": None, "seconds": 1.0,
                                      "steps": 3, "steps_ran": 1, "steps_skipped": 1, "steps_failed": 1,
                                      "compiled": 2, "memory": {}}
    assert summary["memory"] is None and summary["memory_bound"] is None
    assert summary["line"] is None and summary["left_to_requests"] == [], "a report from before the short line"
    assert table.summarize_report(None) is None
    left = {"family": "eager_gemm", "step": "fill", "count": 340, "what": "GEMM problems", "why": "KWARM_BUDGET"}
    short = table.summarize_report({"summary": "kwarm: warmup done in 2.50 s on rank 0 (budget 1.5 s): ran -",
                                    "families": [], "left_to_requests": [left],
                                    "after_capture": {"families": [], "left_to_requests": []}})
    assert short["line"].startswith("kwarm: warmup done in 2.50 s") and short["left_to_requests"] == [left]
    measured = table.summarize_report({"memory_summary": "bound 4.00 GiB", "memory": {"headroom": 4 << 30},
                                       "families": [{"name": "sampler", "memory": {"step": "logprobs"}}],
                                       "after_capture": {"memory_summary": "after: bound 3.00 GiB", "families": []}})
    assert measured["memory"] == "bound 4.00 GiB; after: bound 3.00 GiB"
    assert measured["families"][0]["memory"] == {"step": "logprobs"} and measured["memory_bound"]["headroom"] == 4 << 30

    report = {"families": [], "after_capture": {"families": [
        {"name": "caching_allocator", "status": "ran", "seconds": 0.01, "steps": [{"status": "ran"}]}]}}
    assert [f["name"] for f in table.summarize_report(report)["families"]] == ["caching_allocator (after capture)"]


def test_fmt_s_like_the_baseline():
    assert [table.fmt_s(x) for x in (127.04, 26.2, 3.1302, 0.4141, 0.038)] == ["127", "26", "3.13", "0.414", "0.038"]
    assert table.fmt_s(None) == "—"


def test_excess_comes_from_the_requests(run):
    run["excess_s"], run["excess_pairs"] = 999.0, []  # stored values are not trusted
    assert table.excess_pairs(run) == [
        {"first": 0, "repeat": 1, "first_s": 3.1302, "repeat_s": 0.038, "excess_s": 3.0922},
        {"first": 2, "repeat": 3, "first_s": 1.1498, "repeat_s": 0.0391, "excess_s": 1.1107}]
    assert table.excess_s(run) == pytest.approx(4.2029)
    run["requests"][3]["s"] = 1.2  # a repeat slower than its first counts against the excess
    assert table.excess_s(run) == pytest.approx(3.0922 - 0.0502)
    assert table.render_table([run]).splitlines()[-1].endswith("| 14 | 3042 | 82.4 |")
    for r in run["requests"]:
        r["repeat_of"] = None
    assert table.excess_pairs(run) == [] and table.excess_s(run) is None
    assert [table.fmt_ms(x) for x in (4.2029, 0.0123, -0.0004, None)] == ["4203", "12.3", "-0.4", "—"]


def test_several_repeats_give_a_median_steady_time_and_the_excess_a_noise_estimate(run):
    """Three repeats of request 0 (times 1, 3, 2) and of request 2: steady is their median,
    the spread their sample deviation, and the excess's noise sqrt(sum spread^2 (1 + 1/k))."""
    requests = [dict(run["requests"][0], i=0, s=5.0, repeat_of=None)]
    requests += [dict(run["requests"][1], i=1 + k, s=s, repeat_of=0) for k, s in enumerate((1.0, 3.0, 2.0))]
    requests += [dict(run["requests"][2], i=4, s=0.5, repeat_of=None)]
    requests += [dict(run["requests"][3], i=5 + k, s=s, repeat_of=4) for k, s in enumerate((0.4, 0.6, 0.5))]
    requests += [dict(run["requests"][4], i=8, s=2.6, repeat_of=None, control_of=0)]
    run["requests"] = requests
    assert table.steady_s(run, 0) == 2.0 and table.spread_s(run, 0) == pytest.approx(1.0)
    assert table.pair_ratio(run, 0) == table.first_steady_ratio(run) == 2.5
    assert table.control_ratio(run) == pytest.approx(1.3)
    assert table.excess_pairs(run) == [
        {"first": 0, "repeat": 1, "first_s": 5.0, "repeat_s": 2.0, "excess_s": 3.0, "repeats": 3, "spread_s": 1.0},
        {"first": 4, "repeat": 5, "first_s": 0.5, "repeat_s": 0.5, "excess_s": 0.0, "repeats": 3, "spread_s": 0.1}]
    assert table.excess_s(run) == 3.0
    noise = (4 / 3 * (1.0 ** 2 + 0.1 ** 2)) ** 0.5
    assert table.excess_noise_s(run) == pytest.approx(noise, abs=1e-4)
    assert table.excess_cell(run) == f"3000 ± {noise * 1e3:.0f}"
    assert f"| {table.excess_cell(run)} | 2.50 | 1.30 |" in table.render_start_cost([run])
    run["requests"] = requests[:6] + requests[8:]  # request 4 with one repeat: no noise estimate
    assert table.excess_noise_s(run) is None and table.excess_cell(run) == "3100"
    assert "repeats" not in table.excess_pairs(run)[1]


REPORT_WITH_PHASES = {"total_s": 3.0, "families": [
    {"name": "eager_gemm", "status": "ran", "seconds": 1.2, "steps": []},
    {"name": "runner", "status": "ran", "seconds": 0.05, "steps": []},
    {"name": "qwen_gdn", "status": "skipped", "seconds": 0.0, "reason": "not GDN", "steps": []},
    {"name": "fused_moe", "status": "failed", "seconds": 0.7, "steps": []},
    {"name": "dummy_runs", "status": "ran", "seconds": 0.4, "steps": []}],
    "after_capture": {"families": [
        {"name": "caching_allocator", "status": "ran", "seconds": 0.01, "steps": []},
        {"name": "runner", "status": "ran", "seconds": 0.1, "steps": []}]}}


def test_family_seconds_only_ran_and_both_phases():
    fams = table.family_seconds(REPORT_WITH_PHASES)
    assert fams == {"eager_gemm": 1.2, "dummy_runs": 0.4, "runner": 0.15, "caching_allocator": 0.01}
    assert list(fams) == ["eager_gemm", "dummy_runs", "runner", "caching_allocator"]  # costliest first
    assert table.family_seconds(None) == {} and table.family_seconds({"total_s": 1}) == {}


def test_run_family_seconds_from_report_summary_or_stored(run):
    assert table.run_family_seconds(run) == {}  # kwarm off
    on = kwarm_on_run(run)
    assert table.run_family_seconds(on) == {"qwen_gdn": 8.0, "runner": 0.6}  # from the summary
    on["kwarm_report"] = REPORT_WITH_PHASES  # the raw report wins over the summary
    assert table.run_family_seconds(on)["runner"] == 0.15
    on["kwarm_report_summary"] = table.summarize_report(REPORT_WITH_PHASES)
    del on["kwarm_report"]  # the summary's " (after capture)" names fold into the family
    assert table.run_family_seconds(on) == table.family_seconds(REPORT_WITH_PHASES)
    on["kwarm_report_summary"], on["kwarm_family_s"] = None, {"fused_moe": 2.0}
    assert table.run_family_seconds(on) == {"fused_moe": 2.0}


def test_start_cost_section(run, tmp_path, capsys):
    on = kwarm_on_run(run)
    replay = kwarm_on_run(run)
    replay["variant"], replay["cache"]["label"], replay["init_s"] = "replay", "cold", 40.0
    replay["kwarm_report"] = REPORT_WITH_PHASES
    replay["requests"][4]["deepgemm_new"] = 2
    text = table.render_start_cost([replay, on, run])
    lines = text.splitlines()
    assert lines[0] == "## Start cost and first-request excess"
    assert "### Start cost: tiny-qwen3-next" in lines
    rows = [line for line in lines if line.startswith("| vLLM")]
    assert rows == [
        "| vLLM 0.24.0 · kwarm off · cold Triton cache | 127 | — | — | 4203 | 82.4 | — | 14 |",
        "| vLLM 0.24.0 · kwarm on · warm Triton cache | 31 | 8.70 | qwen_gdn 8.00, runner 0.600 | 1363 | 7.63 | — | 2 |",
        "| vLLM 0.24.0 · kwarm on (replay) · cold Triton cache | 40 | 8.70 "
        "| eager_gemm 1.20, dummy_runs 0.400, runner 0.150, +1 more | 1363 | 7.63 | — | 2 + 2 DeepGEMM |"]
    # a run that ends with a control (request 0's shape once more): its ratio over request 0's repeat
    controlled = kwarm_on_run(run)
    controlled["requests"].append(dict(controlled["requests"][0], i=len(controlled["requests"]), repeat_of=None,
                                       control_of=0, s=controlled["requests"][1]["s"] * 1.25, kernels=[], jit=0))
    assert f"| 7.63 | {table.fmt_ratio(1.25)} | 2 |" in table.render_start_cost([controlled])
    on["complete"], on["scenario"] = False, "pairs"  # two scenarios of one model: named in the row
    text = table.render_start_cost([on, run])
    assert "| vLLM 0.24.0 · kwarm on · warm Triton cache · `pairs` (cut short) | 31 |" in text
    assert "| vLLM 0.24.0 · kwarm off · cold Triton cache · `smoke` | 127 |" in text
    assert "## Start cost and first-request excess" in table.render([run])  # after the main tables

    (tmp_path / "on.json").write_text(json.dumps(kwarm_on_run(run)))
    assert table.main(["--start-cost", str(FIXTURE), str(tmp_path / "on.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Start cost and first-request excess")
    assert "scenario `smoke`" not in out and "Triton compiles during requests" not in out
    assert out.count("| vLLM 0.24.0 ·") == 2


# ----------------------------------------------------------------------------- chart

SVG = "{http://www.w3.org/2000/svg}"


def _titles(root, tag):
    return [el.find(f"{SVG}title").text for el in root.iter(f"{SVG}{tag}") if el.find(f"{SVG}title") is not None]


def test_chart_writes_a_valid_svg(run, tmp_path, capsys):
    on_cold = kwarm_on_run(run)
    on_cold["cache"]["label"], on_cold["variant"], on_cold["init_s"] = "cold", "learning", 150.0
    on_warm = kwarm_on_run(run)
    off_warm = copy.deepcopy(run)
    off_warm["cache"]["label"], off_warm["init_s"] = "warm", 25.0
    paths = []
    for name, data in (("off-cold", run), ("on-cold", on_cold), ("on-warm", on_warm), ("off-warm", off_warm)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    (tmp_path / "x.kwarm-report.json").write_text("{}")
    out = tmp_path / "sub" / "chart.svg"
    assert chart.main([str(out), *map(str, paths), str(tmp_path / "x.kwarm-report.json")]) == 0
    root = ET.parse(out).getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg" and float(root.get("width")) > 0 and float(root.get("height")) > 0
    texts = [el.text for el in root.iter(f"{SVG}text")]
    for label in ("init seconds", "excess ms", "kwarm off", "kwarm on", "of which kwarm warmup", "cold", "warm",
                  "seconds (log)", "request index (hollow: a repeat)"):
        assert label in texts, label
    bars = _titles(root, "rect")
    name = "tiny-qwen3-next · vLLM 0.24.0 · kwarm"
    assert f"{name} off · cold Triton cache: 127" in bars
    assert f"{name} on (learning) · cold Triton cache: 150" in bars
    assert f"{name} off · warm Triton cache: 25" in bars
    assert f"{name} off · cold Triton cache: 4203" in bars  # excess ms, from the requests
    assert f"{name} on · warm Triton cache: 1363" in bars
    assert bars.count("kwarm warmup: 8.70") == 2  # inside both kwarm-on init bars

    def height(title):
        (el,) = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None
                 and r.find(f"{SVG}title").text == title]
        return float(el.get("height"))

    assert height(f"{name} off · cold Triton cache: 127") / height(f"{name} off · warm Triton cache: 25") \
        == pytest.approx(127.04 / 25.0, rel=0.01)
    # one latency panel per cache label with both modes: two series each, one point per request
    assert len(list(root.iter(f"{SVG}polyline"))) == 4
    points = _titles(root, "circle")
    assert len(points) == 4 * 5 and "0 1x200: 3.1302 s" in points
    hollow = [c for c in root.iter(f"{SVG}circle") if c.get("fill") == "white"]
    assert len(hollow) == 4 * 2  # requests 1 and 3 repeat
    assert "wrote" in capsys.readouterr().out

    assert chart.main(["--no-requests", str(out), *map(str, paths)]) == 0
    root = ET.parse(out).getroot()
    assert not list(root.iter(f"{SVG}polyline")) and not list(root.iter(f"{SVG}circle"))
    assert chart.main([str(out), str(tmp_path / "x.kwarm-report.json")]) == 1  # no results
    assert chart.main([str(out)]) == 2


def test_chart_script_runs_alone(tmp_path):
    out = tmp_path / "c.svg"
    proc = subprocess.run([sys.executable, str(BENCH / "chart.py"), str(out), str(FIXTURE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    assert not list(root.iter(f"{SVG}polyline"))  # kwarm off only: no off/on latency panel
    assert "tiny-qwen3-next · vLLM 0.24.0 · smoke: engine init" in [el.text for el in root.iter(f"{SVG}text")]


# ---------------------------------------------------------------------- engine_bench

def test_new_segments_name_the_pool_size_and_stream_a_request_grew():
    assert engine_bench.segments() is None  # no CUDA here
    before = {0x7000: ("small", 2 << 20, 11), 0x9000: ("large", 20 << 20, 11)}
    after = {**before, 0x8000: ("large", 60 << 20, 27), 0x6000: ("small", 2 << 20, 11)}
    assert engine_bench.new_segments(before, after) == [
        {"pool": "small", "mib": 2.0, "stream": 11}, {"pool": "large", "mib": 60.0, "stream": 27}]
    assert engine_bench.new_segments(None, after) is None and engine_bench.new_segments(before, before) == []


def test_allocator_counts_need_cuda_and_subtract_per_counter():
    assert engine_bench.allocator_counts() is None  # CUDA_VISIBLE_DEVICES="": no CUDA here
    before = {"num_device_alloc": 40, "num_host_alloc": 3}
    after = {"num_device_alloc": 46, "num_host_alloc": 3, "num_device_free": 1}
    assert engine_bench.counts_since(before, after) == {"num_device_alloc": 6, "num_host_alloc": 0,
                                                          "num_device_free": 1}
    assert engine_bench.counts_since(None, after) is None


def test_host_counters_count_this_threads_page_faults():
    host = engine_bench.HostCounters()
    try:
        assert bool(host.fds) != bool(host.perf_error)  # counters, or the reason there are none
        snap = host.snapshot()
        block = bytearray(64 << 20)  # touching 64 MiB of new pages faults them in
        delta = host.since(snap)
    finally:
        host.close()
    assert len(block) and delta["minflt"] >= 1000
    assert delta["steal_ms"] is None or delta["steal_ms"] >= 0
    assert all(delta[name] > 0 for name in host.PERF_EVENTS if name in delta)

def test_import_needs_no_vllm_torch_triton():
    code = ("import sys; sys.path.insert(0, %r); import engine_bench, table; "
            "print(sorted(m for m in ('vllm', 'torch', 'triton') if m in sys.modules))" % str(BENCH))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help():
    out = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--kwarm", "--scenario", "--triton-cache", "--cudagraph", "--gdn-prefill-backend",
                 "--attention-backend", "--enforce-eager", "--max-num-seqs", "--out", "--profile",
                 "--sync-lock"):
        assert flag in out.stdout


def _kwargs(argv):
    args = engine_bench.parse_args(argv)
    path = engine_bench.resolve_model(args.model)
    return args, engine_bench.engine_kwargs(args, path, json.loads((path / "config.json").read_text()))


def test_defaults_and_qwen_engine_kwargs():
    args, kw = _kwargs(["tiny-qwen3-next"])
    assert (args.kwarm, args.scenario, args.triton_cache, args.cudagraph) == ("on", "default", "fresh", "on")
    assert kw["model"] == str(BENCH / "models" / "tiny-qwen3-next")
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert (kw["max_num_seqs"], kw["gpu_memory_utilization"], kw["max_model_len"]) == (16, 0.25, 4096)
    assert kw["additional_config"] == {"gdn_prefill_backend": "triton"}  # a GDN model
    assert "compilation_config" not in kw and "attention_backend" not in kw
    assert "kv_cache_memory_bytes" not in kw


def test_engine_kwargs_options():
    _, kw = _kwargs([str(BENCH / "models" / "tiny-qwen3-next"), "--cudagraph", "off", "--enforce-eager",
                     "--attention-backend", "TRITON_ATTN", "--kv-cache-memory-bytes", "4G",
                     "--gdn-prefill-backend", "default", "--max-num-seqs", "8"])
    assert kw["compilation_config"] == {"cudagraph_mode": "NONE"}
    assert kw["enforce_eager"] is True and kw["attention_backend"] == "TRITON_ATTN"
    assert kw["kv_cache_memory_bytes"] == 4 * 2**30 and kw["max_num_seqs"] == 8
    assert "additional_config" not in kw
    _, kw = _kwargs(["tiny-deepseek-v32", "--kwarm", "off"])
    assert "additional_config" not in kw  # not a GDN model


def test_bad_model_folder(tmp_path):
    with pytest.raises(SystemExit):
        engine_bench.resolve_model(str(tmp_path))


def test_parse_bytes():
    assert engine_bench.parse_bytes("4G") == 4 * 2**30
    assert engine_bench.parse_bytes("512MiB") == 512 * 2**20
    assert engine_bench.parse_bytes("1.5g") == int(1.5 * 2**30)
    assert engine_bench.parse_bytes("1000") == 1000
    assert engine_bench.parse_bytes(None) is None


def test_parse_indices():
    assert engine_bench.parse_indices("3,0, 3") == [0, 3]
    assert engine_bench.parse_indices("") == [] and engine_bench.parse_indices(None) == []
    args = engine_bench.parse_args(["tiny-qwen3-next", "--profile", "1,10", "--sync-lock", "/tmp/x.lock"])
    assert args.profile == [1, 10] and args.sync_lock == "/tmp/x.lock"
    args = engine_bench.parse_args(["tiny-qwen3-next"])
    assert args.profile == [] and args.sync_lock is None
    for bad in ("a", "1,-2"):
        with pytest.raises(SystemExit):
            engine_bench.parse_args(["tiny-qwen3-next", "--profile", bad])


def test_smoke_scenario_is_gpu_baseline():
    scenario = engine_bench.build_scenario("smoke")
    assert [(r.batch, r.length, r.max_tokens, r.repeat_of) for r in scenario] == [
        (1, 200, 16, None), (1, 200, 16, 0), (4, 333, 16, None), (4, 333, 16, 2), (1, 37, 16, None)]
    # the very prompts of the first measured baseline (3.13 s for the first request, tiny Qwen3-Next on vLLM 0.24.0)
    for r in scenario:
        want = [{"prompt_token_ids": [(7 * j + 3 * k) % 4000 + 10 for k in range(r.length)]} for j in range(r.batch)]
        assert engine_bench.prompt_ids(r.batch, r.length, r.seed) == want


def test_default_scenario():
    scenario = engine_bench.build_scenario("default")
    assert len(scenario) == 12
    pairs = [(r.repeat_of, i) for i, r in enumerate(scenario) if r.repeat_of is not None]
    assert pairs == [(0, 1), (5, 6), (7, 8), (10, 11)]
    for first, rep in pairs:
        a, b = scenario[first], scenario[rep]
        assert (a.batch, a.length, a.max_tokens, a.mixed) == (b.batch, b.length, b.max_tokens, b.mixed)
        assert engine_bench.prompt_ids(a.batch, a.length, a.seed) != engine_bench.prompt_ids(b.batch, b.length, b.seed)
    singles = [r.length for r in scenario if r.batch == 1]
    assert {1, 16, 37, 200} <= set(singles)
    assert {(r.batch, r.max_tokens) for r in scenario if r.label.startswith("decode")} == {(8, 64), (3, 64)}
    mixed = [r for r in scenario if r.mixed]
    assert len(mixed) == 2 and mixed[0].mixed == (2, 300) and mixed[0].max_tokens > 16
    assert all(r.max_tokens == 16 for r in scenario if r.label.startswith("prefill"))
    for r in scenario:  # every token id inside both tiny vocabularies (4096)
        for p in engine_bench.prompt_ids(r.batch, r.length, r.seed):
            assert len(p["prompt_token_ids"]) == r.length
            assert all(10 <= t < 4096 for t in p["prompt_token_ids"])
    with pytest.raises(ValueError):
        engine_bench.build_scenario("nope")


def test_mla_splits_scenario_crosses_each_split_step_of_triton_mla_mid_generation():
    # vLLM's own split rule (0.33's _compute_num_kv_splits, at an H200's 132 SMs): each first
    # decode starts at one split count and ends at the next; each has a same-shape repeat
    from conftest import cpu_triton_env, run_py

    scenario = engine_bench.build_scenario("mla-splits")
    assert [r.repeat_of for r in scenario] == [None, 0, None, 2, None, 4, None, 6]
    assert len({r.seed for r in scenario}) == 8 and all(r.batch == 1 and r.max_tokens == 64 for r in scenario)
    spans = [(r.length + 1, r.length + r.max_tokens) for r in scenario[::2]]  # contexts of its decode steps
    proc = run_py(f"""
import json
from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
print(json.dumps([[_compute_num_kv_splits(n, 132) for n in span] for span in {spans}]))
""", env=cpu_triton_env(), release="0.33.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[1, 1], [1, 2], [2, 4], [4, 8]]
    assert all(r.length + r.max_tokens <= 4096 for r in scenario)  # the default --max-model-len
    assert engine_bench.parse_args(["tiny-deepseek-v3", "--scenario", "mla-splits"]).scenario == "mla-splits"


def test_tiny_deepseek_v3_is_dense_mla_that_gpu_run_puts_on_triton_mla():
    # transformers' own config class and vLLM's registry; no DSA indexer, so the MLA layers run
    # the backend gpu_run.sh names for it (the indexer models stay on vLLM's choice)
    from transformers import AutoConfig
    from vllm.model_executor.models.registry import ModelRegistry

    cfg = AutoConfig.from_pretrained(BENCH / "models" / "tiny-deepseek-v3")
    assert type(cfg).__name__ == "DeepseekV3Config" and cfg.kv_lora_rank == 512
    assert cfg.architectures[0] in ModelRegistry.get_supported_archs()
    assert not hasattr(cfg, "index_topk")
    model_args = {m: subprocess.run(["bash", "-c", f'eval "$(sed -n "/^model_args()/,/^}}/p" {BENCH / "gpu_run.sh"})"; '
                                                   f"model_args {m}"], capture_output=True, text=True).stdout.strip()
                  for m in ("tiny-deepseek-v3", "tiny-deepseek-v32", "deepseek-v32-2l", "tiny-qwen3-next")}
    assert model_args == {"tiny-deepseek-v3": "--attention-backend TRITON_MLA", "tiny-deepseek-v32": "",
                          "deepseek-v32-2l": "", "tiny-qwen3-next": "--attention-backend TRITON_ATTN"}


def test_pairs_scenario():
    scenario = engine_bench.build_scenario("pairs")
    assert len(scenario) == 17
    assert [r.repeat_of for r in scenario] == [None if i % 2 == 0 else i - 1 for i in range(16)] + [None]
    control = scenario[16]  # request 0's shape again, last, after a pause; not a pair
    assert (control.batch, control.length, control.max_tokens, control.mixed) == (1, 200, 16, None)
    assert control.control_of == 0 and control.pause_s == engine_bench.CONTROL_PAUSE_S > 0
    assert [r.control_of for r in scenario[:16]] == [None] * 16 and {r.pause_s for r in scenario[:16]} == {0.0}
    firsts = [(r.batch, r.length, r.max_tokens, r.mixed) for r in scenario[:16:2]]
    assert firsts == [(1, 200, 16, None), (1, 37, 16, None), (1, 1, 16, None), (4, 333, 16, None),
                      (1, 2500, 16, None), (8, 8, 64, None), (3, 5, 64, None), (2, 8, 64, (2, 300))]
    default_mixed = [r for r in engine_bench.build_scenario("default") if r.mixed][0]
    assert scenario[14].mixed == default_mixed.mixed and scenario[14].max_tokens == default_mixed.max_tokens
    for k in range(8):
        a, b = scenario[2 * k], scenario[2 * k + 1]
        assert (a.batch, a.length, a.max_tokens, a.mixed) == (b.batch, b.length, b.max_tokens, b.mixed)
        assert b.label == a.label + " (repeat)"
    assert len({r.seed for r in scenario}) == 17  # each request its own token ids
    prompts = [engine_bench.prompt_ids(r.batch, r.length, r.seed) for r in scenario]
    assert all(prompts[i] != prompts[j] for i in range(17) for j in range(i))
    for r, ps in zip(scenario, prompts):
        assert all(len(p["prompt_token_ids"]) == r.length for p in ps)
        assert all(10 <= t < 4096 for p in ps for t in p["prompt_token_ids"])
        assert r.length + r.max_tokens <= 4096  # the default --max-model-len
    assert engine_bench.parse_args(["tiny-qwen3-next", "--scenario", "pairs"]).scenario == "pairs"


def test_pairs_scenario_with_repeats():
    scenario = engine_bench.build_scenario("pairs", repeats=3)
    assert len(scenario) == 8 * 4 + 1
    assert [r.repeat_of for r in scenario[:8]] == [None, 0, 0, 0, None, 4, 4, 4]
    assert [r.label for r in scenario[:4]] == ["prefill 1x200"] + [f"prefill 1x200 (repeat {k})" for k in (1, 2, 3)]
    assert len({r.seed for r in scenario}) == len(scenario)  # each request its own token ids
    assert scenario[-1].control_of == 0 and scenario[-1].repeat_of is None
    assert engine_bench.build_scenario("pairs", repeats=1) == engine_bench.build_scenario("pairs")
    for name, repeats, message in (("default", 2, "--repeats 2 needs --scenario pairs"),
                                   ("pairs", 0, "--repeats is at least 1, got 0")):
        with pytest.raises(ValueError, match=message):
            engine_bench.build_scenario(name, repeats)


def test_prepare_env_fresh(tmp_path):
    args = engine_bench.parse_args(["tiny-qwen3-next", "--kwarm", "on"])
    env = {"HOME": str(tmp_path), "DG_JIT_CACHE_DIR": "/keep/me"}
    cache = engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    root = cache["fresh_root"]
    assert root.startswith(str(tmp_path))
    assert env["TRITON_CACHE_DIR"] == f"{root}/triton" == cache["triton_dir"]
    assert env["VLLM_CACHE_ROOT"] == f"{root}/vllm" == cache["vllm_cache_root"]
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["KWARM_ENABLE"] == "1" and env["KWARM_REPORT"].endswith(".json")
    assert not Path(env["KWARM_REPORT"]).exists()  # kwarm writes it
    assert env["DG_JIT_CACHE_DIR"] == "/keep/me"
    assert cache["label"] == "cold" and cache["mode"] == "fresh"


def test_prepare_env_keeps_user_settings(tmp_path):
    warm = tmp_path / "triton"
    (warm / "abc").mkdir(parents=True)
    args = engine_bench.parse_args(["tiny-qwen3-next", "--kwarm", "off", "--triton-cache", str(warm)])
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "KWARM_ENABLE": "1"}
    cache = engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    assert env["TRITON_CACHE_DIR"] == str(warm) and env["VLLM_CACHE_ROOT"] == str(tmp_path / "v")
    assert "TORCHINDUCTOR_CACHE_DIR" not in env
    assert env["KWARM_ENABLE"] == "0" and "KWARM_REPORT" not in env
    assert (cache["mode"], cache["label"], cache["triton_entries_at_start"]) == ("dir", "warm", 1)

    args = engine_bench.parse_args(["tiny-qwen3-next", "--triton-cache", "fresh"])
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "KWARM_REPORT": str(tmp_path / "r.json")}
    engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "v") and env["KWARM_REPORT"] == str(tmp_path / "r.json")


def test_deepgemm_entries(tmp_path):
    assert engine_bench.deepgemm_entries(str(tmp_path / "none")) == set()
    (tmp_path / "cache" / "kernel.fp8_mqa_logits.0a1b").mkdir(parents=True)
    (tmp_path / "cache" / "kernel.fp8_mqa_logits.0a1b" / "kernel.cubin").write_bytes(b"")
    (tmp_path / "tmp").mkdir()
    assert engine_bench.deepgemm_entries(str(tmp_path)) == {"cache/kernel.fp8_mqa_logits.0a1b"}
    # vLLM 0.34's vendored DeepGEMM (DeepJIT): <name>.<digest>/ committed by a .committed file
    committed = tmp_path / "cache" / "sm90_fp8_mqa_logits.9f8e"
    committed.mkdir()
    (committed / ".committed").write_bytes(b"")
    (tmp_path / "cache" / "sm90_fp8_gemm_1d2d.77aa").mkdir()  # being written: not committed yet
    entries = engine_bench.deepgemm_entries(str(tmp_path))
    assert entries == {"cache/kernel.fp8_mqa_logits.0a1b", "cache/sm90_fp8_mqa_logits.9f8e"}
    assert engine_bench.deepgemm_names(entries) == {"fp8_mqa_logits": 1, "sm90_fp8_mqa_logits": 1}


# ------------------------------------------------------------------------- profiling

def test_short_path(tmp_path):
    sp = engine_bench.short_path
    assert sp("/usr/lib/python3/dist-packages/vllm/v1/worker/gpu_model_runner.py") == \
        "vllm/v1/worker/gpu_model_runner.py"
    assert sp("/venv/lib/python3.12/site-packages/torch/site-packages/x.py") == "x.py"  # the last one
    assert sp("/a/b/c/d/e/f.py") == "c/d/e/f.py"  # no package: the last 4 components
    assert sp(str(BENCH / "engine_bench.py")) == "bench/engine_bench.py"  # this tree
    assert sp("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"
    assert sp("<string>") == "<string>"
    # outside site-packages (a PYTHONPATH install, this tree): from the outermost package on
    deep = tmp_path / "stage" / "vllm" / "model_executor" / "layers" / "fla" / "ops"
    deep.mkdir(parents=True)
    for d in (deep, *list(deep.parents)[:4]):
        (d / "__init__.py").write_text("")
    assert sp(str(deep / "chunk.py")) == "vllm/model_executor/layers/fla/ops/chunk.py"
    assert sp(str(tmp_path / "stage" / "vllm" / "__init__.py")) == "vllm/__init__.py"
    assert engine_bench.profile_func((str(deep / "chunk.py"), 12, "chunk_fwd")) == \
        "vllm/model_executor/layers/fla/ops/chunk.py:12(chunk_fwd)"
    assert engine_bench.profile_func(("~", 0, "<built-in method time.sleep>")) == "<built-in method time.sleep>"


def test_profile_rows_order_and_fields():
    f, g, h = ("/a/b/c/d/f.py", 1, "f"), ("/x/g.py", 2, "g"), ("~", 0, "<built-in method builtins.len>")
    stats = {f: (2, 5, 0.123456, 0.9, {}), g: (3, 3, 0.5, 0.6, {}), h: (7, 7, 0.01, 0.01, {})}
    by_tot = engine_bench.profile_rows(stats, "tottime", 30)
    assert [r["func"] for r in by_tot] == ["x/g.py:2(g)", "b/c/d/f.py:1(f)", "<built-in method builtins.len>"]
    assert by_tot[1] == {"func": "b/c/d/f.py:1(f)", "ncalls": 2, "tottime": 0.1235, "cumtime": 0.9}  # primitive calls
    by_cum = engine_bench.profile_rows(stats, "cumtime", 2)
    assert [r["func"] for r in by_cum] == ["b/c/d/f.py:1(f)", "x/g.py:2(g)"]
    summary = engine_bench.profile_summary(stats, n=1)
    assert summary == {"total_s": 0.6335, "top_tottime": by_tot[:1], "top_cumtime": by_cum[:1]}
    text = engine_bench.format_profile(by_cum, n=1)
    assert text.splitlines()[1].split() == ["2", "0.1235", "0.9000", "b/c/d/f.py:1(f)"]
    assert len(text.splitlines()) == 2
    with pytest.raises(KeyError):
        engine_bench.profile_rows(stats, "ncalls", 3)


def _leaf(n):
    return sum(range(n))


def _outer():
    return [_leaf(20_000) for _ in range(3)]


def test_profile_rows_from_a_real_profile(tmp_path):
    profiler = cProfile.Profile()
    profiler.enable()
    _outer()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = {re.sub(r".*\((\w+)\)$", r"\1", r["func"]): r for r in engine_bench.profile_rows(stats, "cumtime", 30)}
    assert rows["_leaf"]["ncalls"] == 3 and rows["_outer"]["ncalls"] == 1
    assert rows["_outer"]["cumtime"] >= rows["_leaf"]["cumtime"]
    assert re.fullmatch(r"tests/test_bench\.py:\d+\(_leaf\)", rows["_leaf"]["func"])
    assert engine_bench.profile_path(tmp_path / "run.json", 3) == tmp_path / "run.req3.prof"


def _first_time_only():
    total = 0
    for i in range(300_000):  # its own time (tottime), not a built-in's
        total += i
    return total


def test_profile_diff_of_a_first_request_and_its_repeat(tmp_path):
    """Two real profiles: the first request also runs a function its repeat does not, and
    calls _leaf twice as often; the diff puts that function first, names both call counts,
    and profile_diffs takes only pairs whose raw stats both exist."""
    files = []
    for i, first in enumerate((True, False)):
        profiler = cProfile.Profile()
        profiler.enable()
        _outer()
        if first:
            _outer()
            _first_time_only()
        profiler.disable()
        files.append(tmp_path / f"run.req{i}.prof")
        pstats.Stats(profiler).dump_stats(str(files[-1]))
    a, b = (pstats.Stats(str(f)).stats for f in files)
    diff = engine_bench.profile_diff(a, b, n=3)
    top = diff["tottime"][0]
    assert re.fullmatch(r"tests/test_bench\.py:\d+\(_first_time_only\)", top["func"]), diff
    assert top["ncalls"] == [1, 0] and top["tottime"] > 0 and top["cumtime"] >= top["tottime"]
    leaf = engine_bench.profile_diff(a, b, n=50)["cumtime"]
    assert [r["ncalls"] for r in leaf if r["func"].endswith("(_leaf)")] == [[6, 3]]
    assert len(diff["cumtime"]) == 3
    text = engine_bench.format_diff(diff["tottime"])
    assert text.splitlines()[1].split()[0] == "1/0" and len(text.splitlines()) == 4

    requests = [{"i": 0, "profile": {"file": str(files[0])}}, {"i": 1, "profile": {"file": str(files[1])}},
                {"i": 2, "profile": {"file": str(tmp_path / "gone.prof")}}, {"i": 3}]
    diffs = engine_bench.profile_diffs(requests, [(0, 1), (2, 3)])
    assert [(d["first"], d["repeat"]) for d in diffs] == [(0, 1)]
    assert diffs[0]["tottime"][0]["func"] == top["func"]


# ---------------------------------------------------------------------- EngineLock

HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import engine_bench
lock = engine_bench.EngineLock(sys.argv[2])
with getattr(lock, sys.argv[3])():
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
    open(sys.argv[5], "w").write("released")
"""


@pytest.mark.parametrize("theirs, mine, waits", [("shared", "exclusive", True), ("exclusive", "shared", True),
                                                  ("shared", "shared", False)])
def test_engine_lock_between_processes(tmp_path, theirs, mine, waits):
    """Another process holds the lock `theirs`; taking it `mine` here waits for its release
    unless both are shared."""
    path, marker = tmp_path / "sub" / "engines.lock", tmp_path / "released"
    path.parent.mkdir()
    hold = 0.4 if waits else 0.6
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(BENCH), str(path), theirs, str(hold), str(marker)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with getattr(engine_bench.EngineLock(str(path)), mine)() as waited:
            assert marker.exists() is waits  # released before we got it (or not)
            assert isinstance(waited, float) and waited >= 0
            if waits:
                assert waited > 0.05
    finally:
        assert child.wait(timeout=10) == 0


def _try_flock(path, mode) -> bool:
    """Whether another open file of `path` gets the lock `mode` at once."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_engine_lock_modes_and_release(tmp_path):
    path = tmp_path / "engines.lock"
    lock = engine_bench.EngineLock(str(path))
    with lock.shared() as waited:  # creates the file
        assert path.exists() and waited >= 0
        assert _try_flock(path, fcntl.LOCK_SH) and not _try_flock(path, fcntl.LOCK_EX)
    assert _try_flock(path, fcntl.LOCK_EX)  # released
    with lock.exclusive():
        assert not _try_flock(path, fcntl.LOCK_SH)
    assert _try_flock(path, fcntl.LOCK_EX)
    with pytest.raises(RuntimeError):
        with lock.exclusive():
            raise RuntimeError("init failed")
    assert _try_flock(path, fcntl.LOCK_EX)  # released on an exception too
    nolock = engine_bench.EngineLock(None)
    with nolock.shared() as a, nolock.exclusive() as b:
        assert a == b == 0.0
    assert [p.name for p in tmp_path.iterdir()] == ["engines.lock"]


def test_gpu_run_script_parses():
    out = subprocess.run(["bash", "-n", str(BENCH / "gpu_run.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


FAKE_BENCH = """
import json, os, sys
argv = sys.argv[1:]
def opt(name, default=None):
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1] if name in argv else default
out, mode = opt("--out"), opt("--kwarm")
env = {k: v for k, v in os.environ.items() if k.startswith(("KWARM_", "DG_JIT_"))}
if env.get("KWARM_LEARN") and env.get("KWARM_MANIFEST"):
    open(env["KWARM_MANIFEST"], "w").write("{}")
reqs = [{"i": 0, "label": "a", "s": 1.0, "jit": 1, "repeat_of": None, "kernels": []},
        {"i": 1, "label": "a (repeat)", "s": 0.1, "jit": 0, "repeat_of": 0, "kernels": []}]
json.dump({"schema": "kwarm-engine-bench/1", "model": os.path.basename(argv[0]), "scenario": opt("--scenario"),
           "versions": {"vllm": "9.9"}, "kwarm": mode, "variant": opt("--variant", ""),
           "cache": {"label": "warm" if out.endswith("-warm.json") else "cold"}, "init_s": 10.0,
           "kwarm_warmup_s": 2.0 if mode == "on" else None, "requests": reqs, "complete": True,
           "fake_argv": argv, "fake_env": env}, open(out, "w"))
"""


def gpu_run_env(tmp_path, **extra) -> dict:
    """gpu_run.sh with a staged 'vLLM 9.9' that is an empty env.sh, an nvidia-smi that
    prints one line, and a $PY that answers engine_bench.py with FAKE_BENCH (which records
    its arguments and KWARM_* environment in the result) and runs everything else."""
    (tmp_path / "staged" / "vllm-9.9").mkdir(parents=True)
    (tmp_path / "staged" / "vllm-9.9" / "env.sh").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'Fake GPU, 0 MiB, 1 MiB'\n")
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    (bin_dir / "py").write_text(f'#!/bin/sh\nif [ "$1" = bench/engine_bench.py ]; then shift; '
                                f'exec {sys.executable} {tmp_path / "fake_bench.py"} "$@"; fi\n'
                                f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KWARM_", "VLLM_", "TRITON_", "MODEL_ARGS_"))}
    env.update(dict(dict(PATH=f"{bin_dir}:{env['PATH']}", STAGED=str(tmp_path / "staged"), VER="9.9",
                         PY=str(bin_dir / "py"), INSTALL="0", REPLAY_BENCH="0", SYNC="0", MODELS="tiny-qwen3-next",
                         OUT=str(tmp_path / "final"), WORK=str(tmp_path / "work")), **extra))
    return env


def gpu_run(tmp_path, env):
    """Run gpu_run.sh (successfully) in `env`: its process, its output folder and the results
    of the tiny Qwen3-Next's runs by tag (``off-cold``, ``on-replay``, ...)."""
    proc = subprocess.run(["bash", str(BENCH / "gpu_run.sh")], env=env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "work" / "out"
    runs = {p.name.split("kwarm", 1)[1].removesuffix(".json"): json.loads(p.read_text())
            for p in out.glob("tiny-qwen3-next-vllm9.9-kwarm*.json")}
    return proc, out, runs


def test_gpu_run_kwarm_env_and_model_args(tmp_path):
    env = gpu_run_env(tmp_path, KWARM_ENV="KWARM_BUDGET=auto KWARM_WARMUPS=-fused_moe",
                      MODEL_ARGS_tiny_qwen3_next="--gpu-memory-utilization 0.5 --settle-s 1",
                      MODEL_ARGS_tiny_deepseek_v32="--max-num-seqs 3", BENCH_ARGS="--max-num-seqs 8",
                      SCENARIO="pairs")
    proc, out, runs = gpu_run(tmp_path, env)
    assert sorted(runs) == ["off-cold", "off-warm", "on-cold", "on-replay", "on-warm"]  # structure unchanged
    for tag, res in runs.items():
        argv = res["fake_argv"]
        assert argv[0] == "bench/models/tiny-qwen3-next" and res["scenario"] == "pairs"
        # the model's own arguments come last: its GPU share wins over GPU_UTIL
        assert argv[argv.index("--attention-backend") + 1] == "TRITON_ATTN"
        i = argv.index("--gpu-memory-utilization")
        assert argv[i + 1] == "0.2" and argv[argv.index("--gpu-memory-utilization", i + 1) + 1] == "0.5"
        assert argv.index("--max-num-seqs") < argv.index("--settle-s") and "3" not in argv
        assert engine_bench.parse_args(argv[:argv.index("--triton-cache")]).gpu_memory_utilization == 0.5
        if tag.startswith("off"):
            assert res["fake_env"] == {}
            continue
        assert res["fake_env"]["KWARM_BUDGET"] == "auto", tag  # every kwarm-on run
        assert res["fake_env"]["KWARM_REPORT"] == str(out / f"tiny-qwen3-next-vllm9.9-kwarm{tag}.kwarm-report.json")
    assert runs["on-cold"]["fake_env"]["KWARM_WARMUPS"] == "-fused_moe"
    assert runs["on-cold"]["fake_env"]["KWARM_LEARN"] == "1" and runs["on-cold"]["variant"] == "learning"
    assert runs["on-warm"]["fake_env"]["KWARM_WARMUPS"] == "-replay"  # the script's own setting wins
    assert runs["on-replay"]["variant"] == "replay" and "KWARM_LEARN" not in runs["on-replay"]["fake_env"]
    assert "kwarm env=[KWARM_BUDGET=auto KWARM_WARMUPS=-fused_moe]" in proc.stdout
    final = tmp_path / "final"
    assert "## Start cost and first-request excess" in (final / "table.md").read_text()
    assert ET.parse(final / "chart.svg").getroot().tag == f"{SVG}svg"
    with tarfile.open(final / "bench-results.tgz") as tgz:
        names = {n.removeprefix("./") for n in tgz.getnames()}
    assert {"table.md", "chart.svg", "status.txt", "tiny-qwen3-next-vllm9.9-kwarmon-replay.json"} <= names


def test_gpu_run_floor_is_vllm_alone_on_the_cold_runs_deepgemm_kernels(tmp_path):
    env = gpu_run_env(tmp_path, FLOOR="1", WARM="0", LEARN="0", SCENARIO="pairs", ON_ARGS="--deepgemm-sweep")
    proc, out, runs = gpu_run(tmp_path, env)
    assert sorted(runs) == ["off-cold", "off-floor", "on-cold"]  # one floor, after the kwarm-on cold run
    floor, argv = runs["off-floor"], runs["off-floor"]["fake_argv"]
    assert floor["kwarm"] == "off" and floor["variant"] == "DeepGEMM built"
    # DeepGEMM's kernels are the cold run's (vLLM's default place under its cache root); the rest is new
    on_cache = tmp_path / "work" / "tiny-qwen3-next-vllm9.9-kwarmon"
    assert floor["fake_env"] == {"DG_JIT_CACHE_DIR": f"{on_cache}/vllm/deep_gemm"}
    assert argv[argv.index("--triton-cache") + 1] == f"{on_cache}-floor/triton"
    # ON_ARGS: the kwarm-on run only
    assert "--deepgemm-sweep" in runs["on-cold"]["fake_argv"]
    assert "--deepgemm-sweep" not in argv and "--deepgemm-sweep" not in runs["off-cold"]["fake_argv"]
    assert "DG_JIT_CACHE_DIR" not in runs["off-cold"]["fake_env"] and "DG_JIT_CACHE_DIR" not in runs["on-cold"]["fake_env"]
    assert "off (DeepGEMM built)" in (tmp_path / "final" / "table.md").read_text()


def test_gpu_run_sync_runs_lock_only_the_runs_named_and_warm_on_restarts_kwarm_on_only(tmp_path):
    # vLLM alone's cold start and the warm restarts take the lock; kwarm's cold start does not
    (tmp_path / "x-kwarmoff-cold").mkdir()  # a file a pattern would match if the shell expanded it
    env = gpu_run_env(tmp_path, SYNC="1", SYNC_RUNS="*kwarmoff-cold *-warm", LEARN="0", SCENARIO="pairs", WARM="on")
    proc, out, runs = gpu_run(tmp_path, env)
    locked = {tag for tag, run in runs.items() if "--sync-lock" in run["fake_argv"]}
    assert sorted(runs) == ["off-cold", "on-cold", "on-warm"], "WARM=on: kwarm-on's warm restart only"
    assert locked == {"off-cold", "on-warm"}
    (tmp_path / "default").mkdir()
    default = gpu_run(tmp_path / "default", gpu_run_env(tmp_path / "default", SYNC="1", LEARN="0", WARM="0"))[2]
    assert default["on-cold"]["fake_argv"].count("--sync-lock") == 1, "every run by default"


def test_gpu_run_rejects_a_bad_kwarm_env(tmp_path):
    env = gpu_run_env(tmp_path, KWARM_ENV="KWARM_BUDGET=auto oops")
    proc = subprocess.run(["bash", str(BENCH / "gpu_run.sh")], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 1 and "KWARM_ENV: oops is not VAR=VALUE" in proc.stdout
    assert not list((tmp_path / "work" / "out").glob("*.log"))  # no run started


# ------------------------------------------------------- main() against a fake engine

FAKE_VLLM = '''
import json, os, types
__version__ = "0.0.fake"
MONITOR = []


def event(what):
    if os.environ.get("FAKE_EVENTS"):
        with open(os.environ["FAKE_EVENTS"], "a") as f:
            f.write(what + "\\n")


def _compile(name, key):
    from triton import knobs
    hook = knobs.runtime.jit_post_compile_hook
    if hook:
        hook(key=(name, key), repr="", fn=types.SimpleNamespace(name=name, module="fake.mod"),
             compile={}, is_manual_warmup=False, already_compiled=False)


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    def __init__(self):
        self.pending = 0
        self.mixed = False

    def step(self):
        if self.pending:
            self.pending -= 1
            if self.pending == 1 and not self.mixed:
                self.mixed = True
                _compile("_causal_conv1d_update_kernel", "mixed")
        return []

    def has_unfinished_requests(self):
        return self.pending > 0


class LLM:
    def __init__(self, **kw):
        event("init")
        LLM.kwargs = kw
        _compile("fused_moe_kernel", "init")  # a compile during init
        if os.environ.get("KWARM_REPORT") and os.environ.get("KWARM_ENABLE") == "1":
            with open(os.environ["KWARM_REPORT"], "w") as f:
                json.dump({"total_s": 4.5, "rank": 0, "families": [
                    {"name": "qwen_gdn", "status": "ran", "seconds": 4.0, "compiled": [{}],
                     "steps": [{"status": "ran"}]}]}, f)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["VLLM_CACHE_ROOT"], "tc", "triton_cache")
        from triton import knobs
        prev = knobs.runtime.jit_post_compile_hook  # vLLM's monitor chains what it finds

        def monitor(**k):
            MONITOR.append(k["fn"].name)
            return prev(**k) if prev else None

        knobs.runtime.jit_post_compile_hook = monitor
        self.llm_engine = _Engine()
        self.seen = set()

    def generate(self, prompts, sp, use_tqdm=True):
        event("generate")
        shape = (len(prompts), len(prompts[0]["prompt_token_ids"]))
        if shape not in self.seen:
            self.seen.add(shape)
            _compile("_compute_slot_mapping_kernel", shape)
            if shape == (4, 333):
                os.makedirs(os.path.join(os.environ["VLLM_CACHE_ROOT"], "deep_gemm", "cache",
                                         "kernel.mqa_logits.abc"))
        return []

    def enqueue(self, prompts, sp, use_tqdm=True):
        self.llm_engine.pending += 3
        return []
'''


def fake_engine_env(tmp_path, cuda: bool = True) -> dict:
    """The environment of an engine_bench.py subprocess that imports a stand-in `vllm`
    (FAKE_VLLM; it appends "imported", "init", "generate" to $FAKE_EVENTS when set) and
    `torch` (whose ``cuda.is_available()`` returns `cuda`), with the real Triton knobs."""
    fake = tmp_path / "fake"
    (fake / "vllm" / "engine").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "engine" / "__init__.py").write_text("")
    (fake / "vllm" / "engine" / "arg_utils.py").write_text(
        "import dataclasses\nfrom vllm import event\nevent('imported')\n"
        "@dataclasses.dataclass\nclass EngineArgs:\n    model: str = ''\n")
    (fake / "torch").mkdir()
    (fake / "torch" / "__init__.py").write_text(
        "__version__ = '0.0.fake'\n"
        "class cuda:\n"
        "    get_device_name = staticmethod(lambda i: 'Fake GPU')\n"
        f"    is_available = staticmethod(lambda: {cuda})\n"
        "    device_allocs = [0]\n"
        "    @staticmethod\n"
        "    def memory_stats():  # two cudaMalloc calls between any two reads; no host_memory_stats\n"
        "        cuda.device_allocs[0] += 2\n"
        "        return {'num_device_alloc': cuda.device_allocs[0], 'active.all.current': 1}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KWARM_", "VLLM_", "TRITON_", "FAKE_"))}
    env.update(PYTHONPATH=f"{fake}:{REPO}", TMPDIR=str(tmp_path))
    return env


@pytest.mark.parametrize("kwarm", ["off", "on"])
def test_main_with_a_fake_engine(tmp_path, kwarm):
    """engine_bench.py end to end with a stand-in `vllm` and `torch` (real Triton knobs):
    hook chaining, per-request counts, DeepGEMM entries, the kwarm report, the JSON."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", kwarm,
                           "--out", str(out)], env=fake_engine_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["gpu"] == "Fake GPU" and res["versions"]["vllm"] == "0.0.fake"
    assert all(r["alloc"] == {"num_device_alloc": 2} for r in res["requests"])
    assert "jit_monitor_verbose" not in res["engine_kwargs"]  # this EngineArgs lacks it
    assert res["init_jit"] == 1 and res["init_kernels"] == [{"name": "fused_moe_kernel", "count": 1}]
    assert res["cache"]["label"] == "cold" and res["cache"]["triton_dir_after_init"].endswith("tc/triton_cache")
    jit = [r["jit"] for r in res["requests"]]
    assert jit == [1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0]  # new shapes compile; repeats and mixed repeat do not
    assert res["requests"][10]["kernels"] == [{"name": "_causal_conv1d_update_kernel", "key": "('_causal_conv1d_update_kernel', 'mixed')"}]
    assert res["requests"][10]["steps"] == 6  # 2 before the prefill is queued, 4 after
    assert [r["deepgemm_new"] for r in res["requests"]][5:7] == [1, 0]
    assert res["total_jit"] == 8 and [p["first"] for p in res["pairs"]] == [0, 5, 7, 10]
    s = {r["i"]: r["s"] for r in res["requests"]}
    assert [(p["first"], p["repeat"], p["first_s"], p["repeat_s"]) for p in res["excess_pairs"]] == [
        (f, r, s[f], s[r]) for f, r in ((0, 1), (5, 6), (7, 8), (10, 11))]
    assert res["excess_s"] == pytest.approx(sum(s[f] - s[r] for f, r in ((0, 1), (5, 6), (7, 8), (10, 11))), abs=1e-3)
    assert res["excess_s"] == table.excess_s(res)
    if kwarm == "on":
        assert res["kwarm_active"] is True and "bench" in res["kwarm_doors"]
        assert res["kwarm_warmup_s"] == 4.5 and res["kwarm_report_summary"]["compiled"] == 1
        assert res["kwarm_family_s"] == {"qwen_gdn": 4.0}
        assert ", qwen_gdn 4.00" in proc.stdout
    else:
        assert res["kwarm_warmup_s"] is None and res["kwarm_report"] is None
        assert res["kwarm_family_s"] == {}
    assert "| 0.0.fake | %s | cold |" % kwarm in proc.stdout
    assert res["sync"] is None and not any("profile" in r or "profiled" in r for r in res["requests"])
    assert not list(tmp_path.glob("*.prof"))


def test_main_pairs_scenario_with_a_fake_engine(tmp_path):
    out = tmp_path / "pairs.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                           "--scenario", "pairs", "--profile", "0,1", "--out", str(out)], env=fake_engine_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["scenario"] == "pairs" and len(res["requests"]) == 17
    assert [r["jit"] for r in res["requests"]] == [1, 0] * 8 + [0]  # every first compiles, no repeat does
    control = res["requests"][16]
    assert control["control_of"] == 0 and control["repeat_of"] is None and control["len"] == 200
    assert res["control_ratio"] == pytest.approx(control["s"] / res["requests"][1]["s"])
    assert f"control/steady {table.fmt_ratio(res['control_ratio'])}" in proc.stdout
    assert f"first/steady {table.fmt_ratio(res['first_steady_ratio'])} (profiled)," in proc.stdout
    # both requests of the first pair profiled: their diff, once, in the result and the log
    assert [(d["first"], d["repeat"]) for d in res["profile_diffs"]] == [(0, 1)]
    assert proc.stdout.count("profile, request 0 minus its repeat 1, by tottime:") == 1
    assert [r["deepgemm_new"] for r in res["requests"]][6:8] == [1, 0]  # 4x333
    assert [r["len"] for r in res["requests"]][8:10] == [2500, 2500]
    assert [(p["first"], p["repeat"]) for p in res["excess_pairs"]] == [(2 * k, 2 * k + 1) for k in range(8)]
    assert res["excess_s"] == table.excess_s(res)
    assert "excess " in proc.stdout and "## Start cost and first-request excess" in proc.stdout


def test_main_pairs_scenario_with_repeats_and_a_bad_repeats(tmp_path):
    out = tmp_path / "pairs3.json"
    cmd = [sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
           "--scenario", "pairs", "--repeats", "3", "--out", str(out)]
    proc = subprocess.run(cmd, env=fake_engine_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert len(res["requests"]) == 33 and [r["jit"] for r in res["requests"]] == [1, 0, 0, 0] * 8 + [0]
    assert [p["repeats"] for p in res["excess_pairs"]] == [3] * 8
    assert res["excess_noise_s"] == table.excess_noise_s(res) and res["excess_noise_s"] is not None
    assert f"excess {table.excess_cell(res)} ms," in proc.stdout and " ± " in table.excess_cell(res)
    proc = subprocess.run(cmd[:5] + ["--repeats", "2", "--out", str(out)], env=fake_engine_env(tmp_path / "again"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == "engine_bench: --repeats 2 needs --scenario pairs"


NO_CUDA_LINE = "engine_bench: needs a CUDA GPU (torch.cuda.is_available() is False)"


def test_main_without_cuda_stops_before_the_engine(tmp_path):
    """A torch without CUDA: one line and a non-zero exit, before vLLM is imported."""
    events, out = tmp_path / "events", tmp_path / "r.json"
    env = dict(fake_engine_env(tmp_path, cuda=False), FAKE_EVENTS=str(events))
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [NO_CUDA_LINE] == [engine_bench.NO_CUDA]
    assert not events.exists() and not out.exists()  # vllm.engine never imported, LLM() never built


def test_main_without_cuda_real_torch(tmp_path):
    """The test venv's real torch with CUDA_VISIBLE_DEVICES="" (vLLM is not imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KWARM_", "VLLM_", "TRITON_"))}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-deepseek-v32", "--kwarm", "off",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == NO_CUDA_LINE
    assert "Traceback" not in proc.stderr and not out.exists()


def test_main_profiles_requests(tmp_path):
    out = tmp_path / "res" / "run.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                           "--profile", "10,0", "--out", str(out)], env=fake_engine_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["args"]["profile"] == [0, 10]
    assert [r["i"] for r in res["requests"] if r.get("profiled")] == [0, 10]
    assert all("profile" not in r for r in res["requests"] if r["i"] not in (0, 10))
    assert sorted(p.name for p in out.parent.glob("*.prof")) == ["run.req0.prof", "run.req10.prof"]
    for i, inner in ((0, "generate"), (10, "run_mixed")):
        prof = res["requests"][i]["profile"]
        assert prof["file"] == str(out.parent / f"run.req{i}.prof")
        raw = pstats.Stats(prof["file"]).stats  # the raw dump loads and holds the same calls
        assert len(prof["top_cumtime"]) == len(prof["top_tottime"]) == min(engine_bench.PROFILE_ROWS, len(raw))
        assert set(prof["top_cumtime"][0]) == {"func", "ncalls", "tottime", "cumtime"}
        funcs = [r["func"] for r in prof["top_cumtime"]]
        assert any(re.fullmatch(r"bench/engine_bench\.py:\d+\(run_request\)", f) for f in funcs), funcs
        assert any(f.endswith(f"({inner})") for f in funcs), funcs
        cum = [r["cumtime"] for r in prof["top_cumtime"]]
        assert cum == sorted(cum, reverse=True) and prof["total_s"] > 0
        assert any(name == "run_request" for (_, _, name) in raw)
    # the fake vllm package, shortened from its own folder on
    assert any(re.fullmatch(r"vllm/__init__\.py:\d+\(generate\)", r["func"])
               for r in res["requests"][0]["profile"]["top_cumtime"])
    after = proc.stdout.split("request 0 prefill 1x200:", 1)[1].split("request 1 ", 1)[0]
    assert "top 15 by cumtime" in after and "(run_request)" in after
    assert len([line for line in after.splitlines() if "(" in line and line.startswith("  ")]) >= 1
    bad = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--profile", "12",
                          "--out", str(out)], env=fake_engine_env(tmp_path / "x"), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--profile/--cuda-profile/--alloc-stacks [12]" in bad.stderr


def _wait_for(path: Path, line: str, proc, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and line in path.read_text().split():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no {line!r} in {path}")


def test_main_sync_lock_orders_init_and_requests(tmp_path):
    """A lock holder here: exclusive while the engine would initialize, then shared while it
    would measure. The engine's init and first request each come after the release."""
    lock, events, out = tmp_path / "engines.lock", tmp_path / "events", tmp_path / "run.json"
    env = dict(fake_engine_env(tmp_path), FAKE_EVENTS=str(events))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = subprocess.Popen([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                                 "--scenario", "smoke", "--sync-lock", str(lock), "--out", str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(events, "imported", proc)  # just before LLM(): the engine now waits for us
        time.sleep(0.3)
        with events.open("a") as f:
            f.write("released-init\n")
        fcntl.flock(fd, fcntl.LOCK_SH)  # lets init through, holds the requests back
        _wait_for(events, "init", proc)
        time.sleep(0.3)
        with events.open("a") as f:
            f.write("released-requests\n")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout
    assert events.read_text().split() == ["imported", "released-init", "init", "released-requests"] + ["generate"] * 5
    res = json.loads(out.read_text())
    assert res["sync"]["lock"] == str(lock) and res["complete"] is True
    assert res["sync"]["init_wait_s"] > 0 and res["sync"]["requests_wait_s"] > 0
    # disjoint stretches of the run: init_s leaves out the wait for the lock
    sync = res["sync"]
    assert 0 <= res["init_s"] and res["init_s"] + sync["init_wait_s"] + sync["requests_wait_s"] <= res["wall_s"] + 0.06
    assert "for %s" % lock in stdout


def test_tensor_parallel_runs_read_every_ranks_report(tmp_path):
    import engine_bench

    report = tmp_path / "r.json"
    report.write_text(json.dumps({"total_s": 2.5}))
    (tmp_path / "r.json.rank1").write_text(json.dumps({"total_s": 2.25}))
    assert engine_bench.rank_warmups(str(report), 2) == {"0": 2.5, "1": 2.25}
    assert engine_bench.rank_warmups(str(report), 3)["2"] is None, "a missing rank's report is None"
    assert engine_bench.rank_warmups(str(report), 1) is None and engine_bench.rank_warmups(None, 2) is None
    args = engine_bench.parse_args(["tiny-qwen3-next", "--tensor-parallel-size", "2"])
    assert engine_bench.engine_kwargs(args, tmp_path, {})["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_bench.engine_kwargs(engine_bench.parse_args(["m"]), tmp_path, {})


def test_deepgemm_sweep_runs_every_count_on_each_weight_vllm_may_run_on_deepgemm(monkeypatch, capsys):
    import torch
    from vllm.utils import deep_gemm

    class Layer(torch.nn.Module):
        def __init__(self, n, k, dtype=torch.float8_e4m3fn):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(n, k).to(dtype), requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(torch.ones(-(-n // 128), k // 128), requires_grad=False)

    # vLLM's own shape test decides (real); DeepGEMM's kernels cannot exist here: a Hopper
    # GPU stood in for, the GEMM recorded
    monkeypatch.setattr(deep_gemm, "is_deep_gemm_supported", lambda: True)
    calls = []
    monkeypatch.setattr(deep_gemm, "fp8_gemm_nt", lambda a, b, out: calls.append((a[0].shape[0], tuple(b[0].shape), tuple(out.shape))))
    model = torch.nn.Sequential(Layer(2112, 256), Layer(2112, 256), Layer(256, 128), Layer(100, 128),
                                Layer(256, 256, dtype=torch.bfloat16))
    res = engine_bench.deepgemm_sweep(model, 4)
    assert res["weights"] == [[2112, 256], [256, 128]], "each distinct FP8 weight whose N is a multiple of 64"
    assert calls == [(m, (n, k), (m, n)) for n, k in ((2112, 256), (256, 128)) for m in range(1, 5)]
    assert res["calls"] == 8
    with pytest.raises(SystemExit):
        engine_bench.parse_args(["tiny-qwen3-next", "--deepgemm-sweep"])
    assert "--deepgemm-sweep needs --max-num-batched-tokens" in capsys.readouterr().err
    assert engine_bench.parse_args(["m", "--deepgemm-sweep", "--max-num-batched-tokens", "64"]).deepgemm_sweep


def test_alloc_stacks_name_each_new_segment_by_the_frames_that_asked_for_it():
    # a snapshot as torch.cuda.memory._snapshot() gives it with Python stacks recorded: only the
    # segment allocations count, vLLM's and kwarm's frames first, paths from their package on
    site = "/tmp/kwarm-gpu/vllm-0.29.0/site"
    frames = [{"filename": f"{site}/torch/cuda/memory.py", "line": 10, "name": "empty"},
              {"filename": f"{site}/vllm/v1/attention/backends/mla/indexer.py", "line": 512, "name": "build"},
              {"filename": "/usr/lib/python3.12/threading.py", "line": 1, "name": "run"}]
    snapshot = {"segments": [], "device_traces": [[
        {"action": "alloc", "size": 512, "stream": 7, "frames": frames},
        {"action": "segment_alloc", "size": 1400 << 20, "stream": 7, "frames": frames},
        {"action": "segment_alloc", "size": 2 << 20, "stream": 9, "frames": []}]]}
    assert engine_bench.segment_stacks(snapshot) == [
        {"mib": 1400.0, "stream": 7, "frames": ["vllm/v1/attention/backends/mla/indexer.py:512 build",
                                                 "torch/cuda/memory.py:10 empty", "python3.12/threading.py:1 run"]},
        {"mib": 2.0, "stream": 9, "frames": []}]
    assert engine_bench.segment_stacks({}) == []
    args = engine_bench.parse_args(["tiny-qwen3-next", "--alloc-stacks", "0,1"])
    assert args.alloc_stacks == [0, 1]


def test_rank_skew_from_every_ranks_report():
    reports = [{"rank": 0, "started_at": 100.0, "ended_at": 112.5}, {"rank": 1, "started_at": 100.2, "ended_at": 120.0},
               {"rank": 2}]
    assert table.rank_skew(reports) == {"ranks": {"0": 12.5, "1": 19.8}, "end_skew_s": 7.5}
    assert table.rank_skew(reports[:1]) is None
