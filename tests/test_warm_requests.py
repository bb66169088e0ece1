"""The warm requests (kwarm_ext/warm_requests.py): what they send, through which layers, and the
traces they leave.

Real parts: FastAPI and Starlette (vLLM's app framework), the Prometheus HTTP-metrics middleware
vLLM installs (``prometheus_fastapi_instrumentator``, on a registry of the test's own), vLLM's
``with_cancellation`` route decorator and vLLM's request models (``ChatCompletionRequest``,
``CompletionRequest``, 0.24.0 and every release of the matrix), against which each planned
request is validated. What cannot exist here is the engine (no GPU): the app's ``engine_client``
is a stand-in with ``AsyncLLM``'s protocol for what the warm requests touch: ``generate`` (a
token per step, each step recorded through the stat-logger slot ``_logger_ref`` that vLLM's output
handler reads, made by ``_run_output_handler``), a prefix cache that keeps each finished
request's prompt, and ``reset_prefix_cache`` that refuses while a request runs, as vLLM's does.
The routes are the test's own: they parse vLLM's request models and stream as vLLM's do.
"""

import asyncio
import json
import logging

import pytest

from conftest import release_path, run_py, clean_env

pytest.importorskip("fastapi")

MODEL = "warm-test"


class StatLoggers:
    """Stands in for vLLM's ``StatLoggerManager``: counts what the output handler records."""

    def __init__(self):
        self.records = []

    def record(self, **stats):
        self.records.append(stats)

    def log(self):
        pass


class EngineClient:
    """``AsyncLLM``'s protocol for what the warm requests touch (see the module's doc)."""

    def __init__(self, *, handler_started=True, hang=None):
        self.logger_manager = StatLoggers()
        self.output_handler = None
        if handler_started:
            self._run_output_handler()
        self.prefix_cache: set = set()
        self.running: set = set()
        self.request_ids: list[str] = []
        self.aborted: list[str] = []
        self.hang = hang  # a request id substring that never finishes

    def _run_output_handler(self):  # vLLM: the handler reads its manager from this slot each step
        if self.output_handler is not None:
            return
        self.output_handler = object()
        self._logger_ref = [self.logger_manager]

    async def generate(self, prompt, max_tokens, request_id):
        self._run_output_handler()
        self.request_ids.append(request_id)
        self.running.add(request_id)
        try:
            for i in range(max_tokens):
                await asyncio.sleep(0)
                if self.hang and self.hang in request_id:
                    await asyncio.Event().wait()
                if self._logger_ref[0] is not None:
                    self._logger_ref[0].record(request_id=request_id, step=i)
                yield f"t{i}"
            self.prefix_cache.add(prompt)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        finally:
            self.running.discard(request_id)

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        if self.running:
            return False
        self.prefix_cache.clear()
        return True


def build_app(engine_client, *, chat_template=True, auto_tools=False):
    """A FastAPI app with vLLM's HTTP-metrics middleware and routes that answer as vLLM's do."""
    import types

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from prometheus_client import CollectorRegistry
    from prometheus_fastapi_instrumentator import Instrumentator
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    app = FastAPI()
    registry = CollectorRegistry()
    Instrumentator(excluded_handlers=["/health"], registry=registry).instrument(app)
    app.state.metrics_registry = registry
    app.state.engine_client = engine_client
    app.state.vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(runner_type="generate", skip_tokenizer_init=False, model=MODEL,
                                           max_model_len=256, get_vocab_size=lambda: 4096),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=16))
    app.state.args = types.SimpleNamespace(served_model_name=[MODEL], model="/models/x",
                                           enable_auto_tool_choice=auto_tools)
    app.state.seen = []

    @app.get("/health")
    async def health():
        return JSONResponse({})

    async def answer(raw_request, body, prompt):
        request_id = raw_request.headers.get("X-Request-Id", "anon")
        raw_request.app.state.seen.append((raw_request.url.path, body))
        tokens = [body.max_tokens or 4] * (body.n or 1)
        if body.stream:
            async def events():
                for n in tokens:
                    async for token in engine_client.generate(prompt, n, request_id):
                        yield f"data: {json.dumps({'choices': [{'text': token}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        out = []
        for n in tokens:
            out.append("".join([t async for t in engine_client.generate(prompt, n, request_id)]))
        return JSONResponse({"choices": [{"text": t} for t in out]})

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat(request: ChatCompletionRequest, raw_request: Request):
        if request.tools and auto_tools:  # vLLM's Hermes parser on a tool call cut short by max_tokens
            try:
                json.loads("")
            except ValueError:
                logging.getLogger(PARSER_LOGGER).exception("Error in extracting tool call from response.")
        if not chat_template:
            return JSONResponse({"error": {"message": "this model has no chat template", "code": 400}},
                                status_code=400)
        return await answer(raw_request, request, json.dumps(request.messages))

    @app.post("/v1/completions")
    @with_cancellation
    async def completion(request: CompletionRequest, raw_request: Request):
        return await answer(raw_request, request, str(request.prompt))

    return app


