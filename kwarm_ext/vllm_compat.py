"""Where vLLM's symbols live in the installed release: resolution by feature, not version.

Each family names the candidates for a symbol (newest location first); :func:`resolve`
returns the first that imports, or raises :class:`Missing` with every place it looked.
:func:`bind` checks a call against the real signature before it is made, so that a
signature change in some release is a logged skip, not a wrong launch.
"""
from __future__ import annotations

import importlib
import inspect


class Missing(LookupError):
    """A vLLM symbol this step needs is absent from the installed release."""


def resolve(*candidates: str):
    """First importable ``"module:attr.path"`` of `candidates`."""
    tried = []
    for cand in candidates:
        mod_name, _, attr = cand.partition(":")
        try:
            obj = importlib.import_module(mod_name)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError) as exc:
            tried.append(f"{cand} ({type(exc).__name__})")
    raise Missing("not in this vLLM: " + ", ".join(tried))


def resolve_or_none(*candidates: str):
    """:func:`resolve`, or None when no candidate exists in this release."""
    try:
        return resolve(*candidates)
    except Missing:
        return None


def has(*candidates: str) -> bool:
    try:
        resolve(*candidates)
        return True
    except Missing:
        return False


def module_exists(name: str) -> bool:
    """Whether `name` can be imported, without importing it (its parents are imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def params(fn) -> dict:
    return dict(inspect.signature(fn).parameters)


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    """Bind the call to `fn`'s real signature; raise :class:`Missing` naming what differs."""
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise Missing(f"{getattr(fn, '__qualname__', fn)}{inspect.signature(fn)} does not take "
                      f"this call: {exc}") from None


def call(fn, *args, **kwargs):
    """:func:`bind`, then call."""
    bind(fn, *args, **kwargs)
    return fn(*args, **kwargs)
