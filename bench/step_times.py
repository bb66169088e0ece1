#!/usr/bin/env python3
"""The engine's step times inside each request of a serving benchmark run: where a request's time
goes, server against server (``serve_bench.py`` with ``SERVE_PROBE_STATS`` set).

The probe (``serve_probe/sitecustomize.py``) writes, per server process, each engine step's end
time and milliseconds (``EngineCore.step_with_batch_queue`` or ``EngineCore.step``, and the model
runner's ``execute_model`` and ``sample_tokens``). This assigns each step to the request whose
wall-clock window holds its end (requests run one at a time) and prints, per phase, request kind
and server, the median over the kind's repeats of: the request's time, its engine steps, their
summed time and the median step. A request slower on one server with the same steps' sum spent
its time outside the engine core (the API server, the transport); a slower steps' sum says which
of the step's parts grew. A second table sets each kind's first against its repeats, split the same
way: a first-use cost outside the engine core, or in its steps, beside how much the repeats' steps'
sum varies by itself. A third gives how many blocks torch's CUDA allocators made anew (cudaMalloc,
cudaHostAlloc) in each engine process over the requests.

    python3 bench/step_times.py bench/results/serve                  # a serve_run.sh output folder
    python3 bench/step_times.py serve-results.tgz                      # or its archive
    python3 bench/step_times.py DIR --kinds json-schema,chat-greedy    # some kinds only
    python3 bench/step_times.py DIR --json step-times.json             # and the rows as JSON (to publish)

Needs only the standard library.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench  # noqa: E402

STEP_KEYS = ("EngineCore.step_with_batch_queue", "EngineCore.step")  # one of them runs, per engine
PART_KEYS = ("GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens")


def stats_lines(folder: Path, model: str, server: str, phase: str) -> list[list[dict]]:
    """The probe's lines of each of `server`'s processes in `phase`, one list per process."""
    out = []
    for path in sorted(folder.glob(f"{model}.{server}.{phase}.stats.*.jsonl")):
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        out.append(lines)
    return out


def load_steps(folder: Path, model: str, server: str, phase: str) -> dict:
    """Every step event of `server`'s processes in `phase`: key -> sorted [[end time, ms], ...]."""
    out: dict = {}
    for lines in stats_lines(folder, model, server, phase):
        for rec in lines:
            for key, events in (rec.get("steps") or {}).items():
                out.setdefault(key, []).extend(e for e in events if isinstance(e, list) and len(e) == 2)
    return {k: sorted(v) for k, v in out.items()}


def in_window(events: list, t0: float, t1: float) -> list:
    return [ms for t, ms in events if t0 <= t <= t1]


def request_steps(steps: dict, rec: dict) -> dict:
    """The engine's steps inside one request record: count, summed and median ms of the step, and
    the summed ms of each of its parts."""
    t0, t1 = rec.get("t0"), rec.get("t1")
    if t0 is None or t1 is None:
        return {}
    key = next((k for k in STEP_KEYS if steps.get(k)), None)
    if key is None:
        return {}
    inside = in_window(steps[key], t0, t1)
    out = {"steps": len(inside), "steps_ms": sum(inside), "step_ms": statistics.median(inside) if inside else None,
           "longest_step_ms": max(inside, default=None)}
    for part in PART_KEYS:
        if steps.get(part):
            out[part.split(".")[-1] + "_ms"] = sum(in_window(steps[part], t0, t1))
    return out


def kind_rows(result: dict, folder: Path, kinds: set | None = None) -> list[dict]:
    """One row per phase, kind and server: medians over the kind's repeats."""
    rows = []
    for phase in result.get("phases", []):
        for name, server in phase.get("servers", {}).items():
            steps = load_steps(folder, result["model"], name, phase["phase"])
            if not steps:
                continue
            for pair in serve_bench.pairs(server.get("requests") or []):
                if kinds and pair["kind"] not in kinds:
                    continue
                reps = [pair[o] for o in serve_bench.REPEATS if pair.get(o) and pair[o].get("s") is not None]
                if not reps:
                    continue
                per = [(1000 * r["s"], request_steps(steps, r)) for r in reps]
                per = [(ms, p) for ms, p in per if p]
                row = {"phase": phase["phase"], "kind": pair["kind"], "server": name,
                       "request_ms": statistics.median(1000 * r["s"] for r in reps)}
                for field in ("steps", "steps_ms", "step_ms", "longest_step_ms", "execute_model_ms", "sample_tokens_ms"):
                    values = [p[field] for _, p in per if p.get(field) is not None]
                    row[field] = statistics.median(values) if values else None
                sums = [p["steps_ms"] for _, p in per]
                row["steps_ms_range"] = [min(sums), max(sums)] if sums else None
                row["outside_ms"] = statistics.median(ms - p["steps_ms"] for ms, p in per) if per else None
                first = pair.get("first")
                if first and first.get("s") is not None:
                    own = request_steps(steps, first)
                    row["first_ms"] = 1000 * first["s"]
                    row["first_steps_ms"] = own.get("steps_ms")
                    row["first_outside_ms"] = None if own.get("steps_ms") is None else row["first_ms"] - own["steps_ms"]
                    row["first_step_ms"], row["first_longest_step_ms"] = own.get("step_ms"), own.get("longest_step_ms")
                rows.append(row)
    return rows


SCHEMA = "kwarm-step-times/1"
ALLOCATOR_KEYS = ("num_device_alloc", "num_alloc_retries", "num_host_alloc", "host_alloc_us")