PARSER_LOGGER = "vllm.tool_parsers.hermes_tool_parser"


def http_metric_paths(app) -> set:
    """The handlers the HTTP-metrics middleware counted."""
    return {s.labels.get("handler") for m in app.state.metrics_registry.collect() for s in m.samples
            if s.name == "http_requests_total"}


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_every_kind_runs_below_the_middleware_and_leaves_no_trace(kwarm_env, kwarm_log):
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")
    engine = EngineClient()
    app = build_app(engine)
    manager = engine.logger_manager
    summary = run(warm_requests.run(app))

    names = [r["name"] for r in summary["requests"]]
    assert names == [r.name for r in warm_requests.plan(warm_requests.served(app))]
    assert {"chat", "json-schema", "tool-call", "stream-chat", "long-prompt", "concurrent-streams",
            "n-logprobs", "prompt-logprobs"} <= set(names)
    assert all(r["status"] == 200 and r["error"] is None for r in summary["requests"]), summary
    assert len(engine.request_ids) >= len(names) + warm_requests.CONCURRENT - 1
    assert all(i.startswith(warm_requests.REQUEST_ID_PREFIX) for i in engine.request_ids)
    # the traces: no HTTP metric, no engine metric, an empty prefix cache, the manager back in place
    assert summary["health"] == 200
    assert http_metric_paths(app) == set(), "the HTTP-metrics middleware counted a warm request"
    assert manager.records == [], "vLLM's stat loggers recorded a warm request's steps"
    assert engine._logger_ref[0] is manager and engine.logger_manager is manager
    assert engine.prefix_cache == set() and summary["prefix_cache_reset"] is True
    # after them, a user's request is counted as before
    run(_drain(engine.generate("user", 2, "user-1")))
    assert [r["request_id"] for r in manager.records] == ["user-1", "user-1"]
    lines = kwarm_log.messages(logging.INFO)
    assert len([m for m in lines if m.startswith("kwarm: warm requests:")]) == 1
    assert "prefix cache reset; vLLM's metrics did not count them" in lines[-1]


async def _drain(agen):
    return [x async for x in agen]


def test_the_output_handler_started_by_a_warm_request_keeps_its_manager(kwarm_env):
    """vLLM starts its output handler on the first request; started inside the warm requests, it
    must still record the user's requests afterwards."""
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")
    engine = EngineClient(handler_started=False)
    manager = engine.logger_manager
    summary = run(warm_requests.run(build_app(engine)))
    assert summary["metrics_held"] is True and manager.records == []
    run(_drain(engine.generate("user", 1, "user-1")))
    assert [r["request_id"] for r in manager.records] == ["user-1"]


