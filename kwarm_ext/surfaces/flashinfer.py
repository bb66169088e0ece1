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
items were recorded with; every refusal is one line.
"""
from __future__ import annotations

import importlib
import json
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

    def replay(self, items, version):
        done = Replayed()
        here = self.version()
        if version != here:
            why = f"recorded with FlashInfer {version}, this is {here or 'no FlashInfer'}"
            done.skipped += [(self.describe(item), why) for item in items]
            return done
        for item in items:
            label = self.describe(item)
            try:
                outcome = _replay_one(self, item)
            except Exception as exc:  # a build that fails here would fail in the request too
                outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                done.skipped.append((label, outcome))
                continue
            if outcome.startswith("!"):
                done.skipped.append((label, outcome[1:]))
            else:
                done.done.append(f"{item['module']} ({outcome})")
        return done


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
    detail = {"built": had is False, "seconds": round(seconds, 3), "getter": None, "args": None}
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

        dtype = getattr(torch, arg["dtype"], None)
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
    if isinstance(arg, dict) and set(arg) == {"dtype"} and type(arg["dtype"]) is str and re.fullmatch(r"[a-z0-9_]{1,32}", arg["dtype"]):
        return None
    return f"{type(arg).__name__} is not a plain value"


def _show(arg) -> str:
    return arg["dtype"] if isinstance(arg, dict) else repr(arg)


# ---------------------------------------------------------------------------- replaying


def _replay_one(surface, item) -> str:
    """Call the item's getter; returns how the module came (built, loaded, already loaded), or a
    reason prefixed with "!" when the getter built something else."""
    from kwarm_ext import monitor

    module, _, function = item["getter"].rpartition(".")
    getter = getattr(importlib.import_module(module), function, None)
    if not callable(getter):
        return f"!{item['getter']} does not exist in this FlashInfer"
    args = [_decode(a) for a in item["args"]]
    with monitor.capture([surface]) as events:
        getter(*args)
    built = [e for e in events if e.surface == "flashinfer"]
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
