"""kwarm's ``.pth`` door, opened only where vLLM (or a library kwarm hooks) is imported.

Installed as a top-level module beside ``kwarm_ext`` (pyproject.toml's ``py-modules``) for the one
line of ``kwarm-ext.pth``, which Python's ``site`` runs at every interpreter start: where
``KWARM_ENABLE`` is truthy that line imports this module, and nothing else of kwarm, and calls
:func:`install`. That puts one finder first on ``sys.meta_path``; it finds nothing, and at the
first import of one of :data:`TRIGGERS` it takes itself out and calls
``kwarm_ext.activate(".pth")`` before that package's own code runs, so every import hook kwarm
registers (vLLM's modules, Triton's JIT and cache manager, FlashInfer's JIT) is in place as when
the door opened at start-up. A Python process that imports none of them (a health check, a
script) imports only this file: no ``kwarm_ext``, wrapt, torch or vLLM (issue 63, item 6).

This module imports nothing (``sys`` is loaded before ``site``) and must stay that small: it is on
the start-up path of every Python process of an environment with ``KWARM_ENABLE=1``.
"""
import sys

# The top-level packages whose import needs kwarm active first: the modules of patches.PATCHES
# and of its other import hooks (tests/test_doors.py checks that this list covers them).
TRIGGERS = frozenset(("vllm", "triton", "flashinfer"))

_opened = False


class KwarmDoor:
    """A ``sys.meta_path`` finder that finds nothing; the first import of a trigger opens the door."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TRIGGERS:
            return None
        # importlib calls finders under its global import lock: one thread at a time gets here
        if not _take_out():
            return None
        open_door()
        return _find_elsewhere(fullname, path, target)

    def __repr__(self):
        return "<kwarm's .pth door: activates kwarm at the first import of %s>" % ", ".join(sorted(TRIGGERS))


DOOR = KwarmDoor()


def install() -> None:
    """Arm the door (the ``.pth`` line, once KWARM_ENABLE is truthy); idempotent, as ``site`` can
    run the line twice (a venv's lib64 -> lib link). Where a trigger is already imported, open it now."""
    if _opened or DOOR in sys.meta_path:
        return
    if any(name in sys.modules for name in TRIGGERS):
        open_door()
        return
    sys.meta_path.insert(0, DOOR)


_warned = False


def invalid(raw: str) -> None:
    """The ``.pth`` line's one warning for a ``KWARM_ENABLE`` that is neither true nor false (kwarm
    stays off): once per process (``site`` can run the line twice), and not in ``kwarm doctor``,
    which reports it itself (each problem once)."""
    global _warned
    if _warned:
        return
    _warned = True
    if kwarm_command("doctor"):
        return
    sys.stderr.write("WARNING kwarm: KWARM_ENABLE=%r is not 1/true/yes/on or 0/false/no/off: kwarm is off\n" % (raw,))


def kwarm_command(word: str, argv=None) -> bool:
    """Whether this process is kwarm's own CLI (``kwarm ...`` or ``python -m kwarm_ext.cli ...``)
    with `word` among its arguments (``doctor``, ``--json``). Read from ``sys.orig_argv`` (the
    interpreter's own, ``-m`` included) and ``sys.argv``; kwarm_ext.activation asks here too."""
    if argv is None:
        argv = [*getattr(sys, "orig_argv", ()), *(getattr(sys, "argv", None) or ())]
    return word in argv and any(a == "kwarm_ext.cli" or str(a).rsplit("/", 1)[-1] == "kwarm" for a in argv)


def armed() -> bool:
    """Whether the door waits in this process (``kwarm doctor``, the tests)."""
    return DOOR in sys.meta_path


def opened() -> bool:
    """Whether the door has called ``kwarm_ext.activate`` in this process."""
    return _opened


def _take_out() -> bool:
    try:
        sys.meta_path.remove(DOOR)
    except ValueError:
        return False
    return True


def open_door() -> None:
    """``kwarm_ext.activate(".pth")``, once. It logs its own failures and raises only under
    KWARM_STRICT; an import that fails here (kwarm_ext gone, this file left behind) is one
    warning, and the user's import goes on."""
    global _opened
    if _opened:
        return
    _opened = True
    try:
        import kwarm_ext
    except Exception as exc:
        sys.stderr.write("WARNING kwarm: the .pth door could not import kwarm_ext, kwarm is off in this "
                         "process: %r\n" % (exc,))
        return
    kwarm_ext.activate(".pth")


def _find_elsewhere(fullname, path, target):
    """The spec the rest of ``sys.meta_path`` finds: importlib's own search, now that the door has
    taken itself out (the triggers are top-level packages: no parent path to pass)."""
    import importlib.util

    return importlib.util.find_spec(fullname)
