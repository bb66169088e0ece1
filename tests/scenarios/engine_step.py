"""Scenario of tests/test_engine_step.py, run in a fresh interpreter (``run_scenario``), against one
vLLM release's real ``EngineCore``, ``Request`` and ``SamplingParams``.

Argument: a JSON object of cases, each ``{"config": {...}, "fail_at": int | null, "held": bool,
"report": path | null}``. A real ``EngineCore`` needs an executor on a GPU: each case builds the
object with ``object.__new__`` and gives it what cannot exist here, a scheduler that holds the real
``Request`` objects kwarm adds (through vLLM's own ``EngineCore.add_request`` and ``abort_requests``) and
finishes each after ``MAX_TOKENS`` steps. The wrapped ``__init__`` is called with a stand-in for the
original. Prints one ``RESULT`` line of JSON per case: the request kwarm built, the steps taken,
what was aborted and reset, what the wrapper raised and the ``kwarm`` logger's messages.
"""
from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

from vllm.v1.engine import core
from vllm.v1.request import Request

from kwarm_ext import engine_step, patches


class Scheduler:
    """What the engine step talks to: the real Request kwarm adds, finished after its tokens."""

    def __init__(self, held: bool, connector=None):
        self.requests, self.aborted, self.resets, self.connector = {}, [], 0, connector
        if held:
            self.requests["user"] = None

    def add_request(self, request):
        assert isinstance(request, Request)
        self.requests[request.request_id] = request

    def has_requests(self):
        return bool(self.requests)

    def get_kv_connector(self):
        return self.connector

    def finish_requests(self, ids, status):
        self.aborted += list(ids if isinstance(ids, list) else [ids])
        for i in self.aborted:
            self.requests.pop(i, None)

    def reset_prefix_cache(self, *args, **kwargs):
        self.resets += 1
        return True


def engine_of(case: dict, log: list):
    cfg = case["config"]
    engine = object.__new__(core.EngineCore)
    engine.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=cfg.get("dp", 1)),
        model_config=SimpleNamespace(runner_type=cfg.get("runner_type", "generate"), max_model_len=cfg.get("max_model_len", 4096),
                                     get_vocab_size=lambda: cfg.get("vocab", 1000)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=cfg.get("batched", 8192), max_num_seqs=cfg.get("seqs", 16)),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=cfg.get("capture", [1, 2, 4, 8, 16, 32]),
                                           max_cudagraph_capture_size=cfg.get("max_capture")))
    engine.scheduler = Scheduler(case.get("held", False), connector=object() if cfg.get("connector") else None)
    engine.request_block_hasher = None
    engine.batch_queue = None
    engine.aborts_queue = None
    steps = []

    def step():
        steps.append(1)
        if case.get("fail_at") == len(steps):
            raise RuntimeError("the executor died")
        for rid, request in list(engine.scheduler.requests.items()):  # one token per request and step
            if request is not None:
                request.kwarm_tokens = getattr(request, "kwarm_tokens", 0) + 1
                if request.kwarm_tokens >= request.max_tokens:
                    engine.scheduler.requests.pop(rid)
        return {}, True

    engine.step_fn = step
    engine.post_step = lambda executed: log.append(("post_step", executed))
    return engine, steps


def main(argv: list[str]) -> None:
    cases = json.loads(argv[0])
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("kwarm").addHandler(handler)
    patched = [patches.ENGINE_CORE.apply(core), patches.ENGINE_CORE.apply(core)]
    out = {"patched": patched, "cases": {}}
    for name, case in cases.items():
        del messages[:]
        log, inits = [], []
        engine, steps = engine_of(case, log)
        added = []
        real_add = core.EngineCore.add_request

        def add(request, request_wave=0, engine=engine):
            added.append({"id": request.request_id, "prompt": len(request.prompt_token_ids),
                          "first_ids": list(request.prompt_token_ids[:3]), "max_tokens": request.max_tokens,
                          "ignore_eos": request.sampling_params.ignore_eos,
                          "temperature": request.sampling_params.temperature})
            return real_add(engine, request, request_wave)  # vLLM's own add_request

        engine.add_request = add
        raised = None
        try:
            patches._wrap_engine_core_init(lambda *a, **k: inits.append(1), engine, (), {})
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
        out["cases"][name] = {"inits": len(inits), "added": added, "steps": len(steps),
                              "post_steps": len(log), "aborted": engine.scheduler.aborted,
                              "held": sorted(engine.scheduler.requests), "resets": engine.scheduler.resets,
                              "raised": raised, "logs": list(messages)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
