"""kwarm's one Triton ``jit_post_compile_hook``, serving both counting (kwarm_ext/monitor.py) and recording.

Triton has a single hook slot, not a chain; vLLM's JIT monitor (installed after warmup)
saves whatever hook it finds and calls it, and others may assign the slot outright. kwarm
installs one hook, chained to whatever was there before, and fans each compilation out to
its listeners: :func:`capture` counts what a warmup step compiles, and the learn-and-replay
recorder (kwarm_ext/surfaces/triton/learn.py) listens for as long as the process learns. The hook is
installed while it has listeners and removed when the last one leaves, if it still holds the
slot (if another hook chained on top of it, it stays as a pass-through).

The hook does not say whether Triton compiled the kernel or loaded it from its disk cache; Triton's
``knobs.compilation.listener`` (3.4+, one slot too) does, just before the hook in the same thread.
While the hook has listeners kwarm holds that slot as well, chained the same way, and hands the
listeners ``cache_hit`` (True, False, or None where Triton did not say). That second slot can go
when the hook's own arguments carry ``cache_hit`` (Triton 3.6's do not).

Listeners never break a launch: their exceptions are swallowed. The chained hook's are not
(vLLM's ``--jit-monitor-mode=error`` must still raise). On a machine without Triton, or with
``TRITON_INTERPRET=1`` (nothing compiles), nothing is recorded and ``available`` says so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable

Listener = Callable[[dict], None]  # receives the hook's keyword arguments


@dataclasses.dataclass
class _HookState:
    installed: bool = False
    prev: Callable | None = None  # the hook found in the slot when kwarm installed its own
    prev_listener: Callable | None = None  # the compilation listener found in its slot
    listening: bool = False  # kwarm's compilation listener is in Triton's slot


_listeners: list[Listener] = []
_lock = threading.RLock()
_state = _HookState()
_inside = threading.local()


def _hook(**kwargs):
    """Notify the listeners, then the previous hook. A chain that loops back here (someone
    chained kwarm, then kwarm re-installed on top of them) returns at once."""
    if getattr(_inside, "active", False):
        return None
    _inside.active = True
    try:
        seen = dict(kwargs, cache_hit=_take_cache_hit(kwargs.get("fn")))
        for listener in list(_listeners):
            try:
                listener(seen)
            except Exception:
                pass  # a counter or recorder must never break a launch
        prev = _state.prev
        return prev(**kwargs) if prev is not None else None
    finally:
        _inside.active = False


def _compilation_listener(**kwargs):
    """Triton's compilation listener: keep whether this thread's compile hit the disk cache, and
    for which function, until kwarm's hook takes it; then the listener that was there before."""
    if getattr(_inside, "listening", False):  # a chain that loops back here
        return None
    _inside.cache_hit = (getattr(kwargs.get("src"), "fn", None), kwargs.get("cache_hit"))
    _inside.listening = True
    try:
        prev = _state.prev_listener
        return prev(**kwargs) if prev is not None else None
    finally:
        _inside.listening = False


def _take_cache_hit(fn_info):
    """The cache_hit the compilation listener kept for `fn_info`'s function in this thread (None
    where it kept none, or kept it for another function: Triton's async compiles, a direct
    ``triton.compile``)."""
    kept, _inside.cache_hit = getattr(_inside, "cache_hit", None), None
    if kept is None or kept[1] is None:
        return None
    function = getattr(fn_info, "jit_function", None)
    return bool(kept[1]) if function is not None and kept[0] is function else None


def available() -> bool:
    try:
        from triton import knobs  # noqa: F401
    except Exception:
        return False
    from kwarm_ext.surfaces.triton.compat import interpreted

    return not interpreted()


def listen(listener: Listener) -> bool:
    """Add `listener` and make sure kwarm's hook is reachable from the slot. False without Triton."""
    knobs = _knobs()
    with _lock:
        if knobs is not None:
            _ensure_installed(knobs)
        _listeners.append(listener)
    return knobs is not None


