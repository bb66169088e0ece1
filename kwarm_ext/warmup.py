"""kwarm's warmup, run on each worker right after vLLM's own ``kernel_warmup``.

Before vLLM's profile run (or, failing that, its ``kernel_warmup``), :func:`ahead` runs the
families marked ``ahead`` (work that makes vLLM's own start cheaper); their results join this
worker's summary and report.
Order: the engine view, then each selected family's steps (``replay`` first), then, with
``KWARM_LEARN``, the recorder starts (``KWARM_LEARN=all``: before the families). Once
``Worker.compile_or_warm_up_model`` has returned (CUDA-graph capture done),
:func:`after_capture` runs the families that belong after it on the same view. Every
step is isolated: an exception becomes one warning naming the step and the reason, and
the next step runs (``KWARM_STRICT=1`` re-raises instead). It ends with one short summary line
per worker (the families that ran, how many were skipped and failed, the compiles, the longest
family, what was left to the requests), the per-family detail on DEBUG and, with
``KWARM_REPORT``, a JSON report that has both (``summary``, ``detail``, ``left_to_requests``):
their text and the report's file are ``kwarm_ext/report.py``'s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import traceback

from kwarm_ext import budget, config, engine, memory, monitor
from kwarm_ext.log import fail_open
from kwarm_ext.report import (NO_VIEW, OUT_OF_MEMORY, budget_seconds, kwarm_version, learning_text,
                              left_to_requests, memory_summary, node_cache_counts, outcome, report_path,
                              short_line, write_report)
from kwarm_ext.families import FAMILIES, Plan

logger = logging.getLogger("kwarm")
_pending: dict = {}  # id(worker) -> (view, report) of its run, for after_capture
_ahead: dict = {}  # id(worker) -> (results, seconds) of its ahead families, for run


@dataclasses.dataclass
class FamilyResult:
    name: str
    status: str = "skipped"  # ran | skipped | failed
    reason: str | None = None
    seconds: float = 0.0
    steps: list = dataclasses.field(default_factory=list)  # {name, kernel, status, variants, reason, seconds}
    compiled: list = dataclasses.field(default_factory=list)  # {kernel, module, key[, surface, cache_hit]}
    details: dict = dataclasses.field(default_factory=dict)  # a family's own outcome (replay's counts)
    memory: dict = dataclasses.field(default_factory=dict)  # its largest step's GPU memory (kwarm_ext.memory)

    def short(self) -> str:
        if self.status != "ran":
            return f"{self.name} ({self.reason})"
        if self.details.get("summary"):
            failed = sum(s["status"] == "failed" for s in self.steps)
            return (f"{self.name} {self.seconds:.2f} s: {self.details['summary']}"
                    + (f"; {failed} steps failed" if failed else ""))
        ran = [s for s in self.steps if s["status"] == "ran"]
        left = [s for s in self.steps if s["status"] == "skipped"]
        failed = [s for s in self.steps if s["status"] == "failed"]
        kernels = sorted({s["kernel"] for s in ran})
        text = (f"{self.name} {self.seconds:.2f} s: {len(kernels)} kernels, "
                f"{sum(len(s['variants']) for s in ran)} variants, {len(self.compiled)} compiled")
        if left:
            text += f"; {len(left)} steps skipped ({'; '.join(sorted({s['reason'] for s in left}))})"
        if failed:
            text += f"; {len(failed)} steps failed"
        return text


class StepFailed(Exception):
    pass


def guarded(what: str, fn):
    """Run `fn` under kwarm's failure policy (``log.fail_open``): an exception is one warning
    naming `what`, then :class:`StepFailed` for the caller to record."""
    with fail_open(f"{what} failed, skipped") as failure:
        return fn()
    raise StepFailed(f"{type(failure.error).__name__}: {failure.error}") from failure.error


# vLLM 0.34+: keeps a one-off step's transient memory out of the extensible KV cache's reserve
KV_TRANSIENT_WINDOW = "vllm.model_executor.warmup.kernel_warmup:_outside_kv_cache_transient_window"


@contextlib.contextmanager
def outside_kv_cache_sizing(worker):
    """The context kwarm's warmup runs in: on vLLM 0.34+ with an extensible KV cache (the default
    where supported), vLLM's own ``_outside_kv_cache_transient_window(worker)``, which its one-off
    autotuning runs in. That cache is sized from the allocator's peak since
    ``compile_or_warm_up_model`` began (kept free for serving's transients); kwarm's warmup is
    one-off compile work, and inside the window its peak does not shrink the KV cache. Elsewhere
    (no extensible KV cache: 0.20-0.33, or turned off): nothing. Entering or leaving it fails open (one warning)."""
    window = None
    with fail_open("could not keep kwarm's warmup out of vLLM's KV-cache sizing, its peak memory may count there"):
        from kwarm_ext.vllm_compat import resolve_or_none

        found = resolve_or_none(KV_TRANSIENT_WINDOW)
        if found is not None and getattr(getattr(worker, "model_runner", None), "extensible_kv_cache", None) is not None:
            candidate = found(worker)
            candidate.__enter__()
            window = candidate
    try:
        yield window is not None
    finally:
        if window is not None:
            with fail_open("leaving vLLM's KV-cache transient window failed, its peak memory may count kwarm's"):
                window.__exit__(None, None, None)


def run(worker) -> dict:
    """Warm `worker`; returns the report (also written to KWARM_REPORT)."""
    settings = config.get()
    t0 = time.perf_counter()
    report = {"kwarm": kwarm_version(), "pid": os.getpid(), "families": [], "view": None,
              "started_at": round(time.time(), 3),  # wall clock: ranks' reports side by side give their skew
              "budget": budget.begin(settings.budget), "memory": memory.begin(worker)}
    try:
        return _run(worker, settings, t0, report)
    finally:
        memory.end()  # the cap lifted, the blocks kwarm grew returned before vLLM's capture


def _run(worker, settings, t0: float, report: dict) -> dict:
    try:
        view = guarded("engine view", lambda: engine.build(worker))
    except StepFailed:
        view = None
    if view is not None:
        report["view"] = view.as_dict()
        gaps = engine.missing_required(view)
        if gaps:
            logger.warning("kwarm: engine view incomplete, families may skip: missing %s",
                           ", ".join(f"{g} ({view.missing[g]})" for g in gaps))
        logger.info("kwarm: engine view: %s", view.summary())

    learning = _start_learning(view) if settings.learn == "all" else None
    results, ahead_s = _ahead.pop(id(worker), ([], 0.0))
    results = results + [_run_family(name, view, settings) for name, family in FAMILIES.items()
                         if not (family.after_capture or family.ahead)]
    report["families"] = [dataclasses.asdict(r) for r in results]
    if settings.learn == "after":
        learning = _start_learning(view)
    if learning is not None:
        report["learn"] = {"manifest": learning.path, "newly_learned": learning.recorder.recorded}
    report["total_s"] = round(time.perf_counter() - t0 + ahead_s, 4)
    report["triton_node_cache"] = node_cache_counts()
    report["ended_at"] = round(time.time(), 3)
    rank = view.tp_rank if view is not None and view.tp_rank is not None else 0
    report["rank"] = rank
    head = (f"kwarm: warmup done in {report['total_s']:.2f} s on rank {rank} "
            f"(budget {budget_seconds(report['budget'])}): {short_line(results)}"
            + (f"; learning into {learning.path}" if learning is not None else ""))
    where = report_path(settings.report, rank) if settings.report else None
    report["summary"] = head + (f"; report {where}" if where else "")
    report["detail"] = f"budget {report['budget']}; {outcome(results)}{learning_text(learning)}"
    report["left_to_requests"] = left_to_requests(results)
    memory_text = memory_summary(report, results)
    written = _write(report, settings, rank)
    logger.info("%s", report["summary"] if written else head)
    logger.debug("kwarm: warmup detail on rank %s: %s", rank, report["detail"])
    if memory_text:
        logger.info("kwarm: GPU memory on rank %s: %s", rank, memory_text)
    _pending[id(worker)] = (view, report)
    return report


def ahead(worker, before_profile_run: bool = False) -> list:
    """Run the selected ``ahead`` families on `worker`, before vLLM's profile run
    (``Worker.determine_available_memory``, `before_profile_run`) or, where that hook did not run
    them, before its ``kernel_warmup``: once per warmup run, the second call returns []. Their
    results (and seconds) go into the summary line and report of :func:`run`. A family may leave
    work running beside the profile run: :func:`finish_ahead` waits for it."""
    names = [name for name, family in FAMILIES.items() if family.ahead]
    if not names or id(worker) in _ahead:
        return []
    settings = config.get()
    t0 = time.perf_counter()
    view = None
    if any(settings.warmups.wants(name) for name in names):  # a view only where one will run
        try:
            view = guarded("engine view", lambda: engine.build(worker))
            view.before_profile_run = before_profile_run
        except StepFailed:
            pass
    results = [_run_family(name, view, settings) for name in names]
    _ahead[id(worker)] = (results, time.perf_counter() - t0)
    for name, family in FAMILIES.items():  # what before_load started and the run did not take
        if family.before_load:
            try:
                guarded(f"{name} release", lambda: family.load().release(worker))
            except StepFailed:
                pass
    return results


def finish_ahead(worker) -> None:
    """Wait for the work `worker`'s ahead families left running beside vLLM's profile run (each
    ran family's ``finish(worker)``: its labels join the family's summary, the wait its seconds);
    one isolated step each, a no-op once done or where nothing was left."""
    results, seconds = _ahead.get(id(worker), ([], 0.0))
    t0 = time.perf_counter()
    for result in results:
        if result.status != "ran" or not hasattr(module := FAMILIES[result.name].load(), "finish"):
            continue
        started = time.perf_counter()
        try:
            labels = guarded(f"{result.name} beside vLLM's profile run", lambda: module.finish(worker)) or []
        except StepFailed as exc:
            result.steps.append({"name": "beside vLLM's profile run", "kernel": "", "status": "failed", "variants": [],
                                 "reason": str(exc), "seconds": round(time.perf_counter() - started, 4)})
            labels = []
        if labels:
            result.details["summary"] = "; ".join(filter(None, [result.details.get("summary"), *labels]))
            logger.info("kwarm: %s: done beside vLLM's profile run: %s", result.name, "; ".join(labels))
        result.seconds = round(result.seconds + time.perf_counter() - started, 4)
    if id(worker) in _ahead:
        _ahead[id(worker)] = (results, seconds + time.perf_counter() - t0)


@contextlib.contextmanager
def beside_profile_run(worker):
    """While vLLM's ``Worker.determine_available_memory`` runs: the worker's model runner's
    ``profile_run`` shadowed on the instance, so that :func:`finish_ahead` runs the moment it
    returns, before vLLM reads the GPU's free memory after it (the compile processes, whose
    memory is not the engine's, have exited by then); the shadow goes on exit, and
    :func:`finish_ahead` runs there too where the profile run did not (a no-op when it did).
    A runner that takes no shadow is one warning: the wait then comes after the memory read."""
    restore = None
    with fail_open("could not shadow the model runner's profile_run, kwarm's ahead work is waited for "
                   "after vLLM's memory profiling"):
        restore = _shadow_profile_run(worker)
    try:
        yield
    finally:
        with fail_open("could not restore the model runner's profile_run"):
            if restore is not None:
                restore()
        finish_ahead(worker)


def _shadow_profile_run(worker):
    """Shadow `worker`'s ``model_runner.profile_run`` with one that runs :func:`finish_ahead`
    once it returns; the function that undoes it (None: nothing to wait for, or no runner)."""
    runner = getattr(worker, "model_runner", None)
    profile_run = getattr(runner, "profile_run", None)
    if not callable(profile_run) or id(worker) not in _ahead:
        return None
    own = "profile_run" in vars(runner)

    def then_finish(*args, **kwargs):
        try:
            return profile_run(*args, **kwargs)
        finally:
            finish_ahead(worker)

    runner.profile_run = then_finish

    def restore():
        if own:
            runner.profile_run = profile_run
        else:
            del runner.profile_run
    return restore


def before_load(worker) -> None:
    """Run the selected ``before_load`` families' ``before_load(worker)`` as vLLM starts loading
    `worker`'s weights (``Worker.load_model``); each is one isolated step, and :func:`ahead`
    releases what they started."""
    _each_before_load("before weight loading", lambda module: module.before_load(worker))


def _each_before_load(when: str, call) -> None:
    """`call` each selected ``before_load`` family's module, one isolated step each."""
    settings = config.get()
    for name, family in FAMILIES.items():
        if family.before_load and settings.warmups.wants(name):
            try:
                guarded(f"{name} {when}", lambda: call(family.load()))
            except StepFailed:
                pass


_loading: list = []  # the workers whose Worker.load_model is running, the innermost last


@contextlib.contextmanager
def loading(worker):
    """While `worker` loads its model: the worker :func:`model_built` gives the built model to."""
    _loading.append(worker)
    try:
        yield
    finally:
        _loading.remove(worker)


def model_built(model) -> None:
    """Run the selected ``before_load`` families' ``model_built(worker, model)`` as vLLM has built
    the model of the worker now loading (its weights not loaded yet); each is one isolated step.
    A model built outside a worker's load (none loading) is not one."""
    if not _loading:
        return
    worker = _loading[-1]
    _each_before_load("as the model was built", lambda module: module.model_built(worker, model))


def after_capture(worker) -> dict | None:
    """Run the selected after-capture families on `worker` (the view of its :func:`run`);
    one summary line, and the report gains ``after_capture``. None when no family is one."""
    settings = config.get()
    view, report = _pending.pop(id(worker), (None, None))  # one after-capture run per warmup run
    names = [name for name, family in FAMILIES.items() if family.after_capture]
    if not names:
        return None
    if view is not None:
        view.after_capture = True  # a family that also runs ahead plans its after-capture steps
    t0 = time.perf_counter()
    bound = memory.begin(worker, after_capture=True)
    try:
        results = [_run_family(name, view, settings) for name in names]
    finally:
        memory.end(release_blocks=False)  # the caching allocator's blocks stay for the first requests
    seconds = round(time.perf_counter() - t0, 4)
    rank = report.get("rank", 0) if report else 0
    part = {"total_s": seconds, "families": [dataclasses.asdict(r) for r in results], "memory": bound,
            "summary": f"kwarm: after CUDA-graph capture, {seconds:.2f} s on rank {rank}: {short_line(results)}",
            "detail": outcome(results), "left_to_requests": left_to_requests(results)}
    memory_text = memory_summary(part, results)
    logger.info("%s", part["summary"])
    logger.debug("kwarm: after CUDA-graph capture, detail on rank %s: %s", rank, part["detail"])
    if memory_text:
        logger.info("kwarm: after CUDA-graph capture, GPU memory on rank %s: %s", rank, memory_text)
    if report is not None:
        report["after_capture"] = part
        _write(report, settings, rank)
    return part


def _write(report: dict, settings, rank: int) -> str | None:
    """Write `report` to KWARM_REPORT; the path written, None where none was (unset, or failed: one warning)."""
    if settings.report:
        try:
            return guarded("report", lambda: write_report(report, settings.report, rank))
        except StepFailed:
            pass
    return None


def _run_family(name: str, view, settings) -> FamilyResult:
    result = FamilyResult(name)
    if not settings.warmups.wants(name):
        result.reason = "disabled by KWARM_WARMUPS"
        return result
    if view is None:
        result.reason = NO_VIEW
        return result
    forced = name in settings.warmups.forced
    t0 = time.perf_counter()
    try:
        module = guarded(f"warmup family {name} (import)", FAMILIES[name].load)
        reason = guarded(f"warmup family {name} (applies)", lambda: module.applies(view))
        if reason:
            result.reason = reason
            return result
        planned = guarded(f"warmup family {name} (plan)", lambda: module.plan(view, forced))
    except StepFailed as exc:
        result.status, result.reason = "failed", str(exc)
        result.seconds = round(time.perf_counter() - t0, 4)
        return result
    steps, details = (planned.steps, planned.details) if isinstance(planned, Plan) else (planned, None)
    result.status = "ran"
    runnable = [step.name for step in steps if step.skip is None and step.run is not None]
    logger.info("kwarm: %s: %d of %d steps to run (%s)", name, len(runnable), len(steps),
                ", ".join(runnable) or "none")
    reserved = memory.reserved()
    with monitor.capture() as compiled, _progress(name) as current:
        for step in steps:
            current[0] = step.name
            result.steps.append(_run_step(name, step))
    largest = memory.largest((s["name"], s.get("memory")) for s in result.steps)
    if largest is not None:
        result.memory = {"step": largest[0], **largest[1]}
    if reserved is not None and not FAMILIES[name].keeps_memory and (memory.reserved() or 0) > reserved:
        try:  # what this family grew goes back to the device, not to the next family or vLLM's capture
            guarded(f"warmup family {name} (returning its cached GPU memory)", lambda: memory.release(collect=False))
        except StepFailed:
            pass
    result.compiled = [{"kernel": c.kernel, "module": c.module, "key": c.key}
                       | ({"surface": c.surface} if c.surface != "triton" else {})
                       | ({"cache_hit": c.cache_hit} if c.cache_hit is not None else {}) for c in compiled]
    labels = [label for step, record in zip(steps, result.steps)
              if step.summary and record["status"] == "ran" for label in record["variants"]]
    if labels:
        result.details["summary"] = "; ".join(labels)
    if details is not None:
        try:
            result.details.update(guarded(f"warmup family {name} (details)", details) or {})
        except StepFailed:
            pass
    result.seconds = round(time.perf_counter() - t0, 4)
    if compiled_for_real(result):  # compiles moved ahead of the requests: not charged to KWARM_BUDGET
        budget.credit(result.seconds)
    return result


# Where Triton does not say whether it loaded a kernel from its disk cache (before 3.4, async
# compiles, another compilation listener in the slot), time tells: a compile takes 0.1-5 s, a load
# a few ms. Per family and kernel on the H100 (vLLM 0.33.0, tiny models): 145-620 ms cold, 3-29 ms
# on the warm restart.
LOADED_S = 0.05


def compiled_for_real(result) -> bool:
    """Whether `result`'s family compiled on this start (its time is then given back to the budget,
    ``budget.credit``), rather than loaded its kernels from the disk cache: on a warm restart the
    loads, counted as compiles, gave the fill 0.3-0.4 s more than the budget (BENCHMARKS.md).
    Triton's own word (``cache_hit``) first; by time for the builds it said nothing about."""
    if any(c.get("cache_hit") is False for c in result.compiled):
        return True
    unsaid = [c for c in result.compiled if "cache_hit" not in c]
    return bool(unsaid) and result.seconds >= LOADED_S * len(unsaid)


PROGRESS_EVERY_S = 10.0


@contextlib.contextmanager
def _progress(family: str):
    """While the block runs, one line every PROGRESS_EVERY_S seconds naming the family, its
    current step and the time so far (long warmups are not silent). Yields a one-item list
    the caller keeps the current step's name in."""
    current, stop, t0 = [""], threading.Event(), time.perf_counter()

    def beat():
        while not stop.wait(PROGRESS_EVERY_S):
            logger.info("kwarm: %s: still warming (step %s, %.0f s so far)", family, current[0],
                        time.perf_counter() - t0)

    thread = threading.Thread(target=beat, name=f"kwarm-progress-{family}", daemon=True)
    thread.start()
    try:
        yield current
    finally:
        stop.set()
        thread.join(timeout=1)


def _start_learning(view):
    """Begin recording for KWARM_LEARN (idempotent); None when it cannot (one warning)."""
    if view is None:
        logger.warning("kwarm: learning is off in this worker: no engine view")
        return None
    from kwarm_ext.surfaces.triton import learn, preload

    # The next start's replay launches kwarm's no-op kernel, which nothing compiled on a start
    # without a manifest: compiled here (into Triton's disk cache), the first warm restart loads
    # it instead of compiling it for real before ready (30-34 ms on the H100, vLLM 0.33.0).
    with fail_open("kwarm's no-op kernel is not compiled ahead of the next start", logging.DEBUG):
        preload.warm_binder()
    try:
        return guarded("learning", lambda: learn.begin(view))
    except StepFailed:
        return None


def forget_frames(exc: BaseException) -> None:
    """Clear the frames of a failed step's traceback, its cause's and context's.

    Why: they hold the step's locals, its tensors among them, in a reference cycle with kwarm's
    record of the error (``log.fail_open``'s outcome) that only Python's garbage collector
    breaks; until then the step's GPU memory stays allocated, through the next steps and vLLM's
    CUDA-graph capture (0.9 GB after ``fused_moe``'s out-of-memory at published Qwen3-Next
    dimensions and ``--gpu-memory-utilization 0.92``, vLLM 0.33.0 on an H100: kwarm's report)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # a frame still running is left as it is
        exc = exc.__cause__ or exc.__context__


def _run_step(family: str, step) -> dict:
    record = {"name": step.name, "kernel": step.kernel, "status": "skipped", "variants": [],
              "reason": step.skip, "seconds": 0.0}
    if step.skip is not None or step.run is None:
        record["reason"] = step.skip or "nothing to run"
        return record
    t0 = time.perf_counter()
    out_of_memory = False
    with memory.measure() as used:
        try:
            record["variants"] = list(guarded(f"warmup step {family}.{step.name}", step.run) or [])
            record["status"] = "ran"
        except StepFailed as exc:
            record["status"], record["reason"] = "failed", str(exc)
            out_of_memory = OUT_OF_MEMORY in str(exc)
            forget_frames(exc)
        if out_of_memory:  # what the failed step held goes back before the next one (its frames are gone now)
            with fail_open("could not return a failed step's GPU memory"):
                memory.release()
    record["seconds"] = round(time.perf_counter() - t0, 4)
    if used:
        record["memory"] = used
    return record
