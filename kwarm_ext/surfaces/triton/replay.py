"""Family ``replay``: compile at engine start what earlier runs of this deployment compiled late.

Triton's entries first (the steps below), then one step per other JIT surface in the manifest
(``surfaces``: FlashInfer's modules), each through that surface's ``replay`` (kwarm_ext/surfaces/).

Why: the hand-written families (kernels/) cover the kernels someone studied. A model,
backend or vLLM release they do not know still compiles on its first requests. With
``KWARM_LEARN=1`` a run records those compilations into the deployment's manifest
(kwarm_ext/surfaces/triton/learn.py); every later start replays it, first among the families.

How (Triton's own mechanisms, through the Triton adapter: kwarm_ext/surfaces/triton/compat.py, triton_preload.py, triton_compile.py):
  1. load the manifest: a trusted file, this Triton, this GPU architecture (one log line and
     no replay otherwise);
  2. resolve each entry (allow-listed modules whose source defines Triton kernels only), skip
     it when its kernel's source changed, when a compiler option is not on the allow-list
     (``manifest.LAUNCH_OPTIONS``), or when it is an autotune config that was not chosen; each
     skip is one log line naming the entry and the reason (loading already dropped entries
     whose constants disagree with their key);
  3. ``preload`` every entry with the launch options of its key, in parallel
     (``AsyncCompileMode`` on a thread pool sized to this rank's share of the cores);
  4. seed the autotuners' caches with the recorded choices (no benchmarking at first launch);
  5. on a GPU, ``_init_handles`` each kernel (launcher and binary load, on as many threads)
     and launch one no-op kernel (the binder's one-time imports), so that the first real
     launch costs what the second does.

Upstream: vLLM has no record/replay; its JIT-warmup registry (0.27+) is per kernel and
hand-written. Remove when Triton or vLLM persist and reload the in-memory kernel caches.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

from kwarm_ext import config, manifest, manifest_files, surfaces
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.surfaces.triton import hook
from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.surfaces.triton import preload as triton_preload
from kwarm_ext.families import Plan, Step
from kwarm_ext.log import CONTAINED, fail_open

logger = logging.getLogger("kwarm")
MAX_SKIP_LINES = 20  # replay's warnings per start; the summary line and the report have the rest
NO_GPU = "no GPU driver is active (a stub or none): kernels load and launch at first use"


@dataclasses.dataclass(frozen=True)
class Skip:
    label: str
    kind: str  # short category for the summary line
    reason: str


@dataclasses.dataclass
class ReplayState:
    """One replay: what the plan found and what each step did."""

    path: str
    threads: int = 1
    refused: str | None = None  # why the whole manifest was not used
    jobs: list = dataclasses.field(default_factory=list)  # [PreloadJob]
    choices: list = dataclasses.field(default_factory=list)  # [(TuneChoice, ResolvedKernel)]
    skipped: list = dataclasses.field(default_factory=list)  # [Skip]
    compiled: list = dataclasses.field(default_factory=list)  # [(label, kernel)]
    already: int = 0  # entries already compiled in this process
    not_chosen: int = 0  # autotune configs the recorded choices did not pick
    seeded: int = 0
    key_cache_seeded: int = 0  # replayed keys mapped from their specialization (kernel_key_cache)
    loaded: int = 0
    binder: str = "not primed"
    logged: int = 0  # skips logged (at most MAX_SKIP_LINES lines a start)
    limit_s: float = 600.0  # KWARM_REPLAY_LIMIT: the whole replay's bound
    deadline: float | None = None  # time.monotonic() the replay must end by (set as its first step starts)
    out_of_time: int = 0  # entries and items the total bound left out
    more_malformed: int = 0  # malformed items past those the manifest kept with their reason
    surfaces: dict = dataclasses.field(default_factory=dict)  # the other surfaces' sections of the manifest
    surfaces_replayed: dict = dataclasses.field(default_factory=dict)  # surface name -> labels done

    def skip(self, label: str, kind: str, reason: str, log: bool = True) -> None:
        self.skipped.append(Skip(label, kind, reason))
        if not log:
            return
        self.logged += 1
        if self.logged <= MAX_SKIP_LINES:
            logger.warning("kwarm: replay skipped %s: %s", label, reason)
        elif self.logged == MAX_SKIP_LINES + 1:
            logger.warning("kwarm: replay: further skips are not logged (the summary line counts them, "
                           "KWARM_REPORT lists them)")

    def until(self) -> float:
        """The replay's deadline, started by the first step that asks (``KWARM_REPLAY_LIMIT``)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.limit_s
        return self.deadline

    def left_out(self, labels: list, what: str) -> None:
        """What the total bound left out: skipped, in one line for the lot (issue 59)."""
        for label in labels:
            self.skip(label, "out of time", f"replay's total bound of {self.limit_s:g} s (KWARM_REPLAY_LIMIT) "
                      "was reached first: left to the requests", log=False)
        if labels:
            self.out_of_time += len(labels)
            logger.warning("kwarm: replay reached its total bound of %g s (KWARM_REPLAY_LIMIT): %d %s left to "
                           "the requests", self.limit_s, len(labels), what)

    def summary(self) -> str:
        if self.refused:
            return f"manifest not used ({self.refused})"
        text = f"{len(self.compiled)} replayed"
        text += "".join(f" + {len(done)} {name}" for name, done in self.surfaces_replayed.items())
        extras = [f"{self.already} already compiled" if self.already else "",
                  f"{self.not_chosen} unchosen autotune configs left out" if self.not_chosen else "",
                  f"{self.seeded} autotune choices seeded" if self.seeded else ""]
        text += "".join(f", {e}" for e in extras if e)
        if self.skipped:
            text += (f", {len(self.skipped) + self.more_malformed} skipped "
                     f"({'; '.join(f'{k}: {n}' for k, n in self.skip_kinds().items())})")
        return text

    def skip_kinds(self) -> dict:
        """{kind: how many} of the skipped entries and items, by kind."""
        kinds: dict = {"malformed": self.more_malformed} if self.more_malformed else {}
        for s in self.skipped:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        return dict(sorted(kinds.items()))

    def details(self) -> dict:
        return {"summary": self.summary(), "manifest": self.path, "refused": self.refused,
                "replayed": len(self.compiled), "already_compiled": self.already,
                "not_chosen": self.not_chosen, "autotune_seeded": self.seeded,
                "key_cache_seeded": self.key_cache_seeded, "loaded": self.loaded,
                "binder": self.binder, "threads": self.threads, "limit_s": self.limit_s,
                "out_of_time": self.out_of_time,
                "surfaces": {name: done for name, done in self.surfaces_replayed.items()},
                "skipped": [dataclasses.asdict(s) for s in self.skipped],
                "left_to_requests": self.left_to_requests()}

    def left_to_requests(self) -> list:
        """What this replay did not compile, for the summary line and the report: the whole
        manifest where it was refused, else the skipped entries by kind."""
        if self.refused:
            return [{"count": 1, "what": "manifests not used", "why": self.refused}]
        return [{"count": n, "what": "manifest entries", "why": kind} for kind, n in self.skip_kinds().items()]


