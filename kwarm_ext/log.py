"""The ``kwarm`` logger, formatted like vLLM's own lines (``INFO 11-29 16:02:11 [file.py:42] ...``)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys

_FORMAT = "%(levelname)s %(asctime)s [kwarm %(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"

logger = logging.getLogger("kwarm")


def configure(level: str = "INFO") -> logging.Logger:
    """Give the ``kwarm`` logger one stream handler in vLLM's format (idempotent)."""
    if not any(getattr(h, "_kwarm", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        handler._kwarm = True
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger


@dataclasses.dataclass
class Outcome:
    """What :func:`fail_open` saw: the exception it swallowed, if any."""

    error: Exception | None = None


@contextlib.contextmanager
def fail_open(what: str, level: int = logging.WARNING):
    """kwarm's one failure policy: nothing raised in the block reaches vLLM. An exception
    becomes one log line naming `what` (``kwarm: <what>: <Type>: <message>``) and the
    yielded :class:`Outcome`'s ``error``; with ``KWARM_STRICT=1`` it is re-raised instead."""
    outcome = Outcome()
    try:
        yield outcome
    except Exception as exc:
        outcome.error = exc
        logger.log(level, "kwarm: %s: %s: %s", what, type(exc).__name__, exc)
        from kwarm_ext import config

        if config.strict():
            raise
