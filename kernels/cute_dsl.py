"""Warmup family ``cute_dsl``: CuTe DSL kernels that FlashInfer and vLLM keep in memory only, saved
once vLLM has captured its CUDA graphs and loaded before the next start's profile run.

Why:
    Two libraries compile CuTe DSL kernels into dicts of their own and never to disk, so every
    start compiles them again, warm restarts included (:data:`SOURCES`):
    - FlashInfer's Hopper GDN prefill (``flashinfer.gdn_prefill.chunk_gated_delta_rule`` on SM90,
      ``gdn_kernels/delta_rule_dsl``) goes through ``cached_compile``, whose cache is
      ``custom_compile_cache._in_mem_compile_cache``; FlashInfer's other CuTe DSL kernels use its
      disk cache (``flashinfer.jit.cute_dsl_core.JitSpecCuteDsl``), these do not;
    - vLLM's MoE router GEMM (``ll_bf16_gemm``, ``gate_linear.py``), which vLLM's ``cutedsl_warmup``
      compiles at every start.
    Measured with ``vllm serve`` of a tiny Qwen3-Next on an H100 (vLLM 0.33.0, FlashInfer
    0.7.2.post1, BENCHMARKS.md's ``serve-restart/``): 7 GDN prefill kernels, inside vLLM's profile
    run, and 16 router GEMM kernels compiled on the cold start and again on the warm restart, in
    both servers.

How:
    - after capture (``after_capture``): every kernel of those dicts that this process compiled
      is exported with the compiled function's own ``export_to_c`` (what FlashInfer's disk cache
      writes: both are compiled for TVM FFI), one ``.o`` per kernel with its dict and key beside
      it as JSON, into a folder of this deployment next to its manifest
      (``<manifest>.cute_dsl/<source>/``), in a subfolder per compiler stack (:func:`stack`: GPU
      arch, every ``nvidia-cutlass-dsl*`` distribution as FlashInfer fingerprints them, the
      library's version and its sources). A stack's subfolder replaces the others.
    - before vLLM's profile run (``ahead``): each saved kernel is loaded with
      ``cutlass.cute.runtime.load_module(..., enable_tvm_ffi=True)`` (as FlashInfer loads its disk
      cache) into its dict under its key, where the library looks before it compiles.

    Keys are written without pickle: tuples, ``None``, booleans, integers, finite floats and
    strings as JSON, torch dtypes by name, classes by ``module:qualname``, resolved only in
    FlashInfer's ``gdn_kernels`` package, CUTLASS's DSL (``cutlass``) and ``builtins`` (a kernel
    whose key holds anything else is not saved). The ``.o`` files are native code, like
    FlashInfer's JIT workspace and Triton's cache: kwarm loads only files of its own folder that
    this user (or root) owns and nobody else can write, for the same stack; each refusal is one line.

Upstream (vLLM 0.33, FlashInfer 0.7.2.post1): none persists these dicts; vLLM's ``cutedsl_warmup``
compiles its registered CuTe DSL kernels again at every start.

Remove when:
    FlashInfer's SM90 GDN prefill goes through its CuTe DSL disk cache (``JitSpecCuteDsl``) and vLLM
    persists its CuTe DSL warmup; each source can go on its own.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import time

from kwarm_ext.config import EARLY_CUTE_DSL_ENV
from kwarm_ext.families import Plan, Step

logger = logging.getLogger("kwarm")


@dataclasses.dataclass(frozen=True)
class Source:
    """One library's CuTe DSL kernels kept in dicts in memory only."""

    name: str  # its subfolder, and what the report calls it
    label: str  # what a log line calls its kernels
    module: str  # the module holding the dicts
    dicts: tuple  # attribute paths from that module to each dict
    dist: str  # the distribution whose version a saved kernel is valid for

    def caches(self, module) -> dict:
        """Attribute path -> the dict, for those `module` has."""
        out = {}
        for path in self.dicts:
            found = module
            for part in path.split("."):
                found = getattr(found, part, None)
            if isinstance(found, dict):
                out[path] = found
        return out


