"""kwarm's configuration: every ``KWARM_*`` environment variable, parsed once, validated.

Nothing else in kwarm reads ``os.environ`` for its own settings. An invalid value gets
one warning that names the variable, the value and the default used instead; it is
never an exception (the engine must start) and never silently ignored.

Precedence: explicit arguments (tests, the CLI) > the environment > the defaults.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
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
    "KWARM_LEARN": "Record the Triton kernels compiled after kwarm's warmup into this deployment's manifest, "
                   "saved periodically and at exit; the next start replays them. 1/true/yes/on, `all` "
                   "(also record during kwarm's warmup), 0 (default).",
    "KWARM_LEARN_INTERVAL": "Seconds between periodic manifest saves while learning (only when something "
                            "new was recorded); 0 saves at exit only. Default 60.",
    "KWARM_MANIFEST": "Path of the learn-and-replay manifest. Default: "
                      "$XDG_CACHE_HOME/kwarm/ (or ~/.cache/kwarm/), one file per model and versions.",
    "KWARM_BUDGET": "Start time optional warmup work may take per worker: `auto` (default: 2% of the "
                    "time vLLM ran before kwarm's warmup, at least 1 s), `N` seconds, `N%` of that time "
                    "(at least 1 s), or `unlimited`. Work that removes a compile, the token counts this "
                    "deployment stepped at and eager_gemm's kernel grid always run; the budget bounds its fill. "
                    "A family's time on a start where it compiled is given back, not on one where it loaded its "
                    "kernels from Triton's disk cache (Triton's `cache_hit` tells them apart, time where Triton "
                    "does not say; `auto`: up to 14% of that time; the fill keeps at least 1 s after the last of them).",
    "KWARM_COMPILE_PROCESSES": "Processes per worker that compile DeepGEMM's block-FP8 kernels on a cold "
                               "start: `auto` (default: one per core of the worker's share but one, at most "
                               "16) or N (1..1024, at most the worker's cores but one), for a host with more cores.",
    "KWARM_REPLAY_LIMIT": "Seconds the whole replay of a manifest may take per worker (Triton entries, then "
                          "FlashInfer modules); past it the rest is skipped in one line and left to the "
                          "requests. Default 600; 0..86400.",
    "KWARM_ALLOW_MODULES": "Comma list of extra module prefixes whose kernels a manifest may name "
                           "(always allowed: `vllm.`, `kwarm_ext.`). `pkg.` allows pkg's submodules, `pkg` "
                           "allows pkg and its submodules.",
}

# Not a setting: kwarm's front end sets it for a block-FP8 model that runs DeepGEMM, and the engine
# processes that inherit it start deep_gemm's compile processes' parent as kwarm activates there.
DEEP_GEMM_EARLY_ENV = "KWARM_DEEP_GEMM_EARLY"
# Not a setting either: set once kwarm_ext.early_builds started FlashInfer's builds at launch, so that
# the engine's processes, which inherit it, do not start them again.
EARLY_BUILDS_ENV = "KWARM_EARLY_BUILDS"
# Not a setting either: where the engine's processes find FlashInfer's GDN prefill kernels compiled since
# launch (kwarm_ext/early_gdn.py; JSON: folder, summary file, background pid), for the cute_dsl family.
EARLY_CUTE_DSL_ENV = "KWARM_EARLY_CUTE_DSL"
# sys.argv[0]'s base names where a process may be ``vllm serve`` starting (``-m``: ``python -m``,
# its module still being located): activation looks before it imports kwarm_ext.early_builds,
# which reads the whole command line (``early_builds.serve_launch``).
SERVE_PROGRAMS = ("vllm", "main.py", "api_server.py", "-m")

# Modules whose kernels a manifest may name without KWARM_ALLOW_MODULES (a manifest is
# untrusted input: replay imports the modules it names).
DEFAULT_ALLOWED_MODULES = ("vllm.", "kwarm_ext.")
LEARN_MODES = ("off", "after", "all")  # KWARM_LEARN: 0 -> off, 1 -> after kwarm's warmup, all

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

logger = logging.getLogger("kwarm")
_LOG_FORMAT = "%(levelname)s %(asctime)s [kwarm %(filename)s:%(lineno)d] %(message)s"  # vLLM's layout
_LOG_DATEFMT = "%m-%d %H:%M:%S"
_STREAMS = {"ext://sys.stdout": "stdout", "ext://sys.stderr": "stderr"}  # VLLM_LOGGING_STREAM's values


def configure_logging(level: str = "INFO", env: Mapping[str, str] | None = None) -> logging.Logger:
    """Fit the ``kwarm`` logger into vLLM's logging configuration (idempotent; the environment
    is read again on each call).

    Why: kwarm's lines belong beside vLLM's, in vLLM's format, yet whatever configures
    vLLM's logging must rule kwarm's too, and pytest's ``caplog`` (a handler on the root
    logger) must see them. A handler of kwarm's own on a logger that does not propagate
    (as vLLM does for ``vllm``) would print in every case and hide the records from the root.

    How: the ``kwarm`` logger propagates (Python's default; this never changes it), and which
    handler it gets depends on vLLM's documented variables, read here without importing vLLM
    (vLLM applies them when it is first imported, before or after this call):

    - ``VLLM_CONFIGURE_LOGGING=0``: none (the application's configuration rules, as vLLM
      adds none to ``vllm``); `level` is set only when ``KWARM_LOG_LEVEL`` is.
    - ``VLLM_LOGGING_CONFIG_PATH``, a dictConfig JSON whose ``loggers`` name ``kwarm``: none,
      and neither level nor propagation is touched: that configuration wins.
    - otherwise, as vLLM's default: one stream handler in vLLM's line format
      (``VLLM_LOGGING_PREFIX``, then ``LEVEL mm-dd HH:MM:SS [kwarm file.py:line] message``),
      on ``VLLM_LOGGING_STREAM`` (stdout unless ``ext://sys.stderr``), and `level`
      (``KWARM_LOG_LEVEL``). It writes a record only while the root logger has no handler of
      the application's: where the application (or pytest) put handlers on the root, the
      propagated record is theirs, so no line is printed twice. In a vLLM process the root has
      none (vLLM configures ``vllm`` only), or only what a library's bare ``logging.basicConfig()``
      made: those do not get kwarm's records (:func:`_past_default_root`), as they do not get vLLM's.
    """
    env = os.environ if env is None else env
    owner = logging_owner(env)
    for handler in [h for h in logger.handlers if getattr(h, "_kwarm", False)]:
        logger.removeHandler(handler)  # a later call with another environment starts over
    logger.removeFilter(_past_default_root)
    if owner == "kwarm":
        stream = getattr(sys, _STREAMS.get(env.get("VLLM_LOGGING_STREAM", "").strip(), "stdout"))
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(env.get("VLLM_LOGGING_PREFIX", "") + _LOG_FORMAT, _LOG_DATEFMT))
        handler.addFilter(_root_has_no_handler)
        handler._kwarm = True
        logger.addHandler(handler)
        logger.addFilter(_past_default_root)
    if owner == "kwarm" or (owner == "application" and "KWARM_LOG_LEVEL" in env):
        logger.setLevel(level)
    return logger


def logging_owner(env: Mapping[str, str] | None = None) -> str:
    """Who configures the ``kwarm`` logger under `env` (see :func:`configure_logging`):
    ``application`` (``VLLM_CONFIGURE_LOGGING=0``), ``file`` (``VLLM_LOGGING_CONFIG_PATH``
    configures ``kwarm``) or ``kwarm`` (vLLM's default configuration, kwarm's handler)."""
    env = os.environ if env is None else env
    raw = env.get("VLLM_CONFIGURE_LOGGING", "1").strip()
    try:
        configure = int(raw) != 0  # vLLM's own reading: bool(int(...))
    except ValueError:
        configure = raw.lower() not in FALSE
    if not configure:
        return "application"
    path = env.get("VLLM_LOGGING_CONFIG_PATH", "").strip()
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                loggers = json.load(file).get("loggers") or {}
            if "kwarm" in loggers:
                return "file"
        except (OSError, ValueError, AttributeError):
            pass  # vLLM refuses such a file itself, when it is imported
    return "kwarm"


def _basic_default(handler: logging.Handler) -> bool:
    """Whether a root handler is what ``logging.basicConfig()`` makes with its defaults (a stream
    handler in ``LEVEL:name:message``): in vLLM's engine process a library makes one (seen on the
    H100 with vLLM 0.33.0: kwarm's lines there came out as ``INFO:kwarm:...``, without time or
    place), and vLLM's own lines never reach it (``vllm`` does not propagate)."""
    formatter = getattr(handler, "formatter", None)
    return type(handler) is logging.StreamHandler and getattr(formatter, "_fmt", None) in (None, logging.BASIC_FORMAT)


def _root_has_no_handler(record: logging.LogRecord) -> bool:
    """kwarm's handler writes a record only where the root has no handler of the application's."""
    return all(_basic_default(h) for h in logging.getLogger().handlers)


def _past_default_root(record: logging.LogRecord) -> bool:
    """The ``kwarm`` logger's filter: where the root's handlers are all ``basicConfig`` defaults, the
    record goes to kwarm's handler alone, in vLLM's format, as vLLM's own lines do, and not to them."""
    if not logging.getLogger().handlers or not _root_has_no_handler(record):
        return True
    for handler in logger.handlers:
        if getattr(handler, "_kwarm", False) and record.levelno >= handler.level:
            handler.handle(record)
    return False


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
    learn: str = "off"  # one of LEARN_MODES
    learn_interval: float = 60.0
    manifest: str | None = None
    allow_modules: tuple = ()  # extra prefixes from KWARM_ALLOW_MODULES
    budget: tuple = ("percent", 2.0)  # KWARM_BUDGET: (percent|seconds|unlimited, value); DEFAULT_BUDGET
    compile_processes: int | None = None  # KWARM_COMPILE_PROCESSES; None: auto
    replay_limit: float = 600.0  # KWARM_REPLAY_LIMIT: seconds for a whole replay (DEFAULT_REPLAY_LIMIT)
    problems: tuple = ()  # the warnings the parse produced, for doctor and tests

    @property
    def allowed_modules(self) -> tuple:
        """Module prefixes a manifest may name: the defaults, then KWARM_ALLOW_MODULES."""
        return DEFAULT_ALLOWED_MODULES + self.allow_modules

    def as_dict(self) -> dict:
        return {"KWARM_ENABLE": self.enable, "KWARM_WARMUPS": self.warmups.describe(),
                "KWARM_STRICT": self.strict, "KWARM_LOG_LEVEL": self.log_level,
                "KWARM_REPORT": self.report, "KWARM_LEARN": self.learn,
                "KWARM_LEARN_INTERVAL": self.learn_interval, "KWARM_MANIFEST": self.manifest,
                "KWARM_ALLOW_MODULES": ",".join(self.allowed_modules),
                "KWARM_BUDGET": _describe_budget(self.budget),
                "KWARM_COMPILE_PROCESSES": self.compile_processes or "auto",
                "KWARM_REPLAY_LIMIT": self.replay_limit}


def is_enabled(env: Mapping[str, str] | None = None) -> bool:
    """The activation gate, cheap enough for the ``.pth`` path (no logging set-up)."""
    env = os.environ if env is None else env
    return env.get("KWARM_ENABLE", "").strip().lower() in TRUE


def parse(env: Mapping[str, str] | None = None, known_families=None) -> Settings:
    """Parse the ``KWARM_*`` variables of `env`; problems are collected, not raised."""
    env = os.environ if env is None else env
    if known_families is None:
        from kwarm_ext.families import selectable

        known_families = selectable()
    problems: list[str] = []

    def bad(var, value, default, why, in_force=None, using=None):
        """One problem line naming the value in force: the default, or (`in_force`) what of the value was
        kept, or (`using`) what happens instead, in words."""
        if using is None:
            using = f"using the default {default!r}" if in_force is None else f"using {in_force!r}"
        from kwarm_ext.escape import printable  # a name from the variable may hold a newline (issue 59)

        problems.append(printable(f"{var}={value!r} is invalid ({why}); {using}", 2000))

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

    return Settings(enable=boolean("KWARM_ENABLE"),
                    warmups=_parse_warmups(env.get("KWARM_WARMUPS"), known_families, bad),
                    strict=boolean("KWARM_STRICT"), log_level=level,
                    report=_parse_file_path(env, "KWARM_REPORT", bad),
                    learn=_parse_learn(env.get("KWARM_LEARN"), bad),
                    learn_interval=_parse_interval(env.get("KWARM_LEARN_INTERVAL"), bad),
                    manifest=_parse_file_path(env, "KWARM_MANIFEST", bad),
                    allow_modules=_parse_allow_modules(env.get("KWARM_ALLOW_MODULES"), bad),
                    budget=_parse_budget(env.get("KWARM_BUDGET"), bad),
                    compile_processes=_parse_processes(env.get("KWARM_COMPILE_PROCESSES"), bad),
                    replay_limit=_parse_replay_limit(env.get("KWARM_REPLAY_LIMIT"), bad),
                    problems=tuple(problems))


def _parse_file_path(env, var, bad) -> str | None:
    value = env.get(var, "").strip() or None
    if value is not None:
        value = os.path.expanduser(value)  # "~/m.json" is the home's, as in a shell
    instead = "no report is written" if var == "KWARM_REPORT" else "using the default manifest path"
    if value is not None and os.path.isdir(value):
        bad(var, value, None, "it is a directory; give a file path", using=instead)
        return None
    folder = os.path.dirname(os.path.abspath(value)) if value is not None else None
    if folder is not None and not os.path.isdir(folder):
        # kwarm creates a missing folder when it writes; say so now if it cannot
        ancestor = folder
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
            bad(var, value, None, f"its folder {folder} does not exist and cannot be created in {ancestor}",
                using=instead)
            return None
    return value


def _parse_learn(raw, bad) -> str:
    if raw is None:
        return "off"
    val = raw.strip().lower()
    if val in TRUE:
        return "after"
    if val in FALSE:
        return "off"
    if val == "all":
        return "all"
    bad("KWARM_LEARN", raw, "0", "expected 1/true/yes/on, all, or 0/false/no/off")
    return "off"


MAX_LEARN_INTERVAL = 86400.0  # a day; larger values overflow the saver thread's timer


def _parse_interval(raw, bad) -> float:
    if raw is None or not raw.strip():
        return 60.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value <= MAX_LEARN_INTERVAL):
        bad("KWARM_LEARN_INTERVAL", raw, "60", f"expected a number of seconds from 0 to {MAX_LEARN_INTERVAL:g}")
        return 60.0
    return value