# ---------------------------------------------------------------------------- the family contract


def applies(view) -> str | None:
    if not hook.available():
        return "Triton is missing or interpreted (TRITON_INTERPRET=1)"
    if triton_compat.current_arch() is None:
        return "no GPU driver"
    _, path = learn.deployment(view)
    if not os.path.exists(path):
        return f"no manifest for this deployment ({path})"
    return None


def plan(view, forced) -> Plan:
    stamp, path = learn.deployment(view)
    state = prepare(path, stamp, config.get().allowed_modules)
    state.threads = triton_compile.compile_threads(view.tp_size)
    state.limit_s = config.get().replay_limit
    gpu_skip = NO_GPU if not triton_compat.has_gpu_driver() else None
    none = state.refused and f"manifest not used: {state.refused}"
    return Plan([Step("compile", "manifest entries", run=lambda: compile_entries(state), skip=none),
                 Step("autotune", "autotuner caches", run=lambda: seed_autotuners(state), skip=none),
                 Step("load", "kernel handles", run=lambda: load_handles(state), skip=none or gpu_skip),
                 Step("launch", "kwarm_noop", run=lambda: launch_once(state), skip=none or gpu_skip)]
                + [Step(name, surfaces.get(name).label, run=lambda name=name: replay_surface(state, name), skip=none)
                   for name in sorted(state.surfaces) if state.surfaces[name]["items"]],
                state.details)  # the replay's outcome, for the summary line and the JSON report


