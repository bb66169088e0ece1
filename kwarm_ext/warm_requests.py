"""Warm requests: one request of each kind through vLLM's own OpenAI app and engine, in the API
server's process, before the server listens.

Why:
    With every kernel compiled at start, the first request of each kind still cost 1.4-4.6x its
    repeat on ``vllm serve`` (vLLM 0.33.0, issue 60): +40-70 ms for the very first request whatever
    its kind, about +100 ms for the first structured-output request, +156 ms for the first ``n=3``
    request with logprobs at a 151936-token vocabulary. None of it is a compile: it is what Python,
    FastAPI and pydantic, the chat template, the tokenizer and detokenizer, xgrammar's matcher and
    token bitmask, the sampler's logprobs path and torch's first use of an op or a block size do
    once per process. Only a request makes vLLM do all of it, so kwarm makes those requests itself.

How:
    ``serve_http(app, ...)`` is where vLLM starts uvicorn on an app whose state is complete
    (``kwarm_ext/patches.py`` wraps it). Before it runs, :func:`run` sends the requests of
    :func:`plan` to that ``app`` in process, as ASGI calls: the HTTP layer of vLLM's routes, its
    request models, serving classes, renderer, input processor, engine client, the engine core and
    the workers, then the output processor, detokenizer and response streaming, everything a
    client's request meets except the socket. One ``GET /health`` goes through the whole
    middleware stack (Starlette builds it on its first call); the others enter it just below the
    user's middleware (Starlette's ``ExceptionMiddleware``: the app's exception handlers, FastAPI's
    own layers, the router), so that the HTTP metrics middleware, CORS and API-key checks never
    see them. Kinds: text
    completion, chat (greedy; top-p, as OpenAI clients sample; top-p/top-k; min-p; seeded;
    penalties; logit bias; stop strings),
    ``n=3`` with logprobs, prompt logprobs, a JSON schema, a named tool call (and ``auto`` where
    ``--enable-auto-tool-choice`` is on, through the configured parser), streamed chat and text,
    a prompt longer than one scheduler step (chunked prefill) and concurrent streams.

What a user can see:
    - nothing in uvicorn's access log (the requests never reach uvicorn) and nothing in the HTTP
      metrics (``http_requests_total`` and the like: the middleware is bypassed);
    - no prefix-cache entry: once the last request has finished, vLLM's own
      ``reset_prefix_cache()`` empties it;
    - vLLM's engine metrics (``vllm:request_success_total``, token counters, latency histograms,
      prefix-cache queries) do not count them: while they run, the engine client's stat-logger
      manager is held back (``AsyncLLM._logger_ref``, the slot vLLM's output handler reads on each
      step, 0.20-0.34), and given back after. Where a release has no such slot, they are counted,
      and the summary line says so;
    - with ``--enable-log-requests`` vLLM logs them, under request ids starting ``kwarm-warm-``;
    - nothing from vLLM's tool parsers: the warm tool calls stop after a few tokens, inside the
      call, and a parser that reads one logs an exception (vLLM 0.33.0's Hermes parser: an ERROR
      and a 12-line traceback at every start of ``kwarm run -- vllm serve --tool-call-parser
      hermes``, H100). What the tool parsers' loggers log while the warm requests run is held
      back (:class:`_HeldParserLog`), and the summary line counts it (it can go when vLLM's tool
      parsers stop logging a traceback for a call cut short by ``max_tokens``);
    - GPU memory: the long prompt's first chunk is a full ``max_num_batched_tokens`` step, the one
      vLLM's profile run sized its activations for, so nvidia-smi shows the engine near its serving
      peak before ready rather than at the first large request (DeepSeek-V3.2 dimensions at 0.92 on
      the H100: BENCHMARKS.md's memory chart).

Each request is isolated: one that fails (a model without a chat template answers 400 to chat)
is named in the summary line with its status and vLLM's message, the others still run. The
whole pass stops at :data:`TOTAL_LIMIT_S` (a request still running is cancelled, which aborts
it in the engine, as a client's disconnect does).

vLLM versions: 0.20-0.34 (``serve_http`` imported by name in ``vllm/entrypoints/openai/
api_server.py`` before 0.33, in ``vllm/entrypoints/launchers/api_server/entry.py`` since). It can
go when vLLM warms its own request path before it listens.

This is the ``warm_requests`` entry of ``KWARM_WARMUPS``; it runs in the API server.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from kwarm_ext import config

logger = logging.getLogger("kwarm")

NAME = "warm_requests"
REQUEST_ID_PREFIX = "kwarm-warm-"
TOTAL_LIMIT_S = 180.0  # the whole pass; a published-size model answers each request in well under 1 s
MAX_TOKENS = 4  # decode steps enough to reach every per-step path (sampling, detokenizing, streaming)
CONCURRENT = 16  # streams at once: the batch shapes of a burst (serve_bench sends 16; 8 left its first burst at 1.7x)
LONG_PROMPT_EXTRA = 16  # tokens beyond one scheduler step: the prompt is prefilled in two chunks

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@dataclasses.dataclass(frozen=True)
class WarmRequest:
    """One request of :func:`plan`: `body` POSTed to `path`, `concurrent` copies at once."""

    name: str
    path: str
    body: dict
    concurrent: int = 1

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))


@dataclasses.dataclass
class Outcome:
    name: str
    status: int | None = None
    seconds: float = 0.0
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Served:
    """What :func:`plan` needs to know of the server (read from the app's state by :func:`served`)."""

    model: str
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    auto_tool_choice: bool = False


def plan(served: Served) -> list[WarmRequest]:
    """The requests, in order; each kind once."""
    words = "The quick brown fox jumps over the lazy dog while the city sleeps and the river runs"

    def chat(text, **params):
        return {"model": served.model, "messages": [{"role": "user", "content": text}],
                "max_tokens": MAX_TOKENS, **params}

    fixed = {"ignore_eos": True}  # every request runs its MAX_TOKENS decode steps
    # What OpenAI clients send: temperature and top_p, no top_k (a vLLM extension). vLLM's sampler
    # takes another path for a batch without top_k (FlashInfer's top-p kernel, not its top-k/top-p
    # one), so the streams and the concurrent burst sample that way; the top-p-top-k and seeded
    # requests cover the extension's path.
    sampled = {"temperature": 0.8, "top_p": 0.9}
    with_top_k = {**sampled, "top_k": 40}
    requests = [
        WarmRequest("completion", "/v1/completions",
                    {"model": served.model, "prompt": words, "max_tokens": MAX_TOKENS, "temperature": 0.0, **fixed}),
        WarmRequest("chat", "/v1/chat/completions", chat(words, temperature=0.0, **fixed)),
        WarmRequest("top-p", "/v1/chat/completions", chat(words, **sampled, **fixed)),
        WarmRequest("top-p-top-k", "/v1/chat/completions", chat(words, **with_top_k, **fixed)),
        WarmRequest("min-p", "/v1/chat/completions", chat(words, temperature=0.7, min_p=0.1, **fixed)),
        WarmRequest("seed", "/v1/chat/completions", chat(words, **with_top_k, seed=1234, **fixed)),
        WarmRequest("n-logprobs", "/v1/chat/completions",
                    chat(words, **sampled, n=min(3, served.max_num_seqs), logprobs=True, top_logprobs=5, **fixed)),
        WarmRequest("prompt-logprobs", "/v1/chat/completions", chat(words, temperature=0.0, prompt_logprobs=3, **fixed)),
        WarmRequest("penalties", "/v1/chat/completions",
                    chat(words, **sampled, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, **fixed)),
        WarmRequest("logit-bias", "/v1/chat/completions",
                    chat(words, temperature=0.0, logit_bias={"1": 5, "2": -5}, **fixed)),
        WarmRequest("stop-strings", "/v1/chat/completions",
                    chat(words, temperature=0.0, stop=["<<kwarm>>", "\n\n\n\n"], **fixed)),
        WarmRequest("json-schema", "/v1/chat/completions",
                    chat(words, temperature=0.0, max_tokens=2 * MAX_TOKENS,
                         response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})),
        WarmRequest("tool-call", "/v1/chat/completions",
                    chat(words, temperature=0.0, max_tokens=2 * MAX_TOKENS, tools=[TOOL],
                         tool_choice={"type": "function", "function": {"name": "get_weather"}})),
    ]
    if served.auto_tool_choice:  # the configured tool parser reads the output
        requests.append(WarmRequest("tool-auto", "/v1/chat/completions",
                                    chat(words, temperature=0.0, tools=[TOOL], tool_choice="auto", **fixed)))
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    requests += [
        WarmRequest("stream-chat", "/v1/chat/completions", chat(words, **sampled, **streamed, **fixed)),
        WarmRequest("stream-completion", "/v1/completions",
                    {"model": served.model, "prompt": words, "max_tokens": MAX_TOKENS, **sampled, **streamed, **fixed}),
    ]
    long_tokens = served.max_num_batched_tokens + LONG_PROMPT_EXTRA
    if long_tokens + MAX_TOKENS <= served.max_model_len:  # token ids: the tokenizer is warmed above
        ids = [10 + i % max(1, min(1000, served.vocab_size - 10)) for i in range(long_tokens)]
        requests.append(WarmRequest("long-prompt", "/v1/completions",
                                    {"model": served.model, "prompt": ids, "max_tokens": MAX_TOKENS,
                                     "temperature": 0.0, **fixed}))
    requests.append(WarmRequest("concurrent-streams", "/v1/chat/completions",
                                chat(words, **sampled, **streamed, **fixed),
                                concurrent=max(1, min(CONCURRENT, served.max_num_seqs))))
    return requests


