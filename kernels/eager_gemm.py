"""Warmup family ``eager_gemm``: plain eager forwards at a ladder of token counts, so that the
GEMM kernels a prefill of any size runs are loaded before the first request.

Why:
    A prefill longer than the largest CUDA-graph capture size runs the compiled model's
    general-shape code, whose dense layers call cuBLAS (Inductor's ``extern_kernels.mm``).
    cuBLAS picks a kernel per shape class and the driver loads each kernel on its first use
    (lazy module loading), which costs milliseconds per kernel. Profiled on the GPU host
    (cProfile of request 0 against its repeat, vLLM 0.24.0, zero Triton compiles, warm
    caches): a 200-token prefill paid 18.6 ms in 12 first ``torch.mm`` calls on the tiny
    DeepSeek-V3.2 (0.2 ms in the repeat) and 7.9 ms on the tiny Qwen3-Next, the largest
    part of what separated request 0 from request 1. Startup's own eager forwards (the
    profile run at the largest size, ``fused_moe``'s token counts) leave whole ranges of
    sizes unvisited.

How:
    ``runner._dummy_run(N, cudagraph_runtime_mode=NONE)`` (no attention metadata: the same
    call as vLLM's profile run and the ``fused_moe`` family) for N on a ladder over the
    eager range: the smallest eager size, every power of two and 1.5x power of two above
    it, and the largest (``max_num_batched_tokens``). 19 forwards for the tiny models
    (33..16384 tokens). Any Triton kernel reached on the way compiles here too.

Upstream: no vLLM release warms cuBLAS shapes outside CUDA-graph capture sizes (0.20-0.33).
The V2 runner (0.29+) is not warmed here: its ``warmup_kernels`` runs real steps.

Remove when:
    vLLM warms the eager forward at more than the profile run's size, or loads its GEMM
    kernels eagerly.
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.runner import dummy_runner, eager_range
from kwarm_ext.vllm_compat import Missing

NAME = "eager_gemm"
KERNEL = "cuBLAS GEMMs of the eager forward"


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if view.runner_kind == "V2":
        return "V2 model runner: its warmup_kernels runs real prefill and decode steps"
    if not callable(getattr(view.runner, "_dummy_run", None)):
        return "runner has no _dummy_run"
    return None


def plan(view, forced) -> list:
    first, last = eager_range(view)
    if first > last:
        return [Step("ladder", KERNEL, skip=f"no eager token counts ({first}..{last})")]
    try:
        run = dummy_runner(view.runner)
    except Missing as exc:
        return [Step("ladder", KERNEL, skip=str(exc))]
    sizes = ladder(first, last)
    return [Step("ladder", KERNEL, run=lambda: _forward_at(run, sizes))]


def ladder(first: int, last: int) -> list:
    """first, every 2**k and 3 * 2**(k-1) between, and last: [33, 48, 64, 96, ..., 16384]."""
    sizes, power = [first], 1
    while power < last:
        sizes.extend(n for n in (power, power + power // 2) if first < n < last)
        power <<= 1
    return sorted(set(sizes)) + ([last] if last > first else [])


def _forward_at(run, sizes: list) -> list:
    import torch

    with torch.inference_mode():
        for tokens in sizes:
            run(tokens)
    return [f"{len(sizes)} token counts: {', '.join(map(str, sizes))}"]
