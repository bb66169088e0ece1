"""The learn-and-replay manifest: one JSON file per model deployment.

A manifest lists the Triton compilations that earlier runs of a deployment made after
kwarm's warmup (kernel identity, in-memory cache key, launch options, specialization),
the autotuners' choices and the other JIT surfaces' builds (``surfaces``: FlashInfer's modules,
kwarm_ext/surfaces/), stamped with what makes those keys valid: the Triton, torch and
vLLM versions, the GPU architecture and the TP size. It is written by every TP rank of
every run that learns, so writes are merge-and-deduplicate under an ``fcntl`` lock, and
atomic (a temporary file, then ``os.replace``).

A manifest is untrusted input: it names modules that replay imports and options that reach
the compiler. So: JSON only; a file must be a regular file owned by this user and writable by
no one else; every field is type-checked, and a bad entry is dropped with its reason while
the rest stays usable. Module allow-listing and source checks happen at replay
(kwarm_ext/surfaces/triton/replay.py). This module is the schema and the parser of untrusted text; reading,
locking and writing files is ``kwarm_ext.manifest_files``. It imports neither Triton nor torch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time

from kwarm_ext.escape import printable  # noqa: F401  (kept here: every caller's name for it)
from kwarm_ext.manifest_keys import (  # noqa: F401
    MAX_CONSTANT, _check_attrs_match_key, _check_constants_match_key, _kind, _same_constant)


FORMAT = "kwarm-manifest"
FORMAT_VERSION = 1
# A learned manifest of a large deployment is about 1 MB (a few hundred entries of 1-4 KB); refuse
# absurd files. Issue 59: at 64 MiB one load cost 19.8 s and 368 MB. At 16 MiB the container bound
# below binds first for real entries (about 8 MiB of them): 1.5-2.3 s and 59-71 MB on this project's
# 2-core CPU machine, 16 MiB of plain numbers 0.4 s and 101 MB (README, "Trust model").
MAX_BYTES = 16 << 20
OPTION_VALUE = (type(None), bool, int, float, str)
MAX_KEY = 20_000  # characters of one in-memory key (vLLM's largest, 73 arguments: about 4,000)
MAX_TOKEN_COUNTS = 4096  # learned step sizes kept per manifest (eager_gemm warms them exactly)
MAX_TOKENS = 1 << 20  # a step's token count above this is not a real one
# Bounds that keep a hostile file cheap (a few seconds and under 110 MB at engine start). A learned
# manifest of a published-size model holds a few hundred entries of at most ~250 JSON containers.
MAX_ENTRIES = 20_000  # entries, and autotune choices, kept per manifest
MAX_CONTAINERS = 400_000  # JSON objects and arrays in one file, counted before it is parsed
MAX_PROBLEMS = 50  # dropped items kept with their reason; the rest are counted


class BadManifest(ValueError):
    """The whole file is unusable (unreadable, untrusted, not a manifest, another format)."""


# ---------------------------------------------------------------------------- schema


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What makes the recorded keys valid. Triton and the GPU architecture must match for a
    manifest to be used; the others are kept for the file name and for ``kwarm manifest verify``."""

    triton: str
    arch: str
    torch: str | None = None
    vllm: str | None = None
    tp_size: int | None = None
    model: str | None = None

    def incompatibility(self, current: "Stamp") -> str | None:
        """Why entries stamped `self` cannot serve `current` (None when they can)."""
        if self.triton != current.triton:
            return f"recorded with Triton {printable(self.triton, 40)}, this is Triton {current.triton}"
        if self.arch != current.arch:
            return f"recorded for GPU architecture {printable(self.arch, 40)}, this GPU is {current.arch}"
        return None

    def differences(self, current: "Stamp") -> list[str]:
        """The informational fields that differ (entries are still checked one by one)."""
        return [f"{name} {printable(getattr(self, name), 120)} (now {getattr(current, name)})"
                for name in ("torch", "vllm", "tp_size", "model")
                if getattr(current, name) is not None and getattr(self, name) != getattr(current, name)]


