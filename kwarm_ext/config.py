"""kwarm's configuration: every ``KWARM_*`` environment variable, parsed once, validated.

Nothing else in kwarm reads ``os.environ`` for its own settings. An invalid value gets
one warning that names the variable, the value and the default used instead; it is
never an exception (the engine must start) and never silently ignored.

Precedence: explicit arguments (tests, the CLI) > the environment > the defaults.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Mapping

# name -> one-line documentation; the README's configuration table and `kwarm doctor`
# are made from this table.
VARIABLES = {
    "KWARM_ENABLE": "Turns kwarm on in every process (1/true/yes/on). Unset: kwarm imports nothing.",
    "KWARM_WARMUPS": "Families to run: comma list of names, `*` for all (default), `-name` to exclude. "
                     "Naming a family forces it even where upstream vLLM already warms it.",
    "KWARM_STRICT": "Re-raise kwarm's errors instead of logging them (CI, hard gates). Default off.",
    "KWARM_LOG_LEVEL": "Level of the `kwarm` logger: DEBUG, INFO (default), WARNING, ERROR.",
    "KWARM_REPORT": "Path of a JSON report written at the end of warmup; `{rank}` is replaced by the "
                    "worker's rank (ranks > 0 get `.rank<N>` appended otherwise). Default: none.",
}

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

logger = logging.getLogger("kwarm")


@dataclasses.dataclass(frozen=True)
class WarmupSelection:
    """What ``KWARM_WARMUPS`` asks for. `forced` names run even where upstream covers them."""

    include_all: bool = True
    forced: frozenset = frozenset()
    excluded: frozenset = frozenset()

    def wants(self, name: str) -> bool:
        if name in self.excluded:
            return False
        return self.include_all or name in self.forced

    def describe(self) -> str:
        parts = (["*"] if self.include_all else []) + sorted(self.forced)
        return ",".join(parts + [f"-{n}" for n in sorted(self.excluded)]) or "(none)"


@dataclasses.dataclass(frozen=True)
class Settings:
    enable: bool = False
    warmups: WarmupSelection = WarmupSelection()
    strict: bool = False
    log_level: str = "INFO"
    report: str | None = None
    problems: tuple = ()  # the warnings the parse produced, for doctor and tests

    def as_dict(self) -> dict:
        return {"KWARM_ENABLE": self.enable, "KWARM_WARMUPS": self.warmups.describe(),
                "KWARM_STRICT": self.strict, "KWARM_LOG_LEVEL": self.log_level,
                "KWARM_REPORT": self.report}


def is_enabled(env: Mapping[str, str] | None = None) -> bool:
    """The activation gate, cheap enough for the ``.pth`` path (no logging set-up)."""
    env = os.environ if env is None else env
    return env.get("KWARM_ENABLE", "").strip().lower() in TRUE


def parse(env: Mapping[str, str] | None = None, known_families=None) -> Settings:
    """Parse the ``KWARM_*`` variables of `env`; problems are collected, not raised."""
    env = os.environ if env is None else env
    if known_families is None:
        from kwarm_ext.families import FAMILIES

        known_families = tuple(FAMILIES)
    problems: list[str] = []

    def bad(var, value, default, why):
        problems.append(f"{var}={value!r} is invalid ({why}); using the default {default!r}")

    def boolean(var, default=False):
        raw = env.get(var)
        if raw is None:
            return default
        val = raw.strip().lower()
        if val in TRUE:
            return True
        if val in FALSE:
            return False
        bad(var, raw, "1" if default else "0", "expected one of 1/true/yes/on or 0/false/no/off")
        return default

    level = env.get("KWARM_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        bad("KWARM_LOG_LEVEL", env["KWARM_LOG_LEVEL"], "INFO", f"expected one of {', '.join(LOG_LEVELS)}")
        level = "INFO"

    report = env.get("KWARM_REPORT", "").strip() or None
    if report is not None and os.path.isdir(report):
        bad("KWARM_REPORT", report, None, "it is a directory; give a file path")
        report = None

    return Settings(enable=boolean("KWARM_ENABLE"),
                    warmups=_parse_warmups(env.get("KWARM_WARMUPS"), known_families, bad),
                    strict=boolean("KWARM_STRICT"), log_level=level, report=report,
                    problems=tuple(problems))


def _parse_warmups(raw, known, bad) -> WarmupSelection:
    if raw is None or not raw.strip():
        return WarmupSelection()
    include_all, forced, excluded, unknown = False, set(), set(), []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name = item[1:].strip() if item.startswith("-") else item
        if name == "*":
            include_all = include_all or not item.startswith("-")
            continue
        if name not in known:
            unknown.append(item)
            continue
        (excluded if item.startswith("-") else forced).add(name)
    if unknown:
        bad("KWARM_WARMUPS", raw, "*", f"unknown famil{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(unknown)}; known: {', '.join(known)}")
        if not forced and not include_all:
            include_all = True  # the whole value was unusable: fall back to the default
    if not forced and not include_all:
        include_all = True  # only exclusions were given: "everything but these"
    return WarmupSelection(include_all, frozenset(forced), frozenset(excluded))


_settings: Settings | None = None
_lock = threading.Lock()


def get() -> Settings:
    """The process's settings, parsed on first use; each problem is logged once."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = parse()
            from kwarm_ext.log import configure

            configure(_settings.log_level)
            for problem in _settings.problems:
                logger.warning(problem)
        return _settings


def reset() -> None:
    """Forget the parsed settings (tests; ``kwarm doctor`` after changing the env)."""
    global _settings
    with _lock:
        _settings = None
