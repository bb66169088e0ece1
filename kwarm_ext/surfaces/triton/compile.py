"""Compiling Triton kernels ahead of their first launch: a launch turned into a compile on
Triton's ``AsyncCompileMode`` pool, and the share of cores a rank may use. Part of the Triton
adapter (see ``kwarm_ext.surfaces.triton.compat``): Triton runtime internals, one function each."""
from __future__ import annotations

from typing import Callable
import contextlib
import os

from kwarm_ext.surfaces.triton import compat as triton_compat


def compile_threads(tp_size) -> int:
    """This rank's share of the cores: each compile thread can start its own MLIR pool, and the
    TP ranks of one host compile at the same time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, tp_size or 1))


@contextlib.contextmanager
def shadowed_runs(kernels, make_run):
    """Inside the block, every launch of each of `kernels` (``kernel[grid](...)`` calls
    ``kernel.run``) goes through ``make_run(kernel, original_run)`` instead.

    Why this patch exists: vLLM computes a kernel's launch arguments (tile config, padded
    sizes, the 2D/3D choice) deep in its own Python code; letting that code run and changing
    only what the launch does (compile without running, or record the key) is how the
    arguments stay production's. An instance attribute ``run`` shadows the class method for
    these kernel objects only and is removed on leaving. Needed with every Triton kwarm
    supports (3.4-3.7), by :func:`launches_compile_only` and ``triton_attn``'s launch
    recording; it can go with them."""
    kernels = list(kernels)
    for kernel in kernels:
        kernel.run = make_run(kernel, kernel.run)
    try:
        yield
    finally:
        for kernel in kernels:
            vars(kernel).pop("run", None)


def launches_compile_only(*jits):
    """Inside the block, launches of `jits` compile without running: Triton's own
    ``run(..., warmup=True)``, what ``JITFunction.warmup`` calls. Inside
    :func:`parallel_compiles` each such compile goes to the pool and the caller moves on, so a
    loop of vLLM calls that each meet a new specialization compiles them all at once. The
    kernels' outputs are not written: only around calls whose results are discarded."""

    def compile_only(kernel, original):
        def run(*args, grid=None, warmup=False, **kwargs):
            return original(*args, grid=grid, warmup=True, **kwargs)

        return run

    return shadowed_runs(jits, compile_only)


def compile_ahead(kernels, run: Callable[[], None], threads: int, failure: str) -> str:
    """Call `run` (vLLM code that launches `kernels`, ``(module, qualname)`` pairs) with those
    launches turned into compiles on `threads` threads (:func:`launches_compile_only` inside
    :func:`parallel_compiles`): every specialization `run` meets compiles at once. Returns the
    words for a summary line. An optimization only: a failure is one line, `failure`, under
    kwarm's failure policy (``log.fail_open``), and the caller's real launches compile instead."""
    import time

    from kwarm_ext.log import fail_open

    try:
        jits = [triton_compat.resolve(module, qualname).jit for module, qualname in kernels]
    except triton_compat.Unresolvable as exc:  # Triton's interpreter (CPU tests)
        return f"no compile ahead ({exc})"
    t0 = time.perf_counter()
    with fail_open(failure) as outcome:
        with parallel_compiles(threads) as parallel:
            if not parallel:
                return "no compile ahead (one thread, or no parallel compile mode in this Triton)"
            with launches_compile_only(*jits):
                run()
    if outcome.error is not None:
        return f"compile ahead failed ({type(outcome.error).__name__})"
    return f"compiled ahead on {threads} threads in {time.perf_counter() - t0:.1f} s"


