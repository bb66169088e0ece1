"""Learning: record what Triton compiles (and the other surfaces build: FlashInfer's JIT modules)
after kwarm's warmup into this deployment's manifest.

Why: the hand-written families cover the kernels someone studied; everything else still
compiles on the first request that reaches it. With ``KWARM_LEARN=1`` (or ``kwarm run
--learn``) each worker records those compilations as they happen, and the next start
replays them (kwarm_ext/surfaces/triton/replay.py) before the families run.

How: a :class:`Recorder` listens on kwarm's one post-compile hook (kwarm_ext/surfaces/triton/hook.py)
from the end of kwarm's warmup (``KWARM_LEARN=all``: from its start) and keeps each new
compilation of an allow-listed, module-level kernel. A :class:`Learner` merges them, with
the autotuners' choices for the kernels seen, into the manifest: every
``KWARM_LEARN_INTERVAL`` seconds from a daemon thread when something new was recorded,
and at exit (``atexit`` and multiprocessing's exit finalizers, so spawned and forked
workers both save). Saving never raises into vLLM; a failure is one warning.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import threading

from kwarm_ext import config, engine, manifest, manifest_files
from kwarm_ext.surfaces.triton import hook
from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.manifest import Entry, Stamp, TuneChoice

logger = logging.getLogger("kwarm")


class Recorder:
    """Manifest entries from the hook's calls. Thread-safe; its listener never raises."""

    def __init__(self, allowed: tuple, known=()):
        self.allowed = allowed
        self._known = frozenset(known)  # identities already in the manifest: not new
        self._lock = threading.Lock()
        self._entries: dict = {}  # identity -> Entry, everything newly learned in this process
        self._unsaved: list = []
        self._kernels: set = set()  # (module, qualname) of everything recorded
        self._paused = 0
        self._refused: set = set()  # modules already logged as not allow-listed
        self._token_counts: set = set()  # step sizes seen (all)
        self._unsaved_counts: list = []
        self._surface_keys: set = set()  # (surface, key) of the other surfaces' items seen or known
        self._unsaved_items: dict = {}  # surface name -> (version, [item])

    def know_items(self, manifest_data) -> None:
        """The other surfaces' items already in the manifest: not new."""
        from kwarm_ext import surfaces

        for name, section in manifest_data.surfaces.items():
            key = surfaces.get(name).key
            self._surface_keys.update((name, key(item)) for item in section["items"])

    def on_built(self, event) -> None:
        """A build of another surface (FlashInfer: a JIT module): its item, if it can be replayed."""
        from kwarm_ext import surfaces

        if self._paused:
            return
        try:
            surface = surfaces.get(event.surface)
            item = surface.item(event)
            if item is None:
                logger.info("kwarm: not learning %s %s: built by no replayable call", surface.label, event.name)
                return
            identity = (surface.name, surface.key(item))
            with self._lock:
                if identity in self._surface_keys:
                    return
                self._surface_keys.add(identity)
                version, items = self._unsaved_items.setdefault(surface.name, (surface.version(), []))
                items.append(item)
        except Exception as exc:
            logger.debug("kwarm: not recording a %s build: %s", event.surface, exc)

    def take_unsaved_items(self) -> dict:
        with self._lock:
            out, self._unsaved_items = self._unsaved_items, {}
        return out

    def on_compile(self, kwargs: dict) -> None:
        if self._paused:
            return
        try:
            record = triton_compat.describe_compile(kwargs)
        except Exception as exc:  # Unrecordable, or a Triton that changed its hook payload
            logger.debug("kwarm: not recording a compile of %s: %s", getattr(kwargs.get("fn"), "name", "?"), exc)
            return
        if record is None:
            return
        if not manifest.module_allowed(record.module, self.allowed):
            self._refuse_once(record.module)
            return
        entry = Entry(**dataclasses.asdict(record))
        with self._lock:
            if entry.identity not in self._entries and entry.identity not in self._known:
                self._entries[entry.identity] = entry
                self._unsaved.append(entry)
                self._kernels.add((entry.module, entry.qualname))

    def _refuse_once(self, module: str) -> None:
        with self._lock:
            if module in self._refused:
                return
            self._refused.add(module)
        logger.info("kwarm: not learning kernels of %s: not in the allowed modules (KWARM_ALLOW_MODULES)", module)

    @contextlib.contextmanager
    def paused(self):
        """Ignore compilations in the block (replay's own, which are in the manifest already)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def on_step(self, num_tokens) -> None:
        """A model step of `num_tokens` scheduled tokens (the runner's ``execute_model``)."""
        if type(num_tokens) is int and num_tokens > 0 and num_tokens not in self._token_counts:
            with self._lock:
                if num_tokens not in self._token_counts:
                    self._token_counts.add(num_tokens)
                    self._unsaved_counts.append(num_tokens)

    def take_unsaved(self) -> list:
        with self._lock:
            out, self._unsaved = self._unsaved, []
        return out

    def take_unsaved_counts(self) -> list:
        """Step sizes not saved yet."""
        with self._lock:
            out, self._unsaved_counts = self._unsaved_counts, []
        return out

    def give_back(self, entries: list, counts=(), items=None) -> None:
        """Entries, step sizes and surface items whose save failed: the next save tries them again."""
        with self._lock:
            self._unsaved[:0] = entries
            self._unsaved_counts[:0] = list(counts)
            for name, (version, lost) in (items or {}).items():
                self._unsaved_items.setdefault(name, (version, []))[1][:0] = lost

    def kernels(self) -> set:
        with self._lock:
            return set(self._kernels)

    @property
    def recorded(self) -> int:
        """Compilations newly learned in this process (not in the manifest at its start)."""
        return len(self._entries)


def snapshot_choices(kernels, allowed: tuple) -> list:
    """The autotuners' current choices for `kernels` ((module, qualname) pairs). Imports
    nothing: a kernel whose module is not loaded has made no choice in this process."""
    out = []
    for module, qualname in sorted(kernels):
        if not manifest.module_allowed(module, allowed):
            continue
        try:
            kernel = triton_compat.resolve(module, qualname, import_missing=False)
        except triton_compat.Unresolvable:
            continue
        out += [TuneChoice(module, qualname, kernel.source_key, key, cfg)
                for key, cfg in triton_compat.autotune_choices(kernel)]
    return out


@dataclasses.dataclass
class Learner:
    """Saves one worker's recordings into its deployment's manifest."""

    path: str
    stamp: Stamp
    recorder: Recorder
    interval: float
    known_kernels: set = dataclasses.field(default_factory=set)  # kernels of the manifest at start
    saved_choices: set = dataclasses.field(default_factory=set)  # TuneChoice identities on disk
    learned: int = 0  # items this process added to the manifest
    saves: int = 0
    _last_error: str | None = dataclasses.field(default=None, repr=False)
    _save_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def save(self, why: str) -> manifest_files.SaveResult | None:
        """Merge what is new into the manifest; None when nothing new was recorded."""
        with self._save_lock:
            entries, counts = self.recorder.take_unsaved(), self.recorder.take_unsaved_counts()
            items = self.recorder.take_unsaved_items()
            kernels = self.recorder.kernels() | self.known_kernels
            choices = [c for c in snapshot_choices(kernels, self.recorder.allowed)
                       if c.identity not in self.saved_choices]
            if not entries and not choices and not counts and not items:
                return None
            try:
                result = manifest_files.save(self.path, self.stamp, entries, choices, counts, items)
            except BaseException:
                self.recorder.give_back(entries, counts, items)
                raise
            self.saved_choices.update(c.identity for c in choices)
            self.learned += result.added
            self.saves += 1
        if result.note:
            logger.warning("kwarm: manifest %s: %s", result.path, result.note)
        if result.left_out:
            logger.warning("kwarm: manifest %s: %s", result.path, "; ".join(result.left_out))
        logger.info("kwarm: learned %d new (%d in the manifest, %s save) -> %s",
                    result.added, result.total, why, result.path)
        return result

    def save_quietly(self, why: str) -> None:
        """Save; a failure is one warning (repeats of the same failure go to debug)."""
        try:
            self.save(why)
            self._last_error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log = logger.debug if error == self._last_error else logger.warning
            log("kwarm: saving the manifest %s failed (%s save): %s", self.path, why, error)
            self._last_error = error

    def run_periodically(self) -> None:
        while not self._stop.wait(self.interval):
            if hook.ensure():
                logger.info("kwarm: another jit_post_compile_hook had replaced kwarm's; chained it again")
            self.save_quietly("periodic")

    def stop(self) -> None:
        self._stop.set()


_learner: Learner | None = None
_lock = threading.Lock()


def deployment(view) -> tuple[Stamp, str]:
    """This worker's stamp and manifest path (``KWARM_MANIFEST``, else one per model and versions)."""
    model = engine.read(view.worker, "vllm_config.model_config.model", {}) if view.worker is not None else None
    if model is None and view.runner is not None:
        model = engine.read(view.runner, "vllm_config.model_config.model", {})
    stamp = manifest_files.current_stamp(model=str(model) if model is not None else None, tp_size=view.tp_size)
    if stamp is None:
        raise RuntimeError("no Triton target: Triton is missing or no GPU driver is active")
    return stamp, config.get().manifest or manifest_files.default_path(stamp)


def begin(view) -> Learner:
    """Start recording in this process (idempotent): listen, save periodically and at exit."""
    global _learner
    with _lock:
        if _learner is not None:
            return _learner
        settings = config.get()
        stamp, path = deployment(view)
        known = _known_manifest(path, stamp)
        recorder = Recorder(settings.allowed_modules, {e.identity for e in known.entries})
        recorder.know_items(known)
        learner = Learner(path, stamp, recorder, settings.learn_interval,
                          known_kernels={(i.module, i.qualname) for i in known.entries + known.autotune},
                          saved_choices={c.identity for c in known.autotune})
        if not hook.listen(learner.recorder.on_compile):
            raise RuntimeError("Triton is not importable: nothing to learn")
        watch_surfaces(learner.recorder)
        _learner = learner
    atexit.register(_save_at_exit)
    with contextlib.suppress(Exception):
        from multiprocessing import util

        util.Finalize(None, _save_at_exit, exitpriority=100)  # multiprocessing children skip atexit on fork
    if view.runner is not None:
        record_steps(view.runner, learner.recorder)
    if learner.interval > 0:
        threading.Thread(target=learner.run_periodically, name="kwarm-learn", daemon=True).start()
    logger.info("kwarm: learning: compilations after kwarm's warmup go to %s", path)
    shared = manifest_files.shared_folder(path)
    if shared:
        logger.warning("kwarm: learning into %s: %s; keep manifests in a folder only you can write",
                       manifest.printable(path), shared)
    return learner


def watch_surfaces(recorder: Recorder) -> dict:
    """Record the other surfaces' builds too (kwarm_ext/surfaces/); returns name -> stop() of those
    watched (a learner watches until the process exits)."""
    from kwarm_ext import surfaces

    watched = {}
    for surface in surfaces.with_sections():
        try:
            stop = surface.watch(recorder.on_built)
            if stop is not None:
                watched[surface.name] = stop
        except Exception as exc:
            logger.warning("kwarm: not learning %s: %s: %s", surface.label, type(exc).__name__, exc)
    return watched


def record_steps(runner, recorder: Recorder) -> bool:
    """Note each step's token count, for ``eager_gemm``'s exact pass at the next start.

    Why: cuBLAS chooses a kernel per exact GEMM problem (about 0.3 ms per weight shape on a
    count never run, more where it loads a kernel); the counts a deployment really steps at
    are the ones worth warming exactly (BENCHMARKS.md, "cuBLAS GEMMs").
    How: this runner's ``execute_model`` is replaced, on the instance only and only while
    learning, by a function that reads ``scheduler_output.total_num_scheduled_tokens`` (V1
    and Model Runner V2, vLLM 0.20-0.33) and calls the original. Nothing else changes.
    Remove when: vLLM records the step sizes it served (no release does, 0.20-0.33).
    Returns False where the runner has no ``execute_model`` (nothing is recorded)."""
    real = getattr(runner, "execute_model", None)
    if not callable(real) or getattr(real, "_kwarm_recording", False):
        return False

    def execute_model(scheduler_output, *args, **kwargs):
        recorder.on_step(getattr(scheduler_output, "total_num_scheduled_tokens", None))
        return real(scheduler_output, *args, **kwargs)

    execute_model._kwarm_recording = True
    execute_model.__wrapped__ = real
    runner.execute_model = execute_model
    return True


def learned_token_counts(view) -> list:
    """The step sizes this deployment's manifest holds (empty without a usable one)."""
    stamp, path = deployment(view)
    return manifest_files.read_token_counts(path, stamp)


def _known_manifest(path: str, stamp: Stamp) -> manifest.Manifest:
    """What the manifest already holds (empty if unusable): its entries are not new, its
    autotune choices need not be saved again."""
    try:
        known = manifest_files.load(path)  # takes what replay parsed at this start, if unchanged
    except (FileNotFoundError, manifest.BadManifest):
        return manifest.Manifest(stamp)
    return known if known.stamp.incompatibility(stamp) is None else manifest.Manifest(stamp)


def _save_at_exit() -> None:
    learner = _learner
    if learner is not None:
        learner.stop()
        learner.save_quietly("exit")


def flush() -> None:
    """Save what was learned now, for a process that leaves through ``os._exit`` (which skips
    ``atexit``): call it last; learning stops."""
    _save_at_exit()


@contextlib.contextmanager
def paused():
    """Don't record the block's compilations (replay's own)."""
    learner = _learner
    if learner is None:
        yield
        return
    with learner.recorder.paused():
        yield