# The whole replay's bound (issue 59: a per-entry bound alone let 20,000 slow entries hold a start
# for about 62 hours). A learned manifest of a published-size model replays in 1-3 minutes on a
# cold Triton cache at 16 threads, and FlashInfer's nvcc builds take about 45 s each.
DEFAULT_REPLAY_LIMIT = 600.0
MAX_REPLAY_LIMIT = 86400.0


def _parse_replay_limit(raw, bad) -> float:
    if raw is None or not raw.strip():
        return DEFAULT_REPLAY_LIMIT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value <= MAX_REPLAY_LIMIT):
        bad("KWARM_REPLAY_LIMIT", raw, f"{DEFAULT_REPLAY_LIMIT:g}",
            f"expected a number of seconds from 0 to {MAX_REPLAY_LIMIT:g}")
        return DEFAULT_REPLAY_LIMIT
    return value


DEFAULT_BUDGET = ("percent", 2.0)  # kwarm_ext/budget.py says why 2%
MAX_BUDGET_S = 86400.0


def _parse_budget(raw, bad) -> tuple:
    """``auto``, ``N``/``Ns`` seconds, ``N%`` or ``unlimited`` -> (kind, value)."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        return DEFAULT_BUDGET
    text = raw.strip().lower()
    if text in ("unlimited", "none", "inf"):
        return ("unlimited", None)
    kind, number = ("percent", text[:-1]) if text.endswith("%") else ("seconds", text.removesuffix("s"))
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    top = 1000.0 if kind == "percent" else MAX_BUDGET_S
    if not 0 <= value <= top:
        bad("KWARM_BUDGET", raw, "auto", f"expected auto, unlimited, seconds (0..{top:g}) or a percentage (0..1000%)")
        return DEFAULT_BUDGET
    return (kind, value)


MAX_COMPILE_PROCESSES = 1024


def _parse_processes(raw, bad) -> int | None:
    """``auto`` (None) or a count of processes, 1..MAX_COMPILE_PROCESSES."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_COMPILE_PROCESSES:
        bad("KWARM_COMPILE_PROCESSES", raw, "auto", f"expected auto or a whole number from 1 to {MAX_COMPILE_PROCESSES}")
        return None
    return value


