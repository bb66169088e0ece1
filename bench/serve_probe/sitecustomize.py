"""The serving benchmark's probe: records every kind of lazy work in each process of ``vllm serve``.

``bench/serve_bench.py`` puts this folder first on ``PYTHONPATH`` of both servers (plain and
through ``kwarm run``, whose own bootstrap chains to this one), with ``SERVE_PROBE_LOG`` naming a
JSON-lines file. Without that variable it does nothing but chain to the next ``sitecustomize``.
With it, an import hook adds one recorder to each JIT surface when its module is first imported,
so that nothing is imported early and nothing changes what vLLM runs:

- ``triton``: Triton's ``knobs.compilation.listener`` (every ``compile()``, i.e. every in-memory
  miss: ``cache_hit`` false is a real compile, true a load from Triton's disk cache);
- ``flashinfer``: ``JitSpec.build_and_load`` (each JIT module: ``built`` when its library was not
  on disk before the call, else loaded);
- ``cutlass.cute``: ``cute.compile`` (CuTe DSL compiles, FlashInfer's Hopper GDN prefill among them);
- ``xgrammar``: tokenizer info and each grammar compile of structured output;
- ``transformers``: the chat template's Jinja compile;
- ``torch._dynamo``: each torch.compile start/end (a recompile after ready lands on a request).

With ``SERVE_PROBE_PROFILE`` set too, kwarm's warmup (``kwarm_ext.warmup.run`` and
``after_capture``) and its warm requests (``kwarm_ext.warm_requests.run``) are sampled: every
2 ms, the stacks of every thread of the process, written when the call returns as collapsed
stacks (``thread;file:function;... count``, flame-graph input) to ``profile.<pid>.<what>.txt``
beside the events file. Sampling, not tracing: the warmup runs at its own speed.

With ``SERVE_PROBE_STATS=SECONDS`` set too, every process writes one line every SECONDS to
``stats.<pid>.jsonl`` beside the events file: CPU seconds per thread, the garbage collector's
collections and their time, and the calls and seconds of the engine's step methods (``_stats``),
for a server that runs slower than another at steady state.

Each event is one line, ``{"t": wall clock, "pid", "proc", "kind", "name", "s", ...}``, appended
with a single ``write`` (O_APPEND) so that processes never interleave. The benchmark assigns an
event to the request whose time window holds it. Caches that compile without a Python entry point
here (DeepGEMM, TileLang, tvm-ffi) are counted by the benchmark from the cache folders instead.
"""
import os
import sys


