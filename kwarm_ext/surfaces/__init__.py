"""JIT surfaces: each way code is compiled or built the first time vLLM runs it, behind one interface.

A *surface* is one library's lazy build: Triton compiles a kernel per specialization, FlashInfer
builds a module with nvcc the first time a getter asks for it. Each surface is one module here
and answers four questions (:class:`Surface`):

- **how the monitor counts it**: ``watch(on_built)`` calls ``on_built(Compiled)`` for each
  build in this process until the returned ``stop()``; kwarm's one monitor
  (kwarm_ext/monitor.py) adds up every surface's builds per warmup step;
- **what it records**: ``item(built)``, the JSON a manifest keeps of one build (None: not
  replayable, e.g. arguments that are no plain values);
- **its key**: ``key(item)``, what makes two records the same build (merge deduplicates on it);
- **how it replays**: ``replay(items, version)`` builds or loads them again at the next start.

``parse_item(raw)`` checks one item of an untrusted manifest (a ``ValueError`` drops it with its
reason). Adding a surface is adding a module and naming it in :data:`NAMES`.

Triton (kwarm_ext/surfaces/triton/) is the first surface. Its items carry more than a key (the
specialization, launch options and the autotuners' choices), so its manifest sections
(``entries``, ``autotune``) and its learn and replay modules are its own; the others share one
section, ``surfaces: {name: {"version": ..., "items": [...]}}``.
"""
from __future__ import annotations

import importlib
from typing import Callable

NAMES = ("triton", "flashinfer")  # kwarm_ext.surfaces.<name>, each with a module-level SURFACE
MAX_ITEMS = 4096  # items of one surface kept in a manifest


class Surface:
    """The interface. Subclasses fill in what their library does; nothing here imports one."""

    name = "?"
    label = "?"  # what a log line calls its builds ("Triton kernels", "FlashInfer JIT modules")

    def version(self) -> str | None:
        """The library's version, or None when it is not installed (the surface is then idle)."""
        return None

    def watch(self, on_built: Callable) -> Callable[[], None] | None:
        """Call ``on_built(monitor.Compiled)`` for each build from now on; returns ``stop``, or None
        when this surface cannot be watched here."""
        return None

    def item(self, built) -> dict | None:
        return None

    def key(self, item: dict) -> tuple:
        raise NotImplementedError

    def parse_item(self, raw) -> dict:
        raise ValueError(f"{self.name} items are not kept in the surfaces section")

    def replay(self, items: list, version: str | None) -> "Replayed":
        raise NotImplementedError

    def describe(self, item: dict) -> str:
        return str(self.key(item))


class Replayed:
    """What one surface's replay did: labels done, and (label, reason) of what it skipped."""

    def __init__(self):
        self.done: list = []
        self.skipped: list = []

    def summary(self) -> str:
        text = f"{len(self.done)} replayed"
        return text + (f", {len(self.skipped)} skipped" if self.skipped else "")


_loaded: dict = {}


def get(name: str) -> Surface:
    if name not in _loaded:
        _loaded[name] = importlib.import_module(f"{__name__}.{name}").SURFACE
    return _loaded[name]


def every() -> list:
    return [get(name) for name in NAMES]


def with_sections() -> list:
    """The surfaces whose items live in the manifest's shared ``surfaces`` section."""
    return [s for s in every() if s.name != "triton"]
