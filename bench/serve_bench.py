#!/usr/bin/env python3
"""The serving benchmark: ``vllm serve`` as operators run it, plain and through ``kwarm run``.

Starts two OpenAI-compatible servers side by side on one GPU, ``vllm serve`` and ``kwarm run --
vllm serve``, each with its own empty caches (Triton, vLLM, Inductor, FlashInfer's JIT workspace,
CuTe DSL, and a HOME of its own for everything else), on a random-weight model from
``bench/models/`` with a tokenizer built for it (``serve_tokenizer.py``), every backend left at
vLLM's default. It records launch to ready, then drives both through the OpenAI API (the
``openai`` client), one request at a time, every request kind's first occurrence followed by its
repeat with other content (``REQUEST_KINDS``), and counts, per request, every kind of lazy work
the servers did meanwhile, by name:

- from the probe (``serve_probe/sitecustomize.py``, in every server process): Triton compiles
  (and loads from Triton's disk cache), FlashInfer JIT modules built or loaded, CuTe DSL compiles,
  torch.compile runs, xgrammar's tokenizer info and grammar compiles, the chat template's compile;
- from the cache folders: new DeepGEMM kernels, TileLang, tvm-ffi builds, Inductor artifacts;
- from the server's log: vLLM's JIT monitor lines and other compile or build lines.

Then (``--restarts 1``, default) it stops both and starts them again on the same caches (a warm
restart: kwarm replays what it learned, ``kwarm run --learn``) and measures again. Backends come
from vLLM's own log lines. Needs a GPU and vLLM; the request set, counting and table need neither.

    python3 bench/serve_bench.py bench/models/tiny-qwen3-next --out bench/results/serve
    python3 bench/serve_bench.py --table bench/results/serve/*.serve.json   # markdown tables
    python3 bench/serve_bench.py --noise bench/results/serve/*.serve.json   # the bar against the host's noise
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE_DIR = HERE / "serve_probe"
SCHEMA = "kwarm-serve-bench/1"
SERVERS = ("plain", "kwarm")
LONG_PROMPT_TOKENS = 8600
BURST = 16
# variables that force a backend: the benchmark measures vLLM's defaults, so the servers never get them
FORCING_ENV = ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND", "VLLM_USE_DEEP_GEMM",
               "VLLM_MOE_USE_DEEP_GEMM", "FLASHINFER_DISABLE_JIT")


# ------------------------------------------------------------------------------- request set
@dataclass(frozen=True)
class Kind:
    """One request kind: what the OpenAI client sends (``api``: chat, completion, stream, burst)."""

    name: str
    api: str
    params: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    max_tokens: int = 16
    words: int = 60
    note: str = ""


SCHEMA_A = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}
SCHEMA_B = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "score": {"type": "number"}, "ok": {"type": "boolean"}}, "required": ["name", "score", "ok"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
FIXED_LENGTH = {"ignore_eos": True}

REQUEST_KINDS: tuple[Kind, ...] = (
    Kind("completion", "completion", {"temperature": 0.0}, FIXED_LENGTH, note="plain completions, text prompt, greedy"),
    Kind("chat-greedy", "chat", {"temperature": 0.0}, FIXED_LENGTH, note="chat template, greedy"),
    Kind("chat-top-p-top-k", "chat", SAMPLED, {"top_k": 40, **FIXED_LENGTH}, note="temperature, top_p, top_k"),
    Kind("chat-min-p", "chat", {"temperature": 0.7}, {"min_p": 0.1, **FIXED_LENGTH}, note="temperature, min_p"),
    Kind("chat-seed", "chat", {**SAMPLED, "seed": 1234}, {"top_k": 40, **FIXED_LENGTH}, note="seeded sampling"),
    Kind("stream", "stream", SAMPLED, FIXED_LENGTH, max_tokens=32, note="streaming: TTFT, inter-token latency"),
    Kind("n2", "chat", {**SAMPLED, "n": 2}, FIXED_LENGTH, note="n=2"),
    Kind("logprobs", "chat", {"temperature": 0.0, "logprobs": True, "top_logprobs": 5}, FIXED_LENGTH),
    Kind("prompt-logprobs", "chat", {"temperature": 0.0}, {"prompt_logprobs": 3, **FIXED_LENGTH}),
    Kind("penalties", "chat", {**SAMPLED, "presence_penalty": 0.5, "frequency_penalty": 0.5},
         {"repetition_penalty": 1.1, **FIXED_LENGTH}, note="presence, frequency, repetition"),
    Kind("logit-bias", "chat", {"temperature": 0.0, "logit_bias": {"100": 5, "200": -5}}, FIXED_LENGTH),
    Kind("stop-strings", "chat", {"temperature": 0.0, "stop": ["<<never>>", "\n\n\n\n"]}, FIXED_LENGTH),
    Kind("json-schema", "chat", {"temperature": 0.0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA_A}}}, max_tokens=32,
         note="structured output (xgrammar), first schema"),
    Kind("json-schema-new", "chat", {"temperature": 0.0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "card", "schema": SCHEMA_B}}}, max_tokens=32,
         note="a second schema never seen before"),
    Kind("tool-call", "chat", {"temperature": 0.0, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, max_tokens=32, note="named tool_choice"),
    Kind("long-prompt", "chat", {"temperature": 0.0}, FIXED_LENGTH, words=-1,
         note=f"{LONG_PROMPT_TOKENS}+ prompt tokens (chunked prefill)"),
    Kind("burst", "burst", SAMPLED, FIXED_LENGTH, note=f"{BURST} concurrent streaming requests: TTFT p50/p99"),
)
KIND_BY_NAME = {k.name: k for k in REQUEST_KINDS}


def content_seed(phase: str, kind: str, occurrence: str) -> int:
    """The same content for both servers; other content for a repeat and for another phase."""
    return int.from_bytes(hashlib.sha256(f"{phase}/{kind}/{occurrence}".encode()).digest()[:8], "big") % 1_000_003


def prompt_text(seed: int, n_words: int) -> str:
    from serve_tokenizer import words

    return " ".join(words(n_words, seed))


def build_request(kind: Kind, seed: int, model: str, long_words: int = 6000) -> dict:
    """Keyword arguments for the openai client's ``chat.completions.create`` (or ``completions``)."""
    n_words = long_words if kind.words < 0 else kind.words
    text = prompt_text(seed, n_words)
    body = {"model": model, "max_tokens": kind.max_tokens, **kind.params}
    if kind.extra_body:
        body["extra_body"] = dict(kind.extra_body)
    if kind.api == "completion":
        body["prompt"] = text
        return body
    # a per-request nonce first: a repeat never shares a prefix-cache block with its first occurrence
    body["messages"] = [{"role": "system", "content": f"Session {seed}: {prompt_text(seed + 7, 4)}"},
                        {"role": "user", "content": text}]
    if kind.api in ("stream", "burst"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# A kind's repeats, each with other content. The table's repeat is their median: one repeat is a
# single sample, and on the GPU host single samples of one kind differed by 10-20 ms with nothing
# lazy in either (tiny DeepSeek-V3.2, cold: logit-bias 57.5 ms first, 39.5 ms repeat; plain's
# Qwen3-Next warm logit-bias 48.8 first, 65.0 repeat), as much as the 1.1x / 10 ms bar itself.
REPEATS = ("repeat", "repeat2", "repeat3")


def kinds_of(args) -> tuple[Kind, ...]:
    """The kinds ``--kinds`` names, in the plan's order (all of them without it)."""
    names = None if args.kinds is None else {k.strip() for k in args.kinds.split(",")}
    return tuple(k for k in REQUEST_KINDS if names is None or k.name in names)


def request_plan(kinds=REQUEST_KINDS) -> list[tuple[Kind, str]]:
    """Every kind's first occurrence, then its repeats (other content each), in order."""
    return [(kind, occurrence) for kind in kinds for occurrence in ("first", *REPEATS)]


ORDERS = ("kind", "request")


def request_schedule(kinds, names: list[str], order: str = "kind") -> list[tuple[Kind, str, str]]:
    """(kind, occurrence, server) in the order they are sent, one at a time.

    ``kind`` (the default): per kind, each server's first and repeats back to back, one server after
    the other; every first follows the other server's last repeat (or, for the first server, the
    other's block of the previous kind), never the other server's first. ``request`` (the order of
    the runs published before it): each request on every server in turn, so the second server's
    first always follows the first server's first: right after whatever lazy work that one did
    (plain `vllm serve` compiling), never after a repeat."""
    if order == "request":
        return [(kind, occurrence, name) for kind, occurrence in request_plan(kinds) for name in names]
    return [(kind, occurrence, name) for kind in kinds for name in names for occurrence in ("first", *REPEATS)]


def long_prompt_words(tokenizer_json: Path, target: int = LONG_PROMPT_TOKENS) -> int:
    """Words of ``prompt_text`` that make at least `target` tokens with this tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    sample = 1000
    per_word = len(tok.encode(prompt_text(1, sample)).ids) / sample
    n = int(target / per_word * 1.05) + 50
    for _ in range(5):
        if len(tok.encode(prompt_text(content_seed("x", "long-prompt", "first"), n)).ids) >= target:
            return n
        n = int(n * 1.1)
    return n


# ---------------------------------------------------------------------------------- counting
def load_events(path: Path) -> list[dict]:
    """The probe's events (a torn or foreign line is skipped)."""
    events = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("t"), (int, float)):
                    events.append(event)
    except OSError:
        pass
    return events


