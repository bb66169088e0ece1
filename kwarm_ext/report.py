"""kwarm's warmup report and summary line: what a worker's families did, in one short line (the
families that ran, how many were skipped and failed, the compiles, the longest family, what was
left to the requests), the per-family detail, the memory line, and the JSON report
(``KWARM_REPORT``) that holds them all. The warmup runner (``kwarm_ext/warmup.py``) fills them."""
from __future__ import annotations

import json
import os

from kwarm_ext import memory

NO_VIEW = "no engine view"
FAMILIES_LEFT = ("failed families", "skipped families")  # left_to_requests' whole families
OUT_OF_MEMORY = "OutOfMemoryError"  # torch's, in a failed step's reason (StepFailed: "<Type>: <message>")


def budget_seconds(description: str) -> str:
    """The budget's seconds (or ``unlimited``) of its description (``budget.begin``'s), for the
    short line: the first words, before the parenthesis that says how they were found."""
    return description.split(" (", 1)[0]


def short_line(results: list) -> str:
    """The short line's text of `results`: the families that ran, how many were skipped and
    failed, the compiles, the longest family and what was left to the requests (the detail:
    :func:`outcome`)."""
    ran = [r for r in results if r.status == "ran"]
    text = (f"ran {', '.join(r.name for r in ran) or '-'}; "
            f"{sum(r.status == 'skipped' for r in results)} skipped; "
            f"{sum(r.status == 'failed' for r in results)} failed; "
            f"{sum(len(r.compiled) for r in results)} compiled")
    loaded = sum(bool(c.get("cache_hit")) for r in results for c in r.compiled)
    if loaded:
        text += f" ({loaded} of them loaded from Triton's disk cache)"
    if ran:
        longest = max(ran, key=lambda r: r.seconds)
        text += f"; largest {longest.name} {longest.seconds:.1f} s"
    left: dict = {}
    for item in left_to_requests(results):
        if item["what"] not in FAMILIES_LEFT:  # counted above
            left[item["what"]] = left.get(item["what"], 0) + item["count"]
    if left:
        text += f"; left to requests: {', '.join(f'{n} {what}' for what, n in left.items())}"
    return text


def left_to_requests(results: list) -> list:
    """What the families of `results` did not warm, as kwarm knows it, so the requests may
    compile it: a failed family or step, a family skipped for want of an engine view, and what a
    family's details say it left (``details["left_to_requests"]``: ``eager_gemm``'s GEMM problems
    past ``KWARM_BUDGET``, ``replay``'s skipped manifest entries). Each item:
    ``{family, step (where one), count, what, why}``."""
    left = []
    for r in results:
        if r.status == "failed" or (r.status == "skipped" and r.reason == NO_VIEW):
            left.append({"family": r.name, "count": 1, "what": FAMILIES_LEFT[r.status == "skipped"], "why": r.reason})
            continue
        for step in r.steps:
            if step["status"] == "failed":
                left.append({"family": r.name, "step": step["name"], "count": 1, "what": "failed steps",
                             "why": step["reason"]})
        left += [{"family": r.name, **item} for item in r.details.get("left_to_requests") or []]
    return left


def outcome(results: list) -> str:
    """`ran A | B; skipped C (why); failed -`: the families of one detail line."""
    def short(status, sep):
        return sep.join(r.short() for r in results if r.status == status) or "-"

    return f"ran {short('ran', ' | ')}; skipped {short('skipped', ', ')}; failed {short('failed', ', ')}"


def learning_text(learning) -> str:
    if learning is None:
        return ""
    return f"; learning: {learning.recorder.recorded} newly learned so far -> {learning.path}"


def node_cache_counts() -> dict | None:
    """This rank's Triton compiles and loads of another rank's, where kwarm's cache manager is in use."""
    try:
        from kwarm_ext.surfaces.triton import node_cache
    except Exception:  # noqa: BLE001  (no Triton)
        return None
    return node_cache.counts_in_use()


def memory_summary(report: dict, results: list) -> str | None:
    """The memory line's text (also ``report["memory_summary"]``): kwarm's memory bound and the
    step that took the most (the report has them all); None where neither is known."""
    bound = report.get("memory")
    top = memory.largest((f"{r.name}.{r.memory['step']}", r.memory) for r in results if r.memory)
    if not bound and top is None:
        return None
    text = (f"bound {memory.gib(bound['headroom'])} above {memory.gib(bound['base_allocated'])} allocated "
            f"({bound['how']})" if bound else "unbounded")
    if top is not None:
        name, used = top
        text += (f"; largest step {name}: peak {memory.gib(used.get('peak_allocated'))} allocated"
                 + (f" (+{memory.gib(used['above_base'])})" if "above_base" in used else "")
                 + f", {memory.gib(used.get('peak_reserved'))} reserved")
    oom = [f"{r.name}.{s['name']}" for r in results for s in r.steps
           if s["status"] == "failed" and OUT_OF_MEMORY in (s.get("reason") or "")]
    if oom:
        text += f"; out of memory within the bound, skipped: {', '.join(oom)}"
    report["memory_summary"] = text
    return text


def report_path(path: str, rank: int) -> str:
    """Where rank `rank`'s report of KWARM_REPORT `path` goes: ``{rank}`` in `path` is the rank,
    else ranks > 0 get ``.rank<N>``."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return f"{path}.rank{rank}" if rank else path


def write_report(report: dict, path: str, rank: int) -> str:
    """Write atomically to :func:`report_path`; returns that path."""
    path = report_path(path, rank)
    from kwarm_ext.manifest_files import check_writable_target, write_atomic

    check_writable_target(path)  # never replace a device, a FIFO, a link or another user's file
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(report, indent=1, default=str))  # O_EXCL|O_NOFOLLOW temporary, fchmod
    return path


def kwarm_version() -> str:
    from kwarm_ext._version import __version__

    return __version__