@dataclasses.dataclass(frozen=True)
class _KernelItem:
    """What an entry and an autotune choice share: the kernel they belong to."""

    module: str
    qualname: str
    source_key: str  # JITFunction.cache_key when recorded: a changed source means a stale item

    @property
    def kernel(self) -> str:
        return f"{self.module}:{self.qualname}"

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Entry(_KernelItem):
    """One compilation: replay compiles `spec` under `key` with `launch_options`."""

    key: str  # Triton's in-memory cache key, exactly as a launch computes it
    launch_options: dict  # the options at the end of `key`, in launch order
    spec: dict  # Triton's specialization data (name, signature, constants, attrs), no options

    @property
    def identity(self) -> tuple:
        return (self.module, self.qualname, self.source_key, self.key)

    @property
    def label(self) -> str:
        return f"{self.kernel} [{short_hash(self.key)}]"


@dataclasses.dataclass(frozen=True)
class TuneChoice(_KernelItem):
    """An autotuner's chosen config for one tuning key."""

    key: list  # Autotuner.cache key: the key arguments' values, then argument dtypes
    config: dict  # {"kwargs": {...}, "num_warps", "num_stages", "num_ctas", "maxnreg"}

    @property
    def identity(self) -> tuple:
        return (self.module, self.qualname, self.source_key, json.dumps(self.key))

    @property
    def label(self) -> str:
        return f"{self.kernel} autotune {tuple(self.key)}"


@dataclasses.dataclass
class Manifest:
    stamp: Stamp
    entries: list = dataclasses.field(default_factory=list)  # [Entry]
    autotune: list = dataclasses.field(default_factory=list)  # [TuneChoice]
    problems: list = dataclasses.field(default_factory=list)  # (label, reason) of dropped items, at most MAX_PROBLEMS
    more_problems: int = 0  # dropped items past MAX_PROBLEMS
    token_counts: list = dataclasses.field(default_factory=list)  # step sizes seen, first seen first
    # the other JIT surfaces' items (kwarm_ext/surfaces/): name -> {"version": str | None, "items": [dict]}
    surfaces: dict = dataclasses.field(default_factory=dict)
    # what merges left out, one line each (items past MAX_ENTRIES, another library version's items):
    # a save says it instead of dropping them silently (issue 59)
    left_out: list = dataclasses.field(default_factory=list)

    def merge(self, entries=(), autotune=(), token_counts=(), surfaces=None) -> int:
        """Add what is new (by identity; a key's first recorded choice wins; at most MAX_ENTRIES
        entries and as many autotune choices, the first kept; at most MAX_TOKEN_COUNTS step sizes,
        the first seen kept; a surface's items by its key, those of another library version
        replaced). What is left out is said in ``left_out``. Returns how many were added."""
        added = self._merge_surfaces(surfaces or {})
        known = set(self.token_counts)
        fresh = [m for m in dict.fromkeys(token_counts) if m not in known]
        fresh = fresh[:max(0, MAX_TOKEN_COUNTS - len(self.token_counts))]
        self.token_counts += fresh
        added += len(fresh)
        for field, mine, theirs in (("entries", self.entries, entries), ("autotune choices", self.autotune, autotune)):
            seen, over = {item.identity for item in mine}, 0
            for item in theirs:
                if item.identity not in seen:
                    if len(mine) >= MAX_ENTRIES:  # what load keeps: a save never writes what the next load drops
                        over += 1
                        continue
                    mine.append(item)
                    seen.add(item.identity)
                    added += 1
            if over:
                self.left_out.append(f"{over} new {field} left out: a manifest keeps at most {MAX_ENTRIES}")
        return added

    def _merge_surfaces(self, surfaces: dict) -> int:
        from kwarm_ext import surfaces as registry

        added = 0
        for name, (version, items) in surfaces.items():
            section = self.surfaces.get(name)
            if section is not None and section["version"] != version and section["items"]:
                self.left_out.append(f"{len(section['items'])} {name} items recorded with {name} "
                                     f"{printable(section['version'], 40)} dropped: replaced by those of {printable(version, 40)}")
            if section is None or section["version"] != version:
                section = self.surfaces[name] = {"version": version, "items": []}
            key = registry.get(name).key
            seen = {key(item) for item in section["items"]}
            over = 0
            for item in items:
                if key(item) not in seen:
                    if len(section["items"]) >= registry.MAX_ITEMS:
                        over += 1
                        continue
                    section["items"].append(item)
                    seen.add(key(item))
                    added += 1
            if over:
                self.left_out.append(f"{over} new {name} items left out: a manifest keeps at most {registry.MAX_ITEMS}")
        return added

    def as_json(self) -> dict:
        from kwarm_ext import surfaces as registry

        out = {"format": FORMAT, "version": FORMAT_VERSION, "stamp": dataclasses.asdict(self.stamp),
               "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "entries": [e.as_json() for e in sorted(self.entries, key=lambda e: e.identity)],
               "autotune": [c.as_json() for c in sorted(self.autotune, key=lambda c: c.identity)],
               "token_counts": sorted(self.token_counts)}
        if any(section["items"] for section in self.surfaces.values()):
            out["surfaces"] = {name: {"version": section["version"],
                                      "items": sorted(section["items"], key=registry.get(name).key)}
                               for name, section in sorted(self.surfaces.items()) if section["items"]}
        return out

    def surface_items(self) -> int:
        return sum(len(section["items"]) for section in self.surfaces.values())

    def kernels(self) -> dict:
        """``module:qualname`` -> {"entries": [...], "autotune": [...]}, for listings."""
        out: dict = {}
        for item in self.entries + self.autotune:
            group = out.setdefault(item.kernel, {"entries": [], "autotune": []})
            group["entries" if isinstance(item, Entry) else "autotune"].append(item)
        return dict(sorted(out.items()))


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def module_allowed(module: str, prefixes) -> bool:
    """``pkg.`` allows pkg's submodules; ``pkg`` allows pkg itself and its submodules."""
    for prefix in prefixes:
        if prefix.endswith("."):
            if module.startswith(prefix):
                return True
        elif module == prefix or module.startswith(prefix + "."):
            return True
    return False