def served(app) -> Served | None:
    """What the requests need from `app`'s state; None where this app has no engine that
    generates text (vLLM's render-only server, a pooling model, ``--skip-tokenizer-init``)."""
    state = app.state
    engine_client = getattr(state, "engine_client", None)
    vllm_config = getattr(state, "vllm_config", None) or getattr(engine_client, "vllm_config", None)
    if engine_client is None or vllm_config is None:
        return None
    model_config = vllm_config.model_config
    if getattr(model_config, "runner_type", "generate") != "generate" or getattr(model_config, "skip_tokenizer_init", False):
        return None
    args = getattr(state, "args", None)
    names = getattr(args, "served_model_name", None) or [getattr(args, "model", None) or model_config.model]
    scheduler = vllm_config.scheduler_config
    return Served(model=str(names[0] if isinstance(names, (list, tuple)) else names),
                  vocab_size=int(model_config.get_vocab_size()), max_model_len=int(model_config.max_model_len),
                  max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
                  max_num_seqs=int(scheduler.max_num_seqs),
                  auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)))


async def asgi_request(target, method: str, path: str, body: dict | None = None, request_id: str | None = None,
                       app=None, disconnect: asyncio.Event | None = None):
    """One HTTP request to the ASGI callable `target` (an app, or a layer of its middleware stack:
    then `app` is the app its routes read their state from) in this process; (status, response
    body bytes). The client stays connected until `disconnect` is set (then it sends
    ``http.disconnect``, on which vLLM's routes abort the request in the engine)."""
    payload = json.dumps(body).encode() if body is not None else b""
    headers = [(b"host", b"kwarm.warmup"), (b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "state": {}, "app": app if app is not None else target}
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await (disconnect or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    response = {"status": None, "body": []}

    async def send(message):
        if message["type"] == "http.response.start":
            response["status"] = message["status"]
        elif message["type"] == "http.response.body":
            response["body"].append(message.get("body", b""))

    await target(scope, receive, send)
    return response["status"], b"".join(response["body"])


def stream_error(data: bytes) -> str | None:
    """The first error event of a server-sent-events body, or a missing ``[DONE]``; None if fine."""
    text = data.decode("utf-8", "replace")
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                event = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("error"):
                return _message(event)
    return None if "data: [DONE]" in text else "the stream ended without [DONE]"


def _message(payload) -> str:
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:200]


def below_middleware(app):
    """The layer of `app`'s built middleware stack just below the user's middleware: Starlette's
    ``ExceptionMiddleware`` (the app's exception handlers, then FastAPI's own layers and the
    router), found by following each layer's ``app``. None if the stack is not built or has none."""
    from starlette.middleware.exceptions import ExceptionMiddleware

    layer = getattr(app, "middleware_stack", None)
    for _ in range(64):
        if layer is None or isinstance(layer, ExceptionMiddleware):
            return layer
        layer = getattr(layer, "app", None)
    return None


async def send(app, request: WarmRequest, index: int, disconnect: asyncio.Event | None = None) -> Outcome:
    """`request` (its copies at once) below `app`'s middleware; never raises but cancellation."""
    outcome = Outcome(request.name)
    t0 = time.perf_counter()
    inner = below_middleware(app)
    if inner is None:
        outcome.error = "not sent: the app's middleware stack has no exception layer to enter below the middleware"
        return outcome

    async def one(copy: int):
        return await asgi_request(inner, "POST", request.path, request.body,
                                  request_id=f"{REQUEST_ID_PREFIX}{index}-{copy}-{request.name}", app=app,
                                  disconnect=disconnect)

    try:
        results = await asyncio.gather(*(one(i) for i in range(request.concurrent)))
    except Exception as exc:  # what the app's exception handlers would have turned into a 4xx/5xx
        outcome.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        results = []
    for status, data in results:
        outcome.status = status
        if status != 200:
            try:
                outcome.error = f"{status}: {_message(json.loads(data))}"
            except ValueError:
                outcome.error = f"{status}: {data[:200].decode('utf-8', 'replace')}"
            break
        if request.streamed and (problem := stream_error(data)):
            outcome.error = problem
            break
    outcome.seconds = time.perf_counter() - t0
    return outcome


class _HeldParserLog(logging.Filter):
    """While the warm requests run, the records of vLLM's tool-parser loggers (every logger whose
    name has ``tool_parser`` in it: ``vllm.tool_parsers.*`` on 0.3x, ``vllm.entrypoints.openai.
    tool_parsers.*`` before) are dropped and counted; any other record passes. A filter on each of
    those loggers, removed after: the parsers' modules are imported once the app is built."""

    def __init__(self):
        super().__init__()
        self.held = 0
        self.loggers: list = []

    def filter(self, record) -> bool:
        self.held += 1
        return False

    def __enter__(self):
        names = [n for n in list(logging.Logger.manager.loggerDict) if "tool_parser" in n]
        self.loggers = [logging.getLogger(n) for n in names]
        for lg in self.loggers:
            lg.addFilter(self)
        return self

    def __exit__(self, *exc):
        for lg in self.loggers:
            lg.removeFilter(self)
        return False


class _HeldMetrics:
    """vLLM's stat-logger manager held back while the warm requests run (see the module's doc)."""

    def __init__(self, engine_client):
        self.engine_client = engine_client
        self.manager = getattr(engine_client, "logger_manager", None)
        self.held = False

    def __enter__(self):
        client = self.engine_client
        if self.manager is None:  # --disable-log-stats: nothing to hold
            return self
        start = getattr(client, "_run_output_handler", None)
        if getattr(client, "_logger_ref", None) is None and callable(start):
            start()  # idempotent; the output handler then reads its manager from the slot it makes
        ref = getattr(client, "_logger_ref", None)
        if isinstance(ref, list) and ref and ref[0] is self.manager:
            ref[0] = None
            client.logger_manager = None  # vLLM's periodic do_log_stats reads this one
            self.held = True
        return self

    def __exit__(self, *exc):
        if self.held:
            self.engine_client._logger_ref[0] = self.manager
            self.engine_client.logger_manager = self.manager
        return False


async def reset_prefix_cache(engine_client) -> bool:
    """vLLM's own reset of the prefix cache (every finished request's blocks); whether it did."""
    reset = getattr(engine_client, "reset_prefix_cache", None)
    if reset is None:
        return False
    result = await reset()
    return result is None or bool(result)  # before 0.2x it returned nothing


DISCONNECT_GRACE_S = 10.0  # for the app to abort a request after its client disconnected


async def _send_within(app, request: WarmRequest, index: int, seconds: float) -> Outcome:
    """:func:`send` for at most `seconds`; then its client disconnects (vLLM aborts the request in
    the engine, as for any client that goes away) and, if the app still has not returned, it is
    cancelled."""
    disconnect = asyncio.Event()
    task = asyncio.ensure_future(send(app, request, index, disconnect))
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        disconnect.set()
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return Outcome(request.name, seconds=seconds, error=f"cancelled after {TOTAL_LIMIT_S:g} s")
    return task.result()


async def run(app) -> dict | None:
    """Send :func:`plan`'s requests to `app`, reset the prefix cache; the summary (also logged),
    or None when the warmup is not selected or `app` serves no text generation."""
    if not config.get().warmups.wants(NAME):
        return None
    what = served(app)
    if what is None:
        logger.info("kwarm: warm requests: skipped, this server does not generate text from prompts")
        return None
    requests = plan(what)
    engine_client = app.state.engine_client
    t0 = time.perf_counter()
    health = await asgi_request(app, "GET", "/health")  # Starlette builds the middleware stack here
    outcomes: list[Outcome] = []
    with _HeldMetrics(engine_client) as held, _HeldParserLog() as parser_log:
        for index, request in enumerate(requests):
            left = TOTAL_LIMIT_S - (time.perf_counter() - t0)
            if left <= 0:
                outcomes.append(Outcome(request.name, error="not sent: the pass ran out of time"))
                continue
            outcomes.append(await _send_within(app, request, index, left))
    reset = await reset_prefix_cache(engine_client)
    seconds = time.perf_counter() - t0
    summary = {"seconds": round(seconds, 3), "health": health[0], "prefix_cache_reset": reset,
               "metrics_held": held.held or held.manager is None, "parser_log_held": parser_log.held,
               "requests": [dataclasses.asdict(o) for o in outcomes]}
    failed = [o for o in outcomes if o.error]
    for o in outcomes:
        logger.debug("kwarm: warm request %s: %s in %.0f ms", o.name, o.error or o.status, 1000 * o.seconds)
    traces = [("prefix cache reset" if reset else "the prefix cache could NOT be reset: it holds their blocks"),
              ("vLLM's metrics did not count them" if summary["metrics_held"]
               else "vLLM's metrics count them (this release has no stat-logger slot to hold)")]
    if parser_log.held:
        traces.append(f"{parser_log.held} tool-parser log record{'s' if parser_log.held > 1 else ''} on their "
                      "truncated tool calls held back")
    text = (f"kwarm: warm requests: {len(outcomes) - len(failed)} of {len(outcomes)} kinds ran through vLLM's "
            f"API in {seconds:.2f} s, before the server listens; {'; '.join(traces)}")
    if failed:
        logger.warning("%s; failed: %s", text, "; ".join(f"{o.name} ({o.error})" for o in failed))
    else:
        logger.info("%s", text)
    return summary
