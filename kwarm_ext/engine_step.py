"""The engine's first step, taken at start: one warm-up request through vLLM's own ``EngineCore``
(scheduler, input preparation, model runner, sampler, output handling), dropped before any
client could see it.

Why:
    With every kernel compiled and loaded (kwarm's families), request 0 of a warm restart still
    cost 5-8 ms more than its repeat on the published-size models (first/steady 1.06-1.19 in
    every restart measured; BENCHMARKS.md, "What request 0 is not"): the same kernels, the same
    GPU time and the same CUDA-graph launches, but the same Python about 10% slower the first
    time through (cProfile: spread over the whole engine step, ``_prepare_inputs``, tensor
    copies, the metadata builders, the scheduler). That is a cold code path, not a kernel:
    only running the path once removes it, and vLLM runs no request at start (its dummy runs
    and CUDA-graph capture call the model directly, past the scheduler and the sampler's
    output path).

How:
    ``vllm.v1.engine.core.EngineCore.__init__`` is wrapped (kwarm_ext/patches.py). When it
    returns (every worker warmed and captured, the scheduler built, before the engine
    announces itself ready and before any request), :func:`warm` adds requests of its own
    (ids starting :data:`REQUEST_ID`, :data:`MAX_TOKENS` greedy tokens each, ``ignore_eos``)
    with ``EngineCore.add_request`` and calls the engine's own step function until the
    scheduler holds nothing, in two rounds (:func:`rounds`):

    1. a *full step*: as many requests as fill one step's token budget
       (``max_num_batched_tokens``; each prompt at most ``max_model_len`` allows, at most
       ``max_num_seqs`` requests). The largest activations a step allocates are then in
       torch's caching allocators, where later requests find them: without it, the first
       requests of a warm restart still called ``cudaMalloc`` and ``cudaHostAlloc`` (the
       engine benchmark's ``alloc`` counters, BENCHMARKS.md). vLLM's own profile run
       allocated as much, before CUDA-graph capture emptied the cache, so it fits;
    2. one request just longer than the largest CUDA-graph capture size: a small request's
       eager prefill, then its decode steps on the batch-1 graph.

    The outputs are dropped, the requests' KV blocks freed by the scheduler as for any
    finished request, and the prefix cache reset so no later request hits their blocks. A
    request still held after :data:`MAX_STEPS` steps of a round (or after an error) is
    aborted.

Skipped (one info line saying why):
    data parallelism (DP engines step in waves with their peers: one engine stepping alone
    would wait on them), a KV connector (disaggregated prefill would transfer the request's
    KV), pooling models (no generation), a scheduler that already holds requests, and
    ``KWARM_WARMUPS`` without ``engine_step``.

Cost: two prefills and a few decode steps each, about what vLLM's profile run costs
(BENCHMARKS.md). It runs in the engine-core
process (the ``LLM`` process offline, the engine core of ``vllm serve``), on every vLLM
release 0.20-0.33, V1 and V2 model runners alike (the step is the engine core's, not the
runner's). Its seconds join the rank-0 ``KWARM_REPORT`` under ``engine_step``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from kwarm_ext import config

logger = logging.getLogger("kwarm")

NAME = "engine_step"
REQUEST_ID = "kwarm-engine-step-warmup"  # the prefix of its requests' ids
MAX_TOKENS = 4  # the prefill's token and 3 decode steps
MAX_STEPS = 64  # per round: a request still held after this many steps is aborted
MIN_PROMPT = 16


@dataclasses.dataclass
class Outcome:
    status: str  # ran | skipped | failed
    reason: str | None = None
    seconds: float = 0.0
    prompt_tokens: int = 0
    steps: int = 0
    rounds: list = dataclasses.field(default_factory=list)  # each round's prompt lengths


def skip_reason(engine) -> str | None:
    """Why `engine` (a vLLM ``EngineCore``) takes no warm-up step, or None."""
    cfg = engine.vllm_config
    dp = getattr(cfg.parallel_config, "data_parallel_size", 1) or 1
    if dp > 1:
        return f"data parallel size {dp}: DP engines step in waves with their peers"
    scheduler = engine.scheduler
    connector = getattr(scheduler, "get_kv_connector", lambda: None)()
    if connector is not None:
        return f"KV connector {type(connector).__name__}: the request's KV would be transferred"
    if getattr(cfg.model_config, "runner_type", "generate") == "pooling":
        return "pooling model: no generation step"
    if scheduler.has_requests():
        return "the scheduler already holds requests"
    return None


def rounds(cfg) -> list[list[int]]:
    """The prompt lengths of each round (see the module's docstring): a full step, then one
    request one token longer than the largest CUDA-graph capture size (at least MIN_PROMPT);
    every prompt within the model's length."""
    longest = max(1, cfg.model_config.max_model_len - MAX_TOKENS - 1)
    budget = cfg.scheduler_config.max_num_batched_tokens
    seqs = max(1, getattr(cfg.scheduler_config, "max_num_seqs", 1) or 1)
    full = []
    while sum(full) < budget and len(full) < seqs:
        full.append(min(longest, budget - sum(full)))
    compilation = cfg.compilation_config
    sizes = getattr(compilation, "cudagraph_capture_sizes", None) or []
    largest = getattr(compilation, "max_cudagraph_capture_size", None) or max(sizes, default=0)
    small = min(longest, max(MIN_PROMPT, largest + 1), budget)
    return [full, [small]]


def warm(engine) -> Outcome | None:
    """Take the warm-up steps on `engine`; None when KWARM_WARMUPS leaves them out. Raises
    what vLLM raises (the caller's ``fail_open`` turns it into one warning)."""
    settings = config.get()
    if not settings.warmups.wants(NAME):
        return None
    reason = skip_reason(engine)
    if reason:
        logger.info("kwarm: engine step: skipped (%s)", reason)
        return _report(Outcome("skipped", reason), settings)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    cfg = engine.vllm_config
    vocab = cfg.model_config.get_vocab_size()
    t0 = time.perf_counter()
    steps, lengths = 0, []
    try:
        for number, prompts in enumerate(rounds(cfg)):
            for i, length in enumerate(prompts):
                ids = [10 + (i + j) % max(1, vocab - 10) for j in range(length)]
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                engine.add_request(Request(f"{REQUEST_ID}-{number}-{i}", ids, params, None,
                                           block_hasher=getattr(engine, "request_block_hasher", None)))
            lengths.append(prompts)
            steps += _step_until_done(engine)
    finally:
        held = [r for r in _ours(engine)]
        if held:
            engine.abort_requests(held)
        reset = getattr(engine.scheduler, "reset_prefix_cache", None)
        if reset is not None:
            reset()
    outcome = Outcome("ran", seconds=round(time.perf_counter() - t0, 4),
                      prompt_tokens=sum(map(sum, lengths)), steps=steps, rounds=lengths)
    logger.info("kwarm: engine step: warm-up requests (%s prompt tokens) in %d steps, %.0f ms, before the "
                "first request", " then ".join("+".join(map(str, r)) for r in lengths), steps, outcome.seconds * 1000)
    return _report(outcome, settings)


def _step_until_done(engine) -> int:
    """The engine's own step (and post-step) until its scheduler holds nothing; the steps taken."""
    step = getattr(engine, "step_fn", engine.step)
    post_step = getattr(engine, "post_step", None)
    steps = 0
    while steps < MAX_STEPS and (engine.scheduler.has_requests() or getattr(engine, "batch_queue", None)):
        _, executed = step()
        if post_step is not None:
            post_step(executed)
        steps += 1
    return steps


def _ours(engine) -> list:
    """The ids of kwarm's requests the scheduler still holds."""
    requests = getattr(engine.scheduler, "requests", {}) or {}
    return [rid for rid in requests if isinstance(rid, str) and rid.startswith(REQUEST_ID)]


def _report(outcome: Outcome, settings) -> Outcome:
    """Add the outcome to the rank-0 KWARM_REPORT the worker wrote (this process or another
    one of this engine), as ``engine_step``; no report, nothing written."""
    if not settings.report:
        return outcome
    path = settings.report.replace("{rank}", "0")
    if not os.path.isfile(path):
        return outcome
    from kwarm_ext.warmup import write_report

    with open(path, encoding="utf-8") as file:
        report = json.load(file)
    entry = {"name": NAME, "status": outcome.status, "reason": outcome.reason, "seconds": outcome.seconds,
             "steps": [], "compiled": [],
             "details": {"prompt_tokens": outcome.prompt_tokens, "steps": outcome.steps, "rounds": outcome.rounds}}
    report["engine_step"] = {"total_s": outcome.seconds, "families": [entry]}
    write_report(report, settings.report, 0)
    return outcome
