"""Replaying a recorded compile: ``JITFunction.preload`` (inside ``AsyncCompileMode`` when
parallel), then the launcher cache, ``CompiledKernel._init_handles`` and one tiny launch. Part of
the Triton adapter (see ``kwarm_ext.surfaces.triton.compat``): Triton runtime internals, one function each."""
from __future__ import annotations

from typing import Any
from typing import Callable
import contextlib
import dataclasses
import json

from kwarm_ext.log import CONTAINED
from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.surfaces.triton import compile as triton_compile


# ---------------------------------------------------------------------------- replaying


@dataclasses.dataclass
class PreloadJob:
    """One manifest entry ready for ``JITFunction.preload``."""

    label: str
    jit: Any
    key: str
    spec_json: str  # Triton's specialization data, options rebuilt from the key
    injected: dict = dataclasses.field(default_factory=dict)  # constant path -> (placeholder, object)


def preload_job(label: str, kernel: "triton_compat.ResolvedKernel", key: str, spec: dict, options: dict,
                resolve_function: Callable[[str], Any]) -> PreloadJob:
    """Decode an entry's constants into what ``preload`` reads; objects JSON can't carry
    (functions, torch dtypes, tuples) become placeholders that :func:`preload` swaps back.
    `resolve_function` turns ``module:qualname`` into a JITFunction (and enforces the allow-list)."""
    data = dict(spec, options={**options_named_by_parameters(spec, options), **options}, key=key)
    vals, injected = [], {}
    for path, encoded in zip(spec["constant_keys"], spec["constant_vals"]):
        plain = _preload_form(encoded)
        if plain is _OBJECT:
            placeholder = f"kwarm-injected:{len(injected)}"
            injected[tuple(path)] = (placeholder, _decode_object(encoded, resolve_function))
            plain = placeholder
        vals.append(plain)
    data["constant_vals"] = vals
    if injected and not hasattr(type(kernel.jit), "_do_compile"):
        raise ValueError("constexpr objects need Triton >= 3.5")
    return PreloadJob(label, kernel.jit, key, json.dumps(data), injected)


def options_named_by_parameters(spec: dict, options: dict) -> dict:
    """The compiler options a launch set through keyword arguments that are also parameters of the
    kernel: allow-listed option names (``manifest.LAUNCH_OPTIONS``) among its constexprs, with
    their values, where those values are in range and `options` (the key's) does not name them.

    Why: Triton's launch binds such a keyword to the parameter *and* parses it as a compiler
    option (``JITFunction._pack_args``: ``backend.parse_options(kwargs)``). vLLM passes
    ``launch_pdl=...`` to kernels with a ``launch_pdl`` constexpr (Mamba's ``causal_conv1d``,
    ``gather_initial_states``, LoRA's ops) and gets a launch with programmatic dependent launch.
    The in-memory key carries it as the parameter only, so a replay compiled with the key's options
    alone built another binary under the same key: Triton's disk cache missed, and Qwen3-Next's first
    warm restart compiled two learned ``_causal_conv1d_update_kernel`` entries for real (0.24 and
    0.26 s, H100, vLLM 0.33.0), kernels that then launched without PDL. A launch that passed the
    argument by position set no option; where its value is the option's default (False) both agree,
    and where it is True the kernel itself waits on the previous grid (``gdc_wait``), as a PDL
    launch needs."""
    from kwarm_ext import manifest

    index = {name: i for i, name in enumerate(spec.get("signature") or {})}
    found = {}
    for path, value in zip(spec.get("constant_keys") or (), spec.get("constant_vals") or ()):
        for name, i in index.items():
            check = manifest.LAUNCH_OPTIONS.get(name)
            if check is not None and name not in options and list(path) == [i] and check(value):
                found[name] = value
    return found


_OBJECT = object()


