"""Triton internals kwarm relies on (Triton 3.4-3.9, checked on 3.6), in one adapter of three modules:
this one (versions, resolving kernels, reading compile records and keys, the 3.4-3.6 serializer,
autotuning, specialization classes), ``triton_preload`` (replaying recorded compiles) and
``triton_compile`` (compiling ahead on a thread pool).

kwarm records through ``knobs.runtime.jit_post_compile_hook`` and replays through
``JITFunction.preload`` inside ``AsyncCompileMode``, then ``CompiledKernel._init_handles``,
``Autotuner.cache`` and one tiny launch (Triton 3.x's ``JITFunction`` cache, ``preload`` and ``warmup``). Those
names are Triton's runtime internals, not a public API: they are used only here, each behind
a function whose docstring says what it relies on, so that a Triton bump is a one-file diff.
Nothing here imports Triton at module import time.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import re
import sys
from typing import Any

from kwarm_ext.log import CONTAINED
from kwarm_ext.patching import Patch



# Constant encodings that JSON cannot carry as-is; preload cannot decode these, so
# replay injects the decoded objects itself (see _injecting_constants).
OBJECT_TAGS = ("jit_function", "torch_dtype", "tuple", "str")
# what ast.literal_eval raises on a text that is not a Python literal (or too deep / too big)
_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


class Unresolvable(LookupError):
    """A manifest entry names a kernel that cannot (or may not) be found in this process."""


class Unrecordable(ValueError):
    """A compilation whose constants cannot be written to a manifest."""


# ---------------------------------------------------------------------------- versions, target


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def version_tuple(version: str | None = None) -> tuple:
    version = version or triton_version() or "0"
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def interpreted() -> bool:
    """``TRITON_INTERPRET=1`` turns kernels into interpreter functions: nothing compiles."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def current_arch() -> str | None:
    """The active driver's target as ``backend:arch`` (``cuda:90``), or None without a driver."""
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
        return f"{target.backend}:{target.arch}"
    except Exception:
        return None


def current_device() -> int:
    from triton.runtime import driver

    return driver.active.get_current_device()


def has_gpu_driver() -> bool:
    """Whether a real GPU driver is active (not a stub): loading and launching need one."""
    try:
        from triton.backends.driver import GPUDriver
        from triton.runtime import driver

        return isinstance(driver.active, GPUDriver)
    except Exception:
        return False


# ---------------------------------------------------------------------------- resolving kernels


@dataclasses.dataclass(frozen=True)
class ResolvedKernel:
    """A kernel found along ``module.qualname``: the outermost wrapper, its JITFunction and
    any autotuners in between (``getattr`` returns the outermost ``Autotuner``/``Heuristics``)."""

    module: str
    qualname: str
    outer: Any
    jit: Any
    autotuners: tuple = ()

    @property
    def source_key(self) -> str:
        return self.jit.cache_key


