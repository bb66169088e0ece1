"""Issue 63, item 1: every number of README's headline and BENCHMARKS.md's serving section agrees
with the JSON under bench/published/ (bench/claims.py)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import claims  # noqa: E402


def test_every_checked_number_matches_the_published_json():
    assert claims.check() == []


def test_the_script_exits_zero_and_says_so():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "claims.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert "every checked number matches" in out.stdout


def _docs_copy(tmp_path: Path) -> Path:
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("doc, old, new, expect", [
    # a claimed number changed: the claim is no longer found
    ("README.md", "3.0-3.1 s → 39-52 ms", "3.0-3.1 s → 39-53 ms", "does not say"),
    # a number with no JSON behind it added to a checked paragraph
    ("README.md", "(60.2 against 59.2 s).", "(60.2 against 59.2 s), 1.0-1.5 s before.", "comes from no published JSON"),
    ("BENCHMARKS.md", "the +2% goal is met", "the +2% goal (+33.3%) is met", "comes from no published JSON"),
    # the wrong claims, put back, fail
    ("BENCHMARKS.md", "Cold start 27.6% (GLM-5) of vLLM alone", "Cold start 25% (GLM-5) of vLLM alone", "does not say"),
    ("README.md", "starts cold in 490 s (GLM-5) and 467 s", "starts cold in 490-522 s (GLM-5) and 467 s", "comes from no published JSON"),
    # a serving table row edited
    ("BENCHMARKS.md", "| chat-seed | 4563.5 |", "| chat-seed | 4563.4 |", "serving table row"),
    # a table of the run at vLLM's default memory utilization edited
    ("BENCHMARKS.md", "| launch to ready | 212.88 s |", "| launch to ready | 202.88 s |", "serving table row"),
    # the tiny pair's later run (serve-medians/): its prose, its tables, README's sentence on it
    ("BENCHMARKS.md", "+3.0% (96.3 against 93.5 s)", "+1.9% (96.3 against 93.5 s)", "does not say"),
    ("BENCHMARKS.md", "kwarm's warm requests held back", "kwarm's 4329 warm requests held back",
     "comes from no published JSON"),
    ("BENCHMARKS.md", "json-schema 146 against 100 ms", "json-schema 146 against 110 ms", "does not say"),
    # tiny Qwen3-Next alone with engine step times (serve-steady/ and its step-times.json)
    ("BENCHMARKS.md", "lower than plain's in 12 of the 17 kinds", "lower than plain's in 11 of the 17 kinds",
     "does not say"),
    ("BENCHMARKS.md", "36 summing 95.0 ms without", "36 summing 59.0 ms without", "does not say"),
    ("BENCHMARKS.md", "within 2.3 ms of their repeats'", "within 1.3 ms of their repeats'", "does not say"),
    ("BENCHMARKS.md", "took 27.1 ms (burst", "took 21.7 ms (burst", "does not say"),
    ("BENCHMARKS.md", "Neither allocated per step", "Neither allocated 4321 per step", "comes from no published JSON"),
    # the tiny pair with the cute_dsl family (serve-restart/, its step times and
    # cute_dsl_cache_check.json), and README's sentence on it
    ("BENCHMARKS.md", "-34.5% (76.1 against 116.2 s)", "-33.5% (76.1 against 116.2 s)", "does not say"),
    ("BENCHMARKS.md", "| launch to ready | 116.16 s |", "| launch to ready | 115.16 s |", "serving table row"),
    ("BENCHMARKS.md", "| launch to ready | 250.13 s |", "| launch to ready | 251.13 s |", "serving table row"),
    ("BENCHMARKS.md", "-0.8% (71.3 against 71.9 s)", "-0.8% (71.3 against 72.9 s)", "does not say"),
    ("BENCHMARKS.md", "one step of 22.1 ms", "one step of 12.1 ms", "does not say"),
    ("BENCHMARKS.md", "in 0.022 and 0.010 s", "in 0.022 and 0.011 s", "does not say"),
    ("BENCHMARKS.md", "122.7-207.6 ms; Qwen3-Next's long-prompt", "122.7-217.6 ms; Qwen3-Next's long-prompt", "does not say"),
    ("BENCHMARKS.md", "in 47 of 399 (12%)", "in 46 of 399 (12%)", "does not say"),
    # FlashInfer's GDN prefill compiled on the CPU, checked on the GPU (gdn_early_check.json)
    ("BENCHMARKS.md", "in 53.9 and 59.1 s", "in 43.9 and 59.1 s", "does not say"),
    ("BENCHMARKS.md", "(largest difference 0.0 over 15 and 15 tensors)", "(largest difference 0.0 over 15 and 16 tensors)",
     "does not say"),
    ("README.md", "a first\n  warm restart of -34.5%", "a first\n  warm restart of -31.5%", "does not say"),
    ("README.md", "and -0.8% (71.3 against 71.9 s)", "and -0.6% (71.3 against 71.9 s)", "does not say"),
    # what one capture thread keeps (bench/gemm_capture_threads.py's JSON)
    ("BENCHMARKS.md", "426 after 4", "246 after 4", "does not say"),
])
def test_a_disagreeing_number_fails(tmp_path, doc, old, new, expect):
    root = _docs_copy(tmp_path)
    text = (root / doc).read_text()
    assert old in text
    (root / doc).write_text(text.replace(old, new, 1))
    problems = claims.check(root)
    assert any(expect in p for p in problems), problems


def test_a_changed_result_file_fails(monkeypatch):
    """The JSON is the source: a different first time of the seeded request disagrees with the docs."""
    real = claims.req_s

    def shifted(model, name, kind, occurrence="first", phase=0, folder=claims.SERVE):
        value = real(model, name, kind, occurrence, phase, folder)
        return value + 0.010 if (kind, name, occurrence) == ("chat-seed", "kwarm", "first") else value

    monkeypatch.setattr(claims, "req_s", shifted)
    assert any("seeded" in p for p in claims.check())


def test_numbers_skips_versions_models_and_code():
    assert claims.numbers("vLLM 0.33.0 on an H100, DeepSeek-V3.2 and GLM-5, `sm90_x 12`, p99: 1.31x and 75 ms") \
        == ["1.31", "75"]