# ---------------------------------------------------------------------------- validation

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # fullmatch: "$" lets "\n" through
_WORD = re.compile(r"[a-z0-9_-]{0,32}")
# The only compiler options an entry may carry, each with the values it may take: replay
# compiles with exactly these (Triton's parse_options fills in the rest for this GPU). Anything
# else (``ptx_options``, ``ir_override``, ``extern_libs``, ...) refuses the entry.
LAUNCH_OPTIONS = {
    "num_warps": lambda v: type(v) is int and v in (1, 2, 4, 8, 16, 32),
    "num_stages": lambda v: type(v) is int and 0 <= v <= 16,
    "num_ctas": lambda v: type(v) is int and 1 <= v <= 16,
    "maxnreg": lambda v: v is None or (type(v) is int and 1 <= v <= 256),
    "debug": lambda v: type(v) is bool,
    "enable_fp_fusion": lambda v: type(v) is bool,
    "launch_cooperative_grid": lambda v: type(v) is bool,
    "launch_pdl": lambda v: type(v) is bool,
    "instrumentation_mode": lambda v: type(v) is str and bool(_WORD.fullmatch(v)),
    "waves_per_eu": lambda v: type(v) is int and 0 <= v <= 16,  # ROCm
    "matrix_instr_nonkdim": lambda v: type(v) is int and v in (0, 4, 16, 32),  # ROCm
    "kpack": lambda v: type(v) is int and v in (1, 2),  # ROCm
    "schedule_hint": lambda v: type(v) is str and bool(_WORD.fullmatch(v)),  # ROCm
}


def disallowed_options(options: dict) -> list:
    """Why each of `options` may not reach the compiler ([] when all may)."""
    out = []
    for name, value in options.items():
        check = LAUNCH_OPTIONS.get(name)
        if check is None:
            out.append(f"compiler option {printable(name)} is not allowed")
        elif not check(value):
            out.append(f"compiler option {name}={printable(repr(value))} is out of range")
    return out


def containers(text: str) -> int:
    """An upper bound of the JSON objects and arrays in `text` (strings may hold braces), counted
    without parsing: what load checks against MAX_CONTAINERS, and save before writing."""
    return text.count("{") + text.count("[")


