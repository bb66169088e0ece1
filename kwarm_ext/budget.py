"""kwarm's start-time budget (``KWARM_BUDGET``): how long optional warmup work may run.

Why: some warmups buy less than they cost. cuBLAS's first call at a token count nobody
warmed costs about 0.3 ms per weight shape, or 2-5 ms where it also loads a kernel
(BENCHMARKS.md, "cuBLAS GEMMs"); covering every token count of a published-size model
took 9-35 s of start. Work that removes a Triton or DeepGEMM compile (seconds of one
request) always runs, and so do the token counts a deployment really steps at and
``eager_gemm``'s kernel grid (about 1 s at published sizes; it loads most kernels cuBLAS
picks); its fill of the token counts between runs until the budget is spent, and the summary
line says what was left to the requests. The budget counts from the start of the warmup: the
work that always runs spends it first, except a family's time on a start where it compiled
Triton kernels (:func:`credit`): on a cold cache the compiles alone would spend it.

The budget of one worker's warmup, from ``KWARM_BUDGET``:

- ``auto`` (default): 2% of the time this process ran before kwarm's warmup started
  (vLLM's own start: imports, model load, compile, profiling, KV cache), at least 1 s;
- ``N`` or ``Ns``: N seconds; ``N%``: N% of that time, at least 1 s;
- ``unlimited``: everything, whatever it costs.

Why 2% and 1 s: a warm restart of ``kwarm run -- vllm serve`` should cost at most 2% more than
``vllm serve`` alone (issue 60). With 8% and 1.5 s (vLLM 0.33.0, tiny models, H100, BENCHMARKS.md)
the warm restart's warmup took 2.0 and 3.5 s, ``eager_gemm``'s fill most of it (2.8 s of 3.5),
against 56-60 s of vLLM's own start. What the fill buys is small: cuBLAS's choice at a token count
no pass warmed, about 0.2-0.3 ms per weight shape, and a kernel load (2-5 ms) about every 14 first
calls off the grid, which the grid and the learned counts already load. The budget is not all of
kwarm's time: work that always runs may have spent it already, and the after-capture families run
after it.
"""
from __future__ import annotations

import os
import time

FLOOR_S = 1.0
CREDIT_LIMIT_PERCENT = 14.0  # a percent budget's credits stop at this share of the time before warmup
_deadline: float | None = None  # time.monotonic() after which optional work stops
_limit: float | None = None  # the latest a credit may move the deadline to (None: no limit)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def seconds_for(spec: tuple, age_s: float | None) -> tuple[float | None, str]:
    """(seconds or None for unlimited, a description) of a parsed ``KWARM_BUDGET``."""
    kind, value = spec
    if kind == "unlimited":
        return None, "unlimited"
    if kind == "seconds":
        return value, f"{value:g} s"
    if age_s is None:
        return FLOOR_S, f"{FLOOR_S:g} s ({value:g}% of an unknown start time, at least {FLOOR_S:g} s)"
    seconds = max(FLOOR_S, age_s * value / 100)
    return seconds, f"{seconds:.1f} s ({value:g}% of {age_s:.1f} s before warmup, at least {FLOOR_S:g} s)"


def begin(spec: tuple) -> str:
    """Start this warmup's clock; returns the description for the summary line."""
    global _deadline, _limit
    age = process_age_s()
    seconds, description = seconds_for(spec, age)
    now = time.monotonic()
    _deadline = None if seconds is None else now + seconds
    _limit = None
    if spec[0] == "percent" and seconds is not None:
        _limit = now + max(seconds, (age or 0.0) * CREDIT_LIMIT_PERCENT / 100)
    return description


def credit(seconds: float) -> None:
    """Give `seconds` back to optional work: a family's time on a start where it compiled, not
    where it loaded its kernels from Triton's disk cache (``kwarm_ext.warmup`` calls this,
    ``compiled_for_real`` tells them apart). Those compiles always run, since each would cost a request
    seconds, so on a cold cache they spent the budget before ``eager_gemm``'s fill came: on vLLM
    0.29.0 with the published-size DeepSeek-V3.2, cold, they took 8.4 s of a 7.6-8.9 s budget,
    the fill got nothing and request 0 cost 1.34x its repeat (BENCHMARKS.md). A percent budget
    (``auto``) is credited up to :data:`CREDIT_LIMIT_PERCENT` of the time before warmup, which is
    about 85% of vLLM's own cold start: the cold bound is 15% of that start. With no limit the
    tiny DeepSeek-V3.2 (vLLM 0.29.0, cold) warmed 13.5 s after 74 s. Past that limit optional
    work still gets :data:`FLOOR_S` after the family that compiled: with the limit alone the
    tiny DeepSeek-V3.2's compiles took 8.6 of its 8.3 s, its fill got nothing and request 0
    paid 10.7 ms for the token counts it had not warmed (BENCHMARKS.md), at +7% of its start."""
    global _deadline
    if _deadline is not None and seconds > 0:
        _deadline += seconds
        if _limit is not None:  # the deadline starts at or before the limit
            _deadline = max(min(_deadline, _limit), time.monotonic() + FLOOR_S)


def left() -> float:
    """Seconds left for optional work (``inf`` when unlimited, <= 0 once spent)."""
    return float("inf") if _deadline is None else _deadline - time.monotonic()


def reset() -> None:
    """No budget (tests; a process that never began a warmup)."""
    global _deadline, _limit
    _deadline = _limit = None