def events_between(events: list[dict], t0: float, t1: float) -> list[dict]:
    return [e for e in events if t0 <= e["t"] <= t1]


FRONTEND_MIN_S = 0.001  # a cached grammar or template returns in microseconds: below this, no work


def cache_surface(rel: str) -> tuple[str, str] | None:
    """(surface, entry name) of a new file in a server's cache folder, or None for bookkeeping."""
    parts = rel.split("/")
    name = parts[-1]
    if name.endswith((".lock", ".tmp")) or "/tmp" in rel:
        return None
    if "deep_gemm" in parts or "deep_gemm" in rel:
        entry = next((p for p in parts if p.startswith("kernel.")), parts[-2] if len(parts) > 1 else name)
        return "deep_gemm", entry
    if "triton_cache" in parts or parts[0] == "triton":
        stem = name.split(".")[0]
        return ("triton", stem) if name.endswith((".cubin", ".hsaco")) else None
    if parts[0] == "flashinfer":
        if "cached_ops" in parts:
            i = parts.index("cached_ops")
            return ("flashinfer", parts[i + 1]) if len(parts) > i + 2 and name.endswith(".so") else None
        return ("flashinfer", "/".join(parts[-2:])) if "cubins" in parts else None
    if parts[0] == "cutedsl":
        return "cute_dsl", name
    if "tvm-ffi" in rel or "tvm_ffi" in rel:
        return ("tvm_ffi", name) if name.endswith(".so") else None
    if "tilelang" in rel:
        return "tilelang", parts[-2] if len(parts) > 1 else name
    if parts[0] == "inductor" or "torch_compile_cache" in parts or "inductor" in rel:
        return None  # torch.compile's artifacts: the probe's torch_compile events count these
    return None


def snapshot(root: Path) -> set[str]:
    """Relative paths of the files under `root`."""
    out = set()
    root = Path(root)
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for f in files:
            out.add(f if rel == "." else f"{rel}/{f}")
    return out


COUNTED = ("triton", "triton_disk", "flashinfer_built", "flashinfer_loaded", "cute_dsl", "torch_compile",
           "deep_gemm", "tilelang", "tvm_ffi")
FRONTEND = ("xgrammar", "chat_template")
LOG_RE = re.compile(r"JIT|[Cc]ompil|[Aa]utotun|Building|[Bb]uilt|recompil|ninja|nvcc")


def summarize_lazy(events: list[dict], new_files=(), log_lines=()) -> dict:
    """What a request (or an interval) met for the first time, by surface and name.

    ``counts`` per surface in ``COUNTED`` (compiles, builds and loads) and ``FRONTEND`` (front-end
    first-use work over ``FRONTEND_MIN_S``), ``names`` (``{surface: {name: count}}``), ``frontend_ms``,
    ``seconds`` (the probe's summed time per ``COUNTED`` surface: at start, how long CuTe DSL's
    compiles or Triton's disk loads held the engine) and the matching log lines."""
    names: dict[str, dict[str, int]] = {}
    frontend_ms: dict[str, float] = {}
    seconds: dict[str, float] = {}

    def add(surface, name, took=None):
        names.setdefault(surface, {})
        names[surface][name] = names[surface].get(name, 0) + 1
        if took is not None:  # compiles, builds and loads only: front-end work has frontend_ms
            seconds[surface] = seconds.get(surface, 0.0) + took

    for e in events:
        kind, name = e.get("kind"), str(e.get("name", "?"))
        took = e.get("s")
        if kind == "triton":
            add("triton_disk" if e.get("cache_hit") else "triton", name, took)
        elif kind == "flashinfer":
            add("flashinfer_built" if e.get("built") else "flashinfer_loaded", name, took)
        elif kind in ("cute_dsl", "torch_compile"):
            add(kind, name, took)
        elif kind in FRONTEND and (took or 0) >= FRONTEND_MIN_S:
            add(kind, name)
            frontend_ms[name] = round(frontend_ms.get(name, 0) + 1000 * took, 2)
    for rel in new_files:
        surface = cache_surface(rel)
        if surface and surface[0] in ("deep_gemm", "tilelang", "tvm_ffi"):
            if surface[1] not in names.get(surface[0], {}):
                add(*surface)
    counts = {s: sum(v.values()) for s, v in names.items()}
    return {"n": sum(counts.get(s, 0) for s in COUNTED),
            "frontend_n": sum(counts.get(s, 0) for s in FRONTEND),
            "counts": counts, "names": names, "frontend_ms": frontend_ms,
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "log": [line[:300] for line in log_lines if LOG_RE.search(line)][:20]}


BACKEND_RES = [re.compile(p) for p in (
    r"Using \S+ attention backend.*", r"Using \S+ backend\.$", r"Using .* GDN prefill kernel.*",
    r"Using FlashInfer for top-p & top-k sampling.*", r"Using \S+ MLA prefill backend.*",
    r"Using .*(?:MoE|[Ee]xperts|moe).*", r".*[Ff]lash[Ii]nfer.*(?:sampl|not available|fall).*",
    r"Using V2 Model Runner.*", r"Using \S+ KV cache layout.*", r".*[Ss]tructured output.*backend.*",
    r".*KV cache size: [\d,]+ tokens.*")]  # the KV cache vLLM sized: equal with and without kwarm


def log_message(line: str) -> str:
    """A vLLM log line without its prefix: ``(EngineCore pid=1) INFO 12-05 08:01:02 [f.py:3] msg``."""
    match = re.search(r"\[[\w./-]+:\d+\] (.*)$", line)
    return (match.group(1) if match else line).strip()


def backends_from_log(lines) -> list[str]:
    """vLLM's own lines naming the backends it chose, each once, in order (not kwarm's lines
    about FlashInfer's builds, which the FlashInfer pattern would take too)."""
    seen = []
    for line in lines:
        message = log_message(line)
        if "kwarm: " in message:
            continue
        if any(r.match(message) for r in BACKEND_RES) and message not in seen:
            seen.append(message[:240])
    return seen


KWARM_DONE_RE = re.compile(r"kwarm: warmup done in ([\d.]+) s")
KV_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


# What a user could see of requests made before ready (kwarm's warm requests): vLLM's engine
# counters and the HTTP middleware's, each summed over its label sets, read once at ready.
TRAFFIC_METRICS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                   "vllm:prefix_cache_queries_total", "http_requests_total")


def traffic_counters(text: str) -> dict:
    """``{metric: summed value}`` of :data:`TRAFFIC_METRICS` in a Prometheus text page (absent: left out)."""
    out: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in TRAFFIC_METRICS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


def stages_text(stages: dict | None) -> str:
    """``engine 34, weights loaded 41, ...`` in the order they happened."""
    if not stages:
        return "—"
    return ", ".join(f"{name} {seconds:.0f}" for name, seconds in sorted(stages.items(), key=lambda kv: kv[1]))


def kv_cache_tokens(lines) -> int | None:
    """The token count of vLLM's "GPU KV cache size: N tokens" line (the last one), if any."""
    found = [int(m.group(1).replace(",", "")) for m in map(KV_TOKENS_RE.search, lines) if m]
    return found[-1] if found else None