def test_a_failing_kind_is_named_once_and_the_others_still_run(kwarm_env, kwarm_log):
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")
    engine = EngineClient()
    summary = run(warm_requests.run(build_app(engine, chat_template=False)))
    by_name = {r["name"]: r for r in summary["requests"]}
    assert by_name["completion"]["status"] == 200 and by_name["long-prompt"]["error"] is None
    assert by_name["chat"]["error"] == "400: this model has no chat template"
    warnings = kwarm_log.messages(logging.WARNING)
    assert len(warnings) == 1 and "failed: chat (400: this model has no chat template)" in warnings[0]


def test_a_request_that_never_ends_is_cancelled_and_aborted_at_the_limit(kwarm_env, kwarm_log, monkeypatch):
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")
    monkeypatch.setattr(warm_requests, "TOTAL_LIMIT_S", 2.0)
    engine = EngineClient(hang="json-schema")
    summary = run(warm_requests.run(build_app(engine)))
    by_name = {r["name"]: r for r in summary["requests"]}
    assert by_name["json-schema"]["error"] == "cancelled after 2 s"
    assert any("json-schema" in r for r in engine.aborted), "the engine did not see the request aborted"
    assert by_name["concurrent-streams"]["error"] == "not sent: the pass ran out of time"
    assert not engine.running and summary["prefix_cache_reset"] is True
    assert engine._logger_ref[0] is engine.logger_manager


def test_what_the_line_says_where_vllm_refuses_the_reset_or_has_no_slot_to_hold(kwarm_env, kwarm_log):
    """vLLM's reset answers False where it refused (0.2x+) and nothing before; a slot that does not
    hold the client's own manager is not one kwarm can hold: the line says the requests are counted."""
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")

    class Refusing(EngineClient):
        async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            return False

    engine = Refusing()
    engine._logger_ref = [StatLoggers()]  # another manager in the slot than the client's own
    summary = run(warm_requests.run(build_app(engine)))
    assert summary["prefix_cache_reset"] is False and summary["metrics_held"] is False
    assert engine.logger_manager is not None, "a manager kwarm did not hold is left where it was"
    assert ("the prefix cache could NOT be reset: it holds their blocks; vLLM's metrics count them "
            "(this release has no stat-logger slot to hold)") in kwarm_log.messages(logging.INFO)[-1]

    class Silent(EngineClient):  # before 0.2x: the reset returned nothing
        async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            self.prefix_cache.clear()

    assert run(warm_requests.run(build_app(Silent())))["prefix_cache_reset"] is True


def test_not_selected_or_no_text_generation_sends_nothing(kwarm_env):
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1", KWARM_WARMUPS="*,-warm_requests")
    engine = EngineClient()
    app = build_app(engine)
    assert run(warm_requests.run(app)) is None and engine.request_ids == []
    kwarm_env(KWARM_WARMUPS="*")
    app.state.vllm_config.model_config.runner_type = "pooling"
    assert run(warm_requests.run(app)) is None and engine.request_ids == []


def test_the_serve_http_hook_warms_before_vllm_serves(kwarm_env):
    from kwarm_ext import patches

    kwarm_env(KWARM_ENABLE="1")
    engine = EngineClient()
    app = build_app(engine)
    order = []

    async def serve_http(app_, **kwargs):
        order.append(("serve_http", len(engine.request_ids)))
        return "task"

    result = run(patches._wrap_serve_http(serve_http, None, (app,), {"host": "h"}))
    assert result == "task" and order[0][1] > 10, "vLLM's serve_http ran before the warm requests"


def test_the_auto_tool_choice_kind_goes_with_the_parser_flag():
    from kwarm_ext import warm_requests

    base = dict(model="m", vocab_size=100, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2)
    names = [r.name for r in warm_requests.plan(warm_requests.Served(**base))]
    assert "tool-auto" not in names and "long-prompt" not in names, "no room for a chunked prompt in 64 tokens"
    plan = warm_requests.plan(warm_requests.Served(**{**base, "max_model_len": 4096}, auto_tool_choice=True))
    by_name = {r.name: r for r in plan}
    assert by_name["tool-auto"].body["tool_choice"] == "auto"
    assert len(by_name["long-prompt"].body["prompt"]) == 64 + warm_requests.LONG_PROMPT_EXTRA
    assert max(by_name["long-prompt"].body["prompt"]) < 100
    assert by_name["concurrent-streams"].concurrent == 2 and by_name["n-logprobs"].body["n"] == 2