@contextlib.contextmanager
def parallel_compiles(threads: int, per_job_s: float | None = None, deadline: float | None = None):
    """Make the block's ``preload``/``warmup`` calls compile on a thread pool.

    Uses ``triton.AsyncCompileMode`` (3.5+; threads only: its compile closures don't pickle).
    On leaving, the mode waits for every compile; errors are kept for :func:`settle`
    (``ignore_errors``). With `per_job_s`, a compile still running that long after it started
    fails with :class:`CompileTimedOut` (on :class:`BoundedCompiles`, even with one thread), and
    the block ends without waiting for it; with `deadline` (``time.monotonic()``), a compile not
    finished by then fails with :class:`OutOfTime`. Falls back to compiling in the caller's thread
    (no bound here: replay bounds the whole loop instead) on Triton 3.4 and 3.5 (no
    ``ignore_errors``), with one thread and no bound, or when another AsyncCompileMode is already
    active in this context."""
    import triton

    mode_cls = getattr(triton, "AsyncCompileMode", None)
    if mode_cls is None or (threads <= 1 and per_job_s is None) or _async_mode_active() \
            or not _keeps_errors(mode_cls):
        yield False
        return
    if per_job_s is not None:
        pool = BoundedCompiles(max(1, threads), per_job_s, deadline)
        try:
            with mode_cls(pool, ignore_errors=True):
                yield True
        finally:
            pool.shutdown()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="kwarm-replay") as pool:
        with mode_cls(pool, ignore_errors=True):
            yield True


class CompileTimedOut(Exception):
    """A compile still running after :class:`BoundedCompiles`'s bound (it goes on, unwaited)."""

    def __init__(self, seconds: float):
        super().__init__(f"still compiling after {seconds:g} s")
        self.seconds = seconds


class OutOfTime(Exception):
    """Replay's total bound (``KWARM_REPLAY_LIMIT``) came before this compile finished."""

    def __init__(self, why: str = "replay's total bound was reached first"):
        super().__init__(why)


class BoundedCompiles:
    """An executor for ``AsyncCompileMode`` whose futures fail with :class:`CompileTimedOut`
    once their job has run `per_job_s` seconds. Triton's compile cannot be interrupted: the job
    goes on in its daemon thread (it never delays the interpreter's exit) and a new worker takes
    its place, so one slow entry neither holds the engine's start nor the other entries. Why:
    a manifest entry is input (issue 51): one crafted entry compiled for 1019 s at engine start.

    Past `deadline` (``time.monotonic()``; replay's total bound, issue 59) every job not finished
    fails with :class:`OutOfTime` and no worker is replaced; so does every job once 2 x `threads`
    workers were left behind on late compiles (at most that many threads go on unwaited: 40 slow
    entries had left 42)."""

    def __init__(self, threads: int, per_job_s: float, deadline: float | None = None):
        import queue
        import threading

        self.per_job_s = per_job_s
        self.deadline = deadline
        self.abandoned = 0  # workers left behind on a late compile
        self.max_abandoned = 2 * max(1, threads)  # workers ever started: `threads`, then replacements
        self._replacements = max(1, threads)
        self._stopped: str | None = None  # why every job now fails at once
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict = {}  # future -> (start, worker thread)
        self._closed = threading.Event()
        self._workers: set = set()
        for _ in range(threads):
            self._spawn()
        threading.Thread(target=self._watch, name="kwarm-compile-bound", daemon=True).start()

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        future = Future()
        if self._stopped:
            future.set_exception(OutOfTime(self._stopped))
            return future
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _stop(self, why: str) -> None:
        """Every queued and future job fails at once with :class:`OutOfTime` (`why`)."""
        import queue

        self._stopped = self._stopped or why
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._jobs.put(None)  # a worker's end: keep it for the worker, after the jobs
                return
            with contextlib.suppress(Exception):
                item[0].set_exception(OutOfTime(self._stopped))

    def shutdown(self, wait: bool = False, **_):
        """No new jobs; idle workers end. Jobs past the bound are not waited for."""
        self._closed.set()
        with self._lock:
            workers = len(self._workers)
        for _ in range(workers):
            self._jobs.put(None)

    def _spawn(self) -> None:
        import threading

        worker = threading.Thread(target=self._work, name="kwarm-replay", daemon=True)
        with self._lock:
            self._workers.add(worker)
        worker.start()

    def _work(self) -> None:
        import threading
        import time

        me = threading.current_thread()
        while True:
            item = self._jobs.get()
            if item is None:
                break
            future, fn, args, kwargs = item
            if self._stopped:
                with contextlib.suppress(Exception):
                    future.set_exception(OutOfTime(self._stopped))
                continue
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[future] = (time.monotonic(), me)
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as exc:  # noqa: BLE001 (the future carries it)
                result, error = None, exc
            with self._lock:
                abandoned = self._running.pop(future, None) is None
            with contextlib.suppress(Exception):  # InvalidStateError: the bound failed it first
                future.set_exception(error) if error is not None else future.set_result(result)
            if abandoned:  # timed out: a new worker already took this one's place
                break
        with self._lock:
            self._workers.discard(me)

    def _watch(self) -> None:
        import time

        while True:
            time.sleep(min(0.05, self.per_job_s / 4))
            now = time.monotonic()
            past_deadline = self.deadline is not None and now >= self.deadline
            with self._lock:
                late = [f for f, (start, _) in self._running.items()
                        if past_deadline or now - start > self.per_job_s]
                for future in late:
                    del self._running[future]
                self.abandoned += len(late)
                idle = self._closed.is_set() and not self._running
            if self._stopped:  # a job queued while the last drain ran
                self._stop(self._stopped)
            if past_deadline:
                self._stop("replay's total bound was reached first")
            for future in late:
                with contextlib.suppress(Exception):  # InvalidStateError: it finished just now
                    future.set_exception(OutOfTime() if past_deadline else CompileTimedOut(self.per_job_s))
                if self._closed.is_set() or self._stopped:
                    continue
                if self._replacements <= 0:  # the workers a pool may leave behind are spent
                    self._stop(f"{self.abandoned} compiles were already past the bound of {self.per_job_s:g} s")
                    continue
                self._replacements -= 1
                self._spawn()
            if idle:
                return


