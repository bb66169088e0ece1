"""The FlashInfer surface: JIT modules built with nvcc (or loaded) the first time a getter asks.

Why: the FlashInfer wheel ``pip install vllm`` installs (0.7.2.post1 with vLLM 0.33.0) ships no
compiled module. Each ``flashinfer.*.get_*_module(...)`` getter (most are ``functools.cache``\\ d)
generates a :class:`flashinfer.jit.core.JitSpec` and calls its ``build_and_load``: ninja and nvcc
build it into FlashInfer's JIT workspace the first time (seconds: ``concat_mla`` took 6.3 s inside
a request at DeepSeek-V3.2's dimensions), and every later process loads it from there. A container
that starts on an empty workspace builds again, in whichever request first needs the module.

What it records: the getter that asked for a module (its module and name) and its arguments, when
they are plain values (numbers, strings, booleans, None, torch dtypes); the JIT module's name is
kept to check the replay. Its key: (getter, arguments). How it replays: the same getter, called
with the same arguments at the next start, in the worker, before the engine is ready: the module
is built or loaded then, and the getter's cache holds it when a request asks. How the monitor
counts it: ``JitSpec.build_and_load`` is wrapped (``FLASHINFER_BUILD``, listed in kwarm_ext/patches.py) and
each call is one :class:`kwarm_ext.monitor.Compiled` (``surface="flashinfer"``).

A manifest is untrusted: replay calls only module-level ``get_*module*`` functions of ``flashinfer``
modules, with plain arguments (strings without path separators), on the FlashInfer version the
items were recorded with; every refusal is one line. A getter's module is imported only when it is
one of the installed FlashInfer's own library modules (:func:`getter_source_problem`): a regular
package's ``.py`` file outside ``flashinfer/data`` whose source, parsed before anything of it runs,
defines that getter at module level (issue 59: ``flashinfer/data`` ships CUTLASS and CCCL scripts
importable as namespace packages, and an item naming one ran it at engine start).
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import logging
import math
import re
import sys
import threading
import time

from kwarm_ext.log import fail_open
from kwarm_ext.patching import Patch
from kwarm_ext.surfaces import Replayed, Surface

logger = logging.getLogger("kwarm")

DIST = "flashinfer-python"
GETTER = re.compile(r"get_[A-Za-z0-9_]*module[A-Za-z0-9_]*")
WORD = re.compile(r"[A-Za-z0-9_.+-]{0,200}")
MAX_ARGS = 32
FRAMES = 12  # how far up from build_and_load a getter is looked for

_listeners: list = []
_lock = threading.Lock()


class FlashInferSurface(Surface):
    name = "flashinfer"
    label = "FlashInfer JIT modules"

    def version(self):
        try:
            from importlib.metadata import version

            return version(DIST)
        except Exception:
            return None

    def watch(self, on_built):
        if self.version() is None:
            return None
        _ensure_patched()
        with _lock:
            _listeners.append(on_built)

        def stop():
            with _lock:
                if on_built in _listeners:
                    _listeners.remove(on_built)
        return stop

    def item(self, built):
        detail = built.payload if isinstance(built.payload, dict) else {}
        if detail.get("getter") is None or detail.get("args") is None:
            return None
        return {"getter": detail["getter"], "args": detail["args"], "module": built.name}

    def key(self, item):
        return item["getter"], json.dumps(item["args"], sort_keys=True)

    def describe(self, item):
        args = ", ".join(_show(a) for a in item["args"])
        return f"{item['module']} ({item['getter']}({args}))"

    def parse_item(self, raw):
        if not isinstance(raw, dict) or set(raw) != {"getter", "args", "module"}:
            raise ValueError("a FlashInfer item has exactly the fields getter, args and module")
        getter, args, module = raw["getter"], raw["args"], raw["module"]
        why = _getter_problem(getter)
        if why:
            raise ValueError(why)
        if type(module) is not str or not WORD.fullmatch(module) or not module:
            raise ValueError("module: not a JIT module name")
        if type(args) is not list or len(args) > MAX_ARGS:
            raise ValueError(f"args: not a list of at most {MAX_ARGS} values")
        for arg in args:
            why = _arg_problem(arg)
            if why:
                raise ValueError(f"args: {why}")
        return {"getter": getter, "args": list(args), "module": module}

    def problem(self, item) -> str | None:
        """Why replay would refuse `item` here without importing anything (``kwarm manifest verify``)."""
        return getter_source_problem(item["getter"])

    def replay(self, items, version, deadline=None):
        """Each item's getter, on up to :data:`BUILD_THREADS` threads at once (FlashInfer locks each
        module's build, and its getters' caches are thread-safe), until `deadline`: an item not
        started by then is left out, one still building goes on unwaited in its daemon thread
        (issue 59: items were built one after another with no bound, two of 45 s took 90.7 s)."""
        done = Replayed()
        here = self.version()
        if version != here:
            why = f"recorded with FlashInfer {version}, this is {here or 'no FlashInfer'}"
            done.skipped += [(self.describe(item), why) for item in items]
            return done
        outcomes = _run_until(lambda item: _replay_one(self, item), items, _build_threads(), deadline)
        for item, outcome in zip(items, outcomes):
            label = self.describe(item)
            if outcome is None:
                done.out_of_time.append(label)
            elif isinstance(outcome, BaseException):  # a build that fails here would fail in the request too
                text = f"{type(outcome).__name__}: {str(outcome).splitlines()[0] if str(outcome) else ''}"[:300]
                done.skipped.append((label, text))
            elif outcome.startswith("!"):
                done.skipped.append((label, outcome[1:]))
            else:
                done.done.append(f"{item['module']} ({outcome})")
        return done


BUILD_THREADS = 4  # FlashInfer builds at once in one worker (each build's ninja runs nvcc in parallel too)


def _current_cuda_device():
    torch = sys.modules.get("torch")  # FlashInfer imports torch; without it there is no device to keep
    try:
        return torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else None
    except Exception:
        return None


def _build_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(BUILD_THREADS, cores))


def _run_until(fn, items, threads: int, deadline) -> list:
    """``fn(item)`` for each item on `threads` daemon threads; returns each outcome (its result,
    or the exception it raised: ``log.CONTAINED``; ``KeyboardInterrupt`` too, as an outcome of
    its thread), None for those not finished by `deadline` (``time.monotonic()``; None: no bound).
    Nothing is started after the deadline; what runs goes on unwaited."""
    outcomes: list = [None] * len(items)
    pending = list(range(len(items)))
    lock, finished = threading.Lock(), threading.Condition()
    device = _current_cuda_device()

    def work():
        if device is not None:  # a new thread's CUDA device is 0; FlashInfer checks the caller's arch
            try:
                sys.modules["torch"].cuda.set_device(device)
            except Exception as exc:  # the build checks device 0's arch instead: same GPUs on a host
                logger.debug("kwarm: a FlashInfer build thread kept device 0: %s", exc)
        while True:
            with lock:
                if not pending or (deadline is not None and time.monotonic() >= deadline):
                    break
                index = pending.pop(0)
            try:
                outcome = fn(items[index])
            except BaseException as exc:  # noqa: BLE001 (the caller reports it; nothing leaves the thread)
                outcome = exc
            with finished:
                outcomes[index] = outcome
                finished.notify_all()
        with finished:
            finished.notify_all()

    workers = [threading.Thread(target=work, name="kwarm-flashinfer", daemon=True)
               for _ in range(max(1, min(threads, len(items))))]
    for worker in workers:
        worker.start()
    with finished:
        while any(w.is_alive() for w in workers):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            finished.wait(0.05 if left is None else min(0.05, left))
        return list(outcomes)


SURFACE = FlashInferSurface()


# ---------------------------------------------------------------------------- recording


def on_build_and_load(wrapped, instance, args, kwargs):
    """``JitSpec.build_and_load`` with each call told to the listeners (none: a plain call)."""
    if not _listeners:
        return wrapped(*args, **kwargs)
    try:
        had = bool(instance.is_compiled)
    except Exception:
        had = None
    t0 = time.perf_counter()
    result = wrapped(*args, **kwargs)
    try:
        event = _event(instance, had, time.perf_counter() - t0, sys._getframe(1))
    except Exception as exc:  # counting never breaks a build
        logger.debug("kwarm: not recording a FlashInfer build: %s", exc)
        return result
    for listener in list(_listeners):
        try:
            listener(event)
        except Exception:
            pass
    return result


def _event(spec, had, seconds, frame):
    from kwarm_ext import monitor

    name = str(getattr(spec, "name", "?"))
    getter = _find_getter(frame)
    detail = {"built": had is False, "seconds": round(seconds, 3), "getter": None, "args": None,
              "thread": threading.get_ident()}  # replay builds on several threads: its own, by thread
    if getter is not None:
        detail["getter"], detail["args"] = getter
    module = detail["getter"].rpartition(".")[0] if detail["getter"] else "flashinfer"
    return monitor.Compiled(module, name, name, surface="flashinfer", payload=detail)


def _find_getter(frame):
    """(dotted getter, encoded arguments) of the nearest module-level ``get_*module*`` function of a
    FlashInfer module above `frame`; arguments None when one is not a plain value."""
    for _ in range(FRAMES):
        if frame is None:
            return None
        module, code = frame.f_globals.get("__name__", ""), frame.f_code
        if module.startswith("flashinfer.") and GETTER.fullmatch(code.co_name):
            target = getattr(sys.modules.get(module), code.co_name, None)
            function = getattr(target, "__wrapped__", target)  # functools.cache keeps the function
            if getattr(function, "__code__", None) is code:
                return f"{module}.{code.co_name}", _arguments(frame, code)
        frame = frame.f_back
    return None


def _arguments(frame, code):
    if code.co_kwonlyargcount:
        return None
    names = code.co_varnames[:code.co_argcount]
    values = [frame.f_locals.get(n) for n in names]
    if code.co_flags & 0x04:  # CO_VARARGS
        values += list(frame.f_locals.get(code.co_varnames[code.co_argcount], ()))
    encoded = [_encode(v) for v in values]
    return None if any(e is _UNENCODABLE for e in encoded) else encoded


_UNENCODABLE = object()


def _encode(value):
    if value is None or type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
        return value if _arg_problem(value) is None else _UNENCODABLE
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"dtype": str(value).replace("torch.", "")}
    return _UNENCODABLE


def _decode(arg):
    if isinstance(arg, dict):
        import torch

        dtype = vars(torch).get(arg["dtype"])  # not getattr: torch's __getattr__ imports lazy submodules
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no torch dtype {arg['dtype']}")
        return dtype
    return arg


# ---------------------------------------------------------------------------- checking untrusted items


def _getter_problem(getter) -> str | None:
    from kwarm_ext import manifest

    if type(getter) is not str or len(getter) > 300 or not manifest.is_dotted_name(getter):
        return "getter: not a dotted name"
    module, _, function = getter.rpartition(".")
    if not module.startswith("flashinfer.") or any(part.startswith("_") for part in getter.split(".")):
        return f"getter {getter}: not a public function of a flashinfer module"
    if not GETTER.fullmatch(function):
        return f"getter {getter}: not a get_*module* function"
    return None


def _arg_problem(arg) -> str | None:
    if arg is None or type(arg) in (bool, int):
        return None if type(arg) is not int or abs(arg) < 1 << 53 else "an integer out of range"
    if type(arg) is float:
        return None if math.isfinite(arg) else "a float that is not finite"
    if type(arg) is str:
        return None if WORD.fullmatch(arg) and ".." not in arg else "a string that is no plain word"
    if isinstance(arg, dict) and set(arg) == {"dtype"} and type(arg["dtype"]) is str and re.fullmatch(r"[a-z][a-z0-9_]{0,31}", arg["dtype"]):
        return None
    return f"{type(arg).__name__} is not a plain value"


def _show(arg) -> str:
    return arg["dtype"] if isinstance(arg, dict) else repr(arg)


REFUSED_PACKAGES = ("data",)  # flashinfer/data: CUTLASS, CCCL and spdlog sources and their scripts


def getter_source_problem(getter: str) -> str | None:
    """Why `getter`'s module may not be imported for replay (None when it may), without importing
    anything: a module already imported must be a file of the installed FlashInfer; another must be
    a ``.py`` file (or a package's ``__init__.py``) under regular packages (an ``__init__.py`` in
    each folder: no namespace package) of the installed FlashInfer, outside ``flashinfer/data``,
    whose source defines `getter`'s function at module level (``ast``, nothing of it run). Why:
    FlashInfer 0.6-0.7 ship scripts under ``flashinfer/data`` that are importable and run on import
    (issue 59); it can go when FlashInfer keeps a registry of its getters kwarm can look names up in."""
    why = _getter_problem(getter)
    if why:
        return why
    module, _, function = getter.rpartition(".")
    parts = module.split(".")
    if parts[1] in REFUSED_PACKAGES:
        return f"getter {getter}: flashinfer.{parts[1]} holds no JIT getters; not imported"
    root = _package_root()
    if root is None:
        return "FlashInfer is not installed"
    loaded = sys.modules.get(module)
    if loaded is not None:
        where = os.path.realpath(getattr(loaded, "__file__", None) or "/")
        if not where.startswith(root + os.sep) or os.path.join(root, "data") + os.sep in where:
            return f"getter {getter}: its module is not a file of the installed FlashInfer"
        return None if callable(getattr(loaded, function, None)) else \
            f"getter {getter}: no such function in this FlashInfer"
    folder = root
    for depth in range(1, len(parts) - 1):
        folder = os.path.join(folder, parts[depth])
        if not _regular_file(os.path.join(folder, "__init__.py")):
            return f"getter {getter}: {'.'.join(parts[:depth + 1])} is no regular package of FlashInfer; not imported"
    source = os.path.join(folder, parts[-1] + ".py")
    if not _regular_file(source):
        source = os.path.join(folder, parts[-1], "__init__.py")
        if not _regular_file(source):
            return f"getter {getter}: {module} is no module of this FlashInfer; not imported"
    try:
        with open(source, encoding="utf-8", errors="replace") as f:
            tree = ast.parse(f.read(4 << 20))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return f"getter {getter}: {module}'s source does not parse; not imported"
    if not any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
               for node in tree.body):
        return f"getter {getter}: {module} defines no function {function}; not imported"
    return None


def _package_root() -> str | None:
    """The installed FlashInfer's folder (its package is not imported to find it)."""
    loaded = sys.modules.get("flashinfer")
    paths = list(getattr(loaded, "__path__", []) or [])
    if not paths:
        try:
            from importlib.util import find_spec

            spec = find_spec("flashinfer")
            paths = list(spec.submodule_search_locations or []) if spec is not None else []
        except (ImportError, ValueError):
            return None
    return os.path.realpath(paths[0]) if paths else None