def allocations(result: dict, folder: Path) -> list[dict]:
    """Per phase, server and process that initialized CUDA: how much torch's allocators' counters
    (the probe's ``allocators``) grew over the server's requests, from its last line before the
    first request to its first line after the last one. Blocks made anew at steady state (a
    cudaMalloc or cudaHostAlloc per step) show here."""
    out = []
    for phase in result.get("phases", []):
        for name, server in phase.get("servers", {}).items():
            times = [(r["t0"], r["t1"]) for r in server.get("requests") or [] if "t0" in r and "t1" in r]
            if not times:
                continue
            t0, t1 = min(t for t, _ in times), max(t for _, t in times)
            for process in stats_lines(folder, result["model"], name, phase["phase"]):
                lines = [rec for rec in process if rec.get("allocators")]
                before = [x for x in lines if x["t"] <= t0]
                after = [x for x in lines if x["t"] >= t1]
                if not before or not after:
                    continue
                a, b = before[-1]["allocators"], after[0]["allocators"]
                grew = {k: (b.get(k) or 0) - (a.get(k) or 0) for k in ALLOCATOR_KEYS}
                out.append({"phase": phase["phase"], "server": name, "proc": after[0].get("proc"),
                            "seconds": after[0]["t"] - before[-1]["t"], **grew})
    return out


def render_allocations(rows: list[dict]) -> str:
    out = ["| phase | server | process | window s | cudaMalloc blocks | OOM retries | cudaHostAlloc blocks | "
           "cudaHostAlloc ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r['server']} | {r['proc'] or '?'} | {r['seconds']:.1f} | {r['num_device_alloc']} | "
                   f"{r['num_alloc_retries']} | {r['num_host_alloc']} | {r['host_alloc_us'] / 1000:.1f} |")
    return "\n".join(out)


def render(rows: list[dict]) -> str:
    def num(v, fmt="{:.1f}"):
        return "—" if v is None else fmt.format(v)

    out = ["| phase | kind | server | request ms | engine steps | steps' sum ms | median step ms | "
           "execute_model ms | sample_tokens ms | outside the steps ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["kind"], r["server"] != "plain", r["server"])):
        outside = None if r["steps_ms"] is None else r["request_ms"] - r["steps_ms"]
        out.append(f"| {r['phase']} | {r['kind']} | {r['server']} | {num(r['request_ms'])} | "
                   f"{num(r['steps'], '{:g}')} | {num(r['steps_ms'])} | {num(r['step_ms'], '{:.2f}')} | "
                   f"{num(r['execute_model_ms'])} | {num(r['sample_tokens_ms'])} | {num(outside)} |")
    return "\n".join(out)


def render_firsts(rows: list[dict]) -> str:
    """Each kind's first against its repeats, split at the engine: a first-use cost outside the engine
    core (the API server, tokenizer, detokenizer, transport) shows in the outside column, one in the
    engine in the steps' sum; the repeats' range of that sum is how much it varies without one. A
    compile or other lazy work in the engine is one long step; a first whose every step is slower
    (its median step) met the host in another state, not work left to do."""
    def num(v):
        return "—" if v is None else f"{v:.1f}"

    out = ["| phase | kind | server | first ms | repeats ms | first: steps' sum ms | repeats: steps' sum ms (range) | "
           "first: median step ms | repeats: median step ms | first: longest step ms | repeats: longest step ms | "
           "first: outside the steps ms | repeats: outside ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["phase"], r["kind"], r["server"] != "plain", r["server"])):
        if r.get("first_ms") is None:
            continue
        spread = r.get("steps_ms_range")
        sums = num(r["steps_ms"]) + ("" if not spread else f" ({spread[0]:.1f}-{spread[1]:.1f})")
        out.append(f"| {r['phase']} | {r['kind']} | {r['server']} | {num(r['first_ms'])} | {num(r['request_ms'])} | "
                   f"{num(r.get('first_steps_ms'))} | {sums} | {num(r.get('first_step_ms'))} | {num(r.get('step_ms'))} | "
                   f"{num(r.get('first_longest_step_ms'))} | {num(r.get('longest_step_ms'))} | "
                   f"{num(r.get('first_outside_ms'))} | {num(r.get('outside_ms'))} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="serve_run.sh's output folder or its serve-results.tgz")
    ap.add_argument("--kinds", help="comma list of request kinds (default: all)")
    ap.add_argument("--json", metavar="OUT", help="also write both tables' rows to OUT (compact JSON)")
    args = ap.parse_args(argv)
    source = Path(args.source)
    if not source.exists():
        print(f"step_times: {source}: no such file or folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = source
        if source.is_file():
            try:
                with tarfile.open(source) as tar:
                    if hasattr(tarfile, "data_filter"):  # 3.12, and 3.8.17+/3.11.4+
                        tar.extractall(tmp, filter="data")
                    else:
                        tar.extractall(tmp)
            except (tarfile.TarError, OSError) as exc:
                print(f"step_times: {source}: not a readable archive ({exc})", file=sys.stderr)
                return 2
            folder = Path(tmp)
        kinds = set(args.kinds.split(",")) if args.kinds else None
        results = sorted(folder.rglob("*.serve.json"))
        rows, grown = [], []
        for path in results:
            result = json.loads(path.read_text())
            rows += kind_rows(result, path.parent, kinds)
            grown += allocations(result, path.parent)
    if not rows:
        print(f"step_times: no step events in {source} (was SERVE_PROBE_STATS set on the GPU host?)", file=sys.stderr)
        return 1
    print(render(rows))
    print("\nEach kind's first against its repeats (the repeats' medians):\n")
    print(render_firsts(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"schema": SCHEMA, "source": source.name, "kinds": rows,
                                               "allocators": grown}, separators=(",", ":")) + "\n")
    if grown:
        print("\nBlocks torch's allocators made during the requests:\n")
        print(render_allocations(grown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
