#!/usr/bin/env python3
"""Render engine_bench.py's result JSONs as the markdown tables of BENCHMARKS.md.

    python bench/table.py bench/results/*.json            # full, with Triton keys
    python bench/table.py --no-keys bench/results/*.json  # kernel names and counts only
    python bench/table.py --start-cost bench/results/*.json  # the start-cost section only

Standard library only (no vLLM, torch or Triton), so CI can test it on a recorded
result. One table per (model, scenario); then, per run, the Triton kernels that still
compiled during requests, each with the kwarm family that should own it; last, per
model, the start cost of each run (engine init, kwarm's warmup and its costliest
families) beside the first-request excess it buys back.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
import sys
from pathlib import Path

SCHEMA = "kwarm-engine-bench/1"

# A kernel no family declares (kwarm_ext.families.triton_owners) is for learn-and-replay.
LEARN_AND_REPLAY = "learn-and-replay"


@functools.lru_cache(maxsize=1)
def owners() -> dict:
    """Kernel -> the kwarm family that compiles it at engine start, from the installed kwarm."""
    from kwarm_ext.families import triton_owners

    return triton_owners()


def owner(kernel: str) -> str:
    """The family that should own `kernel` (a Triton qualname): by its last two parts (a kernel
    method of a class, ``BuildPrefillChunkMetadataKernel.kernel`` on vLLM 0.33), else its last."""
    parts = kernel.split(".")
    found = owners()
    return found.get(".".join(parts[-2:])) or found.get(parts[-1], LEARN_AND_REPLAY)


# ---------------------------------------------------------------------------- loading

def load(paths) -> list[dict]:
    """Load result files; files that are not bench results (kwarm reports, ...) are skipped."""
    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"table.py: skipping {path}: {exc}", file=sys.stderr)
            continue
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            print(f"table.py: skipping {path}: not an engine_bench result", file=sys.stderr)
            continue
        data.setdefault("_path", str(path))
        runs.append(data)
    return runs


# ---------------------------------------------------------------------- derived values

def pairs(run: dict) -> list[tuple[int, int]]:
    """(first, repeat) request indices: each request whose repeat exists, with that repeat."""
    return [(r["repeat_of"], r["i"]) for r in run["requests"] if r.get("repeat_of") is not None]


def run_by_index(run: dict) -> dict[int, dict]:
    """Each recorded request by its index ``i``."""
    return {r["i"]: r for r in run["requests"]}


def request_pairs(run: dict) -> list[tuple[dict, dict]]:
    """(first request, its repeat) for every pair whose first request was recorded."""
    by_index = run_by_index(run)
    return [(by_index[f], by_index[rep]) for f, rep in pairs(run) if f in by_index]


def with_repeats(run: dict, first: int) -> list[tuple[dict, dict]]:
    """(request `first`, one of its repeats) for each repeat of it."""
    return [(a, b) for a, b in request_pairs(run) if a["i"] == first]


def steady_s(run: dict, first: int) -> float | None:
    """Request `first`'s steady time: the median of its repeats' times (engine_bench's
    ``--repeats``; one repeat's time with one), None without a repeat."""
    times = [b["s"] for _, b in with_repeats(run, first)]
    return statistics.median(times) if times else None


def spread_s(run: dict, first: int) -> float | None:
    """The sample standard deviation of request `first`'s repeats: how much one run of that
    shape varies with nothing left to meet; None with fewer than two repeats."""
    times = [b["s"] for _, b in with_repeats(run, first)]
    return statistics.stdev(times) if len(times) >= 2 else None


def pair_ratio(run: dict, first: int) -> float | None:
    """Time of request `first` / its steady time (None without a repeat or a zero time)."""
    steady = steady_s(run, first)
    return run_by_index(run)[first]["s"] / steady if steady else None


def first_steady_ratio(run: dict) -> float | None:
    """The headline ratio: request 0 / its repeat (request 1 in both scenarios)."""
    return pair_ratio(run, 0)


def first_steady_profiled(run: dict) -> bool:
    """Whether request 0 or its repeat ran under a profiler or the allocator's recording
    (``profiled``): the headline ratio then includes that overhead, which need not be the same
    in both (results before 2026-12-03's sixth session also timed the recording's snapshot, 3-5
    ms of request 0 alone at published sizes)."""
    return any(r.get("profiled") for pair in with_repeats(run, 0)[:1] for r in pair)


def first_steady_cell(run: dict) -> str:
    """first/steady, marked "(profiled)" when :func:`first_steady_profiled`."""
    cell = fmt_ratio(first_steady_ratio(run))
    return cell + " (profiled)" if first_steady_profiled(run) and cell != "—" else cell


def control_ratio(run: dict) -> float | None:
    """The control request (request 0's shape, run last: ``control_of`` 0) / request 0's
    steady time; None without one. Near first/steady, request 0's excess is not a first-time cost."""
    steady = steady_s(run, 0)
    for request in run["requests"]:
        if request.get("control_of") == 0 and steady:
            return request["s"] / steady
    return None


def first_steady_counters(run: dict) -> dict[str, float]:
    """Request 0 / its repeat in the thread's hardware counters (engine_bench's ``host``),
    for those this host exposed: {"cycles": r, "instructions": r}."""
    for request, repeat in with_repeats(run, 0):
        a, b = request.get("host") or {}, repeat.get("host") or {}
        return {name: a[name] / b[name] for name in ("cycles", "instructions") if a.get(name) and b.get(name)}
    return {}


def excess_pairs(run: dict) -> list[dict]:
    """Each first request that has repeats, with what it cost beyond its steady time:
    ``[{first, repeat, first_s, repeat_s, excess_s}]`` (``repeat``: its first repeat;
    ``repeat_s``: :func:`steady_s`; excess may be negative: noise). With several repeats also
    ``repeats`` (how many) and ``spread_s`` (:func:`spread_s`)."""
    out = []
    firsts = {a["i"]: (a, b) for a, b in reversed(request_pairs(run))}  # each with its first repeat
    for first, (a, b) in sorted(firsts.items()):
        steady = steady_s(run, first)
        if steady is None:
            continue
        row = {"first": first, "repeat": b["i"], "first_s": a["s"], "repeat_s": round(steady, 4),
               "excess_s": round(a["s"] - steady, 4)}
        n = len(with_repeats(run, first))
        if n > 1:
            row.update(repeats=n, spread_s=round(spread_s(run, first), 4))
        out.append(row)
    return out


def excess_s(run: dict) -> float | None:
    """Sum over the first requests that have repeats of first.s - steady s: the seconds the
    requests paid for first-time work (JIT, cuBLAS loads, allocator growth); None without one."""
    found = excess_pairs(run)
    return round(sum(p["excess_s"] for p in found), 4) if found else None


def excess_noise_s(run: dict) -> float | None:
    """One standard deviation of :func:`excess_s` were there no first-time cost at all: each
    first request is one run of its shape, as noisy as one repeat, and its steady time the
    median of k repeats, so each adds spread² (1 + 1/k) (the mean's variance; the median's is
    larger, so this slightly understates). None unless every first request has two repeats or
    more (``engine_bench --repeats``). An excess within twice this is indistinguishable from
    noise on this host."""
    found = excess_pairs(run)
    if not found or any("spread_s" not in p for p in found):
        return None
    return round(math.sqrt(sum(p["spread_s"] ** 2 * (1 + 1 / p["repeats"]) for p in found)), 4)


def total_jit(run: dict) -> int:
    return sum(r["jit"] for r in run["requests"])


def remaining(run: dict) -> list[dict]:
    """Every compile seen during requests: {i, label, name, key, owner}."""
    return [{"i": r["i"], "label": r["label"], "name": k["name"], "key": k.get("key", "?"),
             "owner": owner(k["name"])}
            for r in run["requests"] for k in r.get("kernels", [])]


def owner_counts(run: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in remaining(run):
        counts[item["owner"]] = counts.get(item["owner"], 0) + 1
    return counts


def summarize_report(report: dict | None) -> dict | None:
    """The part of kwarm's KWARM_REPORT that the tables use."""
    if not report:
        return None
    families = []
    for fam, suffix in [(f, "") for f in report.get("families", [])] + [(f, " (after capture)") for f in _after_capture(report)]:
        steps = fam.get("steps", [])
        families.append({
            "name": fam.get("name") + suffix, "status": fam.get("status"), "reason": fam.get("reason"),
            "seconds": fam.get("seconds", 0.0), "steps": len(steps),
            "steps_ran": sum(s.get("status") == "ran" for s in steps),
            "steps_skipped": sum(s.get("status") == "skipped" for s in steps),
            "steps_failed": sum(s.get("status") == "failed" for s in steps),
            "compiled": len(fam.get("compiled", [])),
            "memory": fam.get("memory") or {},  # its largest step's GPU memory (kwarm_ext.memory)
        })
    memory = "; ".join(filter(None, [report.get("memory_summary"),
                                     (report.get("after_capture") or {}).get("memory_summary")]))
    return {"total_s": total_seconds(report), "rank": report.get("rank"), "pid": report.get("pid"),
            "view": bool(report.get("view")), "families": families,
            "compiled": sum(f["compiled"] for f in families), "memory": memory or None,
            "memory_bound": report.get("memory"),
            "line": report.get("summary"),  # kwarm's short summary line (reports before it: None)
            "left_to_requests": report.get("left_to_requests", [])
            + (report.get("after_capture") or {}).get("left_to_requests", [])}


AFTER_CAPTURE = " (after capture)"


def _after_capture(report: dict) -> list:
    """The families a report ran after CUDA-graph capture."""
    return (report.get("after_capture") or {}).get("families", [])


def total_seconds(report: dict | None) -> float | None:
    """All of kwarm's start time in a KWARM_REPORT: the warmup (ahead families included) and the
    after-capture families."""
    if not report or report.get("total_s") is None:
        return None
    return round(float(report["total_s"]) + float((report.get("after_capture") or {}).get("total_s") or 0.0), 4)


def family_seconds(report: dict | None) -> dict[str, float]:
    """{family name: seconds} of the families that ran in kwarm's KWARM_REPORT, those after
    CUDA-graph capture included (a family that ran in both phases: the sum), costliest first."""
    if not report:
        return {}
    found: dict[str, float] = {}
    for fam in list(report.get("families", [])) + _after_capture(report):
        if fam.get("status") == "ran" and fam.get("name"):
            found[fam["name"]] = found.get(fam["name"], 0.0) + float(fam.get("seconds") or 0.0)
    return {name: round(sec, 3) for name, sec in sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))}