# ---------------------------------------------------------------------------- planning


class Resolver:
    """Resolves kernels once each, enforcing the module allow-list."""

    def __init__(self, allowed: tuple):
        self.allowed = allowed
        self._cache: dict = {}

    def kernel(self, module: str, qualname: str):
        """(ResolvedKernel, None) or (None, (kind, reason))."""
        if (module, qualname) not in self._cache:
            self._cache[(module, qualname)] = self._resolve(module, qualname)
        return self._cache[(module, qualname)]

    def _resolve(self, module, qualname):
        if not manifest.module_allowed(module, self.allowed):
            return None, ("module not allowed", f"module {module} is not allowed "
                          f"(allowed: {', '.join(self.allowed)}; extend with KWARM_ALLOW_MODULES)")
        try:
            return triton_compat.resolve(module, qualname), None
        except triton_compat.Unresolvable as exc:
            return None, ("unresolvable", str(exc))

    def function_for(self, key: str):
        """A resolver for constexpr functions of the entry with `key` (whose text holds each
        function's source hash, so a changed function is caught)."""
        def resolve_function(ref: str):
            module, _, qualname = ref.partition(":")
            if not (manifest.is_dotted_name(module) and manifest.is_dotted_name(qualname)):
                raise ValueError(f"constexpr function {ref!r} is not a module:qualname reference")
            kernel, why = self.kernel(module, qualname)
            if why:
                raise ValueError(f"constexpr function {ref}: {why[1]}")
            if kernel.source_key not in key:
                raise ValueError(f"constexpr function {ref} changed since it was recorded")
            return kernel.jit
        return resolve_function


def prepare(path: str, stamp, allowed: tuple) -> ReplayState:
    """Load and check the manifest, resolve its entries; logs one line per refusal."""
    state = ReplayState(path)
    try:
        # a learner of this start reads it again: it takes this parse instead
        data = manifest_files.load(path, keep=config.get().learn != "off")
        why = data.stamp.incompatibility(stamp)
    except FileNotFoundError:
        state.refused = "no manifest"
        return state
    except manifest.BadManifest as exc:
        why = str(exc)
    if why:
        state.refused = why
        logger.warning("kwarm: replay did not use the manifest %s: %s", path, why)
        return state
    shared = manifest_files.shared_folder(path)
    if shared:  # a warning, not a refusal: the file itself passed the checks (README, "Trust model")
        logger.warning("kwarm: manifest %s: %s; keep manifests in a folder only you can write",
                       manifest.printable(path), shared)
    if data.stamp.differences(stamp):
        logger.info("kwarm: manifest %s was recorded with %s; its entries are checked one by one",
                    path, ", ".join(data.stamp.differences(stamp)))
    if data.problems:  # one line for the file, whatever the number of bad items
        dropped = len(data.problems) + data.more_problems
        logger.warning("kwarm: replay dropped %d malformed item%s of %s (first: %s: %s)", dropped,
                       "s" if dropped > 1 else "", path, *data.problems[0])
    for label, reason in data.problems:
        state.skip(label, "malformed", reason, log=False)
    state.more_malformed = data.more_problems
    state.surfaces = data.surfaces
    resolver, chosen = Resolver(allowed), _choices_by_kernel(data.autotune)
    for entry in data.entries:
        _plan_entry(state, entry, resolver, chosen)
    for choice in data.autotune:
        kernel, why = check_kernel(choice, resolver)
        if why:
            state.skip(choice.label, *why)
        else:
            state.choices.append((choice, kernel))
    return state


def check_kernel(item, resolver: Resolver):
    """(ResolvedKernel, None) when the kernel of `item` (an entry or an autotune choice)
    resolves here with the source it was recorded with, else (None, (kind, reason))."""
    kernel, why = resolver.kernel(item.module, item.qualname)
    if why:
        return None, why
    if kernel.source_key != item.source_key:
        return None, ("source changed", "the kernel's source changed since it was recorded")
    return kernel, None


