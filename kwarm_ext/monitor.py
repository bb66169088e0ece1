"""Counts what Triton compiles: a ``jit_post_compile_hook`` chained with whatever hook was
installed before (vLLM's JIT monitor chains the same slot), used around each warmup step.

On a machine without Triton, or with ``TRITON_INTERPRET=1`` (nothing compiles), it
records nothing and says so through ``available``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One in-memory compilation: kernel identity and Triton's cache key."""

    module: str
    name: str
    key: str

    @property
    def kernel(self) -> str:
        return self.name.rsplit(".", 1)[-1]


class _Recorder:
    def __init__(self):
        self.events: list[Compiled] = []
        self.lock = threading.Lock()


_active: list[_Recorder] = []
_lock = threading.Lock()
_installed = {"hook": None, "prev": None}


def _hook(**kwargs):
    try:
        fn = kwargs.get("fn")
        event = Compiled(str(getattr(fn, "module", "?")), str(getattr(fn, "name", "?")), str(kwargs.get("key")))
        for rec in list(_active):
            with rec.lock:
                rec.events.append(event)
    except Exception:
        pass  # a counter must never break a launch
    prev = _installed["prev"]
    if prev is not None:
        return prev(**kwargs)
    return None


def available() -> bool:
    try:
        from triton import knobs  # noqa: F401
    except Exception:
        return False
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@contextlib.contextmanager
def capture():
    """Yield a list that fills with the :class:`Compiled` events of the block."""
    rec = _Recorder()
    knobs = None
    try:
        from triton import knobs
    except Exception:
        pass
    with _lock:
        if knobs is not None and knobs.runtime.jit_post_compile_hook is not _hook:
            _installed["prev"] = knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = _hook
        _active.append(rec)
    try:
        yield rec.events
    finally:
        with _lock:
            _active.remove(rec)
            if knobs is not None and not _active and knobs.runtime.jit_post_compile_hook is _hook:
                knobs.runtime.jit_post_compile_hook = _installed["prev"]
                _installed["prev"] = None