def run_family_seconds(run: dict) -> dict[str, float]:
    """A run's {family: seconds}: from its raw kwarm report, else from the report summary
    (older results), else the stored ``kwarm_family_s``; {} for kwarm-off runs."""
    if run.get("kwarm") != "on":
        return {}
    if run.get("kwarm_report"):
        return family_seconds(run["kwarm_report"])
    summary = run.get("kwarm_report_summary")
    if summary:
        fams = [dict(f, name=f["name"].removesuffix(AFTER_CAPTURE)) for f in summary.get("families", [])]
        return family_seconds({"families": fams})
    return dict(run.get("kwarm_family_s") or {})


# -------------------------------------------------------------------------- rendering

def init_cell(run: dict) -> str:
    """Engine init seconds; a start `timeout` ended (``init_cut_s``): ``not done at N``."""
    if run.get("init_s") is None and run.get("init_cut_s") is not None:
        return f"not done at {run['init_cut_s']:.0f}"
    return fmt_s(run.get("init_s"))


def fmt_s(value) -> str:
    """Seconds the way gpu-baseline.md writes them: 127, 3.13, 0.038."""
    if value is None:
        return "—"
    if value >= 10:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def fmt_ratio(value) -> str:
    """Two decimals near 1 (the 1.1x goal needs them), one above 10."""
    if value is None:
        return "—"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def fmt_ms(seconds) -> str:
    """Seconds as milliseconds: 4203, 12.3, -0.4."""
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:.0f}" if abs(ms) >= 100 else f"{ms:.1f}"


