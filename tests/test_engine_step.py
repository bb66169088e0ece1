"""The warm-up engine step (kwarm_ext/engine_step.py) against each release's real ``EngineCore``
class (its ``__init__`` wrapped, its own ``add_request`` and ``abort_requests``), ``Request`` and
``SamplingParams``; the engine's scheduler and executor are stand-ins (they need a GPU)."""
from __future__ import annotations

import json

import pytest

from conftest import MATRIX, cpu_triton_env, release_path, result_of, run_scenario

RELEASES = tuple(r for r in (*MATRIX, "0.33.0") if r == "0.24.0" or release_path(r) is not None)

CASES = {
    "plain": {"config": {}},
    "no_graphs": {"config": {"capture": [], "max_capture": None}},
    "short_model": {"config": {"max_model_len": 20, "vocab": 12}},
    "one_seq": {"config": {"batched": 100, "seqs": 1}},
    "dp": {"config": {"dp": 2}},
    "connector": {"config": {"connector": True}},
    "pooling": {"config": {"runner_type": "pooling"}},
    "held": {"config": {}, "held": True},
    "fails": {"config": {}, "fail_at": 2},
}


def _run(release: str, **env) -> dict:
    env.setdefault("KWARM_ENABLE", "1")
    return result_of(run_scenario("engine_step", CASES, release=release, env=cpu_triton_env(**env), timeout=240))


@pytest.fixture(scope="module")
def results():
    return {}


def _cases(results, release):
    if release not in results:
        results[release] = _run(release)
    return results[release]["cases"]


@pytest.mark.parametrize("release", RELEASES)
def test_a_full_step_then_a_small_request_through_vllms_own_add_request(release, results):
    r = _cases(results, release)["plain"]
    assert r["inits"] == 1 and r["raised"] is None, "vLLM's own __init__ runs first, once"
    # max_num_batched_tokens 8192, max_model_len 4096 (prompts of at most 4091), then 33 tokens:
    # one more than the largest capture size (32), the eager prefill path of a small request
    assert [a["prompt"] for a in r["added"]] == [4091, 4091, 10, 33]
    assert [a["id"] for a in r["added"]] == ["kwarm-engine-step-warmup-0-0", "kwarm-engine-step-warmup-0-1",
                                             "kwarm-engine-step-warmup-0-2", "kwarm-engine-step-warmup-1-0"]
    assert all(a["max_tokens"] == 4 and a["ignore_eos"] and a["temperature"] == 0.0 for a in r["added"])
    assert r["added"][1]["first_ids"] == [11, 12, 13], "each prompt its own token ids"
    assert r["steps"] == 8 and r["post_steps"] == 8, "each round until done, vLLM's post_step after each step"
    assert r["held"] == [] and r["aborted"] == [], "finished by their own steps, nothing aborted"
    assert r["resets"] == 1, "the prefix cache is reset: no later request hits the warm-up's blocks"
    assert any("engine step: warm-up requests (4091+4091+10 then 33 prompt tokens) in 8 steps" in m
               for m in r["logs"]), r["logs"]


@pytest.mark.parametrize("release", RELEASES)
def test_prompts_fit_the_model_the_step_and_the_vocabulary(release, results):
    cases = _cases(results, release)
    assert cases["no_graphs"]["added"][-1]["prompt"] == 16, "at least 16 tokens without CUDA graphs"
    short = cases["short_model"]["added"]
    assert [a["prompt"] for a in short] == [20 - 4 - 1] * 16 + [15], \
        "max_num_seqs (16) requests within max_model_len, then the small one as long as the model allows"
    assert short[0]["first_ids"] == [10, 11, 10], "token ids within the vocabulary"
    one = cases["one_seq"]["added"]
    assert [a["prompt"] for a in one] == [100, 33], "one step's token budget (100), one sequence"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case, why", [("dp", "data parallel size 2"), ("connector", "KV connector"),
                                       ("pooling", "pooling model"), ("held", "already holds requests")])
def test_engines_where_a_step_of_its_own_would_disturb_take_none(release, case, why, results):
    r = _cases(results, release)[case]
    assert r["inits"] == 1 and r["added"] == [] and r["steps"] == 0 and r["raised"] is None
    assert [m for m in r["logs"] if "engine step: skipped" in m and why in m], r["logs"]


@pytest.mark.parametrize("release", RELEASES)
def test_a_failing_step_is_one_warning_the_request_aborted_and_the_engine_built(release, results):
    r = _cases(results, release)["fails"]
    assert r["inits"] == 1 and r["raised"] is None, "nothing reaches vLLM"
    assert sorted(r["aborted"]) == ["kwarm-engine-step-warmup-0-0", "kwarm-engine-step-warmup-0-1",
                                    "kwarm-engine-step-warmup-0-2"] and r["held"] == [], "never left in the scheduler"
    assert r["resets"] == 1
    warnings = [m for m in r["logs"] if "engine step failed" in m]
    assert len(warnings) == 1 and "RuntimeError: the executor died" in warnings[0]


def test_strict_mode_raises_and_warmups_without_it_take_no_step():
    strict = _run("0.24.0", KWARM_STRICT="1")["cases"]["fails"]
    assert strict["raised"] == "RuntimeError: the executor died"
    assert len(strict["aborted"]) == 3 and strict["held"] == []
    off = _run("0.24.0", KWARM_WARMUPS="*,-engine_step")["cases"]["plain"]
    assert off["inits"] == 1 and off["added"] == [] and off["steps"] == 0


def test_its_seconds_join_the_rank0_report(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kwarm_ext import engine_step

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"total_s": 1.5, "families": [], "after_capture": {"total_s": 0.25, "families": []}}))
    settings = SimpleNamespace(report=str(path))
    engine_step._report(engine_step.Outcome("ran", seconds=0.125, prompt_tokens=33, steps=4, rounds=[[33]]), settings)
    report = json.loads(path.read_text())
    assert report["engine_step"]["total_s"] == 0.125
    assert report["engine_step"]["families"][0]["details"] == {"prompt_tokens": 33, "steps": 4, "rounds": [[33]]}
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import table

    assert table.total_seconds(report) == 1.875, "warmup + after capture + engine step"
    assert table.family_seconds(report) == {"engine_step": 0.125}
    missing = SimpleNamespace(report=str(tmp_path / "none.json"))
    engine_step._report(engine_step.Outcome("ran"), missing)
    assert not (tmp_path / "none.json").exists(), "no worker report, nothing written"