def _chain_next_sitecustomize():
    """Import the next ``sitecustomize`` on sys.path, hiding this file's folder (as kwarm's does)."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


def _install(log_path):
    import json
    import time

    def process_name():
        try:
            import multiprocessing

            name = multiprocessing.current_process().name
        except Exception:
            name = "?"
        return name if name != "MainProcess" else os.path.basename(sys.argv[0] or "python")

    def emit(kind, name, seconds=None, **extra):
        event = {"t": round(time.time(), 4), "pid": os.getpid(), "proc": process_name(),
                 "kind": kind, "name": str(name)[:200]}
        if seconds is not None:
            event["s"] = round(seconds, 5)
        event.update(extra)
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(event, default=str) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    def timed(kind, name_of, fn, **extra_of):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                try:
                    emit(kind, name_of(args, kwargs), time.perf_counter() - started)
                except Exception:
                    pass
        wrapper.__wrapped__ = fn
        wrapper._serve_probe = True
        return wrapper

    def wrap_method(cls, attr, kind, name_of):
        """Time cls.attr, keeping it a static/class method if it was one."""
        import inspect

        raw = inspect.getattr_static(cls, attr, None)
        if raw is None or getattr(raw, "_serve_probe", False):
            return False
        if isinstance(raw, staticmethod):
            setattr(cls, attr, staticmethod(timed(kind, name_of, raw.__func__)))
        elif isinstance(raw, classmethod):
            setattr(cls, attr, classmethod(timed(kind, name_of, raw.__func__)))
        else:
            setattr(cls, attr, timed(kind, name_of, raw))
        return True

    # ------------------------------------------------------------------ per surface
    def on_triton_knobs(module):
        previous = module.compilation.listener

        def listener(*, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, **kw):
            try:
                fn = getattr(src, "fn", None)
                name = getattr(fn, "__name__", None) or getattr(src, "name", None) or (metadata or {}).get("name")
                total = getattr(times, "total", None)
                emit("triton", name, (total / 1e6) if isinstance(total, (int, float)) else None,
                     cache_hit=bool(cache_hit))
            except Exception:
                pass
            if previous is not None:
                return previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                                cache_hit=cache_hit, **kw)

        module.compilation.listener = listener

    def on_flashinfer_jit_core(module):
        spec_cls = getattr(module, "JitSpec", None)
        original = getattr(spec_cls, "build_and_load", None)
        if original is None or getattr(original, "_serve_probe", False):
            return

        def build_and_load(self, *args, **kwargs):
            try:
                on_disk = bool(self.is_compiled)
            except Exception:
                on_disk = None
            started = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                emit("flashinfer", getattr(self, "name", "?"), time.perf_counter() - started,
                     built=(on_disk is False), spec=type(self).__name__)

        build_and_load._serve_probe = True
        spec_cls.build_and_load = build_and_load

    class CuteCompile:
        """Times ``cute.compile(...)`` and ``cute.compile[options](...)`` alike."""

        _serve_probe = True

        def __init__(self, inner):
            self._inner = inner

        def __getitem__(self, options):
            return CuteCompile(self._inner[options])

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __call__(self, *args, **kwargs):
            kernel = args[0] if args else kwargs.get("function")
            name = getattr(kernel, "__qualname__", None) or getattr(kernel, "__name__", None) or type(kernel).__name__
            started = time.perf_counter()
            try:
                return self._inner(*args, **kwargs)
            finally:
                emit("cute_dsl", name, time.perf_counter() - started)

    def on_cute(module):
        compile_ = getattr(module, "compile", None)
        if compile_ is not None and not getattr(compile_, "_serve_probe", False):
            module.compile = CuteCompile(compile_)

    def on_xgrammar(module):
        info = getattr(module, "TokenizerInfo", None)
        for attr in ("from_huggingface", "from_vocab_and_metadata"):
            if info is not None:
                wrap_method(info, attr, "xgrammar", lambda a, k, attr=attr: f"TokenizerInfo.{attr}")
        compiler = getattr(module, "GrammarCompiler", None)
        if compiler is not None:
            for attr in ("compile_json_schema", "compile_builtin_json_grammar", "compile_regex",
                         "compile_grammar", "compile_structural_tag"):
                wrap_method(compiler, attr, "xgrammar", lambda a, k, attr=attr: f"GrammarCompiler.{attr}")

    def on_chat_template_utils(module):
        compile_ = getattr(module, "_compile_jinja_template", None)
        if compile_ is not None and not getattr(compile_, "_serve_probe", False):
            module._compile_jinja_template = timed("chat_template", lambda a, k: "jinja compile", compile_)

    def on_dynamo_callback(module):
        handler = getattr(module, "callback_handler", None)
        if handler is None:
            return
        starts = {}

        def on_start(*args, **kwargs):
            starts[os.getpid()] = time.perf_counter()

        def on_end(*args, **kwargs):
            started = starts.pop(os.getpid(), None)
            emit("torch_compile", "dynamo compile", None if started is None else time.perf_counter() - started)

        try:
            handler.register_start_callback(on_start)
            handler.register_end_callback(on_end)
        except Exception:
            pass

    class Sampler:
        """Every `interval` seconds, the stacks of every other thread, counted by collapsed stack."""

        def __init__(self, what, interval=0.002):
            self.what, self.interval, self.counts = what, interval, {}
            self.done = None

        def __enter__(self):
            import threading

            self.done = threading.Event()
            self.me = threading.get_ident()
            self.thread = threading.Thread(target=self._loop, name="serve-probe-sampler", daemon=True)
            self.started = time.perf_counter()
            self.thread.start()
            return self

        def _loop(self):
            import threading

            mine = threading.get_ident()
            while not self.done.wait(self.interval):
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    if ident == mine:
                        continue
                    stack = []
                    while frame is not None:
                        code = frame.f_code
                        stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                        frame = frame.f_back
                    key = ";".join([("caller" if ident == self.me else names.get(ident, "?"))] + stack[::-1])
                    self.counts[key] = self.counts.get(key, 0) + 1

        def __exit__(self, *exc):
            self.done.set()
            self.thread.join(1.0)
            try:
                path = os.path.join(os.path.dirname(log_path), f"profile.{os.getpid()}.{self.what}.txt")
                with open(path, "a") as f:
                    f.write(f"# {self.what}: {time.perf_counter() - self.started:.3f} s, every "
                            f"{self.interval * 1e3:g} ms\n")
                    for key, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
                        f.write(f"{key} {n}\n")
            except OSError:
                pass
            return False

    def sampled(what, fn):
        def wrapper(*args, **kwargs):
            with Sampler(what):
                return fn(*args, **kwargs)
        wrapper.__wrapped__ = fn
        wrapper._serve_probe = True
        return wrapper

    def on_kwarm_warmup(module):
        for attr in ("run", "after_capture"):
            fn = getattr(module, attr, None)
            if fn is not None and not getattr(fn, "_serve_probe", False):
                setattr(module, attr, sampled(attr, fn))

    def on_kwarm_warm_requests(module):
        fn = getattr(module, "run", None)
        if fn is None or getattr(fn, "_serve_probe", False):
            return

        async def run(*args, **kwargs):
            with Sampler("warm_requests"):
                return await fn(*args, **kwargs)

        run._serve_probe = True
        module.run = run

    hooks = {
        "triton.knobs": on_triton_knobs,
        "flashinfer.jit.core": on_flashinfer_jit_core,
        "cutlass.cute": on_cute,
        "xgrammar": on_xgrammar,
        "transformers.utils.chat_template_utils": on_chat_template_utils,
        "torch._dynamo.callback": on_dynamo_callback,
    }
    if os.environ.get("SERVE_PROBE_PROFILE"):
        hooks.update({"kwarm_ext.warmup": on_kwarm_warmup, "kwarm_ext.warm_requests": on_kwarm_warm_requests})
    if os.environ.get("SERVE_PROBE_STATS"):
        hooks.update(_stats(log_path, process_name))

    class Loader:
        def __init__(self, inner, name):
            self._inner, self._name = inner, name

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

        def create_module(self, spec):
            create = getattr(self._inner, "create_module", None)
            return create(spec) if create is not None else None

        def exec_module(self, module):
            self._inner.exec_module(module)
            try:
                hooks[self._name](module)
                emit("probe", self._name, hooked=True)
            except Exception as exc:
                emit("probe", self._name, hooked=False, error=f"{type(exc).__name__}: {exc}"[:300])

    class Finder:
        """Adds a recorder right after one of `hooks`' modules has executed."""

        def find_spec(self, name, path=None, target=None):
            if name not in hooks:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = Loader(spec.loader, name)
            return spec

    sys.meta_path.insert(0, Finder())
    emit("probe", "installed", argv=" ".join(sys.argv[:3])[:200])