def _describe_budget(budget: tuple) -> str:
    kind, value = budget
    if budget == DEFAULT_BUDGET:
        return "auto"
    return "unlimited" if kind == "unlimited" else f"{value:g}{'%' if kind == 'percent' else ' s'}"


_MODULE_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\.?")  # fullmatch


def _parse_allow_modules(raw, bad) -> tuple:
    """Extra module prefixes; invalid items are dropped (one warning), the valid ones kept."""
    if raw is None:
        return ()
    items = [part.strip() for part in raw.split(",") if part.strip()]
    good = tuple(item for item in items if _MODULE_PREFIX.fullmatch(item))
    wrong = [item for item in items if item not in good]
    if wrong:
        if good:
            bad("KWARM_ALLOW_MODULES", raw, "", f"not module names: {', '.join(wrong)}", in_force=",".join(good))
        else:
            bad("KWARM_ALLOW_MODULES", raw, "", f"not module names: {', '.join(wrong)}")
    return good


def _parse_warmups(raw, known, bad) -> WarmupSelection:
    if raw is None or not raw.strip():
        return WarmupSelection()
    include_all, forced, excluded, unknown, none = False, set(), set(), [], False
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name = item[1:].strip() if item.startswith("-") else item
        if name == "*":
            if item.startswith("-"):
                none = True  # "-*": no family, but those named
            else:
                include_all = True
            continue
        if name not in known:
            unknown.append(item)
            continue
        (excluded if item.startswith("-") else forced).add(name)
    usable = forced or include_all or excluded or none
    if not forced and not include_all:
        include_all = True  # only exclusions were given ("everything but these"), or nothing usable
    if none:
        excluded |= set(known) - forced
    selection = WarmupSelection(include_all, frozenset(forced), frozenset(excluded))
    if unknown:
        why = f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; known: {', '.join(known)}"
        if usable:
            bad("KWARM_WARMUPS", raw, "*", why, in_force=_selection_text(selection, known))
        else:
            bad("KWARM_WARMUPS", raw, "*", why)
    return selection