def _document(text: str) -> dict:
    """The manifest's JSON object, its format and version checked; raises :class:`BadManifest`."""
    count = containers(text)
    if count > MAX_CONTAINERS:
        raise BadManifest(f"{count} JSON objects and arrays, more than a manifest holds ({MAX_CONTAINERS})")
    try:
        data = json.loads(text)
    except RecursionError:
        raise BadManifest("nested too deeply to be a manifest") from None
    except ValueError as exc:
        raise BadManifest(f"not valid JSON ({printable(exc)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BadManifest("not a kwarm manifest (no \"format\": \"kwarm-manifest\")")
    if type(data.get("version")) is not int or data["version"] != FORMAT_VERSION:  # true == 1 in Python
        raise BadManifest(f"manifest format version {data.get('version')!r}; this kwarm reads {FORMAT_VERSION}")
    return data


def parse(text: str) -> Manifest:
    """A manifest from JSON text. Raises :class:`BadManifest` when the file as a whole is
    unusable; a malformed entry is dropped into ``problems`` as (label, reason)."""
    data = _document(text)
    manifest = Manifest(_stamp(data.get("stamp")))
    problems = _Problems()
    for field, build in (("entries", _entry), ("autotune", _choice)):
        items = data.get(field, [])
        if not isinstance(items, list):
            raise BadManifest(f"\"{field}\" is not a list")
        if len(items) > MAX_ENTRIES:
            problems.append((field, f"{len(items) - MAX_ENTRIES} past the first {MAX_ENTRIES} dropped"))
            items = items[:MAX_ENTRIES]
        good = []
        for raw in items:
            try:
                good.append(build(raw))
            except (TypeError, ValueError, KeyError, RecursionError) as exc:
                problems.item(raw, exc)
        manifest.merge(**{field: good})
    manifest.merge(token_counts=_token_counts(data.get("token_counts", []), problems))
    from kwarm_ext import surfaces as registry

    manifest.merge(surfaces=registry.parse_sections(data.get("surfaces", {}), problems, printable))
    manifest.problems, manifest.more_problems = problems.kept, problems.more
    return manifest


class _Problems:
    """(label, reason) of dropped items: the first MAX_PROBLEMS kept, the rest counted (a hostile
    file of millions of bad items costs neither memory nor log lines)."""

    def __init__(self):
        self.kept: list = []
        self.more = 0

    def append(self, problem) -> None:
        if len(self.kept) < MAX_PROBLEMS:
            self.kept.append(problem)
        else:
            self.more += 1

    def item(self, raw, exc) -> None:
        """A malformed item: labelled and described only while it is kept."""
        if len(self.kept) < MAX_PROBLEMS:
            self.kept.append((_raw_label(raw), f"malformed: {printable(exc)}"))
        else:
            self.more += 1


def _token_counts(raw, problems: list) -> list:
    """The learned step sizes: ints in 1..MAX_TOKENS, at most MAX_TOKEN_COUNTS; else dropped
    (one problem line)."""
    if not isinstance(raw, list):
        problems.append(("token_counts", "malformed: not a list"))
        return []
    good = [m for m in raw[:MAX_TOKEN_COUNTS] if type(m) is int and 1 <= m <= MAX_TOKENS]
    if len(good) < len(raw):
        problems.append(("token_counts", f"malformed: {len(raw) - len(good)} of {len(raw)} dropped "
                         f"(ints 1..{MAX_TOKENS}, at most {MAX_TOKEN_COUNTS})"))
    return good


def _stamp(raw) -> Stamp:
    if not isinstance(raw, dict):
        raise BadManifest("\"stamp\" is missing or not an object")
    try:
        stamp = Stamp(triton=_str(raw, "triton"), arch=_str(raw, "arch"), torch=_opt(raw, "torch", str),
                      vllm=_opt(raw, "vllm", str), tp_size=_opt(raw, "tp_size", int), model=_opt(raw, "model", str))
    except (TypeError, ValueError) as exc:
        raise BadManifest(f"bad stamp: {exc}") from None
    return stamp


def _entry(raw) -> Entry:
    if not isinstance(raw, dict):
        raise TypeError("an entry is not an object")
    module, qualname = _dotted(raw, "module"), _dotted(raw, "qualname")
    key = _str(raw, "key", limit=MAX_KEY)
    options = raw.get("launch_options")
    if not isinstance(options, dict) or not all(isinstance(k, str) and _option_value(v) for k, v in options.items()):
        raise TypeError("launch_options is not an object of JSON scalars")
    from kwarm_ext.surfaces.triton.compat import read_key

    specialization, key_options = read_key(key)
    if json.loads(json.dumps(key_options)) != options:
        raise ValueError("launch_options disagree with the key")
    refused = disallowed_options(options)
    if refused:
        raise ValueError("; ".join(refused))
    spec = _spec(raw.get("spec"), f"{module}.{qualname}")
    _check_key_matches_signature(key, spec["signature"])
    _check_constants_match_key(specialization, spec)
    _check_attrs_match_key(specialization, spec)
    return Entry(module, qualname, _str(raw, "source_key", limit=256), key, options, spec)


def _spec(spec, full_name: str) -> dict:
    if not isinstance(spec, dict):
        raise TypeError("spec is not an object")
    if spec.get("name") != full_name:
        raise ValueError(f"spec is for {spec.get('name')!r}, not {full_name!r}")
    signature = spec.get("signature")
    if not isinstance(signature, dict) or not all(isinstance(k, str) and _types(v) for k, v in signature.items()):
        raise TypeError("signature is not an object of type names")
    for keys, vals in (("constant_keys", "constant_vals"), ("attrs_keys", "attrs_vals")):
        paths, values = spec.get(keys), spec.get(vals)
        if not isinstance(paths, list) or not isinstance(values, list) or len(paths) != len(values):
            raise TypeError(f"{keys}/{vals} are not two lists of one length")
        if not all(isinstance(p, list) and p and all(type(i) is int and i >= 0 for i in p) for p in paths):
            raise TypeError(f"{keys} are not argument paths")
    return {k: v for k, v in spec.items() if k not in ("options", "key")}


def _check_key_matches_signature(key: str, signature: dict) -> None:
    """The key's argument types, in order, must be the signature's (a corrupt or hand-edited
    entry would otherwise compile one specialization under another's key)."""
    flat = []

    def walk(value):
        if isinstance(value, list):
            for v in value:
                walk(v)
        else:
            flat.append(value)

    walk(list(signature.values()))
    pos = 0
    for type_name in flat:
        found = key.find(f"'{type_name}'", pos)
        if found < 0:
            raise ValueError(f"the key does not match the signature (no {type_name!r} in order)")
        pos = found + len(type_name) + 2


def _choice(raw) -> TuneChoice:
    if not isinstance(raw, dict):
        raise TypeError("an autotune choice is not an object")
    key, config = raw.get("key"), raw.get("config")
    if not isinstance(key, list) or not all(_scalar(v) for v in key):
        raise TypeError("key is not a list of JSON scalars")
    if not isinstance(config, dict) or not isinstance(config.get("kwargs"), dict):
        raise TypeError("config is not an object with kwargs")
    if not all(isinstance(k, str) and _scalar(v) for k, v in config["kwargs"].items()):
        raise TypeError("config kwargs are not JSON scalars")
    for field in ("num_warps", "num_stages", "num_ctas"):
        if type(config.get(field)) is not int:
            raise TypeError(f"config {field} is not an integer")
    if config.get("maxnreg") is not None and type(config.get("maxnreg")) is not int:
        raise TypeError("config maxnreg is not an integer")
    config = {k: config.get(k) for k in ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg")}
    return TuneChoice(_dotted(raw, "module"), _dotted(raw, "qualname"), _str(raw, "source_key", limit=256),
                      key, config)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _option_value(value) -> bool:
    return _scalar(value) or (isinstance(value, (list, tuple)) and all(_option_value(v) for v in value))


def _types(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(_types(v) for v in value))


def _str(raw: dict, field: str, limit: int = 1000) -> str:
    value = raw.get(field)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise TypeError(f"{field} is not a non-empty string")
    return value


def _opt(raw: dict, field: str, kind):
    value = raw.get(field)
    if value is not None and (type(value) is not kind):
        raise TypeError(f"{field} is not {kind.__name__}")
    return value


def is_dotted_name(value: str) -> bool:
    """A dotted name without dunder parts: resolving it walks attributes, and ``__globals__``
    or ``__class__`` would lead anywhere."""
    return bool(_DOTTED.fullmatch(value)) and not any(part.startswith("__") for part in value.split("."))


def _dotted(raw: dict, field: str) -> str:
    value = _str(raw, field, limit=300)
    if not is_dotted_name(value):
        raise ValueError(f"{field} {value!r} is not a dotted Python name without dunders")
    return value


def _raw_label(raw) -> str:
    if isinstance(raw, dict) and isinstance(raw.get("module"), str) and isinstance(raw.get("qualname"), str):
        key = raw.get("key")
        return printable(f"{raw['module']}:{raw['qualname']}", 120) + (
            f" [{short_hash(key)}]" if isinstance(key, str) else "")
    return printable(repr(raw)[:80] if not isinstance(raw, (dict, list)) or len(raw) < 20 else
                     f"a JSON {type(raw).__name__} of {len(raw)} items", 80)
