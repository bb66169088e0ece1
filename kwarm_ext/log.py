"""kwarm's failure policy (:func:`fail_open`) and the ``kwarm`` logger it writes to: it propagates
to the root (pytest's ``caplog`` sees it), and ``kwarm_ext.config.configure_logging`` fits it into
vLLM's logging configuration (``VLLM_CONFIGURE_LOGGING``, ``VLLM_LOGGING_CONFIG_PATH``; by default
one handler writing vLLM's line format)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

logger = logging.getLogger("kwarm")  # its handler and level: kwarm_ext.config.configure_logging


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
