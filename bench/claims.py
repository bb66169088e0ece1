#!/usr/bin/env python3
"""Every number of README's headline and BENCHMARKS.md's serving section, checked against the
JSON under bench/published/.

    python3 bench/claims.py          # prints each disagreement, exits 1 if there is one

Each claim is a phrase rendered here from the published JSON; it must appear word for word in its
document. The serving tables of BENCHMARKS.md must equal `serve_bench.py --table`'s rendering of
the same JSON, and every number in the checked paragraphs (README's "Measured" and "Block-FP8"
paragraphs, BENCHMARKS.md's "What this shows" bullets) must be one a claim of that document gives
(or a setting of the benchmark, listed in SETTINGS). A number changed in the prose, or a result
file changed under it, fails tests/test_claims.py. Standard library only.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUB = ROOT / "bench" / "published"
SERVE = PUB / "vllm0.33.0-flashinfer-h100" / "serve"
SERVE_092 = PUB / "vllm0.33.0-flashinfer-h100" / "serve-0.92"
# the tiny pair again at a later commit, each kind's repeat the median of three
SERVE_MEDIANS = PUB / "vllm0.33.0-flashinfer-h100" / "serve-medians"
SERVE_STEADY = PUB / "vllm0.33.0-flashinfer-h100" / "serve-steady"  # tiny Qwen3-Next alone, engine step times
SERVE_RESTART = PUB / "vllm0.33.0-flashinfer-h100" / "serve-restart"  # the tiny pair with the cute_dsl family
QWEN, DSV = "tiny-qwen3-next", "tiny-deepseek-v32"
BIG, BIG_DSV = "qwen3-next-80b-a3b-4l", "deepseek-v32-2l"
NAMES = {QWEN: "Qwen3-Next", DSV: "DeepSeek-V3.2"}

# Numbers in the checked paragraphs that are settings of the benchmark, not results.
SETTINGS = {
    # the burst's 16 concurrent streams (serve_bench.BURST); the sweep's 8192 token counts
    # (max_num_batched_tokens)
    "README.md": {"16", "8192", "0.92"},
    # 16 streams; the 1.1x and 10 ms bars; HTTP 500, token 0; vLLM's default memory utilization;
    # issue 60's goals (ready in 80% of vLLM alone's time, a warm restart within +2%)
    "BENCHMARKS.md": {"16", "10", "1.1", "500", "0", "0.92", "80", "2"},
}

# (document, first line of the paragraph or block, the line that ends it (exclusive) or "" for a blank line)
REGIONS = [
    ("README.md", "**Measured**", ""),
    ("README.md", "Block-FP8 checkpoints", ""),
    ("BENCHMARKS.md", "**What this shows**", "## The tiny pair again"),
    ("BENCHMARKS.md", "**What this run shows**", "## Tiny Qwen3-Next alone, with engine step times"),
    ("BENCHMARKS.md", "**At steady state**", "## The tiny pair at the current code"),
    ("BENCHMARKS.md", "**At the current code**", "### tiny-deepseek-v32, cold start"),
    ("BENCHMARKS.md", "**On the H100**", ""),
]

NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)\d+(?:\.\d+)?(?![\w.]*\d)(?![A-WYZa-wyz_])")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def serve(model: str, folder: Path = SERVE) -> dict:
    return load(folder / f"{model}.serve.json")


def server(model: str, name: str, folder: Path = SERVE) -> dict:
    return phase_server(model, 0, name, folder)


def req_s(model: str, name: str, kind: str, occurrence: str = "first", phase: int = 0,
          folder: Path = SERVE) -> float | None:
    """The request's headline time (TTFT for stream kinds, p99 TTFT for the burst) in seconds, in
    `phase` (0 cold, 1 the warm restart); for "repeat", the median of the kind's repeats: what the
    tables show (``serve_bench.headline_time``, ``serve_bench.repeat_time``)."""
    sb = _bench("serve_bench")
    row = next((r for r in sb.pairs(phase_server(model, phase, name, folder)["requests"]) if r["kind"] == kind), {})
    return sb.repeat_time(row) if occurrence == "repeat" else sb.headline_time(row.get(occurrence))


def _bench(name: str):
    """A module of bench/ (serve_bench renders the serving tables, table the engine's; their
    imports are the standard library's)."""
    import importlib

    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module(name)


def ms(seconds) -> str:
    return f"{seconds * 1000:.0f}"


def s1(seconds) -> str:
    return f"{seconds:.1f}"


def span(values, fmt) -> str:
    """``a-b`` of the smallest and largest, as formatted (one value if they format the same)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def pct(new, old) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def share(new, old) -> str:
    """`new` as a percentage of `old` (issue 60's goal: kwarm ready in at most 80% of vLLM alone's time)."""
    return f"{100 * new / old:.1f}%"


def triton_in_requests(model: str, name: str, folder: Path = SERVE) -> int:
    return sum((r.get("lazy") or {}).get("counts", {}).get("triton", 0)
               for r in server(model, name, folder)["requests"])


def engine(folder: str, name: str) -> dict:
    return load(PUB / folder / f"{name}.json")


def phase_server(model: str, phase: int, name: str, folder: Path = SERVE) -> dict:
    return serve(model, folder)["phases"][phase]["servers"][name]


def default_memory(model: str) -> dict:
    """The run at vLLM's default --gpu-memory-utilization (0.92), published dimensions."""
    return load(SERVE_092 / f"{model}.serve.json")


def over_bar(model: str, phase: int = 0, folder: Path = SERVE) -> list[tuple[str, float, float]]:
    """kwarm's request kinds whose first is over 1.1x its repeat and more than 10 ms over it, in
    `phase` (0 cold, 1 the warm restart)."""
    out = []
    for kind in dict.fromkeys(r["kind"] for r in phase_server(model, phase, "kwarm", folder)["requests"]):
        first = req_s(model, "kwarm", kind, "first", phase, folder)
        repeat = req_s(model, "kwarm", kind, "repeat", phase, folder)
        if first and repeat and _bench("serve_bench").over_bar(first, repeat):
            out.append((kind, first, repeat))
    return out


def stage(model: str, name: str, what: str, phase: int = 0, folder: Path = SERVE) -> float | None:
    return (phase_server(model, phase, name, folder).get("start_stages") or {}).get(what)


def stage_s(model: str, name: str, what: str, phase: int = 0, folder: Path = SERVE) -> str:
    """A start milestone's seconds after launch, as the tables print it."""
    return sec(stage(model, name, what, phase, folder))


def stage_of(server_result: dict, what: str) -> str:
    return sec(server_result["start_stages"][what])


def sec(seconds) -> str:
    return f"{seconds:.0f}"


def cold_ready(folder: Path = SERVE) -> dict:
    """Launch to ready of each tiny model's servers in the cold start, by (model, server)."""
    return {(m, n): server(m, n, folder)["launch_to_ready_s"] for m in (QWEN, DSV) for n in ("plain", "kwarm")}


def ready_phrase(folder: Path = SERVE) -> str:
    """Both tiny models' cold starts: kwarm against vLLM alone, and kwarm's warmup."""
    ready = cold_ready(folder)
    warm = {m: server(m, "kwarm", folder)["kwarm_warmup_s"][0] for m in (QWEN, DSV)}
    return (f"ready in {ready[QWEN, 'kwarm']:.1f} s against {ready[QWEN, 'plain']:.1f} s "
            f"({pct(ready[QWEN, 'kwarm'], ready[QWEN, 'plain'])}, {share(ready[QWEN, 'kwarm'], ready[QWEN, 'plain'])} "
            f"of vLLM alone's time; tiny Qwen3-Next, kwarm's warmup {s1(warm[QWEN])} s) and "
            f"{ready[DSV, 'kwarm']:.1f} s against {ready[DSV, 'plain']:.1f} s "
            f"({pct(ready[DSV, 'kwarm'], ready[DSV, 'plain'])}, {share(ready[DSV, 'kwarm'], ready[DSV, 'plain'])}; "
            f"tiny DeepSeek-V3.2, {s1(warm[DSV])} s)")


def serving_claims(headline: bool = True) -> list[str]:
    """Phrases about the serving benchmark: README's headline (`headline`), else BENCHMARKS.md's."""
    restart = {(m, n): phase_server(m, 1, n)["launch_to_ready_s"] for m in (QWEN, DSV) for n in ("plain", "kwarm")}
    again = {(m, n): phase_server(m, 2, n)["launch_to_ready_s"] for m in (QWEN, DSV) for n in ("plain", "kwarm")}
    kinds = len(serve(QWEN)["request_kinds"])
    assert kinds == len(serve(DSV)["request_kinds"])
    f = lambda m, n, k, o="first": req_s(m, n, k, o)  # noqa: E731
    seed_plain = [f(m, "plain", "chat-seed") for m in (QWEN, DSV)]
    seed_kwarm = [f(m, "kwarm", "chat-seed") for m in (QWEN, DSV)]
    big = default_memory(BIG)["phases"][0]["servers"]
    dsv_big = default_memory(BIG_DSV)["phases"][0]["servers"]
    first = [
        f"{kinds} kinds of OpenAI requests",
        "plain `vllm serve` still compiles "
        f"{span([triton_in_requests(m, 'plain') for m in (QWEN, DSV)], str)} Triton kernels inside requests; "
        f"with kwarm {'none' if not any(triton_in_requests(m, 'kwarm') for m in (QWEN, DSV)) else '?'}",
        f"The first seeded sampled request: {span(seed_plain, s1)} s → {span(seed_kwarm, ms)} ms",
    ] if headline else []
    return first + [
        f"Qwen3-Next's first tool call, long prompt and burst of 16 streams (p99 TTFT): "
        f"{ms(f(QWEN, 'plain', 'tool-call'))}, {ms(f(QWEN, 'plain', 'long-prompt'))} and "
        f"{ms(f(QWEN, 'plain', 'burst'))} ms → {ms(f(QWEN, 'kwarm', 'tool-call'))}, "
        f"{ms(f(QWEN, 'kwarm', 'long-prompt'))} and {ms(f(QWEN, 'kwarm', 'burst'))} ms",
        f"its long prompt's repeat: {ms(f(DSV, 'plain', 'long-prompt', 'repeat'))} ms, after a first of "
        f"{ms(f(DSV, 'plain', 'long-prompt'))} ms; kwarm's first: {ms(f(DSV, 'kwarm', 'long-prompt'))} ms",
        ready_phrase(),
        f"{big['kwarm']['launch_to_ready_s']:.1f} s against {big['plain']['launch_to_ready_s']:.1f} s "
        f"({pct(big['kwarm']['launch_to_ready_s'], big['plain']['launch_to_ready_s'])}, "
        f"{share(big['kwarm']['launch_to_ready_s'], big['plain']['launch_to_ready_s'])}), the same "
        f"{big['kwarm']['kv_cache_tokens']:,} tokens of KV cache, peak GPU memory {big['kwarm']['peak_gpu_mib']} "
        f"against {big['plain']['peak_gpu_mib']} MiB",
        f"DeepSeek-V3.2's dimensions at 0.92: ready in {dsv_big['kwarm']['launch_to_ready_s']:.1f} s against "
        f"{dsv_big['plain']['launch_to_ready_s']:.1f} s ({pct(dsv_big['kwarm']['launch_to_ready_s'], dsv_big['plain']['launch_to_ready_s'])}, "
        f"{share(dsv_big['kwarm']['launch_to_ready_s'], dsv_big['plain']['launch_to_ready_s'])}), "
        f"the same {dsv_big['kwarm']['kv_cache_tokens']:,} tokens of KV cache, peak GPU memory "
        f"{dsv_big['kwarm']['peak_gpu_mib']} against {dsv_big['plain']['peak_gpu_mib']} MiB",
        f"A warm restart costs {pct(restart[QWEN, 'kwarm'], restart[QWEN, 'plain'])} "
        f"({restart[QWEN, 'kwarm']:.1f} against {restart[QWEN, 'plain']:.1f} s) and "
        f"{pct(restart[DSV, 'kwarm'], restart[DSV, 'plain'])} ({restart[DSV, 'kwarm']:.1f} against "
        f"{restart[DSV, 'plain']:.1f} s)",
        f"the second costs {pct(again[QWEN, 'kwarm'], again[QWEN, 'plain'])} "
        f"({again[QWEN, 'kwarm']:.1f} against {again[QWEN, 'plain']:.1f} s) and "
        f"{pct(again[DSV, 'kwarm'], again[DSV, 'plain'])} ({again[DSV, 'kwarm']:.1f} against "
        f"{again[DSV, 'plain']:.1f} s)",
    ]


def benchmarks_claims() -> list[str]:
    f = req_s
    both = (QWEN, DSV)
    ready = [server(m, n)["launch_to_ready_s"] for m in both for n in ("plain", "kwarm")]
    over = {m: over_bar(m) for m in both}
    dsv_big = default_memory(BIG_DSV)["phases"][0]["servers"]
    return serving_claims(headline=False) + [
        f"{span([triton_in_requests(m, 'plain') for m in both], str)} for `vllm serve`, "
        f"{sum(triton_in_requests(m, 'kwarm') for m in both)} with kwarm on both models",
        f"request {s1(f(DSV, 'plain', 'chat-seed'))} s and {s1(f(QWEN, 'plain', 'chat-seed'))} s without kwarm "
        f"(`_topk_topp_kernel`), {ms(f(DSV, 'kwarm', 'chat-seed'))} and {ms(f(QWEN, 'kwarm', 'chat-seed'))} ms with it",
        f"`min_p` {ms(f(DSV, 'plain', 'chat-min-p'))}/{ms(f(QWEN, 'plain', 'chat-min-p'))} ms against "
        f"{ms(f(DSV, 'kwarm', 'chat-min-p'))}/{ms(f(QWEN, 'kwarm', 'chat-min-p'))} ms",
        f"`prompt_logprobs` {ms(f(DSV, 'plain', 'prompt-logprobs'))}/{ms(f(QWEN, 'plain', 'prompt-logprobs'))} ms "
        f"against {ms(f(DSV, 'kwarm', 'prompt-logprobs'))}/{ms(f(QWEN, 'kwarm', 'prompt-logprobs'))} ms",
        f"the first JSON-schema request {ms(f(QWEN, 'plain', 'json-schema'))} and {ms(f(DSV, 'plain', 'json-schema'))} ms "
        f"without kwarm, {ms(f(QWEN, 'kwarm', 'json-schema'))} and {ms(f(DSV, 'kwarm', 'json-schema'))} ms with it",
        over_text(over),
        f"{over_text({m: over_bar(m, 1) for m in both})} on the first warm restart",
        f"The two restarts of plain `vllm serve` differ by "
        f"{span([abs(phase_server(m, 1, 'plain')['launch_to_ready_s'] - phase_server(m, 2, 'plain')['launch_to_ready_s']) for m in both], s1)} s themselves",
        f"on the second, {over_text({m: over_bar(m, 2) for m in both})}",
        f"after {span(ready, lambda x: f'{x:.0f}')} s cold starts",
        f"kwarm's sampling build started {span([stage(m, 'kwarm', 'sampling build started') for m in both], sec)} s "
        f"after launch and was done at {stage(QWEN, 'kwarm', 'kwarm early sampling built'):.0f} and "
        f"{stage(DSV, 'kwarm', 'kwarm early sampling built'):.0f} s; the KV cache was sized at "
        f"{stage(QWEN, 'kwarm', 'kv cache sized'):.0f} and {stage(DSV, 'kwarm', 'kv cache sized'):.0f} s "
        "(Qwen3-Next/DeepSeek-V3.2)",
        f"plain `vllm serve` began the same build at {stage(QWEN, 'plain', 'sampling build started'):.0f} and "
        f"{stage(DSV, 'plain', 'sampling build started'):.0f} s, inside its profile run, and sized its KV cache at "
        f"{stage(QWEN, 'plain', 'kv cache sized'):.0f} and {stage(DSV, 'plain', 'kv cache sized'):.0f} s",
        f"kwarm's warmup took {s1(phase_server(QWEN, 1, 'kwarm')['kwarm_warmup_s'][0])} and "
        f"{s1(phase_server(DSV, 1, 'kwarm')['kwarm_warmup_s'][0])} s",
        f"compiled {warm_compiles(QWEN)} and {warm_compiles(DSV)} Triton kernels for real before ready",
        f"the second restart {warm_compiles(QWEN, 2)} and {warm_compiles(DSV, 2)}",
        f"kwarm's warmup took {s1(phase_server(QWEN, 2, 'kwarm')['kwarm_warmup_s'][0])} and "
        f"{s1(phase_server(DSV, 2, 'kwarm')['kwarm_warmup_s'][0])} s there",
        f"plain `vllm serve` compiled {big_triton('plain')} Triton "
        f"kernels in requests, kwarm {big_triton('kwarm')}",
        f"{big_triton('plain', BIG_DSV)} compiles in requests without kwarm, {big_triton('kwarm', BIG_DSV)} with it",
        f"kwarm's server at {dsv_big['kwarm']['peak_gpu_at_s']:.1f} s, plain's at {dsv_big['plain']['peak_gpu_at_s']:.1f} s "
        f"(ready at {dsv_big['kwarm']['launch_to_ready_s']:.1f} and {dsv_big['plain']['launch_to_ready_s']:.1f} s)",
        f"the engine process {max(dsv_big['kwarm']['gpu_processes_peak_mib'].values())} against "
        f"{max(dsv_big['plain']['gpu_processes_peak_mib'].values())} MiB",
        f"sampling build done {stage_of(dsv_big['kwarm'], 'kwarm early sampling built')} s after launch, KV cache sized at "
        f"{stage_of(dsv_big['kwarm'], 'kv cache sized')} s; plain `vllm serve` began its build at "
        f"{stage_of(dsv_big['plain'], 'sampling build started')} s and sized its KV cache at "
        f"{stage_of(dsv_big['plain'], 'kv cache sized')} s",
    ]


def medians_claims() -> list[str]:
    """BENCHMARKS.md's section on the tiny pair's later run (``serve-medians/``: each kind's repeat the
    median of three; a cold start of both models and a warm restart of Qwen3-Next)."""
    F, both = SERVE_MEDIANS, (QWEN, DSV)
    restart = {n: phase_server(QWEN, 1, n, F)["launch_to_ready_s"] for n in ("plain", "kwarm")}
    st = lambda m, n, what, phase=0: stage_s(m, n, what, phase, F)  # noqa: E731
    cold = {m: over_bar(m, 0, F) for m in both}
    sb = _bench("serve_bench")
    within = []
    for m, xs in cold.items():
        for kind, first, _ in xs:
            row = next(r for r in sb.pairs(phase_server(m, 0, "kwarm", F)["requests"]) if r["kind"] == kind)
            top = max(sb.headline_time(row.get(o)) for o in sb.REPEATS)
            if first <= top:
                within.append(f"{NAMES[m]}'s {kind}, {first * 1000:.1f} ms against repeats up to {top * 1000:.1f} ms")
    words = {1: "One", 2: "Two", 3: "Three", 4: "Four"}
    before = {k: (a, b) for k, a, b in over_bar(QWEN)}
    assert "tool-call" in before and "tool-call" in {k for k, _, _ in cold[QWEN]}
    loaded = phase_server(QWEN, 1, "kwarm", F)["lazy_before_ready"]["counts"].get("triton_disk", 0)
    return [
        ready_phrase(F),
        f"kwarm's sampling build was done at {st(QWEN, 'kwarm', 'kwarm early sampling built')} and "
        f"{st(DSV, 'kwarm', 'kwarm early sampling built')} s and the KV cache sized at "
        f"{st(QWEN, 'kwarm', 'kv cache sized')} and {st(DSV, 'kwarm', 'kv cache sized')} s (Qwen3-Next/DeepSeek-V3.2); "
        f"plain `vllm serve` began the build at {st(QWEN, 'plain', 'sampling build started')} and "
        f"{st(DSV, 'plain', 'sampling build started')} s and sized its KV cache at "
        f"{st(QWEN, 'plain', 'kv cache sized')} and {st(DSV, 'plain', 'kv cache sized')} s",
        f"Compiles in requests after ready: {span([triton_in_requests(m, 'plain', F) for m in both], str)} for "
        f"`vllm serve`, {sum(triton_in_requests(m, 'kwarm', F) for m in both)} with kwarm on both models",
        f"cold: {over_text(cold)}; on the warm restart, {over_text({QWEN: over_bar(QWEN, 1, F)})}",
        f"{words[len(within)]} of them lie within their own repeats' spread ({'; '.join(within)})",
        f"Qwen3-Next's cold tool call is over the bar in both runs ({ms(before['tool-call'][0])} against "
        f"{ms(before['tool-call'][1])} ms in the section above)",
        f"The first warm restart** (Qwen3-Next): {pct(restart['kwarm'], restart['plain'])} ({restart['kwarm']:.1f} "
        f"against {restart['plain']:.1f} s); kwarm's warmup took {s1(phase_server(QWEN, 1, 'kwarm', F)['kwarm_warmup_s'][0])} s, "
        f"and kwarm's server compiled {warm_compiles(QWEN, 1, F)} Triton kernels for real before ready (it loaded "
        f"{loaded} from Triton's disk cache), where the first restart above compiled {warm_compiles(QWEN)}",
        steady_text(),
        f"kwarm's engine process started at {st(QWEN, 'kwarm', 'engine', 1)} s against {st(QWEN, 'plain', 'engine', 1)} s "
        f"after launch, its KV cache was sized at {st(QWEN, 'kwarm', 'kv cache sized', 1)} s against "
        f"{st(QWEN, 'plain', 'kv cache sized', 1)} s and its graphs captured at {st(QWEN, 'kwarm', 'graphs captured', 1)} s "
        f"against {st(QWEN, 'plain', 'graphs captured', 1)} s",
    ]


def against(kind: str, phase: int, folder: Path) -> str:
    """Tiny Qwen3-Next's median repeat of `kind`, kwarm's server against plain's."""
    rep = {n: req_s(QWEN, n, kind, "repeat", phase, folder) for n in ("kwarm", "plain")}
    return f"{ms(rep['kwarm'])} against {ms(rep['plain'])} ms"


def steady_text() -> str:
    """Qwen3-Next's structured requests at steady state (the median of three repeats) in the later
    run, kwarm's server against plain's, cold and on the warm restart; and the widest gap between the
    two servers' repeats of those kinds in the earlier run (``serve/``, every phase)."""
    F = SERVE_MEDIANS
    rep = lambda n, k, ph, folder=F: req_s(QWEN, n, k, "repeat", ph, folder)  # noqa: E731
    pair = lambda k, ph: against(k, ph, F)  # noqa: E731
    phases = range(len(serve(QWEN)["phases"]))
    gap = max(abs(rep("kwarm", k, ph, SERVE) - rep("plain", k, ph, SERVE))
              for k in ("json-schema", "tool-call") for ph in phases)
    return (f"json-schema {pair('json-schema', 0)} cold and {pair('json-schema', 1)} on the warm restart, "
            f"tool-call {pair('tool-call', 0)} and {pair('tool-call', 1)} (medians of three); in the section "
            f"above's run the two servers' repeats of these kinds were within {ms(gap)} ms of each other")


def steady_claims() -> list[str]:
    """BENCHMARKS.md's section on tiny Qwen3-Next alone with engine step times (``serve-steady/``):
    the cold start, how kwarm's repeats compare with plain's over every kind, json-schema (which
    kwarm's server ran slower in the earlier runs) with its engine steps, and the blocks
    torch's allocators made over the requests (``step-times.json``, ``bench/step_times.py --json``)."""
    F = SERVE_STEADY
    ready = {n: server(QWEN, n, F)["launch_to_ready_s"] for n in ("plain", "kwarm")}
    sb = _bench("serve_bench")
    rows = {n: {r["kind"]: r for r in sb.pairs(server(QWEN, n, F)["requests"])} for n in ("plain", "kwarm")}
    ratios = [sb.repeat_time(rows["kwarm"][k]) / sb.repeat_time(rows["plain"][k]) for k in rows["plain"]]
    lower = sum(r < 1 for r in ratios)
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    rep = lambda n, ph, folder: req_s(QWEN, n, "json-schema", "repeat", ph, folder)  # noqa: E731
    early = [rep("kwarm", ph, SERVE) - rep("plain", ph, SERVE) for ph in range(len(serve(QWEN)["phases"]))]
    steps = load(F / "step-times.json")
    js = {r["server"]: r for r in steps["kinds"] if r["kind"] == "json-schema" and r["phase"] == "cold"}
    alloc = {a["server"]: a for a in steps["allocators"] if a["phase"] == "cold" and a["proc"] == "EngineCore"}
    pair = lambda ph, folder: against("json-schema", ph, folder)  # noqa: E731

    def blocks(n):
        return (f"{alloc[n]['num_device_alloc']} new cudaMalloc blocks and {alloc[n]['num_host_alloc']} cudaHostAlloc "
                f"blocks ({alloc[n]['host_alloc_us'] / 1000:.1f} ms)")

    return [
        f"ready in {ready['kwarm']:.1f} s against {ready['plain']:.1f} s ({pct(ready['kwarm'], ready['plain'])}, "
        f"{share(ready['kwarm'], ready['plain'])} of vLLM alone's time)",
        f"compiles in requests after ready: {triton_in_requests(QWEN, 'plain', F)} for `vllm serve`, "
        f"{triton_in_requests(QWEN, 'kwarm', F)} with kwarm",
        f"kwarm's median repeat was lower than plain's in {lower} of the {len(ratios)} kinds (their ratios' "
        f"geometric mean {geomean:.2f})",
        f"({pair(0, SERVE_MEDIANS)} and {pair(1, SERVE_MEDIANS)} in the section above, slower by at most "
        f"{ms(max(early))} ms in each of the first run's {len(early)} phases): {pair(0, F)} here",
        f"{js['kwarm']['steps']} engine steps summing {js['kwarm']['steps_ms']:.1f} ms with kwarm, "
        f"{js['plain']['steps']} summing {js['plain']['steps_ms']:.1f} ms without; outside the steps "
        f"{js['kwarm']['request_ms'] - js['kwarm']['steps_ms']:.1f} against "
        f"{js['plain']['request_ms'] - js['plain']['steps_ms']:.1f} ms",
        f"kwarm's engine core made {blocks('kwarm')}, plain's {blocks('plain')}",
        f"Firsts over the bar (1.1x and 10 ms): {over_text({QWEN: over_bar(QWEN, 0, F)})}",
    ]


def step_rows(server_name: str) -> dict:
    """``serve-steady/step-times.json``'s cold rows of one server, by request kind."""
    return {r["kind"]: r for r in load(SERVE_STEADY / "step-times.json")["kinds"]
            if r["phase"] == "cold" and r["server"] == server_name}


def outside_phrase() -> str:
    """How close kwarm's firsts came to their repeats outside the engine's steps (README and BENCHMARKS.md)."""
    outside = max(abs(r["first_outside_ms"] - r["outside_ms"]) for r in step_rows("kwarm").values())
    return f"kwarm's firsts spent within {outside:.1f} ms of their repeats' time outside the engine's steps, in every kind"


def first_use_claims() -> list[str]:
    """BENCHMARKS.md's bullet on where each first's time goes (``serve-steady/step-times.json``): with
    kwarm, the time outside the engine's steps of every first against its repeats'; plain's first-use
    costs as one long step (a compile) or time outside the steps (the API server); kwarm's firsts
    over the bar, their longest step and their steps' sum against the repeats'."""
    F = SERVE_STEADY
    kw, pl = step_rows("kwarm"), step_rows("plain")
    plain_out = sorted(((r["first_outside_ms"], r["outside_ms"], k) for k, r in pl.items()
                        if r["first_outside_ms"] - r["outside_ms"] > 10), reverse=True)
    plain_long = sorted(((r["first_longest_step_ms"], k) for k, r in pl.items() if r["first_longest_step_ms"] > 100),
                        reverse=True)
    longest = max(kw.values(), key=lambda r: r["first_longest_step_ms"])
    over = [k for k, _, _ in over_bar(QWEN, 0, F)]
    within = [k for k in over if kw[k]["steps_ms_range"][0] <= kw[k]["first_steps_ms"] <= kw[k]["steps_ms_range"][1]]
    above = [k for k in over if k not in within]
    apart = max(kw.values(), key=lambda r: r["steps_ms_range"][1] / r["steps_ms_range"][0])
    lo, hi = apart["steps_ms_range"]
    return [
        f"kwarm's repeats of one kind summed their steps up to {100 * (hi / lo - 1):.0f}% apart ({apart['kind']}: "
        f"{lo:.1f}-{hi:.1f} ms)",
        outside_phrase(),
        "plain's first-use costs lie outside the steps, in the API server (" + ", ".join(
            f"{k} {a:.0f} against {b:.0f} ms" for a, b, k in plain_out),
        "or in one long step (" + ", ".join(f"{k} {v:.0f} ms" for v, k in plain_long),
        f"kwarm's longest step in any first took {longest['first_longest_step_ms']:.1f} ms ({longest['kind']}, whose "
        f"repeats' longest took {longest['longest_step_ms']:.1f} ms)",
        f"Of its {len(over)} firsts over the bar, " + " and ".join(within) + " summed their steps within the range of "
        "their repeats' sums; " + "; ".join(
            f"{k} summed {kw[k]['first_steps_ms']:.1f} against {span(kw[k]['steps_ms_range'], lambda v: f'{v:.1f}')} ms, "
            f"its median step {kw[k]['first_step_ms']:.1f} against {kw[k]['step_ms']:.1f} ms" for k in above),
    ]


def restart_claims(headline: bool = False) -> list[str]:
    """The tiny pair with the ``cute_dsl`` family (``serve-restart/``): tiny Qwen3-Next cold and on a
    warm restart (commit 2949244), tiny DeepSeek-V3.2 likewise (commit e1b8dd2), their engine steps
    (``<model>.step-times.json``); BENCHMARKS.md's section, or README's sentence (`headline`)."""
    F = SERVE_RESTART
    ready = {(m, ph, n): phase_server(m, ph, n, F)["launch_to_ready_s"]
             for m, ph in ((QWEN, 0), (QWEN, 1), (DSV, 0), (DSV, 1)) for n in ("plain", "kwarm")}

    def cold(m):
        return f"{share(ready[m, 0, 'kwarm'], ready[m, 0, 'plain'])} ({ready[m, 0, 'kwarm']:.1f} against {ready[m, 0, 'plain']:.1f} s"

    def warm_of(m):
        return f"{pct(ready[m, 1, 'kwarm'], ready[m, 1, 'plain'])} ({ready[m, 1, 'kwarm']:.1f} against {ready[m, 1, 'plain']:.1f} s)"

    warm = warm_of(QWEN)
    if headline:
        return [f"The latest runs (tiny Qwen3-Next and tiny DeepSeek-V3.2, CuTe DSL kernels saved and loaded): ready "
                f"in {cold(QWEN)}) and {cold(DSV)}) of vLLM alone's time cold, and a first warm restart of {warm} "
                f"and {warm_of(DSV)}"]

    def cute(m, ph, n):
        lazy = phase_server(m, ph, n, F)["lazy_before_ready"]
        return lazy["counts"].get("cute_dsl", 0), (lazy.get("seconds") or {}).get("cute_dsl")

    def family_s(m, ph, name):
        fams = phase_server(m, ph, "kwarm", F)["kwarm_report_summary"]["families"]
        return next(f["seconds"] for f in fams if f["name"] == name)

    n_plain, s_plain = cute(QWEN, 1, "plain")
    check = {r["mode"]: r for r in load(PUB / "vllm0.33.0-flashinfer-h100" / "cute_dsl_cache_check.json")["runs"]}
    c, ld = check["compile"], check["load"]
    steps = {m: {(r["phase"], r["kind"]): r for r in load(F / f"{m}.step-times.json")["kinds"] if r["server"] == "kwarm"}
             for m in (QWEN, DSV)}
    over = [(m, ph, k) for m, ph in ((QWEN, 0), (QWEN, 1), (DSV, 0), (DSV, 1)) for k, _, _ in over_bar(m, ph, F)]
    rows = [steps[m]["cold" if ph == 0 else "warm", k] for m, ph, k in over]
    longest = max(rows, key=lambda r: r["first_longest_step_ms"])
    outside = max(abs(r["first_outside_ms"] - r["outside_ms"]) for r in rows)
    return [
        f"FlashInfer's GDN prefill at Qwen3-Next's shapes compiled {c['compiled']['flashinfer_gdn']} kernels in "
        f"{c['seconds']['short']:.1f} s and vLLM's router GEMM {c['compiled']['vllm_router_gemm']} in "
        f"{c['seconds']['router_gemm']:.2f} s",
        f"loaded the family's saved files first (in {ld['load']['flashinfer_gdn']['seconds']:.3f} and "
        f"{ld['load']['vllm_router_gemm']['seconds']:.3f} s) compiled {ld['compiled_anyway']['flashinfer_gdn']} and "
        f"{ld['compiled_anyway']['vllm_router_gemm']} of them, ran the same calls in {ld['seconds']['short']:.3f} and "
        f"{ld['seconds']['router_gemm']:.3f} s, and returned outputs equal to the first process's (largest "
        f"difference {max(ld['max_abs_diff'])})",
        f"**The first warm restart of tiny Qwen3-Next: {warm}**",
        f"plain `vllm serve` compiled its {n_plain} CuTe DSL kernels again before ready ({s_plain:.1f} s), kwarm's "
        f"server compiled {cute(QWEN, 1, 'kwarm')[0]}: the `cute_dsl` family loaded them in "
        f"{family_s(QWEN, 1, 'cute_dsl'):.2f} s",
        f"kwarm's KV cache was sized {stage_s(QWEN, 'kwarm', 'kv cache sized', 1, F)} s after launch against "
        f"{stage_s(QWEN, 'plain', 'kv cache sized', 1, F)} s",
        f"kwarm's warmup took {s1(phase_server(QWEN, 1, 'kwarm', F)['kwarm_warmup_s'][0])} s and its server compiled "
        f"{warm_compiles(QWEN, 1, F)} Triton kernels for real before ready",
        f"**The first warm restart of tiny DeepSeek-V3.2: {warm_of(DSV)}**",
        f"plain `vllm serve` compiled its {cute(DSV, 1, 'plain')[0]} router-GEMM CuTe DSL kernels again "
        f"({cute(DSV, 1, 'plain')[1]:.1f} s), kwarm's server {cute(DSV, 1, 'kwarm')[0]}: the family loaded them in "
        f"{family_s(DSV, 1, 'cute_dsl'):.2f} s",
        f"**Cold**: ready in {cold(QWEN)}; tiny Qwen3-Next) and {cold(DSV)}; tiny DeepSeek-V3.2) of vLLM alone's time",
        f"compiles in requests after ready: {triton_in_requests(QWEN, 'plain', F)} and "
        f"{triton_in_requests(DSV, 'plain', F)} for `vllm serve`, {triton_in_requests(QWEN, 'kwarm', F)} and "
        f"{triton_in_requests(DSV, 'kwarm', F)} with kwarm",
        f"Both servers compiled the CuTe DSL kernels cold ({cute(QWEN, 0, 'kwarm')[0]} on Qwen3-Next, "
        f"{cute(DSV, 0, 'kwarm')[0]} router-GEMM kernels on DeepSeek-V3.2); kwarm's saved them after CUDA-graph "
        f"capture, in {family_s(QWEN, 0, 'cute_dsl (after capture)'):.2f} and "
        f"{family_s(DSV, 0, 'cute_dsl (after capture)'):.2f} s",
        f"cold: {over_text({m: over_bar(m, 0, F) for m in (QWEN, DSV)})}; on the warm restart, "
        f"{over_text({m: over_bar(m, 1, F) for m in (QWEN, DSV)})}",
        f"kwarm's longest step in any of these firsts took {longest['first_longest_step_ms']:.1f} ms "
        f"({longest['kind']}, whose repeats' longest took {longest['longest_step_ms']:.1f} ms)",
        f"their time outside the steps was within {outside:.1f} ms of their repeats'",
        "; ".join(f"{NAMES[m]}'s {k}{' (warm)' if ph else ''} held one step of {r['first_longest_step_ms']:.1f} ms "
                  f"against its repeats' longest {r['longest_step_ms']:.1f} ms" for (m, ph, k), r in zip(over, rows)
                  if r["first_longest_step_ms"] > 2 * r["longest_step_ms"]),
        "; ".join(f"{NAMES[m]}'s {k}{' (warm)' if ph else ''} {r['first_steps_ms']:.1f} against "
                  f"{span(r['steps_ms_range'], lambda v: f'{v:.1f}')} ms" for (m, ph, k), r in zip(over, rows)),
        noise_phrase(),
    ]


def gdn_early_claims() -> list[str]:
    """``gdn_early_check.json`` (commit e1b8dd2, H100): FlashInfer's SM90 GDN prefill compiled on the CPU
    by kwarm_ext/early_gdn.py, against the GPU's own compile; BENCHMARKS.md's section."""
    runs = {(r["mode"], r["model"]): r for r in load(PUB / "vllm0.33.0-flashinfer-h100" / "gdn_early_check.json")["runs"]}
    models = ("tiny", "80b")

    def both(fmt, value):
        return " and ".join(fmt.format(value(runs_of)) for runs_of in models)

    def warmup_s(model):
        return sum(v for k, v in runs["gpu compile", model]["seconds"].items() if k.startswith("warmup"))

    return [
        f"{both('{}', lambda m: runs['cpu', m]['summary']['saved'])} kernels in "
        f"{both('{:.1f}', lambda m: runs['cpu', m]['wall_s'])} s",
        f"the GPU's own compile of the same calls: {both('{}', lambda m: runs['gpu compile', m]['compiled'])} kernels "
        f"in {both('{:.1f}', warmup_s)} s",
        f"loaded the CPU-compiled files first (in {both('{:.3f}', lambda m: runs['gpu load', m]['load']['seconds'])} s) "
        f"compiled {both('{}', lambda m: runs['gpu load', m]['compiled'])} kernels",
        f"returned outputs equal to the GPU-compiled ones (largest difference "
        f"{max(runs['gpu load', m]['max_abs_diff'] for m in models)} over "
        f"{both('{}', lambda m: runs['gpu load', m]['outputs'])} tensors)",
    ]


def noise_phrase() -> str:
    """``serve_bench.py --noise`` over the published runs with three repeats: how often kwarm's firsts,
    plain's, and single repeats against their kind's other two cross the bar (kinds with nothing lazy named)."""
    results = [load(p) for f in (SERVE_MEDIANS, SERVE_STEADY, SERVE_RESTART) for p in sorted(f.glob("*.serve.json"))]
    sb = _bench("serve_bench")
    totals = sb.noise_totals(sb.noise_rows(results))

    def total(name):
        k, f, n, o = (totals[name][x] for x in sb.NOISE_COUNTS)
        return f"{f} of {k} kinds ({100 * f / k:.0f}%)", f"{o} of {n} ({100 * o / n:.0f}%)"

    kw, pl = total("kwarm"), total("plain")
    return (f"kwarm's firsts crossed it in {kw[0]}, a single repeat against its kind's other two in {kw[1]}; "
            f"plain's firsts in {pl[0]}, its repeats in {pl[1]}")


def over_text(over: dict) -> str:
    """The kinds over the 1.1x / 10 ms bar per model, or that none is."""
    if not any(over.values()):
        return "every kind's first within 1.1x or 10 ms of its repeat" + (" on both models" if len(over) > 1 else "")
    return "; ".join(f"{NAMES[m]}'s " + " and ".join(f"{k} ({ms(a)} against {ms(b)} ms)" for k, a, b in xs)
                     for m, xs in over.items() if xs)


def warm_compiles(model: str, phase: int = 1, folder: Path = SERVE) -> int:
    """Real Triton compiles (not loads from its disk cache) before ready in kwarm's warm restart
    (`phase` 1 the first, 2 the second)."""
    return phase_server(model, phase, "kwarm", folder)["lazy_before_ready"]["counts"].get("triton", 0)


def big_triton(name: str, model: str = BIG) -> int:
    s = default_memory(model)["phases"][0]["servers"][name]
    return sum((r.get("lazy") or {}).get("counts", {}).get("triton", 0) for r in s["requests"])


def fp8_claims() -> list[str]:
    """README's Block-FP8 paragraph and BENCHMARKS.md's table of it (vLLM 0.29.0, H200)."""
    ep = "vllm0.29.0-h200/fp8-early-parent"
    fp8 = "vllm0.29.0-h200/fp8"
    glm_off = engine(ep, "glm5-2l-fp8-vllm0.29.0-kwarmoff-cold")
    dsv_cut = engine(ep, "deepseek-v32-2l-fp8-vllm0.29.0-kwarmoff-cold")
    dsv_off = engine(fp8, "deepseek-v32-2l-fp8-vllm0.29.0-torch2.13.0-kwarmoff-cold")
    assert glm_off["complete"] and dsv_off["complete"] and not dsv_cut["complete"]
    on = {m: engine(ep, f"{m}-2l-fp8-vllm0.29.0-kwarmon-cold") for m in ("glm5", "deepseek-v32")}
    warm = {m: engine(ep, f"{m}-2l-fp8-vllm0.29.0-kwarmon-warm") for m in ("glm5", "deepseek-v32")}
    floor = [engine(fp8, f"{m}-2l-fp8-vllm0.29.0-torch2.13.0-kwarmoff-floor")["init_s"] for m in ("glm5", "deepseek-v32")]
    table = _bench("table")
    dg = [int(re.search(r"(\d+) DeepGEMM", table.jit_cell(r)).group(1)) for r in (glm_off, dsv_off)]
    return [
        f"still compiled {span(dg, str)} DeepGEMM kernels",
        f"vLLM alone starts cold in {glm_off['init_s']:.0f} s (GLM-5) and {dsv_off['init_s']:.0f} s (DeepSeek-V3.2",
        f"for {glm_off['excess_s']:.1f} s (GLM-5) and {dsv_off['excess_s']:.1f} s (DeepSeek-V3.2) of excess",
        f"With kwarm: {on['glm5']['init_s']:.0f} s (GLM-5, {100 * on['glm5']['init_s'] / glm_off['init_s']:.1f}% of "
        f"vLLM alone's {glm_off['init_s']:.0f} s in the same call) and {on['deepseek-v32']['init_s']:.0f} s "
        f"(DeepSeek-V3.2; vLLM alone's run in that call was cut short)",
        f"excess {span([on[m]['excess_s'] for m in on], ms)} ms",
        f"on a warm restart {span([warm[m]['kwarm_warmup_s'] for m in warm], s1)} s of warmup against "
        f"{span([warm[m]['init_s'] for m in warm], lambda x: f'{x:.0f}')} s of init",
        f"takes {span(floor, lambda x: f'{x:.0f}')} s",
        # BENCHMARKS.md's table: the cut-short run is not a denominator
        f"| off, cold | {dsv_cut['init_s']:.0f} s, cut short (no request ran) |",
        f"Cold start {100 * on['glm5']['init_s'] / glm_off['init_s']:.1f}% (GLM-5) of vLLM alone",
    ]


def capture_threads_claims() -> list[str]:
    """``bench/gemm_capture_threads.py`` on the H100: what one capture thread costs and keeps
    against 4 and 8 (the first and last runs are both one thread)."""
    runs = load(PUB / "vllm0.33.0-flashinfer-h100" / "gemm_capture_threads.json")["runs"]
    by = {n: [r for r in runs if r["threads"] == n] for n in (1, 4, 8)}
    kept = {n: span([r["kept_outside_torch_mib"] for r in by[n]], lambda x: f"{x:.0f}") for n in by}

    def took(n: int, pass_: str) -> str:
        return span([r[pass_]["s"] for r in by[n]], lambda x: f"{x:.2f}")

    return [
        f"kept {kept[1]} MiB outside torch after one capture thread, {kept[4]} after 4 and {kept[8]} after 8",
        f"{by[1][0]['grid']['problems']} grid problems took {took(1, 'grid')} s on one thread against "
        f"{took(4, 'grid')} s on 4, and the fill's {by[1][0]['fill']['problems']} took {took(1, 'fill')} s "
        f"against {took(4, 'fill')} s",
    ]


def readme_claims() -> list[str]:
    return serving_claims() + restart_claims(headline=True) + [outside_phrase()] + fp8_claims()[:7]


def all_claims() -> dict[str, list[str]]:
    return {"README.md": readme_claims(),
            "BENCHMARKS.md": benchmarks_claims() + medians_claims() + steady_claims() + first_use_claims()
                      + restart_claims() + gdn_early_claims() + fp8_claims()[7:]
            + capture_threads_claims()}


def numbers(text: str) -> list[str]:
    """The numbers a reader takes as results: not versions, model names (V3.2, H100) or identifiers."""
    text = re.sub(r"`[^`]*`", " ", text)          # code spans: kernel and flag names
    text = re.sub(r"\]\([^)]*\)", "]", text)       # link targets
    return NUMBER.findall(text)


def region(doc: str, start: str, end: str) -> str:
    lines = doc.splitlines()
    i = next((n for n, line in enumerate(lines) if line.startswith(start)), None)
    if i is None:
        return ""
    out = []
    for line in lines[i:]:
        if (end and line.startswith(end)) or (not end and not line.strip() and out):
            break
        out.append(line)
    return "\n".join(out)


def serving_tables(doc: str) -> list[str]:
    """BENCHMARKS.md's serving tables against serve_bench.py's rendering of the published JSON (the
    runs whose tables it shows; ``serve/``'s, ``serve-medians/``'s and ``serve-steady/``'s are their
    ``--table`` commands')."""
    serve_bench = _bench("serve_bench")
    results = [load(p) for p in sorted([*SERVE_RESTART.glob("*.serve.json"), *SERVE_092.glob("*.serve.json")])]
    want = [line for line in serve_bench.render(results).splitlines() if line.startswith("|")]
    section = doc.split("## `vllm serve` with vLLM's defaults", 1)[-1].split("\n# Second table", 1)[0]
    have = [line for line in section.splitlines() if line.startswith("|")]
    problems = [f"BENCHMARKS.md: serving table row not from the JSON: {line[:100]}" for line in have if line not in want]
    problems += [f"BENCHMARKS.md: serving table row missing: {line[:100]}" for line in want if line not in have]
    return problems


def check(root: Path = ROOT) -> list[str]:
    problems = []
    docs = {name: (root / name).read_text() for name in ("README.md", "BENCHMARKS.md")}
    claims = all_claims()
    for name, phrases in claims.items():
        flat = " ".join(docs[name].split())
        for phrase in phrases:
            if " ".join(phrase.split()) not in flat:
                problems.append(f"{name}: does not say (from the JSON): {phrase!r}")
    for name, start, end in REGIONS:
        text = region(docs[name], start, end)
        if not text:
            problems.append(f"{name}: no paragraph starting {start!r}")
            continue
        known = {n for phrase in claims[name] for n in numbers(phrase)} | SETTINGS[name]
        for n in numbers(text):
            if n not in known:
                problems.append(f"{name}: {n} in the paragraph {start!r} comes from no published JSON")
    problems += serving_tables(docs["BENCHMARKS.md"])
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"claims.py: {len(problems)} disagreement(s)" if problems else "claims.py: every checked number matches bench/published/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