def check_entry(entry, resolver: Resolver):
    """:func:`check_kernel`, and only allow-listed compiler options with values in range
    (``manifest.LAUNCH_OPTIONS``; ``load`` already drops other entries)."""
    kernel, why = check_kernel(entry, resolver)
    if why:
        return None, why
    refused = manifest.disallowed_options(entry.launch_options)
    if refused:
        return None, ("option refused", "; ".join(refused))
    return kernel, None


def _plan_entry(state: ReplayState, entry, resolver: Resolver, chosen: dict) -> None:
    kernel, why = check_entry(entry, resolver)
    if why:
        return state.skip(entry.label, *why)
    if triton_preload.is_loaded(kernel.jit, entry.key):
        state.already += 1
        return None
    if not _is_chosen(entry, kernel, chosen):
        state.not_chosen += 1
        return None
    try:
        job = triton_preload.preload_job(entry.label, kernel, entry.key, entry.spec, entry.launch_options,
                                        resolver.function_for(entry.key))
    except (TypeError, ValueError, KeyError) as exc:
        return state.skip(entry.label, "constants", f"unusable constants: {exc}")
    state.jobs.append(job)
    return None


def _choices_by_kernel(choices) -> dict:
    out: dict = {}
    for c in choices:
        out.setdefault((c.module, c.qualname, c.source_key), []).append(c.config)
    return out


def _is_chosen(entry, kernel, chosen: dict) -> bool:
    """Autotuning compiles every candidate config; replay keeps only the recorded winners
    (all candidates when no choice was recorded for the kernel)."""
    configs = chosen.get((entry.module, entry.qualname, entry.source_key))
    if not configs or not triton_compat.tunes(kernel):
        return True
    names = triton_compile.param_names(kernel.jit)
    constants = {}
    for path, value in zip(entry.spec["constant_keys"], entry.spec["constant_vals"]):
        if len(path) == 1 and path[0] < len(names):
            plain = value.get("constexpr") if isinstance(value, dict) and set(value) == {"constexpr"} else value
            constants[names[path[0]]] = plain
    options = entry.launch_options
    return any(all(k in constants and constants[k] == v for k, v in cfg["kwargs"].items())
               and all(options.get(f) == cfg[f] for f in ("num_warps", "num_stages", "num_ctas", "maxnreg")
                       if cfg.get(f) is not None)
               for cfg in configs)


# ---------------------------------------------------------------------------- the steps


# The most one entry's compile may take (a manifest is input, issue 51: one crafted entry compiled
# for 1019 s at engine start); past it the entry is skipped and its compile goes on unwaited.
# vLLM's own kernels compile in 0.1-30 s each on the GPU host.
ENTRY_COMPILE_S = 180.0