def excess_cell(run: dict) -> str:
    """The excess in ms, with ``± noise`` (:func:`excess_noise_s`) where the run measured it."""
    noise = excess_noise_s(run)
    return fmt_ms(excess_s(run)) + (f" ± {fmt_ms(noise)}" if noise is not None else "")


def request_cell(run: dict) -> str:
    """`3.13 (8), 0.038, 1.15 (3)`: seconds per request, JIT count when there was any."""
    cell = ", ".join(fmt_s(r["s"]) + (f" ({r['jit']})" if r["jit"] else "") for r in run["requests"])
    if run.get("complete") is False:  # written after init and each request; the run was cut short
        cell = (cell + ", " if cell else "") + "cut short"
    return cell


def kwarm_mode(run: dict) -> str:
    return run["kwarm"] + (f" ({run['variant']})" if run.get("variant") else "")


def run_label(run: dict) -> str:
    """A run within its model: vLLM release, kwarm mode (and variant), cache label."""
    return f"vLLM {run['versions']['vllm']} · kwarm {kwarm_mode(run)} · {run['cache']['label']} Triton cache"


def run_name(run: dict) -> str:
    return f"{run['model']} · {run_label(run)}"


def _sort_key(run: dict):
    return (run["model"], run["scenario"], run["versions"]["vllm"], run["kwarm"] != "off",
            run.get("variant", ""), run["cache"]["label"] != "cold", run.get("_path", ""))