def _regular_file(path: str) -> bool:
    try:
        import stat

        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------------- replaying


def _replay_one(surface, item) -> str:
    """Call the item's getter; returns how the module came (built, loaded, already loaded), or a
    reason prefixed with "!" when the getter built something else."""
    from kwarm_ext import monitor

    module, _, function = item["getter"].rpartition(".")
    why = getter_source_problem(item["getter"])
    if why:
        return f"!{why}"
    getter = getattr(importlib.import_module(module), function, None)
    if not callable(getter):
        return f"!{item['getter']} is not a function in this FlashInfer"
    args = [_decode(a) for a in item["args"]]
    with monitor.capture([surface]) as events:
        getter(*args)
    me = threading.get_ident()
    built = [e for e in events if e.surface == "flashinfer" and e.payload.get("thread") == me]
    if not built:
        return "already loaded"
    names = {e.name for e in built}
    if item["module"] not in names:
        return f"!the getter built {', '.join(sorted(names))}, not {item['module']}"
    event = next(e for e in built if e.name == item["module"])
    return f"{'built' if event.payload.get('built') else 'loaded'} in {event.payload.get('seconds', 0):.2f} s"


# ---------------------------------------------------------------------------- the patch


def _wrap_build_and_load(wrapped, instance, args, kwargs):
    """Tell kwarm's monitor and learner about each FlashInfer JIT module a getter builds or loads:
    what still builds after kwarm's warmup is counted, learned and replayed at the next start.
    Without a listener it is a plain call. FlashInfer 0.6-0.7 (vLLM 0.24-0.33) build every module
    through ``JitSpec.build_and_load``; it can go when FlashInfer reports its builds itself (it
    keeps a registry of specs, not of builds) or ships its modules compiled."""
    return on_build_and_load(wrapped, instance, args, kwargs)


FLASHINFER_BUILD = Patch("flashinfer.jit.core", "build_and_load", _wrap_build_and_load, "FlashInfer 0.6-0.7",
                         "FlashInfer JIT builds are neither counted nor learned", owner="JitSpec")
_hook_registered = False


def _ensure_patched() -> None:
    """Apply the wrapper now if FlashInfer's JIT is imported and the wrapper is not on it (anyone may
    have removed it: ``Patch.remove``), else when it is imported (activation installs it with every
    other patch, kwarm_ext/patches.py; a process that only counts needs it too)."""
    global _hook_registered

    def apply(module) -> None:
        with fail_open(f"could not wrap {FLASHINFER_BUILD.target}, {FLASHINFER_BUILD.lost}"):
            FLASHINFER_BUILD.apply(module)

    module = sys.modules.get(FLASHINFER_BUILD.module)
    if module is not None:
        if not FLASHINFER_BUILD.applied(module):
            apply(module)
        return
    if not _hook_registered:
        import wrapt

        wrapt.register_post_import_hook(apply, FLASHINFER_BUILD.module)
        _hook_registered = True