def compile_entries(state: ReplayState) -> list:
    """Step 3: preload every job in parallel, with kwarm's recorder paused; also compiles the
    no-op kernel through its binder (the one-time specialization imports). An entry still
    compiling :data:`ENTRY_COMPILE_S` after it started is skipped, unwaited (Triton 3.6+: the
    bounded pool). The whole loop is bounded too (``KWARM_REPLAY_LIMIT``, issue 59: the bound on
    one entry let 40 slow entries hold a start for 10 s at a 0.5 s bound, and Triton 3.4-3.5
    compile in one thread with no bound on an entry): it runs in a daemon thread the step waits
    for until the replay's deadline; what is not compiled by then is skipped in one line, and a
    compile still running goes on unwaited (the loop starts no new one)."""
    import threading

    threads = max(1, min(state.threads, len(state.jobs)))
    deadline = state.until()
    results: dict = {}
    stop = threading.Event()
    take_device = triton_preload.take_callers_device()

    def loop():
        take_device()  # kernels are filed under the compiling thread's device: this rank's
        with triton_compile.parallel_compiles(threads, per_job_s=ENTRY_COMPILE_S, deadline=deadline):
            for index, job in enumerate(state.jobs):
                if stop.is_set() or time.monotonic() >= deadline:
                    break
                try:
                    results[index] = triton_preload.preload(job)
                except CONTAINED as exc:
                    results[index] = exc
            if not stop.is_set():
                state.binder = _attempt(triton_preload.warm_binder, "primed by warmup")

    errors: list = []

    def contained():
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 (raised again below, in the step's own thread)
            errors.append(exc)

    with learn.paused():
        worker = threading.Thread(target=contained, name="kwarm-replay-loop", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        if errors:  # the loop's failure under kwarm's policy, where KWARM_STRICT can see it
            with fail_open("replay's compile loop failed"):
                raise errors[0]
        late = []
        for index, job in enumerate(state.jobs):
            result = results.get(index)
            if result is None or _unfinished(result):
                late.append(job.label)
            else:
                _settle(state, job, result)
        if errors:  # not the bound: the loop ended (its one warning above)
            for label in late:
                state.skip(label, "compile failed", f"the compile loop failed: {type(errors[0]).__name__}", log=False)
        else:
            state.left_out(late, "Triton entries")
    return [label for label, _ in state.compiled]


def _unfinished(result) -> bool:
    """Whether `result` (a kernel, an exception, or Triton's ``FutureKernel`` of a compile) is a
    compile the total bound ended: its future not done yet, or failed with OutOfTime."""
    if isinstance(result, BaseException):
        return isinstance(result, triton_compile.OutOfTime)
    future = getattr(result, "future", None)  # FutureKernel (Triton 3.5-3.6): the executor's future
    if not callable(getattr(future, "done", None)):
        return False
    if not future.done():
        return True
    try:
        return isinstance(future.exception(timeout=0), triton_compile.OutOfTime)
    except Exception:
        return False


def _settle(state: ReplayState, job, result) -> None:
    if isinstance(result, CONTAINED):
        return state.skip(job.label, "compile failed", f"preload failed: {type(result).__name__}: {result}")
    kernel, why = triton_preload.settle(job, result)
    if why:
        return state.skip(job.label, "compile failed", why)
    state.compiled.append((job.label, kernel))
    # an optimization only (the launch builds the key itself): a debug line; KWARM_STRICT (CI)
    # sees a Triton layout change here
    with fail_open(f"replay could not seed the key cache for {job.label}", logging.DEBUG):
        state.key_cache_seeded += triton_preload.seed_key_cache(job.jit, job.key)
    return None


def replay_surface(state: ReplayState, name: str) -> list:
    """Another surface's items (kwarm_ext/surfaces/), through that surface's own replay."""
    section = state.surfaces[name]
    with learn.paused():
        result = surfaces.get(name).replay(section["items"], section["version"], deadline=state.until())
    for label, reason in result.skipped:
        state.skip(label, name, reason)
    state.left_out(result.out_of_time, f"{surfaces.get(name).label}")
    state.surfaces_replayed[name] = result.done
    return result.done


def seed_autotuners(state: ReplayState) -> list:
    """Step 4: the recorded choices go into ``Autotuner.cache``."""
    seeded = []
    for choice, kernel in state.choices:
        why = triton_compat.seed_autotune(kernel, choice.key, choice.config)
        if why:
            state.skip(choice.label, "autotune", why)
        else:
            seeded.append(choice.label)
    state.seeded = len(seeded)
    return seeded


def load_handles(state: ReplayState) -> list:
    """Step 5 (GPU only): build each kernel's launcher and load its binary now, in parallel."""
    errors = triton_preload.init_handles_each([kernel for _, kernel in state.compiled], state.threads)
    loaded = []
    for (label, _), exc in zip(state.compiled, errors):
        if exc is None:
            loaded.append(label)
        else:  # e.g. OutOfResources: its first launch would raise the same
            logger.warning("kwarm: replay could not load %s: %s: %s", label, type(exc).__name__, exc)
    state.loaded = len(loaded)
    return loaded


def launch_once(state: ReplayState) -> list:
    """Step 6 (GPU only): one tiny real launch pays what only a first launch pays."""
    t0 = time.perf_counter()
    triton_preload.tiny_launch()
    state.binder = f"primed by one launch ({(time.perf_counter() - t0) * 1000:.1f} ms)"
    return ["kwarm_noop"]


def _attempt(fn, done: str) -> str:
    # an optimization only (the first launch pays it instead): a debug line
    with fail_open("replay could not prime the binder", logging.DEBUG) as outcome:
        fn()
        return done
    return f"not primed ({type(outcome.error).__name__}: {outcome.error})"
