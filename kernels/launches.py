"""Launches of Triton kernels recorded by their key, as the attention families read them: which
specialization a batch reaches, known only once vLLM's own code has computed the launch's
arguments. Not a family (no ``applies``/``plan``): shared by ``triton_attn`` and ``triton_mla``.
"""
from __future__ import annotations

import contextlib

from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.surfaces.triton.compat import int_class, param_mode


@contextlib.contextmanager
def observed_launches(kernels: dict, *, launch: bool):
    """Inside the block each launch of `kernels` appends ``(name, key)`` to the yielded list;
    with `launch` false nothing compiles or runs (the kernel returns None). The key of a
    launch is known only once vLLM's own code (``unified_attention``, ``decode_attention_fwd``) has computed its arguments from the
    batch: recording the launch (``triton_compile.shadowed_runs``, whose docstring says why and
    until when) reads the batch's specialization without replicating that code."""
    seen: list = []
    names = {id(kernel): name for name, kernel in kernels.items()}

    def recording(kernel, original):
        def run(*args, grid=None, warmup=False, **kwargs):
            seen.append((names[id(kernel)], launch_key(kernel, args, kwargs)))
            return original(*args, grid=grid, warmup=warmup, **kwargs) if launch else None

        return run

    with triton_compile.shadowed_runs(kernels.values(), recording):
        yield seen


def launch_key(kernel, args, kwargs) -> tuple:
    """What Triton keys a launch on, readably: ``((param, value), ...)`` with constexprs by
    value, specialized integers by class, tensors by dtype, floats as ``fp``. Pointer
    alignment is left out (every tensor here is a fresh, aligned allocation)."""
    names = triton_compile.param_names(kernel)
    bound = dict(zip(names, args), **kwargs)
    out = []
    for name in names:
        if name not in bound:
            continue
        value, mode = bound[name], param_mode(kernel, name)
        if mode == "constexpr":
            out.append((name, value if isinstance(value, (bool, int, float, str, type(None))) else str(value)))
        elif value is None or isinstance(value, bool):
            out.append((name, value))
        elif isinstance(value, int):
            out.append((name, int_class(value) if mode == "class" else "int"))
        elif isinstance(value, float):
            out.append((name, "fp"))
        else:
            out.append((name, str(getattr(value, "dtype", type(value).__name__))))
    return tuple(out)