STEP_METHODS = {  # module: (class, methods) whose calls the stats time, per process
    "vllm.v1.engine.core": ("EngineCore", ("step", "step_with_batch_queue", "add_request")),
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", ("execute_model", "sample_tokens")),
    "vllm.v1.worker.gpu.model_runner": ("GPUModelRunner", ("execute_model", "sample_tokens")),  # Model Runner V2
    "vllm.v1.core.sched.scheduler": ("Scheduler", ("schedule", "update_from_output")),
    "vllm.v1.structured_output": ("StructuredOutputManager", ("grammar_bitmask",)),
}
STEP_EVENTS = {"EngineCore.step", "EngineCore.step_with_batch_queue", "GPUModelRunner.execute_model",
               "GPUModelRunner.sample_tokens"}  # each call kept as [end time, ms] too, for a request's window


def _stats(log_path, process_name):
    """``SERVE_PROBE_STATS=SECONDS`` (e.g. 5): every SECONDS, one line per process in ``stats.<pid>.jsonl`` beside the
    events file: CPU seconds per thread (Python's thread names where Python knows the thread), the
    garbage collector's collections and their time per generation and its generations' counts,
    and the calls and seconds of the engine's step methods (``STEP_METHODS``). For a server that
    runs slower than another at steady state: which process, thread or step the time goes to.
    Returns the import hooks that wrap the step methods."""
    import gc
    import json
    import threading
    import time

    try:
        every = max(0.1, float(os.environ["SERVE_PROBE_STATS"]))
    except ValueError:
        every = 5.0
    folder = os.path.dirname(log_path) or "."
    calls: dict = {}  # "Class.method" -> [calls, seconds]
    steps: dict = {}  # STEP_EVENTS' calls since the last line: "Class.method" -> [[end time, ms], ...]
    steps_lock = threading.Lock()
    collections = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            rec = collections.setdefault(info.get("generation"), [0, 0.0])
            rec[0] += 1
            rec[1] += time.perf_counter() - started.pop("t")

    gc.callbacks.append(on_gc)

    def timing(key, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                rec = calls.setdefault(key, [0, 0.0])
                rec[0] += 1
                rec[1] += took
                if key in STEP_EVENTS:
                    with steps_lock:
                        steps.setdefault(key, []).append([round(time.time(), 4), round(took * 1000, 3)])
        wrapper.__wrapped__ = fn
        wrapper._serve_probe = True
        return wrapper

    def hook_for(cls_name, methods):
        def hook(module):
            cls = getattr(module, cls_name, None)
            for attr in methods:
                fn = cls.__dict__.get(attr) if cls is not None else None
                if callable(fn) and not getattr(fn, "_serve_probe", False):
                    setattr(cls, attr, timing(f"{cls_name}.{attr}", fn))
        return hook

    def threads():
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            if cpu >= 0.01:
                out[f"{names.get(int(tid), comm)}:{tid}"] = round(cpu, 2)
        return out

    def allocators():
        """Torch's CUDA allocators' counts where this process initialized CUDA (never initializes
        it): device blocks made and returned with cudaMalloc/cudaFree, and the retries after an
        out-of-memory; pinned host blocks made with cudaHostAlloc and their microseconds. A
        process whose steps allocate anew instead of reusing cached blocks shows them grow."""
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return None
            device = torch.cuda.memory_stats()
            out = {k: device.get(k) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
            host = getattr(torch.cuda, "host_memory_stats", None)
            if host is not None:
                stats = host()
                out.update({"num_host_alloc": stats.get("num_host_alloc"),
                            "host_alloc_us": stats.get("host_alloc_time.total"),
                            "host_active": stats.get("active_requests.current")})
            return out
        except Exception:
            return None

    def loop():
        while True:
            time.sleep(every)
            try:
                with steps_lock:
                    taken = {k: steps.pop(k) for k in list(steps)}
                line = {"t": round(time.time(), 2), "pid": os.getpid(), "proc": process_name(),
                        "threads": threads(), "gc": {str(k): [v[0], round(v[1], 4)] for k, v in collections.items()},
                        # not gc.get_freeze_count(): it walks the frozen objects holding the GIL
                        # (16 ms at 1.3M, an engine core's count after vLLM's freeze)
                        "gc_count": gc.get_count(),
                        "gc_threshold": gc.get_threshold(), "switch_s": sys.getswitchinterval(),
                        "calls": {k: [v[0], round(v[1], 4)] for k, v in calls.items()},
                        "steps": taken, "allocators": allocators()}
                with open(os.path.join(folder, f"stats.{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(line) + "\n")
            except Exception:
                pass

    def start():
        threading.Thread(target=loop, name="serve-probe-stats", daemon=True).start()

    def in_child():  # a forked process (vLLM's engine core, on some paths) starts without the thread
        calls.clear()
        steps.clear()
        for rec in collections.values():
            rec[:] = [0, 0.0]
        start()

    os.register_at_fork(after_in_child=in_child)
    start()
    return {module: hook_for(cls, methods) for module, (cls, methods) in STEP_METHODS.items()}


if os.environ.get("SERVE_PROBE_LOG"):
    try:
        _install(os.environ["SERVE_PROBE_LOG"])
    except Exception as _exc:  # a probe never breaks the server it measures
        sys.stderr.write(f"serve_probe: not installed: {_exc!r}\n")
_chain_next_sitecustomize()
