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
- **how it replays**: ``replay(items, version, deadline)`` builds or loads them again at the next start
  (``problem(item)``: what ``kwarm manifest verify`` says replay would refuse).

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

    def problem(self, item: dict) -> str | None:
        """Why replay would refuse `item` on this installation, found without importing or building
        anything (``kwarm manifest verify``); None when replay would call it."""
        return None

    def replay(self, items: list, version: str | None, deadline: float | None = None) -> "Replayed":
        """Build or load `items`; what is not done by `deadline` (``time.monotonic()``, replay's
        total bound) goes to ``Replayed.out_of_time``."""
        raise NotImplementedError

    def describe(self, item: dict) -> str:
        return str(self.key(item))


class Replayed:
    """What one surface's replay did: labels done, and (label, reason) of what it skipped."""

    def __init__(self):
        self.done: list = []
        self.skipped: list = []
        self.out_of_time: list = []  # labels the deadline left out (the caller says them in one line)

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


def parse_sections(raw, problems, printable) -> dict:
    """A manifest's ``surfaces`` object, untrusted: name -> (version, items) of the surfaces this
    kwarm knows; a section or an item that does not parse is one problem (label, reason), its text
    escaped by `printable` (``kwarm_ext.manifest.printable``)."""
    if not isinstance(raw, dict):
        problems.append(("surfaces", "malformed: not an object"))
        return {}
    known = {s.name: s for s in with_sections()}
    out = {}
    for name, section in raw.items():
        label = f"surface {printable(name, 40)}"
        if name not in known:
            problems.append((label, "not a surface this kwarm knows: ignored"))
            continue
        version = section.get("version") if isinstance(section, dict) else None
        if not isinstance(section, dict) or not isinstance(section.get("items"), list) or \
                not (version is None or (type(version) is str and len(version) <= 100)):
            problems.append((label, "malformed: not {\"version\": string, \"items\": [...]}"))
            continue
        items, raw_items = [], section["items"]
        if len(raw_items) > MAX_ITEMS:
            problems.append((label, f"malformed: {len(raw_items) - MAX_ITEMS} items past the first {MAX_ITEMS} dropped"))
        for i, item in enumerate(raw_items[:MAX_ITEMS]):
            try:
                items.append(known[name].parse_item(item))
            except (TypeError, ValueError, KeyError, RecursionError) as exc:
                problems.append((f"{name} item {i}", f"malformed: {printable(exc)}"))
        out[name] = (version, items)
    return out