# The milestones of a start, each the first log line that matches (vLLM's own lines, FlashInfer's
# JIT lines, kwarm's): where the time between launch and ready went, to the second.
START_STAGES = (
    ("engine", r"Initializing a V1 LLM engine"),
    ("weights loaded", r"Model loading took|Loading weights took"),
    ("torch.compile done", r"torch\.compile (?:takes|took)[^\n]*in total"),
    ("memory profiled", r"Available KV cache memory"),
    ("kv cache sized", r"GPU KV cache size"),
    ("kwarm warmup done", r"kwarm: warmup done in"),
    ("graphs captured", r"Graph capturing finished"),
    ("engine ready", r"init engine \(profile"),
    ("kwarm warm requests done", r"kwarm: warm requests:"),
    ("api listening", r"Starting vLLM (?:API )?server on|Application startup complete"),
    ("sampling build started", r"Building JIT module sampling"),  # FlashInfer 0.7 says no end
    ("kwarm early builds started", r"kwarm: early FlashInfer builds: "),
    ("kwarm early sampling built", r"kwarm: early FlashInfer build: sampling ready"),
)
_STAMP_RES = (re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR)\s+(\d\d-\d\d \d\d:\d\d:\d\d)\b"),  # vLLM's
              re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ - "))  # logging's default (FlashInfer)


def line_time(line: str, year: int) -> float | None:
    """The epoch seconds of a log line's own timestamp (local time, to the second), if it has one."""
    for i, r in enumerate(_STAMP_RES):
        m = r.search(line)
        if m:
            text = m.group(1) if i else f"{year}-{m.group(1)}"  # vLLM's lines have no year
            try:
                return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()
            except ValueError:
                return None
    return None


def start_stages(lines, launched: float) -> dict:
    """``{stage: seconds after launch}`` of :data:`START_STAGES` met in a server's log, in log order.
    Timestamps are the lines' own (one-second resolution): a stage reads as up to 1 s early."""
    year = datetime.datetime.fromtimestamp(launched).year
    patterns = [(name, re.compile(p)) for name, p in START_STAGES]
    found: dict = {}
    for line in lines:
        for name, r in patterns:
            if name not in found and r.search(line):
                t = line_time(line, year)
                if t is not None:
                    found[name] = round(max(0.0, t - launched), 0)
    return found


class GpuMemory:
    """The device's used memory (nvidia-smi's ``memory.used``, every `interval` s) while a server runs
    alone on it (``--one-at-a-time``): ``timeline`` [[seconds since `t0`, MiB], ...] and ``peak_mib``;
    which process held what, every `apps_interval` s.

    One ``nvidia-smi --loop-ms`` process prints the samples: a vLLM CUDA-graph capture holds its
    peak for about a second, and one nvidia-smi call per sample (50-100 ms, two a sample with the
    process list) sampled every 0.6-0.7 s, so a peak could fall between samples (the published
    0.92 results before 2026-12-07: 0.5 s asked). Where that process gives nothing, one call per
    sample, as before. The process list comes from its own thread; the peak's is the latest one."""

    def __init__(self, t0: float, interval: float = 0.1, apps_interval: float = 0.5):
        self.t0, self.interval, self.apps_interval, self.samples = t0, interval, apps_interval, []
        self.processes: dict = {}  # label -> the most MiB it held (gpu_processes_mib)
        self.at_peak: list = []  # who held what at the peak sample
        self._apps: list = []  # the latest process list
        self._peak = -1
        self._loop = None  # the nvidia-smi --loop-ms process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory", daemon=True)
        self._apps_thread = threading.Thread(target=self._run_apps, name="gpu-processes", daemon=True)

    def __enter__(self):
        self._apps = gpu_processes_mib()  # the first sample's, before either thread runs
        self._apps_thread.start()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        loop = self._loop
        if loop is not None and loop.poll() is None:
            loop.terminate()
        self._thread.join(timeout=5)
        self._apps_thread.join(timeout=5)
        if loop is not None and loop.poll() is None:
            loop.kill()

    def _sample(self, mib: int) -> None:
        self.samples.append([round(time.time() - self.t0, 2), mib])
        if mib >= self._peak:
            self._peak, self.at_peak = mib, list(self._apps)

    def _run(self):
        if not self._run_loop():
            while not self._stop.is_set():
                mib = gpu_used_mib()
                if mib is not None:
                    self._sample(mib)
                self._stop.wait(self.interval)

    def _run_loop(self) -> bool:
        """Samples from one ``nvidia-smi --loop-ms`` process; False where it gave none."""
        try:
            self._loop = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0",
                 f"--loop-ms={max(10, int(self.interval * 1000))}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi here
            return False
        got = False
        for line in self._loop.stdout:
            try:
                mib = int(line.strip())
            except ValueError:
                continue
            got = True
            self._sample(mib)
            if self._stop.is_set():
                break
        return got

    def _run_apps(self):
        while not self._stop.is_set():
            apps = gpu_processes_mib()
            self._apps = apps
            for label, used in apps:
                self.processes[label] = max(used, self.processes.get(label, 0))
            self._stop.wait(self.apps_interval)

    def summary(self, every: float = 2.0) -> dict:
        """Peak, and a timeline thinned to one sample per `every` s that keeps every sample's maximum."""
        if not self.samples:
            return {}
        thin, bucket = [], None
        for t, mib in self.samples:
            key = int(t // every)
            if bucket is not None and bucket[0] == key:
                bucket[1] = max(bucket[1], mib)
            else:
                if bucket is not None:
                    thin.append([bucket[0] * every, bucket[1]])
                bucket = [key, mib]
        thin.append([bucket[0] * every, bucket[1]])
        peak_t, peak = max(self.samples, key=lambda s: s[1])
        return {"peak_gpu_mib": peak, "peak_gpu_at_s": peak_t, "gpu_mib_timeline": thin,
                "gpu_sample_interval_s": self.interval,
                "gpu_processes_peak_mib": dict(sorted(self.processes.items())),
                "gpu_processes_at_peak_mib": self.at_peak}


def gpu_processes_mib() -> list:
    """[[label, MiB], ...] of every process holding memory on the GPU (``nvidia-smi
    --query-compute-apps``), labelled by its command line (vLLM titles its processes, e.g.
    ``VLLM::EngineCore``): which of a server's processes holds what."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except Exception:  # noqa: BLE001  (no GPU here)
        return []
    apps = []
    for line in out.strip().splitlines():
        try:
            pid, used = (part.strip() for part in line.split(","))
            apps.append([process_label(int(pid)), int(used)])
        except ValueError:
            continue
    return apps


def process_label(pid: int) -> str:
    """``<pid> <command line, 60 characters>`` (``<pid> ?`` where it cannot be read)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} {cmd[:60]}"


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        return int(out[0]) if out else None
    except Exception:  # noqa: BLE001  (no GPU here: no samples)
        return None


