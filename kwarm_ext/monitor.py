"""kwarm's one monitor: what still compiles or builds, on every JIT surface.

Each surface (kwarm_ext/surfaces/) says how its builds are watched; :func:`capture` watches all
of them for the length of a block (a warmup step, a replay) and yields one list of
:class:`Compiled` events, whatever the surface. The learner (kwarm_ext/surfaces/triton/learn.py)
watches the same way from the end of kwarm's warmup.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

logger = logging.getLogger("kwarm")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One build: the module that asked for it, what was built, and the surface's key for it."""

    module: str
    name: str
    key: str
    surface: str = "triton"
    payload: object = dataclasses.field(default=None, compare=False, repr=False)  # the surface's own detail
    cache_hit: bool | None = dataclasses.field(default=None, compare=False)  # loaded from a disk cache (None: not said)

    @property
    def kernel(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@contextlib.contextmanager
def capture(surfaces=None):
    """Yield a list that fills with the :class:`Compiled` events of the block, of every surface
    that can be watched here (or of `surfaces`)."""
    from kwarm_ext import surfaces as registry

    events: list[Compiled] = []
    lock = threading.Lock()

    def on_built(event: Compiled) -> None:
        with lock:
            events.append(event)

    stops = []
    for surface in surfaces if surfaces is not None else registry.every():
        try:
            stop = surface.watch(on_built)
        except Exception as exc:  # a surface that cannot be watched counts nothing; the rest still do
            logger.debug("kwarm: cannot watch %s: %s", surface.label, exc)
            stop = None
        if stop is not None:
            stops.append(stop)
    try:
        yield events
    finally:
        for stop in stops:
            with contextlib.suppress(Exception):
                stop()