def _preload_form(encoded):
    """What Triton's preload decodes back faithfully, or _OBJECT."""
    import triton.language as tl

    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    if isinstance(encoded, dict) and set(encoded) == {"tl_dtype"}:
        if not tl.dtype.is_dtype(encoded["tl_dtype"]):
            raise ValueError(f"unknown Triton dtype {encoded['tl_dtype']!r}")
        return encoded["tl_dtype"]
    if isinstance(encoded, dict) and set(encoded) == {"constexpr"}:
        inner = encoded["constexpr"]
        if inner is None or isinstance(inner, (bool, int, float)):
            return {"constexpr": inner}
    return _OBJECT


def _decode_object(encoded, resolve_function):
    import triton.language as tl

    if not isinstance(encoded, dict) or len(encoded) != 1:
        raise ValueError(f"unreadable constant {encoded!r}")
    tag, value = next(iter(encoded.items()))
    if tag == "jit_function" and isinstance(value, str):
        return resolve_function(value)
    if tag == "torch_dtype" and isinstance(value, str):
        import torch

        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {value!r}")
        return dtype
    if tag == "tuple" and isinstance(value, list):
        return tuple(_decode_plain(v, resolve_function) for v in value)
    if tag == "str" and isinstance(value, str):
        return value
    if tag == "constexpr":
        return tl.constexpr(_decode_plain(value, resolve_function))
    if tag == "tl_dtype" and isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    raise ValueError(f"unreadable constant {encoded!r}")


def _decode_plain(encoded, resolve_function):
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    return _decode_object(encoded, resolve_function)


def preload(job: PreloadJob):
    """``job.jit.preload(...)``: the compiled kernel, a FutureKernel inside
    :func:`parallel_compiles`, or None when a ``jit_cache_hook`` declined it."""
    with _injecting_constants(job.jit, job.injected):
        return job.jit.preload(job.spec_json)


@contextlib.contextmanager
def _injecting_constants(jit, injected: dict):
    """Swap placeholders for objects on their way from ``preload`` to ``_do_compile``.

    ``preload`` can only decode JSON scalars, dtype names and ``{"constexpr": v}``; a
    constexpr that is a jitted function (or a tuple, or a torch dtype) reaches the compiler
    through this per-instance shim, active only during the one synchronous ``preload`` call."""
    if not injected:
        yield
        return
    original = type(jit)._do_compile

    def _do_compile(key, signature, device, constexprs, *args, **kwargs):
        for path, (placeholder, obj) in injected.items():
            if constexprs.get(path) == placeholder:
                constexprs[path] = obj
        return original(jit, key, signature, device, constexprs, *args, **kwargs)

    jit._do_compile = _do_compile
    try:
        yield
    finally:
        vars(jit).pop("_do_compile", None)


def settle(job: PreloadJob, result) -> tuple[Any, str | None]:
    """After :func:`parallel_compiles`: the compiled kernel of `job`, or None and why not.

    Also covers a 3.5/3.6 quirk: AsyncCompileMode deduplicates by the on-disk hash, so of two
    in-memory keys for one binary only the first reaches ``kernel_cache``; the second is
    stored here, as Triton's own finalize step would have."""
    if result is None:
        return None, "a jit_cache_hook declined the compile"
    kernel = result
    if hasattr(result, "result") and callable(result.result):
        try:
            kernel = result.result()
        except triton_compile.CompileTimedOut as exc:
            return None, f"{exc}: skipped, the compile goes on unwaited (the bound on one entry)"
        except CONTAINED as exc:
            return None, f"compile failed: {type(exc).__name__}: {exc}"
        if kernel is None:
            return None, "compile failed"
    cache = kernel_cache(job.jit)
    if job.key not in cache:
        cache[job.key] = kernel
    return kernel, None