SOURCES = (
    # FlashInfer 0.7.2: cached_compile's dict (custom_compile_cache.py), keyed by the kernel object's
    # compile key (its class's MRO and its attributes) and the compile options.
    Source("flashinfer_gdn", "FlashInfer GDN prefill", "flashinfer.gdn_kernels.delta_rule_dsl.custom_compile_cache",
           ("_in_mem_compile_cache",), "flashinfer-python"),
    # vLLM 0.33: the MoE router's bf16 GEMM (gate_linear.py), two module-level LLBf16Gemm objects
    # (the one-row one prefetches weights under PDL), each with a dict per backend, keyed by plain
    # values (M, K, block size, output dtype; split-k, stages, dtype). Compiled by vLLM's
    # cutedsl_warmup at every start.
    Source("vllm_router_gemm", "vLLM router GEMM", "vllm.model_executor.kernels.linear.cute_dsl.ll_bf16",
           ("ll_bf16_gemm_kernel._compiled_cache", "ll_bf16_gemm_kernel._splitk_cache",
            "ll_bf16_gemm_c1_pdl_kernel._compiled_cache", "ll_bf16_gemm_c1_pdl_kernel._splitk_cache"), "vllm"),
)
# Where a class in a saved key may come from: the package whose kernels these are, the CuTe DSL's
# types and options, and object.
CLASS_MODULES = ("flashinfer.gdn_kernels.", "cutlass.")
CLASS_TOP_MODULES = ("builtins", "cutlass")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,15}")
MAX_KERNELS = 256  # saved kernels of one source one start loads
MAX_KEY_BYTES = 64 << 10
MAX_OBJECT_BYTES = 512 << 20
MAX_DEPTH = 8
SUBFOLDER = re.compile(r"[0-9a-f]{16}")

_on_disk: dict = {}  # (dict path, key) -> the function this process loaded or saved for it (not saved again)


# ---------------------------------------------------------------------------- keys


def encode(value, depth: int = 0):
    """A dict key of FlashInfer's CuTe DSL cache as JSON (see the module's doc); ValueError for a
    part it cannot write."""
    import torch

    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"not a finite float: {value!r}")
        return value
    if type(value) is tuple:
        return [encode(v, depth + 1) for v in value]
    if isinstance(value, torch.dtype):
        return {"torch.dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        text = f"{value.__module__}:{value.__qualname__}"
        resolve_class(text)  # what load would refuse is not written
        return {"class": text}
    raise ValueError(f"a {type(value).__name__} cannot be saved in a key")


def decode(raw, depth: int = 0):
    """The key `encode` wrote, from untrusted JSON; ValueError for anything else."""
    import torch

    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if raw is None or isinstance(raw, (bool, str, int)):
        return raw
    if isinstance(raw, float):
        if not math.isfinite(raw):
            raise ValueError("not a finite float")
        return raw
    if isinstance(raw, list):
        return tuple(decode(v, depth + 1) for v in raw)
    if isinstance(raw, dict) and len(raw) == 1:
        (tag, text), = raw.items()
        if tag == "torch.dtype" and isinstance(text, str) and NAME.fullmatch(text):
            dtype = getattr(torch, text, None)
            if isinstance(dtype, torch.dtype):
                return dtype
            raise ValueError(f"not a torch dtype: {text!r}")
        if tag == "class" and isinstance(text, str):
            return resolve_class(text)
    raise ValueError(f"not a key part: {str(raw)[:80]!r}")


def resolve_class(text: str) -> type:
    """The class ``module:qualname`` names, from the modules :data:`CLASS_MODULES` allows (a module
    of theirs not imported yet is imported: library code of FlashInfer's or CUTLASS's); ValueError
    for any other name."""
    module_name, _, qualname = text.partition(":")
    if not (NAME.fullmatch(module_name) and NAME.fullmatch(qualname)):
        raise ValueError(f"not a class name: {text[:120]!r}")
    if module_name not in CLASS_TOP_MODULES and not module_name.startswith(CLASS_MODULES):
        raise ValueError(f"class {text[:120]!r} is not FlashInfer's gdn_kernels', CUTLASS's or a builtin")
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.find_spec(module_name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"class {text[:120]!r}: no module {module_name!r} of Python source")
        module = importlib.import_module(module_name)
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type) or f"{found.__module__}:{found.__qualname__}" != text:
        raise ValueError(f"no class {text[:120]!r}")
    return found


