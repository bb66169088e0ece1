"""Triton's integer specialization classes, and splitting a kernel's warm work into what
upstream vLLM already warms (a skipped ``[upstream]`` step) and what kwarm runs. Shared by the
warmup families."""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.surfaces.triton.compat import int_class

# One value per Triton integer specialization class: ==1, "other", %16==0.
INT_CLASSES = (1, 2, 16)


def classes_for(mode: str) -> tuple:
    return INT_CLASSES if mode in ("class", "constexpr") else (1,)


def int_key(value: int, mode: str):
    """What Triton's key records for integer `value` of a parameter in `mode`."""
    if mode in ("dns", "absent"):
        return None
    if mode == "constexpr":
        return value
    return int_class(value)


def split_by_key(items, key_of, up_keys) -> tuple:
    """(items whose ``key_of(item)`` is not in `up_keys`, the ones upstream already warms)."""
    return (tuple(i for i in items if key_of(i) not in up_keys),
            tuple(i for i in items if key_of(i) in up_keys))


def partition(counts, mode: str, upstream) -> tuple:
    """Split integer `counts` into (to warm, already warmed by upstream's ``(name, counts)``),
    comparing the keys Triton would build for them."""
    if upstream is None:
        return tuple(counts), ()
    return split_by_key(counts, lambda n: int_key(n, mode), {int_key(n, mode) for n in upstream[1]})


def split_steps(name: str, kernel: str, todo, covered, up_name, run) -> list:
    """A skipped ``name[upstream]`` step for what upstream covers, a running one for the rest."""
    steps = []
    if covered:
        steps.append(Step(f"{name}[upstream]", kernel, skip=f"covered by upstream {up_name}"))
    if todo:
        steps.append(Step(name, kernel, run=run))
    return steps