# ----------------------------------------------------------------------------------- servers
class Server:
    """One ``vllm serve`` process group with its own caches, log and probe events."""

    def __init__(self, name: str, root: Path, port: int, cmd: list[str], env: dict):
        self.name, self.root, self.port, self.cmd, self.env = name, root, port, cmd, env
        self.proc = None
        self.log_path = root / "server.log"
        self.events_path = Path(env["SERVE_PROBE_LOG"])
        self.cache = root / "cache"
        self.launched = self.ready_at = None
        self.log_offset = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, phase: str) -> None:
        self.log_path = self.root / f"server-{phase}.log"
        log = open(self.log_path, "wb")
        self.launched = time.time()
        self.ready_at = None
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(self.root))
        log.close()

    def poll_ready(self) -> bool:
        if self.ready_at is not None:
            return True
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    self.ready_at = time.time()
                    return True
        except Exception:
            pass
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def traffic_at_ready(self) -> dict | None:
        """The server's traffic counters right after ready (:func:`traffic_counters`), None if unread."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                return traffic_counters(r.read().decode("utf-8", "replace"))
        except Exception:
            return None

    def stop(self, grace: float = 30) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived the leader (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None

    def log_lines(self, start: int = 0) -> tuple[list[str], int]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return [], start
        return data.decode("utf-8", "replace").splitlines(), start + len(data)


CACHES = ("home", "xdg", "triton", "vllm", "inductor", "flashinfer", "cutedsl", "tilelang")


def make_caches(root: Path, empty: bool = False) -> Path:
    """A server's cache folders under `root` (HOME and every compile cache; kwarm's manifest and its
    CuTe DSL files are there too); `empty`: removed first, for another cold start (``--colds``)."""
    cache = root / "cache"
    if empty:
        shutil.rmtree(cache, ignore_errors=True)
    for sub in CACHES:
        (cache / sub).mkdir(parents=True, exist_ok=True)
    return cache


def phase_labels(colds: int, restarts: int) -> list[str]:
    """cold, cold2, ... (each on empty caches), then warm, warm2, ... (on the caches the starts left)."""
    return ([f"cold{i + 1}" if i else "cold" for i in range(colds)]
            + [f"warm{i + 1}" if i else "warm" for i in range(restarts)])


def server_env(base: dict, root: Path, name: str, kwarm_env: dict | None = None) -> dict:
    """`base` without backend-forcing variables, with caches, HOME and the probe of its own; kwarm's
    server also gets `kwarm_env` (``--kwarm-env``: a variant of kwarm, e.g. a family left out)."""
    cache = make_caches(root)
    env = {k: v for k, v in base.items() if k not in FORCING_ENV and not k.startswith("KWARM_")}
    env.update({
        "HOME": str(cache / "home"), "XDG_CACHE_HOME": str(cache / "xdg"),
        "TRITON_CACHE_DIR": str(cache / "triton"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "FLASHINFER_WORKSPACE_BASE": str(cache / "flashinfer"),
        "CUTE_DSL_CACHE_DIR": str(cache / "cutedsl"), "TILELANG_CACHE_DIR": str(cache / "tilelang"),
        "SERVE_PROBE_LOG": str(root / "events.jsonl"), "PYTHONUNBUFFERED": "1",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        "PYTHONPATH": os.pathsep.join([str(PROBE_DIR)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]),
    })
    if name == "kwarm":
        env["KWARM_REPORT"] = str(root / "kwarm-report.json")
        env["KWARM_MANIFEST"] = str(cache / "kwarm-manifest.json")
        env.update(kwarm_env or {})
    return env


def stats_wait() -> float:
    """With ``SERVE_PROBE_STATS=SECONDS`` (the probe's interval), wait one interval and a half, so
    that every server process writes a line after the last request (its steps are in no line
    before); returns the seconds waited."""
    try:
        seconds = 1.5 * float(os.environ.get("SERVE_PROBE_STATS") or 0)
    except ValueError:
        seconds = 7.5  # the probe's default interval
    seconds = min(max(seconds, 0.0), 30.0)
    time.sleep(seconds)
    return seconds


def kwarm_launcher() -> list[str]:
    exe = shutil.which("kwarm")
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from kwarm_ext.cli import main; sys.exit(main(sys.argv[1:]))"]


def serve_command(model_dir: Path, port: int, args, kwarm: bool) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--served-model-name", "bench", "--load-format", "dummy", "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_util)]
    if args.kv_bytes:
        cmd += ["--kv-cache-memory-bytes", args.kv_bytes]
    # what an operator serving tool calls sets: on vLLM 0.33 a named tool_choice is refused (400,
    # "requires --tool-call-parser to be set") unless both are given; the built chat template is Hermes'
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    cmd += args.serve_arg
    if kwarm:
        return [*kwarm_launcher(), "run", *(["--learn"] if args.learn else []), "--", *cmd]
    return cmd


# ----------------------------------------------------------------------------------- driving
def percentile(values, q: float):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def stream_once(client, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    gaps, tokens = [], 0
    for chunk in client.chat.completions.create(**body):
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"s": end - t0, "ttft_s": None if first is None else first - t0,
            "itl_s": statistics.mean(gaps) if gaps else None, "completion_tokens": tokens}


def send(client, kind: Kind, body: dict, seed: int = 0) -> dict:
    """One request (or one burst) of `kind`: seconds, TTFT and ITL where streamed, tokens."""
    if kind.api == "completion":
        t0 = time.perf_counter()
        r = client.completions.create(**body)
        return {"s": time.perf_counter() - t0, "completion_tokens": r.usage.completion_tokens if r.usage else None}
    if kind.api == "chat":
        t0 = time.perf_counter()
        r = client.chat.completions.create(**body)
        out = {"s": time.perf_counter() - t0, "completion_tokens": r.usage.completion_tokens if r.usage else None}
        if body.get("tools"):
            calls = r.choices[0].message.tool_calls or []
            out["tool_calls"] = len(calls)
        if body.get("response_format"):
            try:
                json.loads(r.choices[0].message.content or "")
                out["valid_json"] = True
            except ValueError:
                out["valid_json"] = False  # cut by max_tokens: still a structured request
        return out
    if kind.api == "stream":
        return stream_once(client, body)
    # burst: BURST streaming requests at once, each with its own content
    results, errors = [None] * BURST, []

    def one(i):
        try:
            b = dict(body, messages=[body["messages"][0], {"role": "user", "content": prompt_text(
                seed * 31 + i + 1, kind.words)}])
            results[i] = stream_once(client, b)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ttfts = [r["ttft_s"] for r in results if r and r["ttft_s"] is not None]
    out = {"s": time.perf_counter() - t0, "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
           "ttft_s": percentile(ttfts, 0.99), "completed": len(ttfts)}
    if errors:
        out["error"] = errors[0]
    return out


def measure_phase(servers: list[Server], phase: str, model: str, long_words: int, deadline: float, log,
                  kinds=REQUEST_KINDS, order: str = "kind") -> dict:
    """Every request of the plan on each ready server, one at a time, in `order` (:func:`request_schedule`)."""
    from openai import OpenAI

    clients = {s.name: OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=300, max_retries=0)
               for s in servers}
    records = {s.name: [] for s in servers}
    snaps = {s.name: snapshot(s.cache) for s in servers}
    offsets = {s.name: s.log_lines(0)[1] for s in servers}
    marks = {s.name: time.time() for s in servers}
    between = {s.name: [] for s in servers}
    by_name = {s.name: s for s in servers}
    for kind, occurrence, name in request_schedule(kinds, list(by_name), order):
        seed = content_seed(phase, kind.name, occurrence)  # the same content on every server
        body = build_request(kind, seed, "bench", long_words)
        s = by_name[name]
        if time.time() > deadline:
            records[s.name].append({"kind": kind.name, "occurrence": occurrence, "error": "cut: out of time"})
            continue
        if not s.alive():
            records[s.name].append({"kind": kind.name, "occurrence": occurrence, "error": "server exited"})
            continue
        t0 = time.time()
        between[s.name].append((marks[s.name], t0))
        try:
            rec = send(clients[s.name], kind, body, seed)
        except Exception as exc:  # noqa: BLE001  (a failed request is recorded, the run goes on)
            rec = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        t1 = time.time()
        time.sleep(0.05)  # let the servers' log lines of this request reach the file
        lines, offsets[s.name] = s.log_lines(offsets[s.name])
        after = snapshot(s.cache)
        new = sorted(after - snaps[s.name])
        snaps[s.name] = after
        marks[s.name] = time.time()
        rec.update({"kind": kind.name, "occurrence": occurrence, "t0": round(t0, 4), "t1": round(t1, 4),
                    "lazy": summarize_lazy(events_between(load_events(s.events_path), t0, t1), new, lines)})
        records[s.name].append(rec)
        log(f"{phase} {s.name:5s} {kind.name:17s} {occurrence:6s} {fmt_ms(rec.get('s'))} ms"
            f"{'  ttft ' + fmt_ms(rec['ttft_s']) + ' ms' if rec.get('ttft_s') is not None else ''}"
            f"  lazy {rec['lazy']['n']}+{rec['lazy']['frontend_n']}"
            f"{'  ' + rec['error'] if rec.get('error') else ''}")
    out = {}
    for s in servers:
        events = load_events(s.events_path)
        gaps = [e for t0, t1 in between[s.name] for e in events_between(events, t0 + 1e-4, t1 - 1e-4)]
        out[s.name] = {"requests": records[s.name], "between_requests": summarize_lazy(gaps)}
    return out


def fmt_ms(seconds) -> str:
    return "—" if seconds is None else f"{1000 * seconds:.1f}"


# -------------------------------------------------------------------------------------- main
def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("vllm", "torch", "triton", "flashinfer-python", "xgrammar", "transformers", "kwarm-ext",
                 "nvidia-cutlass-dsl", "openai"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        return None


def start_phase(servers: list[Server], phase: str, timeout: float, log) -> dict:
    """Start every server at once; launch to ready of each, its backends and kwarm's warmup."""
    for s in servers:
        s.start(phase)
    end = time.time() + timeout
    while time.time() < end and any(s.ready_at is None and s.alive() for s in servers):
        for s in servers:
            if s.alive():
                s.poll_ready()
        time.sleep(0.1)
    out = {}
    for s in servers:
        lines, _ = s.log_lines(0)
        ready = s.ready_at is not None
        info = {"ready": ready, "launch_to_ready_s": round(s.ready_at - s.launched, 2) if ready else None,
                "traffic_at_ready": s.traffic_at_ready() if ready else None,
                "exit_code": None if s.alive() else (s.proc.returncode if s.proc else None),
                "backends": backends_from_log(lines), "kv_cache_tokens": kv_cache_tokens(lines),
                "start_stages": start_stages(lines, s.launched),
                "lazy_before_ready": summarize_lazy(events_between(load_events(s.events_path), s.launched,
                                                                   s.ready_at or time.time()))}
        if not ready:
            info["not_ready_after_s"] = round(time.time() - s.launched, 1)
            info["log_tail"] = [line[:300] for line in lines[-25:]]
        if s.name == "kwarm":
            done = [float(m.group(1)) for m in map(KWARM_DONE_RE.search, lines) if m]
            info["kwarm_warmup_s"] = done
            info["kwarm_lines"] = [log_message(line)[:400] for line in lines if "kwarm" in line][-12:]
            info.update(kwarm_report(s.root / "kwarm-report.json"))
        out[s.name] = info
        log(f"{phase} {s.name}: {'ready in ' + str(info['launch_to_ready_s']) + ' s' if ready else 'NOT READY'}"
            f"; backends: {' | '.join(info['backends'][:6])}")
    return out


def kwarm_report(path: Path) -> dict:
    """``kwarm_report_summary`` (the families, their seconds and compiles) of a KWARM_REPORT file."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    try:
        from table import summarize_report

        return {"kwarm_report_summary": summarize_report(report)}
    except Exception as exc:  # noqa: BLE001
        return {"kwarm_report_summary": {"error": f"{type(exc).__name__}: {exc}"[:200]}}


@contextlib.contextmanager
def sync_lock(path: str | None, exclusive: bool):
    """With ``--sync-lock``: benchmarks beside each other start their servers together (shared) but
    measure requests one at a time and never while another one starts or stops (exclusive: a
    benchmark stops its servers before it lets the lock go)."""
    if not path:
        yield 0.0
        return
    waited = time.time()
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield time.time() - waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(args) -> int:
    started = time.time()
    deadline = started + args.budget
    model_src = Path(args.model).resolve()
    name = model_src.name
    work = Path(args.work).resolve() / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    result_path = out_dir / f"{name}.serve.json"

    def log(msg):
        print(f"[serve_bench {time.time() - started:6.1f}s] {name}: {msg}", flush=True)

    from serve_tokenizer import write_model_folder

    model_dir = work / "model"
    tokenizer = write_model_folder(model_src, model_dir, args.max_model_len)
    long_words = long_prompt_words(model_dir / "tokenizer.json")
    log(f"tokenizer {tokenizer}; long prompt {long_words} words")
    base = dict(os.environ)
    dropped = sorted(k for k in FORCING_ENV if k in base)
    servers = []
    for i, sname in enumerate(args.servers):
        root = work / sname
        root.mkdir()
        env = server_env(base, root, sname, dict(e.split("=", 1) for e in args.kwarm_env))
        if args.share_flashinfer_cache:  # the first server builds FlashInfer's modules, the next loads them
            shared = (Path(args.work).resolve() / "flashinfer-shared" if args.share_flashinfer_cache is True
                      else Path(args.share_flashinfer_cache).resolve())  # beside every model's folder: one build
            shared.mkdir(parents=True, exist_ok=True)
            env["FLASHINFER_WORKSPACE_BASE"] = str(shared)
        servers.append(Server(sname, root, args.port + i, serve_command(model_dir, args.port + i, args, sname == "kwarm"), env))
    result = {"schema": SCHEMA, "model": name, "model_path": str(model_src), "versions": versions(), "gpu": gpu_name(),
              "args": {k: v for k, v in vars(args).items() if k not in ("table",)}, "tokenizer": tokenizer,
              "long_prompt_words": long_words, "dropped_env": dropped, "commands": {s.name: s.cmd for s in servers},
              "request_kinds": [{"name": k.name, "api": k.api, "note": k.note} for k in kinds_of(args)],
              "phases": [], "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started))}

    def save():
        result["wall_s"] = round(time.time() - started, 1)
        result_path.write_text(json.dumps(result, separators=(",", ":"), default=str))  # published as is: compact

    try:
        for i, label in enumerate(phase_labels(args.colds, args.restarts)):
            if i > 0:
                left = deadline - time.time()
                last = result["phases"][-1]
                # a restart on warm caches took 0.32-0.48 of the cold start (phase start_s, lock waits
                # included, tiny pair, bench/published/vllm0.33.0-flashinfer-h100/serve*/, H100); 0.6
                # skipped a restart that would have fitted (212 s left, one model, 0.34 expected)
                cold = label.startswith("cold")
                need = (1.0 if cold else 0.5) * result["phases"][0].get("start_s", 0) + last.get("requests_s", 0) + 30
                if left < need:
                    log(f"no {label} restart: {left:.0f} s left, about {need:.0f} s needed")
                    result["skipped"] = f"{label}: {left:.0f} s left of the budget, about {need:.0f} s needed"
                    break
                if cold:  # another cold start: every compile cache emptied (kwarm's manifest too)
                    for srv in servers:
                        make_caches(srv.root, empty=True)
            phase_rec = {"phase": label, "servers": {}, "lock_wait_s": {}, "start_s": 0.0, "requests_s": 0.0}
            result["phases"].append(phase_rec)
            # side by side: every server at once; --one-at-a-time: each alone on the GPU, in turn
            for group in ([[s] for s in servers] if args.one_at_a_time else [servers]):
                t_group = time.time()
                with contextlib.ExitStack() as stack:
                    sampler = stack.enter_context(GpuMemory(t_group)) if args.one_at_a_time else None
                    with sync_lock(args.sync_lock, exclusive=False) as waited_start:
                        came_up = start_phase(group, label, min(args.start_timeout, deadline - time.time()), log)
                    phase_rec["servers"].update(came_up)
                    phase_rec["lock_wait_s"]["start"] = round(waited_start, 1)
                    save()
                    ready = [s for s in group if came_up[s.name]["ready"]]
                    phase_rec["start_s"] += round(time.time() - t_group, 1)
                    t_requests = time.time()
                    if ready:
                        with sync_lock(args.sync_lock, exclusive=True) as waited:
                            phase_rec["lock_wait_s"]["requests"] = round(waited, 1)
                            measured = measure_phase(ready, label, "bench", long_words, deadline - 15, log,
                                                     kinds_of(args), args.order)
                            stats_wait()  # SERVE_PROBE_STATS: each process's line after the last request
                            for s in group:  # stopped before the lock goes: a server's shutdown is CPU
                                s.stop()     # that the next benchmark's first requests would share
                        for sname, rec in measured.items():
                            came_up[sname].update(rec)
                        for s in ready:  # kwarm's report is complete once warmup (after capture too) is done
                            if s.name == "kwarm":
                                came_up[s.name].update(kwarm_report(s.root / "kwarm-report.json"))
                                if (s.root / "kwarm-report.json").exists():
                                    shutil.copy(s.root / "kwarm-report.json", out_dir / f"{name}.kwarm-report.{label}.json")
                    phase_rec["requests_s"] += round(time.time() - t_requests, 1)
                    for s in group:
                        s.stop()
                        shutil.copy(s.log_path, out_dir / f"{name}.{s.name}.{label}.log")
                        for profile in [*s.root.glob("profile.*.txt"), *s.root.glob("stats.*.jsonl")]:
                            # SERVE_PROBE_PROFILE's samples, SERVE_PROBE_STATS's lines
                            shutil.move(str(profile), out_dir / f"{name}.{s.name}.{label}.{profile.name}")
                if sampler is not None:
                    for s in group:
                        came_up[s.name].update(sampler.summary())
                        log(f"{label} {s.name}: peak GPU memory {came_up[s.name].get('peak_gpu_mib')} MiB, "
                            f"KV cache {came_up[s.name].get('kv_cache_tokens')} tokens")
                save()
    finally:
        for s in servers:
            s.stop()
            if s.events_path.exists():
                shutil.copy(s.events_path, out_dir / f"{name}.{s.name}.events.jsonl")
            manifest = Path(s.env.get("KWARM_MANIFEST", s.cache / "kwarm-manifest.json"))
            if manifest.exists():  # what kwarm learned and replayed (a replay that compiled: its entries)
                shutil.copy(manifest, out_dir / f"{name}.{s.name}.kwarm-manifest.json")
            keep_cute_dsl_keys(manifest.with_suffix(".cute_dsl"), out_dir / f"{name}.{s.name}.cute_dsl")
        save()
    print(render([result]))
    return 0


def keep_cute_dsl_keys(saved: Path, dest: Path) -> int:
    """The keys (``<kernel>.json``) and ``meta.json`` of the CuTe DSL kernels kwarm's ``cute_dsl``
    family saved beside the manifest (``<source>/<stack>/``), without their native code: which
    kernels the engine compiled, with the arguments that made them, for predicting them at launch.
    Returns how many files were kept."""
    kept = 0
    for path in sorted(saved.glob("*/*/*.json")) if saved.is_dir() else []:
        target = dest / path.relative_to(saved)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
        kept += 1
    return kept


# ------------------------------------------------------------------------------------- table
def lazy_text(lazy: dict | None, max_names: int = 4) -> str:
    """``triton 3 (_fwd_kernel ×2, ...); flashinfer built: sampling`` or ``0``."""
    if not lazy:
        return "—"
    parts = []
    for surface in COUNTED + FRONTEND:
        names = lazy.get("names", {}).get(surface)
        if not names:
            continue
        label = surface.replace("_", " ")
        listed = ", ".join(f"{n}{' ×' + str(c) if c > 1 else ''}" for n, c in list(names.items())[:max_names])
        more = f", +{len(names) - max_names}" if len(names) > max_names else ""
        if surface in FRONTEND:
            ms = sum(lazy.get("frontend_ms", {}).get(n, 0) for n in names)
            parts.append(f"{label} {ms:.0f} ms ({listed}{more})")
        else:
            took = lazy.get("seconds", {}).get(surface)  # results before 2026-12-07 have none
            parts.append(f"{label} {sum(names.values())}{'' if took is None else f', {took:.1f} s'} ({listed}{more})")
    return "; ".join(parts) or "0"


def pairs(requests: list[dict]) -> list[dict]:
    """One row per kind: first and repeat records."""
    rows = {}
    for r in requests:
        rows.setdefault(r["kind"], {})[r["occurrence"]] = r
    return [{"kind": k, **v} for k, v in rows.items()]


def repeat_time(row: dict):
    """The median headline time of a kind's repeats (``REPEATS``; results before 2026-12-07 hold one)."""
    times = [t for t in (headline_time(row.get(o)) for o in REPEATS) if t is not None]
    return statistics.median(times) if times else None


def headline_time(rec: dict | None):
    """TTFT for streaming kinds (p99 for a burst), else the request's seconds."""
    if not rec or rec.get("error"):
        return None
    return rec.get("ttft_s") if rec.get("ttft_s") is not None else rec.get("s")


def over_bar(t: float, ref: float) -> bool:
    """Issue 60's bar for a first against its repeat: over 1.1x `ref` and more than 10 ms over it."""
    return t > 1.1 * ref and t - ref > 0.010


def noise_rows(results: list[dict]) -> list[dict]:
    """How often the bar is crossed by chance on the host that ran `results`. Per result, phase and
    server, over the kinds with a first and three repeats and no lazy work named in any of the four:
    how many firsts are over the bar against their repeats' median (the tables' test), and how
    many single repeats are over it against the mean of the kind's other two repeats: requests
    that have nothing left to do first, so every crossing of theirs is the host's noise."""
    rows = []
    for result in results:
        for phase in result.get("phases") or []:
            for name, srv in (phase.get("servers") or {}).items():
                kinds = firsts = repeats = 0
                for row in pairs(srv.get("requests") or []):
                    occ = [row.get(o) for o in ("first", *REPEATS)]
                    times = [headline_time(r) for r in occ]
                    if None in times or any(((r.get("lazy") or {}).get("n") or 0) for r in occ):
                        continue
                    first, reps = times[0], times[1:]
                    kinds += 1
                    firsts += over_bar(first, statistics.median(reps))
                    repeats += sum(over_bar(t, statistics.mean(reps[:i] + reps[i + 1:])) for i, t in enumerate(reps))
                if kinds:
                    rows.append({"model": result.get("model"), "source": result.get("_source", ""),
                                 "phase": phase.get("phase"), "server": name, "kinds": kinds, "firsts_over": firsts,
                                 "repeats": kinds * len(REPEATS), "repeats_over": repeats})
    return rows


NOISE_COUNTS = ("kinds", "firsts_over", "repeats", "repeats_over")


def noise_totals(rows: list[dict]) -> dict:
    """:func:`noise_rows` summed per server: server -> {kinds, firsts_over, repeats, repeats_over}."""
    return {name: {x: sum(r[x] for r in rows if r["server"] == name) for x in NOISE_COUNTS}
            for name in dict.fromkeys(r["server"] for r in rows)}


def noise_table(results: list[dict]) -> str:
    """:func:`noise_rows` as markdown, with each server's totals."""
    rows = noise_rows(results)
    out = ["| result | model | phase | server | kinds, nothing lazy | firsts over the bar | repeats over the bar "
           "(against the other two) |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['source']} | {r['model']} | {r['phase']} | {r['server']} | {r['kinds']} | "
            f"{r['firsts_over']} of {r['kinds']} | {r['repeats_over']} of {r['repeats']} |" for r in rows]
    for name, t in noise_totals(rows).items():
        k, f, n, o = (t[x] for x in NOISE_COUNTS)
        out.append(f"| all | | | {name} | {k} | {f} of {k} ({100 * f / k:.0f}%) | {o} of {n} ({100 * o / n:.0f}%) |")
    return "\n".join(out)


def firsts_rows(results: list[dict]) -> list[dict]:
    """Per result, server and kind: its first in every cold start (``cold``, ``cold2``, ...) and its
    repeats there; the median first against the median repeat, against the bar (:func:`over_bar`).
    With one first per cold start the host's noise (:func:`noise_rows`) crosses the bar about one time
    in eight; the median of several firsts crosses it far less often, where a first-use cost that
    every cold start pays still does."""
    rows = []
    for result in results:
        colds = [p for p in result.get("phases") or [] if str(p.get("phase", "")).startswith("cold")]
        names = list(dict.fromkeys(n for p in colds for n in (p.get("servers") or {})))
        for name in names:
            per_kind: dict = {}
            for phase in colds:
                for row in pairs(((phase.get("servers") or {}).get(name) or {}).get("requests") or []):
                    rec = per_kind.setdefault(row["kind"], {"firsts": [], "repeats": [], "lazy": 0})
                    first = headline_time(row.get("first"))
                    if first is not None:
                        rec["firsts"].append(first)
                        rec["lazy"] += bool(((row.get("first") or {}).get("lazy") or {}).get("n"))
                    rec["repeats"] += [t for t in (headline_time(row.get(o)) for o in REPEATS) if t is not None]
            for kind, rec in per_kind.items():
                if not rec["firsts"] or not rec["repeats"]:
                    continue
                first, repeat = statistics.median(rec["firsts"]), statistics.median(rec["repeats"])
                rows.append({"model": result.get("model"), "server": name, "kind": kind, "colds": len(rec["firsts"]),
                             "firsts_s": rec["firsts"], "first_s": first, "repeat_s": repeat,
                             "firsts_with_lazy": rec["lazy"], "over": over_bar(first, repeat)})
    return rows


def firsts_table(results: list[dict]) -> str:
    """:func:`firsts_rows` as markdown, with each server's count of kinds over the bar."""
    rows = firsts_rows(results)
    out = ["| model | server | kind | cold starts | firsts ms | median first ms | median repeat ms | first/repeat | "
           "firsts naming lazy work | over the bar |", "|---|---|---|---|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['server']} | {r['kind']} | {r['colds']} | "
            f"{', '.join(f'{1000 * t:.1f}' for t in r['firsts_s'])} | {1000 * r['first_s']:.1f} | "
            f"{1000 * r['repeat_s']:.1f} | {ratio_text(r['first_s'], r['repeat_s'])} | {r['firsts_with_lazy']} | "
            f"{'over' if r['over'] else ''} |" for r in rows]
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        out.append(f"| all | {name} | | | | | | | | {sum(r['over'] for r in mine)} of {len(mine)} kinds |")
    return "\n".join(out)


def ratio_text(first, repeat) -> str:
    if first is None or repeat is None or repeat <= 0:
        return "—"
    return f"{first / repeat:.2f}"


def traffic_text(counters: dict | None) -> str:
    """``requests 0, prompt tokens 0, ...`` of :func:`traffic_counters`; ``—`` when unread."""
    if counters is None:
        return "—"
    short = {"vllm:request_success_total": "requests", "vllm:prompt_tokens_total": "prompt tokens",
             "vllm:generation_tokens_total": "generated tokens", "vllm:prefix_cache_queries_total": "prefix-cache queries",
             "http_requests_total": "HTTP requests"}
    return ", ".join(f"{short[m]} {counters[m]:g}" for m in TRAFFIC_METRICS if m in counters) or "none of them"


def render(results: list[dict]) -> str:
    out = []
    for res in results:
        v = res.get("versions", {})
        for phase in res.get("phases", []):
            servers = phase["servers"]
            out.append(f"### {res['model']}, {phase['phase']} start (vLLM {v.get('vllm')}, FlashInfer "
                       f"{v.get('flashinfer-python') or 'not installed'}, {res.get('gpu') or 'GPU ?'})\n")
            plain, kw = servers.get("plain", {}), servers.get("kwarm", {})
            backends = plain.get("backends") or kw.get("backends") or []
            if backends:
                out.append("Backends vLLM chose (its log): " + "; ".join(f"`{b}`" for b in backends[:8]) + "\n")
            lr = [plain.get("launch_to_ready_s"), kw.get("launch_to_ready_s")]
            cost = f" ({100 * (lr[1] / lr[0] - 1):+.1f}%)" if all(lr) else ""
            kws = kw.get("kwarm_warmup_s") or []
            out.append("| | `vllm serve` | `kwarm run -- vllm serve` |\n|---|---|---|")
            out.append(f"| launch to ready | {lr[0] if lr[0] else 'not ready'} s | "
                       f"{lr[1] if lr[1] else 'not ready'} s{cost}"
                       f"{' (kwarm warmup ' + '+'.join(f'{x:.1f}' for x in kws) + ' s)' if kws else ''} |")
            if plain.get("start_stages") or kw.get("start_stages"):
                out.append(f"| start (s after launch, from the log) | {stages_text(plain.get('start_stages'))} | "
                           f"{stages_text(kw.get('start_stages'))} |")
            fams = (kw.get("kwarm_report_summary") or {}).get("families") or []
            if fams:
                ran = sorted((f for f in fams if f.get("status") == "ran"), key=lambda f: -(f.get("seconds") or 0))
                out.append("| kwarm families (s) | | " + ", ".join(
                    f"{f['name']} {f.get('seconds') or 0:.2f}" for f in ran[:6]) + " |")
            if plain.get("kv_cache_tokens") or kw.get("kv_cache_tokens"):
                out.append(f"| GPU KV cache (vLLM's log) | {plain.get('kv_cache_tokens') or '—'} tokens | "
                           f"{kw.get('kv_cache_tokens') or '—'} tokens |")
            if plain.get("peak_gpu_mib") or kw.get("peak_gpu_mib"):
                out.append(f"| peak GPU memory (nvidia-smi, alone on the GPU) | {plain.get('peak_gpu_mib') or '—'} MiB | "
                           f"{kw.get('peak_gpu_mib') or '—'} MiB |")
            memory_text = (kw.get("kwarm_report_summary") or {}).get("memory")
            if memory_text:
                out.append(f"| kwarm's GPU memory (its report) | | {memory_text} |")
            if plain.get("traffic_at_ready") or kw.get("traffic_at_ready"):
                out.append(f"| `/metrics` at ready (besides the readiness poll) | {traffic_text(plain.get('traffic_at_ready'))} | "
                           f"{traffic_text(kw.get('traffic_at_ready'))} |")
            for key, label in (("lazy_before_ready", "lazy work before ready"), ("between_requests", "lazy work between requests")):
                out.append(f"| {label} | {lazy_text(plain.get(key), 3)} | {lazy_text(kw.get(key), 3)} |")
            out.append("")
            out.append("| request | plain first ms | repeat ms | first/repeat | plain: lazy work in the first | "
                       "kwarm first ms | repeat ms | first/repeat | kwarm: lazy work in the first |")
            out.append("|---|---|---|---|---|---|---|---|---|")
            p_rows = {r["kind"]: r for r in pairs(plain.get("requests", []))}
            k_rows = {r["kind"]: r for r in pairs(kw.get("requests", []))}
            for kind in [k["name"] for k in res.get("request_kinds", [])] or list(p_rows):
                cells = [kind + (" (TTFT p99)" if kind == "burst" else " (TTFT)" if kind == "stream" else "")]
                for rows in (p_rows, k_rows):
                    row = rows.get(kind, {})
                    first, repeat = headline_time(row.get("first")), repeat_time(row)
                    lazy = (row.get("first") or {}).get("lazy")
                    err = (row.get("first") or {}).get("error") or (row.get("repeat") or {}).get("error")
                    text = lazy_text(lazy)
                    for o in REPEATS:
                        rep_lazy = (row.get(o) or {}).get("lazy") or {}
                        if rep_lazy.get("n"):
                            text += f"; {o}: {lazy_text(rep_lazy)}"
                    if err:
                        text += f" — error: {err[:80]}"
                    cells += [fmt_ms(first), fmt_ms(repeat), ratio_text(first, repeat), text]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def chart(results: list[dict]) -> str:
    """An SVG: per model and phase, each request kind's first and repeat time (TTFT where streamed)
    on a log axis, `vllm serve` and `kwarm run -- vllm serve` on rows of their own."""
    import math

    panels = [(res, phase) for res in results for phase in res.get("phases", [])]
    kinds = [k["name"] for k in (results[0].get("request_kinds") if results else [])] or [k.name for k in REQUEST_KINDS]
    lo, hi = 0.005, 10.0
    left, width, row, top = 150, 560, 14, 34
    height_panel = top + row * 2 * len(kinds) + 30
    total_h = max(1, len(panels)) * height_panel + 30
    colors = {"plain": "#c0392b", "kwarm": "#2471a3"}

    def x(seconds):
        seconds = min(max(seconds, lo), hi)
        return left + width * (math.log10(seconds) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40}" height="{total_h}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="{left}" y="14" font-size="11">first occurrence (filled) and the median of its repeats (hollow), '
           f'<tspan fill="{colors["plain"]}">vllm serve</tspan> and <tspan fill="{colors["kwarm"]}">kwarm run -- '
           'vllm serve</tspan>, seconds, log scale</text>']
    for p, (res, phase) in enumerate(panels):
        y0 = 20 + p * height_panel
        out.append(f'<text x="4" y="{y0 + 18}" font-size="11" font-weight="bold">{res["model"]}, '
                   f'{phase["phase"]} start ({res.get("gpu") or "GPU ?"})</text>')
        for tick in (0.01, 0.1, 1, 10):
            out.append(f'<line x1="{x(tick):.1f}" y1="{y0 + top - 6}" x2="{x(tick):.1f}" '
                       f'y2="{y0 + top + row * 2 * len(kinds)}" stroke="#ddd"/>'
                       f'<text x="{x(tick):.1f}" y="{y0 + top - 8}" text-anchor="middle">{tick:g}</text>')
        for i, kind in enumerate(kinds):
            for j, server in enumerate(("plain", "kwarm")):
                y = y0 + top + row * (2 * i + j) + row / 2
                if j == 0:
                    out.append(f'<text x="{left - 6}" y="{y + 7}" text-anchor="end">{kind}</text>')
                rows = {r["kind"]: r for r in pairs(phase["servers"].get(server, {}).get("requests", []))}
                first = headline_time(rows.get(kind, {}).get("first"))
                repeat = repeat_time(rows.get(kind, {}))
                c = colors[server]
                if first is not None and repeat is not None:
                    out.append(f'<line x1="{x(first):.1f}" y1="{y}" x2="{x(repeat):.1f}" y2="{y}" stroke="{c}"/>')
                if repeat is not None:
                    out.append(f'<circle cx="{x(repeat):.1f}" cy="{y}" r="3.5" fill="white" stroke="{c}"/>')
                if first is not None:
                    out.append(f'<circle cx="{x(first):.1f}" cy="{y}" r="3.5" fill="{c}"/>')
    out.append("</svg>")
    return "\n".join(out)


