"""bench/step_times.py: each engine step the probe recorded goes to the request whose window holds
it, and the table tells a request slower outside the engine from one with slower steps."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import step_times  # noqa: E402


def _request(kind, occurrence, t0, seconds):
    return {"kind": kind, "occurrence": occurrence, "t0": t0, "t1": t0 + seconds, "s": seconds}


def _run(folder: Path) -> None:
    """Two servers, one kind, a first and three repeats each; kwarm's repeats 40 ms slower, plain's
    and kwarm's steps alike but for one slower step in kwarm's second repeat."""
    requests = {"plain": [], "kwarm": []}
    steps = {"plain": [], "kwarm": []}
    for name, base in (("plain", 1000.0), ("kwarm", 2000.0)):
        for i, occurrence in enumerate(("first", "repeat", "repeat2", "repeat3")):
            t0 = base + 10 * i
            seconds = 0.100 if name == "plain" else 0.140
            if name == "kwarm" and occurrence == "first":
                seconds = 0.200  # 60 ms more than its repeats, all of it outside the engine's steps
            requests[name].append(_request("json-schema", occurrence, t0, seconds))
            for k in range(8):  # 8 steps of 5 ms inside the window
                ms = 25.0 if (name == "kwarm" and occurrence == "repeat2" and k == 0) else 5.0
                if name == "plain" and occurrence == "first" and k == 3:
                    ms = 50.0  # a compile in plain's first: one long step
                steps[name].append([t0 + 0.01 * (k + 1), ms])
            steps[name].append([t0 + 5, 99.0])  # between requests: in no window
    result = {"model": "m", "phases": [{"phase": "cold", "servers": {
        n: {"requests": requests[n]} for n in requests}}]}
    (folder / "m.serve.json").write_text(json.dumps(result))
    for n in steps:
        base = 1000.0 if n == "plain" else 2000.0
        grown = 0 if n == "plain" else 120  # kwarm's engine: a pinned block per step
        lines = [{"t": base - 1, "allocators": {"num_device_alloc": 50, "num_alloc_retries": 0, "num_host_alloc": 8,
                                                "host_alloc_us": 4000}},
                 {"t": 0, "steps": {"EngineCore.step_with_batch_queue": steps[n][:20],
                                    "GPUModelRunner.execute_model": [[t, ms / 2] for t, ms in steps[n][:20]]}},
                 {"t": 1, "steps": {"EngineCore.step_with_batch_queue": steps[n][20:]}},
                 {"t": base + 100, "allocators": {"num_device_alloc": 50, "num_alloc_retries": 0,
                                                  "num_host_alloc": 8 + grown, "host_alloc_us": 4000 + 90 * grown}}]
        (folder / f"m.{n}.cold.stats.{len(n)}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_steps_go_to_the_request_whose_window_holds_them(tmp_path):
    _run(tmp_path)
    rows = {r["server"]: r for r in step_times.kind_rows(json.loads((tmp_path / "m.serve.json").read_text()), tmp_path)}
    assert rows["plain"]["steps"] == 8 and rows["plain"]["steps_ms"] == 40.0 and rows["plain"]["step_ms"] == 5.0
    assert rows["plain"]["request_ms"] == 100.0
    # kwarm's repeats: 40, 60 and 40 ms of steps: the median is 40, its request 140 ms: 100 ms outside the steps
    assert rows["kwarm"]["steps_ms"] == 40.0 and rows["kwarm"]["request_ms"] == 140.0
    # the first against its repeats: kwarm's extra 60 ms lie outside the steps, whose sum varied 40-60 ms
    assert rows["kwarm"]["first_ms"] == 200.0 and rows["kwarm"]["first_steps_ms"] == 40.0
    assert rows["kwarm"]["first_outside_ms"] == 160.0 and rows["kwarm"]["outside_ms"] == 100.0
    assert rows["kwarm"]["steps_ms_range"] == [40.0, 60.0]
    firsts = step_times.render_firsts(list(rows.values()))
    # kwarm's repeat2 had one 25 ms step: its longest; the median of the repeats' longest is 5 ms
    assert rows["kwarm"]["first_longest_step_ms"] == 5.0 and rows["kwarm"]["longest_step_ms"] == 5.0
    assert "| cold | json-schema | kwarm | 200.0 | 140.0 | 40.0 | 40.0 (40.0-60.0) | 5.0 | 5.0 | 5.0 | 5.0 | 160.0 | 100.0 |" \
        in firsts, firsts
    assert "| cold | json-schema | plain | 100.0 | 100.0 | 85.0 | 40.0 (40.0-40.0) | 5.0 | 5.0 | 50.0 | 5.0 | 15.0 | 60.0 |" \
        in firsts, firsts
    table = step_times.render(list(rows.values()))
    assert "| cold | json-schema | plain | 100.0 | 8 | 40.0 | 5.00 |" in table
    assert table.splitlines()[-1].endswith("| 100.0 |"), table


def test_the_command_reads_an_archive_and_says_when_there_is_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _run(run)
    archive = tmp_path / "serve-results.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(run, arcname=".")
    assert step_times.main([str(archive), "--kinds", "json-schema"]) == 0
    out = capsys.readouterr().out
    assert "| cold | json-schema | kwarm | 140.0 |" in out
    # over each server's requests: plain's engine made no block, kwarm's 120 pinned ones (10.8 ms)
    assert "| cold | plain | ? | 101.0 | 0 | 0 | 0 | 0.0 |" in out
    assert "| cold | kwarm | ? | 101.0 | 0 | 0 | 120 | 10.8 |" in out
    # --json: the same rows, to publish beside the result
    assert step_times.main([str(archive), "--json", str(tmp_path / "steps.json")]) == 0
    written = json.loads((tmp_path / "steps.json").read_text())
    assert written["schema"] == "kwarm-step-times/1" and written["source"] == "serve-results.tgz"
    assert {(r["server"], r["request_ms"], r["steps_ms"]) for r in written["kinds"]} == {("plain", 100.0, 40.0),
                                                                                       ("kwarm", 140.0, 40.0)}
    assert [(a["server"], a["num_host_alloc"]) for a in written["allocators"]] == [("plain", 0), ("kwarm", 120)]
    capsys.readouterr()
    for f in run.glob("*.jsonl"):
        f.unlink()
    assert step_times.main([str(run)]) == 1
    assert "no step events" in capsys.readouterr().err
    assert step_times.main([str(tmp_path / "missing")]) == 2


def test_the_benchmark_waits_for_each_processs_line_after_the_last_request(monkeypatch):
    import serve_bench

    slept = []
    monkeypatch.setattr(serve_bench.time, "sleep", slept.append)
    monkeypatch.setenv("SERVE_PROBE_STATS", "5")
    assert serve_bench.stats_wait() == 7.5
    monkeypatch.delenv("SERVE_PROBE_STATS")
    assert serve_bench.stats_wait() == 0.0
    assert slept == [7.5, 0.0]