def symbol(raw_key, dict_path: str) -> str:
    """The exported function's name (and the files' stem) of a key in one dict: a digest of both."""
    text = json.dumps([dict_path, raw_key], sort_keys=True)
    return "kwarm_cute_" + hashlib.sha256(text.encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------- where


def stack(source: Source, capability=None) -> dict:
    """What a saved kernel of `source` is valid for: GPU arch (this process's GPU, or `capability`),
    the CuTe DSL compiler stack (every installed ``nvidia-cutlass-dsl*`` distribution, as
    FlashInfer's own disk cache fingerprints it), the library's version and a digest of the sources
    of its dicts' package (found, not imported)."""
    import importlib.metadata as md

    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    major, minor = capability
    return {"arch": f"sm_{major}{minor}{'a' if major >= 9 else ''}", "cute_dsl": cute_dsl_stack(),
            source.dist: md.version(source.dist), "source_sha256": source_digest(source.module)}


@functools.cache
def cute_dsl_stack() -> str:
    """Every installed ``nvidia-cutlass-dsl*`` distribution and version (one scan of the installed
    distributions per process: each source's load and save ask)."""
    import importlib.metadata as md

    dsl = sorted(f"{d.metadata['Name']}=={d.version}" for d in md.distributions()
                 if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl"))
    return ";".join(dsl) or "unknown"


def source_digest(module_name: str) -> str:
    """sha256 of the ``.py`` files beside `module_name`'s file, found without importing it."""
    digest = hashlib.sha256()
    spec = importlib.util.find_spec(module_name)
    if spec is not None and spec.origin:
        folder = os.path.dirname(spec.origin)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                digest.update(name.encode())
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def folder_for(view) -> str:
    """This deployment's folder: its manifest's path (``KWARM_MANIFEST``, else one per model and
    versions) with ``.cute_dsl`` for ``.json``."""
    from kwarm_ext.surfaces.triton.learn import deployment

    _, manifest = deployment(view)
    return os.path.splitext(manifest)[0] + ".cute_dsl"


def subfolder(base: str, meta: dict) -> str:
    return os.path.join(base, hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16])


def trusted(path: str) -> str | None:
    """Why `path` may not be loaded (None when it may): kwarm's manifest rules (a regular file,
    or a folder, of this user's or root's that nobody else can write, reached through no link of
    another user's)."""
    from kwarm_ext import manifest_files

    link = manifest_files.foreign_link(path)
    if link:
        return f"{link} is a link of another user's"
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    if stat.S_ISDIR(st.st_mode):  # judged as a file would be, but for its type
        st = os.stat_result((stat.S_IFREG | stat.S_IMODE(st.st_mode),) + tuple(st)[1:])
    return manifest_files.untrusted_reason(st)


# ---------------------------------------------------------------------------- load and save


def load(where: str, caches: dict) -> dict:
    """Load the kernels saved under `where` into `caches` (attribute path -> the library's dict, as
    :meth:`Source.caches` gives them); a key its dict holds already is left. Returns {"loaded": n,
    "refused": [(file, reason)], "seconds": s}."""
    import cutlass.cute as cute

    t0 = time.perf_counter()
    out = {"loaded": 0, "refused": []}
    names = sorted(n for n in os.listdir(where) if n.endswith(".json") and n != "meta.json")
    if len(names) > MAX_KERNELS:
        out["refused"].append((f"{len(names) - MAX_KERNELS} files", f"more than the {MAX_KERNELS} kernels one start loads"))
        names = names[:MAX_KERNELS]
    for name in names:
        stem = name[:-5]
        try:
            key_path, object_path = os.path.join(where, name), os.path.join(where, stem + ".o")
            for path in (key_path, object_path):
                reason = trusted(path)
                if reason:
                    raise ValueError(f"{os.path.basename(path)}: {reason}")
            if os.path.getsize(key_path) > MAX_KEY_BYTES or os.path.getsize(object_path) > MAX_OBJECT_BYTES:
                raise ValueError("larger than a saved kernel can be")
            with open(key_path, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict) or raw.get("dict") not in caches:
                raise ValueError(f"not a kernel of the dicts {', '.join(caches)}")
            if symbol(raw.get("key"), raw["dict"]) != stem:
                raise ValueError("its key does not match its file name")
            key, cache = decode(raw["key"]), caches[raw["dict"]]
            hash(key)
            if key in cache:
                continue
            function = getattr(cute.runtime.load_module(object_path, enable_tvm_ffi=True), stem)
            cache[key] = function
            _on_disk[(raw["dict"], key)] = function
            out["loaded"] += 1
        except Exception as exc:  # noqa: BLE001  (bad files and the DSL's own load errors: it compiles as before)
            out["refused"].append((name, f"{type(exc).__name__}: {exc}"[:300]))
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def save(where: str, caches: dict, meta: dict) -> dict:
    """Export the kernels of `caches` (attribute path -> dict) that this process compiled rather
    than loaded into `where`, a stack's subfolder, which replaces the other stacks' beside it
    (a kernel whose files this start refused to load is written again). Returns {"saved": n, "skipped": [(kernel, reason)], "seconds": s}."""
    from kwarm_ext import manifest_files

    t0 = time.perf_counter()
    out = {"saved": 0, "skipped": []}
    fresh = [(path, k, f) for path, cache in caches.items() for k, f in list(cache.items())
             if _on_disk.get((path, k)) is not f]
    if not fresh:
        out["seconds"] = 0.0
        return out
    base = os.path.dirname(where)
    os.makedirs(where, mode=0o700, exist_ok=True)
    for other in os.listdir(base):  # another stack's kernels are stale: FlashInfer wipes its own likewise
        path = os.path.join(base, other)
        if path != where and SUBFOLDER.fullmatch(other) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
    meta_path = os.path.join(where, "meta.json")
    if not os.path.exists(meta_path):
        manifest_files.write_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    for dict_path, key, function in fresh:
        label = _kernel_name(key) or dict_path.split(".")[0]
        try:
            raw = encode(key)
            stem = symbol(raw, dict_path)
            object_path = os.path.join(where, stem + ".o")  # replaced where a file this start refused was
            manifest_files.check_writable_target(object_path)  # no link, no other user's file or folder link
            tmp = os.path.join(where, f".{stem}.{os.getpid()}.o.tmp")
            try:
                function.export_to_c(tmp, function_name=stem)
                os.chmod(tmp, 0o644)
                os.replace(tmp, object_path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            # the key last: a kernel without its key is never loaded
            manifest_files.write_atomic(os.path.join(where, stem + ".json"), json.dumps(
                {"dict": dict_path, "key": raw, "kernel": label}, sort_keys=True) + "\n")
            _on_disk[(dict_path, key)] = function
            out["saved"] += 1
        except Exception as exc:  # noqa: BLE001  (one kernel not saved: it compiles at the next start)
            out["skipped"].append((label, f"{type(exc).__name__}: {exc}"[:300]))
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def _kernel_name(key) -> str | None:
    """The kernel class of a FlashInfer key, for logs: its compile key's MRO comes first."""
    try:
        cls = key[0][0][0]
    except (TypeError, IndexError, KeyError):
        return None
    return cls.__name__ if isinstance(cls, type) else None


# ---------------------------------------------------------------------------- the family


def imported_caches(source: Source) -> dict:
    """`source`'s dicts where its module is imported (attribute path -> dict), else {}."""
    module = sys.modules.get(source.module)
    return source.caches(module) if module is not None else {}


def applies(view) -> str | None:
    if view.worker is None and view.runner is None:
        return "no worker"
    if getattr(view, "after_capture", False):
        if any(any(imported_caches(source).values()) for source in SOURCES):
            return None
        return "no CuTe DSL kernel was compiled into a dict kwarm saves (FlashInfer GDN prefill, vLLM router GEMM)"
    if os.environ.get(EARLY_CUTE_DSL_ENV):
        return None
    try:
        base = folder_for(view)
    except Exception as exc:  # noqa: BLE001  (no Triton target, no model: no deployment folder)
        return f"no deployment folder ({type(exc).__name__}: {exc})"
    if not os.path.isdir(base):
        return "no CuTe DSL kernels saved for this deployment yet"
    return None


def plan(view, forced: bool) -> Plan:
    base = folder_for(view)
    steps, details = [], {}
    early = os.environ.get(EARLY_CUTE_DSL_ENV)
    if early and not getattr(view, "after_capture", False):
        steps.append(Step("load early flashinfer_gdn", "FlashInfer GDN prefill compiled since launch", summary=True,
                          run=lambda: load_early(json.loads(early), details)))
    for source in SOURCES:
        if getattr(view, "after_capture", False):
            if any(imported_caches(source).values()):
                steps.append(Step(f"save {source.name}", source.label, summary=True,
                                  run=lambda source=source: save_source(source, base, details)))
        elif os.path.isdir(os.path.join(base, source.name)):
            steps.append(Step(f"load {source.name}", source.label, summary=True,
                              run=lambda source=source: load_source(source, base, details)))
    return Plan(steps, lambda: details)


def save_source(source: Source, base: str, details: dict) -> list:
    meta = stack(source)
    where = subfolder(os.path.join(base, source.name), meta)
    result = save(where, imported_caches(source), meta)
    details[source.name] = {"folder": where, **result}
    if result["skipped"]:
        label, reason = result["skipped"][0]
        logger.warning("kwarm: cute_dsl: %d %s kernels not saved, they compile at the next start; first: %s: %s",
                       len(result["skipped"]), source.label, label, reason)
    return [f"{source.label}: {result['saved']} kernels saved in {result['seconds']:.2f} s"] if result["saved"] else []


def source_named(name: str) -> Source:
    """The :data:`SOURCES` entry of that name."""
    return next(s for s in SOURCES if s.name == name)


def load_source(source: Source, base: str, details: dict, key: str | None = None, label: str | None = None) -> list:
    """Load `source`'s kernels saved under `base` for this stack; `details[key]` (the source's name)
    says what happened, `label` (the source's) names them in the line and the warning."""
    key, label = key or source.name, label or source.label
    where = subfolder(os.path.join(base, source.name), stack(source))
    if not os.path.isdir(where):
        details[key] = {"folder": where, "loaded": 0}
        return [f"{label}: none saved for this CuTe DSL stack"]
    reason = trusted(where)
    if reason:
        raise ValueError(f"{where}: {reason}")
    try:
        found = source.module in sys.modules or importlib.util.find_spec(source.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:  # saved by a release that had it
        details[key] = {"folder": where, "loaded": 0}
        return [f"{label}: {source.module} is not in this installation"]
    result = load(where, source.caches(importlib.import_module(source.module)))
    details[key] = {"folder": where, **result}
    if result["refused"]:
        name, why = result["refused"][0]
        logger.warning("kwarm: cute_dsl: %d %s kernels not loaded from %s (they compile as before); first: %s: %s",
                       len(result["refused"]), label, where, name, why)
    return [f"{label}: {result['loaded']} kernels loaded in {result['seconds']:.2f} s"]


EARLY_WAIT_S = 120.0  # longer than the early compile of 7 kernels on a busy host


def load_early(early: dict, details: dict) -> list:
    """Load the GDN prefill kernels ``kwarm_ext.early_gdn`` compiled since launch, once its
    background process is done with them (:data:`EARLY_WAIT_S` at most)."""
    source = source_named("flashinfer_gdn")
    t0 = time.perf_counter()
    summary = wait_early(early, EARLY_WAIT_S, lambda line: logger.info("kwarm: cute_dsl: %s", line))
    waited = time.perf_counter() - t0
    if summary is None:
        details["early"] = {"waited_s": round(waited, 3), "loaded": 0}
        return [f"no GDN prefill kernels compiled since launch (waited {waited:.1f} s): vLLM compiles them"]
    if not summary.get("compiled") and summary.get("skipped") != "compiled before":
        details["early"] = {"waited_s": round(waited, 3), "loaded": 0, **summary}
        return [f"no GDN prefill kernels compiled since launch ({summary.get('not') or summary.get('failed') or '?'})"]
    lines = load_source(source, early["folder"], details, key="early", label=f"{source.label} compiled since launch")
    details["early"]["waited_s"] = round(waited, 3)
    return [f"{line} (waited {waited:.1f} s)" for line in lines]


def ended(pid) -> bool:
    """Whether the background process `pid` ended (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return True


def wait_early(early: dict, limit: float, say=lambda line: None) -> dict | None:
    """The summary ``kwarm_ext.early_gdn``'s background process writes once it is done with the
    kernels, waiting for it up to `limit` seconds (None: it ended without one, or is still running).
    Waiting costs nothing vLLM would not spend: its profile run compiles the same kernels, and began
    later."""
    t0, said = time.monotonic(), False
    while True:
        over = ended(early.get("pid", 0)) or time.monotonic() - t0 >= limit  # before the read: its last write counts
        try:
            with open(early["done"], encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            if over:
                return None
        if not said:
            say(f"waiting for the GDN prefill kernels compiled since launch (pid {early.get('pid')}, at most {limit:.0f} s)")
            said = True
        time.sleep(0.2)