def _keeps_errors(mode_cls) -> bool:
    """3.5's AsyncCompileMode has no ``ignore_errors``: one failed compile raises from its
    ``__exit__`` before it resets the active mode, which would leave later compiles of this
    thread queued on a closed pool. There, replay compiles sequentially instead."""
    import inspect

    try:
        return "ignore_errors" in inspect.signature(mode_cls).parameters
    except (TypeError, ValueError):
        return False


def _async_mode_active() -> bool:
    try:
        from triton.runtime import _async_compile

        return _async_compile.active_mode.get() is not None
    except Exception:
        return False



def disk_cache_entries() -> int | None:
    """How many kernels Triton's on-disk cache holds (one directory per compile key, written
    only when a kernel compiles; a load from the cache writes nothing), so that a step can
    tell what it compiled from what it only loaded. None where that cannot be told: Triton's
    interpreter, a cache manager of the user's own (``TRITON_CACHE_MANAGER``; kwarm's ``node_cache`` keeps
    Triton's folders), an unreadable
    directory, a Triton without ``knobs`` (before 3.4). A directory not made yet holds 0."""
    if triton_compat.interpreted():
        return None
    try:
        from triton import knobs

        from kwarm_ext.surfaces.triton.node_cache import users_own_manager

        if users_own_manager():  # (kwarm's own keeps Triton's layout)
            return None
        with os.scandir(knobs.cache.dir) as entries:
            return sum(1 for _ in entries)
    except FileNotFoundError:
        return 0
    except Exception:
        return None


def param_names(kernel) -> list[str]:
    """A kernel's parameter names: its JITFunction's (through Autotuner/Heuristics wrappers),
    or, under Triton's interpreter, the Python function's signature."""
    fn = kernel
    while not hasattr(fn, "arg_names") and getattr(fn, "fn", None) is not None:
        fn = fn.fn
    if hasattr(fn, "arg_names"):
        return list(fn.arg_names)
    import inspect

    return list(inspect.signature(fn).parameters)