def render_table(runs: list[dict]) -> str:
    """One markdown table; all runs should share a model and a scenario."""
    longest = max(runs, key=lambda run: len(run["requests"]))
    legend = "; ".join(f"{r['i']} {r['label']}" for r in longest["requests"])
    lines = [
        f"Requests: {legend}.",
        "",
        "| vLLM | kwarm | Triton cache | engine init s | kwarm warmup s | per-request s (JIT) "
        "| total JIT | excess ms | first/steady |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        warm = fmt_s(run.get("kwarm_warmup_s")) if run["kwarm"] == "on" else "—"
        lines.append(f"| {run['versions']['vllm']} | {kwarm_mode(run)} | {run['cache']['label']} "
                     f"| {init_cell(run)} | {warm} | {request_cell(run)} | {total_jit(run)} "
                     f"| {excess_cell(run)} | {first_steady_cell(run)} |")
    return "\n".join(lines)


TOP_FAMILIES = 3


def top_families(run: dict, n: int = TOP_FAMILIES) -> str:
    """kwarm's `n` costliest families of a run: ``eager_gemm 1.20, fused_moe 0.400``."""
    fams = list(run_family_seconds(run).items())
    if not fams:
        return "—"
    cell = ", ".join(f"{name} {fmt_s(sec)}" for name, sec in fams[:n])
    return cell + (f", +{len(fams) - n} more" if len(fams) > n else "")


def jit_cell(run: dict) -> str:
    """Triton compiles during requests, and DeepGEMM kernels when any were JIT-compiled."""
    dg = sum(r.get("deepgemm_new") or 0 for r in run["requests"])
    return f"{total_jit(run)}" + (f" + {dg} DeepGEMM" if dg else "")


def render_start_cost(runs: list[dict]) -> str:
    """Per model, one row per run: what starting cost (engine init, kwarm's warmup and its
    costliest families) beside what the first requests still paid (excess over their
    repeats, first/steady, compiles during requests)."""
    runs = sorted(runs, key=_sort_key)
    models: dict[str, list[dict]] = {}
    for run in runs:
        models.setdefault(run["model"], []).append(run)
    out = ["## Start cost and first-request excess", "",
           "excess: the sum over first requests of first s - steady s (the median of its repeats; "
           "\"± x\": one standard deviation of that sum from the repeats' spread, where each first had 2 or more); "
           "first/steady \"(profiled)\": "
           "request 0 or its repeat ran under a profiler or the allocator's recording, whose overhead it includes; "
           "control: request 0's shape once more, last, over its steady time (nothing left to meet: the noise floor).", ""]
    for model, group in models.items():
        several = len({run["scenario"] for run in group}) > 1
        out += [f"### Start cost: {model}", "",
                "| run | init s | kwarm warmup s | top families s | excess ms | first/steady | control | JIT in requests |",
                "|---|---|---|---|---|---|---|---|"]
        for run in group:
            name = run_label(run) + (f" · `{run['scenario']}`" if several else "")
            if run.get("complete") is False:
                name += " (cut short)"
            warm = fmt_s(run.get("kwarm_warmup_s")) if run["kwarm"] == "on" else "—"
            out.append(f"| {name} | {init_cell(run)} | {warm} | {top_families(run)} "
                       f"| {excess_cell(run)} | {first_steady_cell(run)} | {fmt_ratio(control_ratio(run))} "
                       f"| {jit_cell(run)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_kernels(run: dict, keys: bool = True) -> str:
    """The compiles left during requests of one run, each with its owning family;
    without `keys`, one line per (request, kernel) with a count."""
    items = remaining(run)
    head = f"- **{run_name(run)}**: "
    if not items:
        return head + "no Triton compile during requests."
    counts = ", ".join(f"{k} {v}" for k, v in sorted(owner_counts(run).items()))
    lines = [head + f"{len(items)} compiles ({counts})"]
    if keys:
        for item in items:
            lines.append(f"  - req {item['i']} `{item['name']}` → {item['owner']}: key `{item['key']}`")
        return "\n".join(lines)
    grouped: dict[tuple, int] = {}
    for item in items:
        grouped[(item["i"], item["name"])] = grouped.get((item["i"], item["name"]), 0) + 1
    for (i, name), n in grouped.items():
        lines.append(f"  - req {i} `{name}`{f' ×{n}' if n > 1 else ''} → {owner(name)}")
    return "\n".join(lines)


def render_kwarm(run: dict) -> str | None:
    """One line on kwarm's own warmup (on-runs only)."""
    if run["kwarm"] != "on":
        return None
    summary = run.get("kwarm_report_summary")
    if not summary and run.get("init_cut_s") is not None:
        return f"- **{run_name(run)}**: ended before init was done, at {run['init_cut_s']:.0f} s"
    if not summary:
        return f"- **{run_name(run)}**: no kwarm report (the warmup hook did not run?)"
    fams = "; ".join(
        f"{f['name']} {f['status']}"
        + (f" {fmt_s(f['seconds'])} s, {f['steps_ran']}/{f['steps']} steps, {f['compiled']} compiled"
           if f["status"] == "ran" else f" ({f['reason']})")
        for f in summary["families"])
    return f"- **{run_name(run)}**: warmup {fmt_s(summary.get('total_s'))} s: {fams}"


def render(runs: list[dict], keys: bool = True) -> str:
    runs = sorted(runs, key=_sort_key)
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["model"], run["scenario"]), []).append(run)
    out = []
    for (model, scenario), group in groups.items():
        out += [f"### {model} (scenario `{scenario}`)", "", render_table(group), ""]
        kw = [line for line in map(render_kwarm, group) if line]
        if kw:
            out += ["kwarm warmup:", "", *kw, ""]
        out += ["Triton compiles during requests (kernel → family that should own it):", ""]
        out += [render_kernels(run, keys) for run in group] + [""]
    out += [render_start_cost(runs)]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    keys = "--no-keys" not in args
    start_cost_only = "--start-cost" in args
    paths = [a for a in args if a not in ("--no-keys", "--start-cost")]
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = load(paths)
    if not runs:
        print("table.py: no engine_bench results", file=sys.stderr)
        return 1
    sys.stdout.write(render_start_cost(runs) if start_cost_only else render(runs, keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def rank_skew(reports: list) -> dict | None:
    """Each rank's kwarm warmup seconds and how far apart the ranks' warmups ended (KWARM_REPORT of
    every rank: ``started_at``/``ended_at``, wall clock); None without two timed reports. A rank that
    ends late holds the others at the next collective (issue 62)."""
    timed = [r for r in reports if r and r.get("ended_at") is not None and r.get("started_at") is not None]
    if len(timed) < 2:
        return None
    ends = [r["ended_at"] for r in timed]
    return {"ranks": {str(r.get("rank", i)): round(r["ended_at"] - r["started_at"], 3) for i, r in enumerate(timed)},
            "end_skew_s": round(max(ends) - min(ends), 3)}
