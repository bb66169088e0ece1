"""The ``kwarm`` logger, formatted like vLLM's own lines (``INFO 11-29 16:02:11 [file.py:42] ...``)."""
from __future__ import annotations

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