def _selection_text(selection, known) -> str:
    """The value that selects what `selection` does: "*,-a", "a,b", or the names it keeps."""
    kept = [n for n in known if selection.wants(n)]
    if selection.include_all and len(selection.excluded) <= len(known) / 2:
        return ",".join(["*", *(f"-{n}" for n in sorted(selection.excluded))])
    return ",".join(sorted(set(kept) | set(selection.forced))) or "-*"


_settings: Settings | None = None
_lock = threading.Lock()
_quiet = False  # `kwarm doctor` reports the problems itself, once (issue 63)


def quiet_problems() -> None:
    """Parse without logging the problems: for ``kwarm doctor``, which prints each one once."""
    global _quiet
    _quiet = True


def get() -> Settings:
    """The process's settings, parsed on first use; each problem is logged once."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = parse()
            configure_logging(_settings.log_level)
            for problem in () if _quiet else _settings.problems:
                logger.warning(problem)
        return _settings


def reset() -> None:
    """Forget the parsed settings (tests; ``kwarm doctor`` after changing the env)."""
    global _settings
    with _lock:
        _settings = None


def strict() -> bool:
    """``KWARM_STRICT``, read in this one place for every failure path; False when the
    settings cannot be read (a failure path must not fail again)."""
    try:
        return get().strict
    except Exception:
        return False