def jit_names(source: str) -> set:
    """The module-level names the source defines as Triton kernels, read from its syntax tree
    (a comment or a string mentioning ``triton.jit`` defines none): functions decorated with
    ``*.jit``/``jit`` (called or not, under ``autotune``/``heuristics`` too) and names assigned
    a call of it (``kernel = triton.jit(fn)``)."""
    def is_jit(node) -> bool:
        node = node.func if isinstance(node, ast.Call) else node
        return (isinstance(node, ast.Name) and node.id == "jit") or (isinstance(node, ast.Attribute) and node.attr == "jit")

    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(is_jit(d) for d in node.decorator_list):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and is_jit(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def module_source(module: str) -> str | None:
    """The path of `module`'s Python source, found without importing it or its packages
    (only the top-level package is looked up on ``sys.path``); None where there is none."""
    import importlib.util

    top, *parts = module.split(".")
    loaded = sys.modules.get(top)
    try:
        spec = None if loaded is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if loaded is not None:
        dirs = list(getattr(loaded, "__path__", []) or [])
        origin = getattr(loaded, "__file__", None)
    elif spec is None:
        return None
    else:
        dirs = list(spec.submodule_search_locations or [])
        origin = spec.origin
    for i, part in enumerate(parts):
        found = None
        for d in dirs:
            package, plain = os.path.join(d, part, "__init__.py"), os.path.join(d, part + ".py")
            if os.path.isfile(package):
                found, dirs = package, [os.path.join(d, part)]
                break
            if os.path.isfile(plain) and i == len(parts) - 1:
                found, dirs = plain, []
                break
            if os.path.isdir(os.path.join(d, part)) and i < len(parts) - 1:  # a namespace package
                found, dirs = None, [os.path.join(d, part)]
                break
        else:
            return None
        origin = found
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def not_a_kernel_module(module: str, qualname: str | None = None) -> str | None:
    """Why replay will not import `module` (None when it may): only a module whose source, parsed
    on disk before anything of it runs, defines Triton kernels (and `qualname`'s top-level name
    among them) is imported, so that a manifest cannot choose the side effects of importing
    anything else under an allowed prefix."""
    path = module_source(module)
    if path is None:
        return f"module {module} has no Python source to check; not imported"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(4 << 20)
        kernels = jit_names(text)
    except OSError as exc:
        return f"module {module}: cannot read {path} ({exc.strerror}); not imported"
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return f"module {module}: {path} does not parse; not imported"
    if not kernels:
        return f"module {module} defines no Triton kernel (no function decorated with triton.jit); not imported"
    if qualname is not None and qualname.split(".")[0] not in kernels:
        return f"module {module} defines no Triton kernel {qualname.split('.')[0]}; not imported"
    return None


def resolve(module: str, qualname: str, *, import_missing: bool = True) -> ResolvedKernel:
    """Find a kernel; the caller has checked `module` against the allow-list.

    With `import_missing` false only modules already in ``sys.modules`` are searched (the
    learner's periodic thread must not import anything)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if "<locals>" in qualname or not qualname:
        raise Unresolvable(f"{qualname!r} is not reachable from its module")
    mod = sys.modules.get(module)
    if mod is None:
        if not import_missing:
            raise Unresolvable(f"module {module} is not imported")
        why = not_a_kernel_module(module, qualname)
        if why:
            raise Unresolvable(why)
        try:
            mod = importlib.import_module(module)
        except CONTAINED as exc:  # a module that calls sys.exit on import too (issue 59)
            raise Unresolvable(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise Unresolvable(f"{module} has no {qualname}")
    outer, autotuners = obj, []
    for _ in range(8):  # Heuristics -> Autotuner -> JITFunction, never deeper in practice
        if isinstance(obj, JITFunction):
            return ResolvedKernel(module, qualname, outer, obj, tuple(autotuners))
        if isinstance(obj, Autotuner):
            autotuners.append(obj)
        obj = getattr(obj, "fn", None)
    raise Unresolvable(f"{module}.{qualname} is not a Triton JITFunction (interpreted or not a kernel)")


# ---------------------------------------------------------------------------- recording


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One compilation as the post-compile hook saw it, ready for the manifest."""

    module: str
    qualname: str
    source_key: str
    key: str
    launch_options: dict
    spec: dict  # Triton's specialization data without its ``options`` (rebuilt at replay)


def describe_compile(kwargs: dict) -> CompileRecord | None:
    """Read a ``jit_post_compile_hook`` call (kwargs ``key``, ``fn``, ``compile``); None if it is
    not a module-level JITFunction. Raises :class:`Unrecordable` for constants JSON can't carry."""
    from triton.runtime.jit import JITFunction

    fn, key, comp = kwargs.get("fn"), kwargs.get("key"), kwargs.get("compile")
    jit = getattr(fn, "jit_function", None)
    if not isinstance(jit, JITFunction) or not isinstance(key, str) or not isinstance(comp, dict):
        return None
    module, qualname = str(getattr(fn, "module", "")), str(getattr(fn, "name", ""))
    if "<locals>" in qualname or not module:
        return None
    spec = json.loads(comp["specialization_data"])
    spec.pop("options", None)  # the recording install's paths and arch: never replayed
    spec.pop("key", None)  # kept once, beside the spec
    constants = comp.get("constants") or {}
    spec["constant_keys"] = [list(path) for path in constants]
    spec["constant_vals"] = [encode_constant(value) for value in constants.values()]
    return CompileRecord(module, qualname, jit.cache_key, key, launch_options(key), spec)


def launch_options(key: str) -> dict:
    """The launch options at the end of an in-memory cache key, ``str(spec) + str(options)``.

    The key's options are what the launch passed (``num_warps=``, ... in call order, plus
    ``debug``/``instrumentation_mode``); replay compiles with exactly these, so that
    ``parse_options`` fills in the current GPU instead of the recording's."""
    for _, _, options in _key_splits(key):
        return options
    raise ValueError("the key does not end with a readable options dict")


def _key_splits(key: str):
    """Each way, last first, to read an in-memory key as ``spec_text + options_text`` whose
    options part is a readable dict: yields (spec_text, options_text, options)."""
    start, tries = key.rfind("]{"), 0
    while start != -1 and tries < _MAX_SPLITS:  # bounded: a crafted key cannot cost n^2
        tries += 1
        try:
            options = ast.literal_eval(key[start + 1:])
        except _LITERAL_ERRORS:
            options = None
        if isinstance(options, dict):
            yield key[:start + 1], key[start + 1:], options
        start = key.rfind("]{", 0, start)


_MAX_SPLITS = 3  # Triton's options dict holds no "]{"; a few tries cover a value that does


def read_key(key: str) -> tuple[list | None, dict]:
    """(specialization, launch options) of an in-memory key, read once: the list at its start
    (one element per argument: ``(type, attribute)``, ``("constexpr", value)``; None where it
    cannot be read) and the options dict at its end (ValueError where there is none)."""
    for spec_text, _, options in _key_splits(key):
        return _read_specialization(spec_text), options
    raise ValueError("the key does not end with a readable options dict")


def attrs_from_key(specialization: list) -> dict:
    """The compiler attributes (``tt.divisibility``, ...) a key's specialization implies, path ->
    attributes, as Triton's own ``JITFunction._pack_args`` derives them for a launch: its
    ``find_paths_if`` over each argument's specialization string, and the backend's ``parse_attr``."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import find_paths_if, get_iterable_path

    values = [x[1] for x in specialization]
    paths = find_paths_if(values, lambda _, x: isinstance(x, str))
    return {tuple(path): BaseBackend.parse_attr(get_iterable_path(values, path)) for path in paths}


def encode_constant(value):
    """A constexpr value as JSON; objects JSON can't carry get a one-key tag (OBJECT_TAGS)."""
    import triton.language as tl
    from triton.runtime.jit import JITCallable

    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return {"str": value} if tl.dtype.is_dtype(value) else value  # preload would make it a dtype
    if isinstance(value, tl.dtype):
        return {"tl_dtype": str(value)}
    if isinstance(value, tl.constexpr):
        return {"constexpr": encode_constant(value.value)}
    if isinstance(value, JITCallable):
        return {"jit_function": f"{value.fn.__module__}:{value.fn.__qualname__}"}
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return {"torch_dtype": str(value).replace("torch.", "")}
    if isinstance(value, (tuple, list)):
        return {"tuple": [encode_constant(v) for v in value]}
    raise Unrecordable(f"constexpr of type {type(value).__name__} cannot be recorded")


def function_refs(value) -> list[str]:
    """``module:qualname`` of every jitted function among an encoded constant."""
    if isinstance(value, dict):
        if "jit_function" in value:
            return [value["jit_function"]]
        return [ref for v in value.values() for ref in function_refs(v)]
    if isinstance(value, list):
        return [ref for v in value for ref in function_refs(v)]
    return []


# ---------------------------------------------------------------------------- the 3.4-3.6 serializer's fallback


def fallback_serialize(name, signature, constants, attrs, options, key) -> str:
    """What ``serialize_specialization_data`` returns when Triton's own raises (Triton 3.4-3.6,
    see ``kwarm_ext.patches.SERIALIZER``): functions as ``{"jit_function": "mod:qualname"}``
    (Triton 3.7's own encoding), anything else unencodable as its repr."""
    def constant(value):
        try:
            return encode_constant(value)
        except Exception:
            return {"unrecordable": repr(value)}

    obj = {"name": name, "signature": signature,
           "constant_keys": [list(k) for k in constants], "constant_vals": [constant(v) for v in constants.values()],
           "attrs_keys": [list(k) for k in attrs], "attrs_vals": list(attrs.values()),
           "options": getattr(options, "__dict__", {}), "key": key}
    return json.dumps(obj, default=repr)


# An IntEnum constexpr prints as its repr (vLLM's KVQuantMode in unified attention)
_INT_ENUM_REPR = re.compile(r"<[A-Za-z_][\w.]*: (-?\d+)>")


def _read_specialization(text: str) -> list | None:
    """The specialization list whose ``str`` is `text`, or None.

    Python literals, plus two constexpr kinds vLLM's kernels take that print as code:
    a ``triton.language`` dtype (``compute_type`` of fused MoE) reads back as that dtype,
    and an IntEnum member (``<KVQuantMode.NONE: 0>``) as its value, which it equals and
    hashes like; a manifest only holds such members as ints (JSON), so the member's class
    is not known here. A launch passing the plain value then finds the same key, as it
    does in Triton's own key cache once the member has launched."""
    plain = _INT_ENUM_REPR.sub(r"\1", text)
    try:
        spec = _literal_or_dtype(ast.parse(plain, mode="eval").body)
    except _LITERAL_ERRORS:
        return None
    return spec if isinstance(spec, list) and str(spec) == plain else None


def _literal_or_dtype(node):
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "triton.language":
        import triton.language as tl

        dtype = getattr(tl, node.attr, None)
        if isinstance(dtype, tl.dtype):
            return dtype
        raise ValueError(f"not a triton.language dtype: {node.attr}")
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal_or_dtype(item) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    return ast.literal_eval(node)


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _is_hash(value) -> bool:
    """A jitted function's ``cache_key`` as ``compute_cache_key`` prints it (a sha256 hex digest)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)



# ---------------------------------------------------------------------------- autotuning


def config_to_json(config) -> dict | None:
    """An autotune ``Config`` as JSON (its kwargs, warps, stages, ctas, maxnreg), or None if its
    kwargs are not JSON scalars. ``pre_hook`` and ``ir_override`` are code, not data: replay
    takes them from the kernel's own configs."""
    kwargs = dict(getattr(config, "kwargs", {}) or {})
    if not all(isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))
               for k, v in kwargs.items()):
        return None
    return {"kwargs": kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def autotune_choices(kernel: ResolvedKernel) -> list[tuple[list, dict]]:
    """The outermost autotuner's chosen config per tuning key, as JSON (``Autotuner.cache``)."""
    if not kernel.autotuners:
        return []
    out = []
    for key, config in list(kernel.autotuners[0].cache.items()):
        wanted = config_to_json(config)
        if wanted is not None and all(v is None or isinstance(v, (bool, int, float, str)) for v in key):
            out.append((list(key), wanted))
    return out


def tunes(kernel: ResolvedKernel) -> bool:
    """Whether the kernel's outermost autotuner chooses among several configs."""
    return bool(kernel.autotuners) and len(kernel.autotuners[0].configs) > 1


def seed_autotune(kernel: ResolvedKernel, key: list, wanted: dict) -> str | None:
    """Pre-seed ``Autotuner.cache[key]`` with the kernel's own config equal to `wanted`, so its
    first launch neither prunes nor benchmarks. Returns why not, or None when seeded."""
    config, why = find_config(kernel, wanted)
    if config is not None:
        kernel.autotuners[0].cache.setdefault(tuple(key), config)
    return why


def find_config(kernel: ResolvedKernel, wanted: dict):
    """(the kernel's own Config equal to `wanted`, None) or (None, why not). Its own, so that
    its ``pre_hook`` and ``ir_override`` come from the code, never from the manifest."""
    if not kernel.autotuners:
        return None, "the kernel is no longer autotuned"
    config = next((c for c in kernel.autotuners[0].configs if config_to_json(c) == wanted), None)
    if config is None:
        return None, "the recorded config is no longer among the kernel's configs"
    return config, None


# ------------------------------------------------------------------ specialization classes
# The warmup families use these to tell which integer values give distinct Triton keys.


def int_class(value: int) -> str:
    """Triton's value class of a specialized (non-constexpr, non-dns) int argument."""
    if value == 1:
        return "one"
    return "div16" if value % 16 == 0 else "other"


def param_mode(kernel, name: str) -> str:
    """How Triton keys `name` of `kernel`: absent | constexpr | dns | class (1 / %16 / other)."""
    fn = kernel
    for _ in range(8):  # Heuristics/Autotuner wrap the JITFunction in .fn
        if hasattr(fn, "params") or hasattr(fn, "arg_names"):
            break
        fn = getattr(fn, "fn", None)
        if fn is None:
            return "absent"
    if hasattr(fn, "params"):  # JITFunction
        for p in fn.params:
            if p.name == name:
                if p.is_constexpr:
                    return "constexpr"
                return "dns" if p.do_not_specialize else "class"
        return "absent"
    # InterpretedFunction (TRITON_INTERPRET=1): the jit kwargs and the Python signature
    import inspect

    sig = inspect.signature(fn.fn).parameters
    if name not in sig:
        return "absent"
    if "constexpr" in str(sig[name].annotation):
        return "constexpr"
    dns = fn.kwargs.get("do_not_specialize") or ()
    index = list(sig).index(name)
    return "dns" if (name in dns or index in dns) else "class"


# ---------------------------------------------------------------------------- the serializer patch
# One entry of kwarm's patch table (kwarm_ext.patches.PATCHES), defined beside what it wraps.

def _wrap_serialize_specialization_data(wrapped, instance, args, kwargs):
    """Triton's ``serialize_specialization_data``, made unable to raise.

    Why: on Triton 3.4-3.6 ``JITFunction._call_hook`` serializes the specialization before
    calling any post-compile hook, and the stock serializer raises ``TypeError: Object of type
    JITFunction is not JSON serializable`` for a kernel taking a ``@jit`` function as a
    constexpr: with *any* hook installed (kwarm's learning and capture, or vLLM's JIT monitor)
    that launch fails. How: the original runs first; only when it raises is the data encoded
    by ``triton_compat.fallback_serialize``. Versions: Triton 3.4-3.6 (``when``); it can go
    when kwarm requires Triton >= 3.7.
    """
    try:
        return wrapped(*args, **kwargs)
    except Exception:
        return fallback_serialize(*args, **kwargs)


def _triton_before_3_7() -> bool:
    """From the installed distribution: the hook fires while ``triton`` itself is importing."""
    from importlib import metadata

    for dist in ("triton", "pytorch-triton"):
        try:
            return version_tuple(metadata.version(dist)) < (3, 7)
        except metadata.PackageNotFoundError:
            continue
    return version_tuple() < (3, 7)


SERIALIZER = Patch("triton.runtime.jit", "serialize_specialization_data", _wrap_serialize_specialization_data,
                   "Triton 3.4-3.6", "a kernel taking a @jit function as a constexpr fails to launch while "
                   "a compile hook is installed", when=_triton_before_3_7)