def unlisten(listener: Listener) -> None:
    knobs = _knobs()
    with _lock:
        with contextlib.suppress(ValueError):
            _listeners.remove(listener)
        if knobs is not None and not _listeners and knobs.runtime.jit_post_compile_hook is _hook:
            knobs.runtime.jit_post_compile_hook = _state.prev
            _state.prev, _state.installed = None, False
        compilation = getattr(knobs, "compilation", None)
        if not _listeners and _state.listening and getattr(compilation, "listener", None) is _compilation_listener:
            compilation.listener = _state.prev_listener  # (one chained on top keeps it, a pass-through)
            _state.prev_listener, _state.listening = None, False


def ensure() -> bool:
    """Re-install kwarm's hook if a hook assigned since then dropped it (one that chains it
    is fine). Returns whether it had to. The learner calls this at each periodic save."""
    knobs = _knobs()
    with _lock:
        if knobs is None or not _listeners or (_state.installed and
                                                _reaches_us(knobs.runtime.jit_post_compile_hook)):
            return False
        _ensure_installed(knobs)
        return True


def is_installed() -> bool:
    """Whether the slot holds kwarm's hook, or a hook that chains to it."""
    knobs = _knobs()
    return knobs is not None and _state.installed and _reaches_us(knobs.runtime.jit_post_compile_hook)


def compiled(kwargs: dict):
    """The hook's keyword arguments as the monitor's :class:`kwarm_ext.monitor.Compiled`."""
    from kwarm_ext.monitor import Compiled

    fn = kwargs.get("fn")
    return Compiled(str(getattr(fn, "module", "?")), str(getattr(fn, "name", "?")), str(kwargs.get("key")),
                    cache_hit=kwargs.get("cache_hit"))


@contextlib.contextmanager
def capture():
    """Yield a list that fills with the Triton compiles of the block (``monitor.capture`` counts
    every surface's)."""
    events: list = []
    events_lock = threading.Lock()

    def count(kwargs):
        event = compiled(kwargs)
        with events_lock:
            events.append(event)

    listen(count)
    try:
        yield events
    finally:
        unlisten(count)


def _knobs():
    try:
        from triton import knobs

        return knobs
    except Exception:
        return None


def _ensure_installed(knobs) -> None:
    """Install (or re-install on top of a hook that replaced kwarm's without chaining it), and
    hold the compilation listener's slot, whether or not the hook was still in place (vLLM's JIT
    monitor chains it, and keeps it past the last listener; the listener's slot is given back)."""
    compilation = getattr(knobs, "compilation", None)
    if hasattr(compilation, "listener") and not _state.listening:  # once: it may be chained on top of
        _state.prev_listener, _state.listening = compilation.listener, True
        compilation.listener = _compilation_listener
    current = knobs.runtime.jit_post_compile_hook
    if current is _hook or (_state.installed and _reaches_us(current)):
        return
    from triton.runtime import jit

    from kwarm_ext.surfaces.triton.compat import SERIALIZER

    SERIALIZER.apply(jit)  # Triton 3.4-3.6: any hook breaks kernels with function constexprs
    _state.prev, _state.installed = current, True
    knobs.runtime.jit_post_compile_hook = _hook


def _reaches_us(hook, depth: int = 3) -> bool:
    """Whether `hook` is kwarm's or calls it: vLLM's monitor keeps the previous hook in a
    closure cell; wrappers keep it in ``__wrapped__`` or a partial's ``func``."""
    if hook is _hook:
        return True
    if hook is None or depth == 0:
        return False
    inner = [getattr(hook, "__wrapped__", None), getattr(hook, "func", None)]
    inner += [cell.cell_contents for cell in (getattr(hook, "__closure__", None) or ())
              if _cell_filled(cell)]
    return any(callable(obj) and _reaches_us(obj, depth - 1) for obj in inner)


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False