def test_the_streams_and_the_burst_sample_as_openai_clients_do():
    """OpenAI clients send temperature and top_p, no top_k (a vLLM extension); vLLM's sampler takes
    another path for a batch without top_k (FlashInfer's top-p kernel after a softmax, instead of
    its top-k/top-p one). The streams, the burst and a single request sample that way; one request
    with top_k (and the seeded one) covers the extension's path."""
    from kwarm_ext import warm_requests

    served = warm_requests.Served(model="m", vocab_size=4096, max_model_len=12288, max_num_batched_tokens=8192,
                                  max_num_seqs=256)
    by_name = {r.name: r for r in warm_requests.plan(served)}

    def top_p_only(body):
        return body.get("temperature", 1.0) > 0 and body.get("top_p", 1.0) < 1.0 and "top_k" not in body \
            and "seed" not in body

    for name in ("top-p", "stream-chat", "stream-completion", "concurrent-streams", "n-logprobs", "penalties"):
        assert top_p_only(by_name[name].body), name
    assert by_name["concurrent-streams"].concurrent == warm_requests.CONCURRENT
    assert by_name["top-p-top-k"].body["top_k"] > 0 and by_name["top-p-top-k"].body["top_p"] < 1.0
    assert by_name["seed"].body["top_k"] > 0 and "seed" in by_name["seed"].body


VALIDATE = """
import json, sys
from kwarm_ext import warm_requests
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
served = warm_requests.Served(model="m", vocab_size=4096, max_model_len=4096, max_num_batched_tokens=256,
                              max_num_seqs=16, auto_tool_choice=True)
out = {}
for r in warm_requests.plan(served):
    model = ChatCompletionRequest if r.path == "/v1/chat/completions" else CompletionRequest
    parsed = model.model_validate(r.body)
    out[r.name] = sorted((parsed.model_extra or {}).keys())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.24.0", "0.20.0", "0.33.0", "0.34.0"])
def test_every_planned_body_is_a_valid_request_of_the_release(release):
    """Each body parses with the release's own request model, with no field it would ignore."""
    if release != "0.24.0" and release_path(release) is None:
        pytest.skip(f"vLLM {release}'s files are not fetched (tests/run.sh)")
    proc = run_py(VALIDATE, env=clean_env(CUDA_VISIBLE_DEVICES=""), release=None if release == "0.24.0" else release)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result and all(extra == [] for extra in result.values()), result


def test_the_tool_parsers_errors_on_the_warm_tool_calls_stay_out_of_the_log(kwarm_env, kwarm_log):
    """kwarm's warm tool calls stop after a few tokens, inside the call: vLLM 0.33.0's Hermes parser
    logged an ERROR and its traceback at every start. Held back while they run, counted in the
    summary; the parser's logger logs as before once they are done, and other loggers never stop."""
    from kwarm_ext import warm_requests

    kwarm_env(KWARM_ENABLE="1")
    parser_log = logging.getLogger(PARSER_LOGGER)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    parser_log.addHandler(handler)
    try:
        app = build_app(EngineClient(), auto_tools=True)
        summary = run(warm_requests.run(app))
        tool_kinds = [r for r in warm_requests.plan(warm_requests.served(app)) if r.body.get("tools")]
        assert len(tool_kinds) == 2 and summary["parser_log_held"] == 2
        assert seen == [], [r.getMessage() for r in seen]
        assert "2 tool-parser log records on their truncated tool calls held back" in kwarm_log.messages(logging.INFO)[-1]
        assert parser_log.filters == []
        parser_log.error("a user's request")
        assert [r.getMessage() for r in seen] == ["a user's request"]
    finally:
        parser_log.removeHandler(handler)
