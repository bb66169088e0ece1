"""kwarm's failure policy (:func:`fail_open`) and the ``kwarm`` logger it writes to: it propagates
to the root (pytest's ``caplog`` sees it), and ``kwarm_ext.config.configure_logging`` fits it into
vLLM's logging configuration (``VLLM_CONFIGURE_LOGGING``, ``VLLM_LOGGING_CONFIG_PATH``; by default
one handler writing vLLM's line format).

What is contained: every ``Exception`` and ``SystemExit``. A ``SystemExit`` inside a kwarm step is
never a request to stop the engine: it comes from code kwarm ran for its own work (issue 59: a
script a manifest made kwarm import parsed ``sys.argv`` and called ``sys.exit(2)``, which ended
the worker), so it is one warning like any error. What propagates: ``KeyboardInterrupt`` (a real
Ctrl-C, or the signal vLLM's shutdown turns into one, must still stop the engine) and
``GeneratorExit``. This holds for every vLLM and Python kwarm supports; it can change only if
kwarm ever runs code whose exit is meant to end the process (none does)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

logger = logging.getLogger("kwarm")  # its handler and level: kwarm_ext.config.configure_logging

CONTAINED = (Exception, SystemExit)  # what fail_open and kwarm's per-item guards turn into one line


@dataclasses.dataclass
class Outcome:
    """What :func:`fail_open` saw: the exception it swallowed, if any."""

    error: BaseException | None = None


@contextlib.contextmanager
def fail_open(what: str, level: int = logging.WARNING):
    """kwarm's one failure policy: nothing raised in the block reaches vLLM. An exception (or a
    ``SystemExit``: :data:`CONTAINED`) becomes one log line naming `what`
    (``kwarm: <what>: <Type>: <message>``) and the yielded :class:`Outcome`'s ``error``; with
    ``KWARM_STRICT=1`` it is re-raised instead. ``KeyboardInterrupt`` always propagates."""
    outcome = Outcome()
    try:
        yield outcome
    except CONTAINED as exc:
        outcome.error = exc
        logger.log(level, "kwarm: %s: %s: %s", what, type(exc).__name__, exc)
        from kwarm_ext import config

        if config.strict():
            raise