def seed_key_cache(jit, key: str) -> bool:
    """Map the launch arguments' specialization to `key` in `jit`'s ``kernel_key_cache``, the
    dict ``compute_cache_key`` (3.4+) consults before building a key string, so that the first
    launch of a replayed kernel skips that build (``replace_callables`` over the
    specialization): one such build cost 0.5 ms of request 0 on tiny Qwen3-Next (engine
    benchmark under cProfile, vLLM 0.24.0), none in its repeat.

    That dict maps ``(tuple(specialization), str(options))`` to ``str(specialization) +
    str(options)``, the in-memory key, so the specialization is read back from the key's own
    text (:func:`triton_compat._read_specialization`). Only a text that prints back the same is used, and
    none whose specialization held a jitted function (its text is the function's hash, which
    no launch's specialization holds): a hit returns the key Triton would have built. Returns
    whether an entry was added."""
    caches = jit.device_caches[triton_compat.current_device()]
    if len(caches) < 2 or not isinstance(caches[1], dict):
        return False
    for spec_text, options_text, _ in triton_compat._key_splits(key):
        spec = triton_compat._read_specialization(spec_text)
        if spec is None:
            continue
        if any(triton_compat._is_hash(value) for value in triton_compat._leaves(spec)):
            return False
        try:
            return caches[1].setdefault((tuple(spec), options_text), key) == key
        except TypeError:  # an unhashable element: no launch can look it up either
            return False
    return False


def kernel_cache(jit) -> dict:
    """The in-memory ``key -> kernel`` dict of `jit` on the current device."""
    return jit.device_caches[triton_compat.current_device()][0]


def is_loaded(jit, key: str) -> bool:
    return key in kernel_cache(jit)


def init_handles(kernel) -> None:
    """Load the binary and build the launcher now (``CompiledKernel._init_handles``), not at
    the first launch. Needs a real GPU driver."""
    if hasattr(kernel, "result") and callable(kernel.result):
        kernel = kernel.result()
    kernel._init_handles()


def init_handles_each(kernels: list, threads: int) -> list:
    """:func:`init_handles` for every kernel on a thread pool: per kernel, None or the exception.

    Most of the cost is the launcher build (a gcc run per signature on 3.4-3.6) and the binary
    load, which release the GIL. ``_init_handles`` loads onto the thread's current device,
    and a new thread's is device 0: each pool thread first takes the caller's device."""
    device = _current_cuda_device()

    def on_device():
        if device is not None:
            import torch

            torch.cuda.set_device(device)

    def attempt(kernel):
        try:
            init_handles(kernel)
            return None
        except Exception as exc:
            return exc

    if threads <= 1 or len(kernels) <= 1:
        return [attempt(k) for k in kernels]
    from concurrent.futures import BrokenExecutor, ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(min(threads, len(kernels)), thread_name_prefix="kwarm-load",
                                initializer=on_device) as pool:
            return list(pool.map(attempt, kernels))
    except BrokenExecutor:  # a thread could not take the device: load here, one by one
        return [attempt(k) for k in kernels]


def take_callers_device():
    """A function that makes the thread calling it use the caller's current CUDA device (a new
    thread's is device 0): Triton files a preloaded kernel under the compiling thread's device
    (``device_caches[device]``), and a TP rank's is not device 0. A no-op without CUDA."""
    device = _current_cuda_device()

    def take() -> None:
        if device is not None:
            import torch

            torch.cuda.set_device(device)
    return take


def _current_cuda_device():
    import torch

    try:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    except Exception:
        return None


def warm_binder():
    """Compile kwarm's no-op kernel through ``warmup``: its binder runs Triton's one-time
    specialization imports (85-190 ms measured on an H200) now instead of in the first real
    launch. Needs no GPU; :func:`tiny_launch` then pays what only a launch pays."""
    import torch

    from kwarm_ext._noop import kwarm_noop

    return kwarm_noop.warmup(torch.int32, grid=(1,))


def tiny_launch() -> None:
    """One real launch of kwarm's no-op kernel on the current GPU (loads it, runs its launcher)."""
    import torch

    from kwarm_ext._noop import kwarm_noop

    device = torch.device("cuda", torch.cuda.current_device())
    kwarm_noop[(1,)](torch.zeros(1, dtype=torch.int32, device=device))
    torch.cuda.synchronize(device)
