#!/usr/bin/env python3
"""Chart engine_bench.py's results as one SVG: start cost beside first-request excess.

    python bench/chart.py OUT.svg bench/results/*.json
    python bench/chart.py --no-requests OUT.svg bench/results/*.json   # bar panels only

Standard library only (no matplotlib). Per (model, vLLM, scenario), one row of two panels:
- engine init seconds, grouped by cache condition (cold, warm, and "replay": empty caches
  with a learned manifest), one bar per kwarm mode; the darker part of a kwarm-on bar is
  kwarm's own warmup;
- the first-request excess in ms (sum over first requests of first s - steady s, the median of their repeats),
  same groups and bars.
Then, per (model, vLLM, scenario, cache label) that has both a kwarm-off and a kwarm-on run,
the seconds of every request (log scale) by request index; hollow markers are repeats.
Results are read with table.py's loader (other JSON files are skipped).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import table  # noqa: E402  (bench/table.py, standard library only)

WIDTH = 1000
BAR_ROW_H = 300
LINE_ROW_H = 300
MARGIN = {"left": 70, "right": 20, "top": 40, "bottom": 60}
FONT = "font-family='sans-serif'"
COLORS = {"off": "#e07b39", "on": "#3b75af", "warmup": "#1f3f66"}
SERIES_COLORS = ["#e07b39", "#3b75af", "#4a9a4a", "#8e5ba8", "#a0522d", "#555555"]
CONDITIONS = ("cold", "warm", "replay")


# ------------------------------------------------------------------------------ data

def condition(run: dict) -> str:
    """The bar group of a run: its cache label, or "replay" for a kwarm-on run that replays
    a learned manifest on empty caches."""
    if run["kwarm"] == "on" and run.get("variant") == "replay":
        return "replay"
    return run["cache"]["label"]


def bar_groups(runs: list[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    """{"model · vLLM v · scenario s": {condition: {kwarm mode: run}}}; when several runs
    fall on one place, the last one (table.py's order) wins."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for run in sorted(runs, key=table._sort_key):
        row = f"{run['model']} · vLLM {run['versions']['vllm']} · {run['scenario']}"
        out.setdefault(row, {}).setdefault(condition(run), {})[run["kwarm"]] = run
    return out


def latency_groups(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """[(title, runs)] per (model, vLLM, scenario, cache label) holding kwarm off and on."""
    groups: dict[tuple, list[dict]] = {}
    for run in sorted(runs, key=table._sort_key):
        key = (run["model"], run["versions"]["vllm"], run["scenario"], run["cache"]["label"])
        groups.setdefault(key, []).append(run)
    return [(f"{model} · vLLM {ver} · {scenario} · {label} Triton cache: seconds per request", group)
            for (model, ver, scenario, label), group in groups.items()
            if {"off", "on"} <= {run["kwarm"] for run in group} and any(r["requests"] for r in group)]


# --------------------------------------------------------------------------- drawing

def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks."""
    raw = span / ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def fmt_tick(value: float) -> str:
    return f"{value:g}"


class Svg:
    def __init__(self, width: int, height: int):
        self.width, self.height, self.items = width, height, []

    def add(self, item: str):
        self.items.append(item)

    def text(self, x, y, s, size=12, anchor="start", rotate=None, weight="normal"):
        rot = f" transform='rotate({rotate} {x:.1f} {y:.1f})'" if rotate else ""
        self.add(f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' "
                 f"font-weight='{weight}' {FONT}{rot}>{escape(str(s))}</text>")

    def rect(self, x, y, w, h, fill, title=None):
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.add(f"<rect x='{x:.1f}' y='{y:.1f}' width='{max(w, 0):.1f}' height='{max(h, 0):.1f}' "
                 f"fill='{fill}'>{tip}</rect>")

    def line(self, x1, y1, x2, y2, stroke="#000", width=1, dash=None):
        d = f" stroke-dasharray='{dash}'" if dash else ""
        self.add(f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' stroke='{stroke}' "
                 f"stroke-width='{width}'{d}/>")

    def render(self) -> str:
        head = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.width}' height='{self.height}' "
                f"viewBox='0 0 {self.width} {self.height}'>")
        bg = f"<rect x='0' y='0' width='{self.width}' height='{self.height}' fill='white'/>"
        return "\n".join([head, bg, *self.items, "</svg>"]) + "\n"


def legend(svg: Svg, x: float, y: float, entries: list[tuple[str, str]]):
    for label, color in entries:
        svg.rect(x, y - 9, 10, 10, color)
        svg.text(x + 14, y, label, size=11)
        x += 24 + 6.5 * len(label)


def bar_panel(svg: Svg, x0: float, y0: float, w: float, h: float, title: str, ylabel: str,
              groups: dict[str, dict[str, dict]], value, part=None, fmt=str):
    """Grouped bars: one group per condition, one bar per kwarm mode (off, on). `value(run)`
    gives a bar's height (None: no bar); `part(run)` a darker lower part of it."""
    svg.text(x0 + w / 2, y0 - 16, title, size=13, anchor="middle", weight="bold")
    left, bottom = x0 + MARGIN["left"], y0 + h - MARGIN["bottom"]
    pw, ph = w - MARGIN["left"] - MARGIN["right"], h - MARGIN["bottom"]
    conds = [c for c in CONDITIONS if c in groups] + sorted(c for c in groups if c not in CONDITIONS)
    values = [value(run) for c in conds for run in groups[c].values()]
    values = [v for v in values if v is not None]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    if hi == lo:
        hi = lo + 1.0
    step = nice_step(hi - lo)
    lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step

    def y(v):
        return bottom - (v - lo) / (hi - lo) * ph

    tick = lo
    while tick <= hi + step / 2:
        svg.line(left, y(tick), left + pw, y(tick), stroke="#ddd")
        svg.text(left - 6, y(tick) + 4, fmt_tick(round(tick, 10)), size=11, anchor="end")
        tick += step
    svg.line(left, y(lo), left, y(hi))
    svg.line(left, y(0), left + pw, y(0))
    svg.text(x0 + 16, bottom - ph / 2, ylabel, size=12, anchor="middle", rotate=-90)
    svg.text(left + pw / 2, bottom + 40, "cache condition (bars: kwarm off, kwarm on)", size=12, anchor="middle")
    if not conds:
        return
    gw = pw / len(conds)
    bw = min(60.0, gw * 0.35)
    for k, cond in enumerate(conds):
        cx = left + gw * (k + 0.5)
        svg.text(cx, bottom + 18, cond, size=12, anchor="middle")
        for j, mode in enumerate(("off", "on")):
            run = groups[cond].get(mode)
            v = value(run) if run else None
            if v is None:
                continue
            bx = cx - bw + j * bw
            top, base = y(max(v, 0.0)), y(min(v, 0.0))
            svg.rect(bx + 2, top, bw - 4, base - top, COLORS[mode], title=f"{table.run_name(run)}: {fmt(v)}")
            p = part(run) if part else None
            if p:
                ptop = y(min(p, v))
                svg.rect(bx + 2, ptop, bw - 4, y(0) - ptop, COLORS["warmup"], title=f"kwarm warmup: {fmt(p)}")
            svg.text(bx + bw / 2, top - 4, fmt(v), size=10, anchor="middle")


def latency_panel(svg: Svg, x0: float, y0: float, w: float, h: float, title: str, runs: list[dict]):
    """Seconds of every request on a log y axis, one series per run."""
    svg.text(x0 + w / 2, y0 - 16, title, size=13, anchor="middle", weight="bold")
    left, bottom = x0 + MARGIN["left"], y0 + h - MARGIN["bottom"]
    pw, ph = w - MARGIN["left"] - MARGIN["right"] - 170, h - MARGIN["bottom"]
    secs = [r["s"] for run in runs for r in run["requests"] if r["s"] > 0]
    n = max(len(run["requests"]) for run in runs)
    lo = 10 ** math.floor(math.log10(min(secs))) if secs else 1e-3
    hi = 10 ** math.ceil(math.log10(max(secs))) if secs else 1.0
    if hi <= lo:
        hi = lo * 10

    def y(v):
        return bottom - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * ph

    def x(i):
        return left + (i + 0.5) * pw / max(n, 1)

    decade = lo
    while decade <= hi * 1.0001:
        svg.line(left, y(decade), left + pw, y(decade), stroke="#ddd")
        svg.text(left - 6, y(decade) + 4, fmt_tick(decade), size=11, anchor="end")
        decade *= 10
    svg.line(left, y(lo), left, y(hi))
    svg.line(left, bottom, left + pw, bottom)
    for i in range(n):
        svg.text(x(i), bottom + 16, str(i), size=10, anchor="middle")
    svg.text(left + pw / 2, bottom + 36, "request index (hollow: a repeat)", size=12, anchor="middle")
    svg.text(x0 + 16, bottom - ph / 2, "seconds (log)", size=12, anchor="middle", rotate=-90)
    for k, run in enumerate(runs):
        color = SERIES_COLORS[k % len(SERIES_COLORS)]
        pts = [(x(r["i"]), y(r["s"]), r) for r in run["requests"] if r["s"] > 0]
        if len(pts) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in pts)
            svg.add(f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='1.5'/>")
        for px, py, r in pts:
            fill = "white" if r.get("repeat_of") is not None else color
            tip = escape(f"{r['i']} {r['label']}: {r['s']} s")
            svg.add(f"<circle cx='{px:.1f}' cy='{py:.1f}' r='3.5' fill='{fill}' stroke='{color}' "
                    f"stroke-width='1.5'><title>{tip}</title></circle>")
        ly = y0 + 10 + 18 * k
        svg.rect(left + pw + 20, ly - 9, 10, 10, color)
        svg.text(left + pw + 34, ly, f"kwarm {table.kwarm_mode(run)}", size=11)


def chart(runs: list[dict], requests: bool = True) -> str:
    """The SVG document for `runs` (engine_bench results)."""
    bars = bar_groups(runs)
    lines = latency_groups(runs) if requests else []
    top = 36
    height = top + len(bars) * BAR_ROW_H + len(lines) * LINE_ROW_H + 10
    svg = Svg(WIDTH, height)
    svg.text(WIDTH / 2, 20, "kwarm: start cost and first-request excess", size=15, anchor="middle", weight="bold")
    legend(svg, MARGIN["left"], top + 4, [("kwarm off", COLORS["off"]), ("kwarm on", COLORS["on"]),
                                          ("of which kwarm warmup", COLORS["warmup"])])
    y0 = top + 40
    half = WIDTH / 2
    for model, groups in bars.items():
        bar_panel(svg, 0, y0, half, BAR_ROW_H - 40, f"{model}: engine init", "init seconds", groups,
                  value=lambda run: run.get("init_s"),
                  part=lambda run: run.get("kwarm_warmup_s") if run["kwarm"] == "on" else None,
                  fmt=table.fmt_s)
        bar_panel(svg, half, y0, half, BAR_ROW_H - 40, f"{model}: first-request excess", "excess ms", groups,
                  value=lambda run: _ms(table.excess_s(run)),
                  fmt=lambda v: table.fmt_ms(v / 1e3))
        y0 += BAR_ROW_H
    for title, group in lines:
        latency_panel(svg, 0, y0, WIDTH, LINE_ROW_H - 40, title, group)
        y0 += LINE_ROW_H
    return svg.render()


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    requests = "--no-requests" not in args
    args = [a for a in args if a != "--no-requests"]
    if len(args) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, paths = Path(args[0]), args[1:]
    runs = table.load(paths)
    if not runs:
        print("chart.py: no engine_bench results", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(chart(runs, requests))
    print(f"chart.py: wrote {out} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