def memory_chart(results: list[dict]) -> str:
    """An SVG: per model and phase, the GPU's used memory (MiB) from launch, `vllm serve` and
    `kwarm run -- vllm serve` each alone on the GPU (``--one-at-a-time``), ready marked on each."""
    panels = [(res, phase) for res in results for phase in res.get("phases", [])
              if any(s.get("gpu_mib_timeline") for s in phase["servers"].values())]
    left, width, height, gap = 60, 560, 150, 40
    colors = {"plain": "#c0392b", "kwarm": "#2471a3"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" '
           f'height="{30 + max(1, len(panels)) * (height + gap)}" font-family="sans-serif" font-size="10">',
           f'<text x="{left}" y="14" font-size="11">GPU memory used (nvidia-smi) from launch, each server alone on the GPU: '
           f'<tspan fill="{colors["plain"]}">vllm serve</tspan>, <tspan fill="{colors["kwarm"]}">kwarm run -- '
           'vllm serve</tspan>; a tick marks ready</text>']
    for p, (res, phase) in enumerate(panels):
        y0 = 30 + p * (height + gap)
        servers = phase["servers"]
        t_max = max((s["gpu_mib_timeline"][-1][0] for s in servers.values() if s.get("gpu_mib_timeline")), default=1) or 1
        total = max(80 * 1024, max((s.get("peak_gpu_mib") or 0) for s in servers.values()))
        out.append(f'<text x="4" y="{y0 + 8}" font-size="11" font-weight="bold">{res["model"]}, {phase["phase"]} start, '
                   f'--gpu-memory-utilization {res.get("args", {}).get("gpu_util")} ({res.get("gpu") or "GPU ?"})</text>')
        for gib in range(0, int(total / 1024) + 1, 20):
            y = y0 + 14 + height * (1 - gib * 1024 / total)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}" stroke="#eee"/>'
                       f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{gib} GiB</text>')
        for name, s in servers.items():
            line = s.get("gpu_mib_timeline") or []
            if not line:
                continue
            pts = " ".join(f"{left + width * t / t_max:.1f},{y0 + 14 + height * (1 - mib / total):.1f}" for t, mib in line)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colors.get(name, "#555")}"/>')
            if s.get("launch_to_ready_s"):
                x = left + width * s["launch_to_ready_s"] / t_max
                out.append(f'<line x1="{x:.1f}" y1="{y0 + 14 + height - 6}" x2="{x:.1f}" y2="{y0 + 14 + height + 4}" '
                           f'stroke="{colors.get(name, "#555")}" stroke-width="2"/>')
        out.append(f'<text x="{left + width}" y="{y0 + height + 28}" text-anchor="end">{t_max:.0f} s</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model folder with config.json (bench/models/...)")
    ap.add_argument("--table", nargs="+", metavar="RESULT", help="print the markdown tables of result files and exit")
    ap.add_argument("--chart", nargs="+", metavar=("OUT.svg", "RESULT"), help="write an SVG chart of result files and exit")
    ap.add_argument("--noise", nargs="+", metavar="RESULT",
                    help="print how often firsts, and single repeats against their kind's other repeats, cross "
                         "issue 60's bar (1.1x and 10 ms) in result files with three repeats, and exit")
    ap.add_argument("--out", default=str(HERE / "results" / "serve"), help="folder for results and server logs")
    ap.add_argument("--work", default="/tmp/kwarm-serve", help="folder for caches, model copy, events (not kept)")
    ap.add_argument("--servers", default="plain,kwarm", help="comma list of plain, kwarm (default both)")
    ap.add_argument("--port", type=int, default=8100, help="first server's port; the next one gets +1")
    ap.add_argument("--max-model-len", type=int, default=12288)
    ap.add_argument("--gpu-util", type=float, default=0.2, help="--gpu-memory-utilization of each server")
    ap.add_argument("--kv-bytes", default="4G", help="--kv-cache-memory-bytes of each server ('' for vLLM's sizing)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` argument (repeatable)")
    ap.add_argument("--restarts", type=int, default=1, help="warm restarts on the same caches after the cold start")
    ap.add_argument("--colds", type=int, default=1,
                    help="cold starts, each on emptied caches, before the warm restarts: several firsts of each "
                         "kind, for --firsts (not with --share-flashinfer-cache)")
    ap.add_argument("--firsts", nargs="+", metavar="RESULT",
                    help="per kind and server, the median of its firsts over every cold start against the median "
                         "of their repeats, against issue 60's bar (runs with --colds 2 or more), and exit")
    ap.add_argument("--no-learn", dest="learn", action="store_false", help="kwarm run without --learn")
    ap.add_argument("--kwarm-env", action="append", default=[], metavar="KWARM_NAME=VALUE",
                    help="one more variable of kwarm's server (repeatable; e.g. KWARM_WARMUPS=-eager_gemm)")
    ap.add_argument("--kinds", help="comma list of request kinds to send (default: all of them)")
    ap.add_argument("--order", choices=ORDERS, default="kind",
                    help="kind: per kind, one server's first and repeats, then the other's (no first right "
                         "after the other server's first); request: each request on every server in turn "
                         "(the order of runs published before 2026-12-07's serve-steady)")
    ap.add_argument("--start-timeout", type=float, default=420, help="seconds a start may take")
    ap.add_argument("--sync-lock", metavar="FILE", help="a lock file shared with benchmarks beside this one")
    ap.add_argument("--budget", type=float, default=560, help="seconds for everything (restarts are skipped to fit)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="each server alone on the GPU, in turn (plain, then kwarm), its GPU memory sampled every "
                         "0.1 s with nvidia-smi: for production memory, e.g. --gpu-util 0.92 --kv-bytes ''")
    ap.add_argument("--share-flashinfer-cache", nargs="?", const=True, default=None, metavar="DIR",
                    help="one FlashInfer JIT workspace for every server and model of --work, or in DIR for benchmarks "
                         "beside this one too (serve_run.sh's VARIANTS); with --one-at-a-time: the first server builds "
                         "its nvcc modules, the later ones load them; saves about 100 s of a start, which then is not "
                         "a cold start")
    ap.add_argument("--memory-chart", nargs="+", metavar=("OUT.svg", "RESULT"),
                    help="write an SVG of each server's GPU memory over time (--one-at-a-time results) and exit")
    args = ap.parse_args(argv)
    if args.table or args.chart or args.memory_chart or args.noise or args.firsts:
        if (args.chart and len(args.chart) < 2) or (args.memory_chart and len(args.memory_chart) < 2):
            ap.error("--chart/--memory-chart OUT.svg RESULT...")
        results = []
        for path in (args.table or args.noise or args.firsts or (args.chart or args.memory_chart)[1:]):
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                print(f"serve_bench: {path}: {exc}", file=sys.stderr)
                return 1
            if data.get("schema") == SCHEMA:
                results.append(dict(data, _source=Path(path).parent.name) if args.noise else data)
        if args.chart or args.memory_chart:
            out_svg = (args.chart or args.memory_chart)[0]
            Path(out_svg).write_text(chart(results) if args.chart else memory_chart(results))
            print(f"serve_bench: wrote {out_svg} ({len(results)} results)")
        elif args.noise:
            print(noise_table(results))
        elif args.firsts:
            print(firsts_table(results))
        else:
            print(render(results))
        return 0
    if not args.model:
        ap.error("give a model folder, or --table RESULT...")
    if not (Path(args.model) / "config.json").is_file():
        print(f"serve_bench: {args.model}: no config.json there", file=sys.stderr)
        return 1
    bad_env = [e for e in args.kwarm_env if not re.fullmatch(r"KWARM_[A-Z0-9_]+=.*", e)]
    if bad_env:
        ap.error(f"--kwarm-env: expected KWARM_NAME=VALUE, got {bad_env[0]!r}")
    if args.kinds is not None:
        names = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = [k for k in names if k not in KIND_BY_NAME]
        if unknown or not names:
            ap.error(f"--kinds: expected some of {', '.join(KIND_BY_NAME)}, got {args.kinds!r}")
    if args.colds < 1 or (args.colds > 1 and args.share_flashinfer_cache):
        ap.error("--colds: 1 or more, and a shared FlashInfer cache is not emptied (not with --share-flashinfer-cache)")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or not args.servers:
        ap.error(f"--servers: expected plain and/or kwarm, got {args.servers}")
    return run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
