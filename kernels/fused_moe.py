"""Warmup family ``fused_moe``: vLLM's Triton fused-MoE GEMM at every token count that runs
outside CUDA graphs.

Why:
    ``fused_moe_kernel`` (``vllm/model_executor/layers/fused_moe/fused_moe.py``) runs twice per
    MoE layer and step (the gate/up GEMM, then the down GEMM that multiplies by the router
    weights: ``MUL_ROUTED_WEIGHT``). Its key depends on the step's token count M three ways:

    - the tile config, ``try_get_optimal_moe_config(..., M, ...)``: the nearest entry of a
      tuned table, else ``get_default_config``'s M thresholds (BLOCK_SIZE_M/N/K, GROUP_SIZE_M,
      num_warps, num_stages);
    - the integer class (``%16``, ``==1``, other) of ``EM`` (the padded sorted-token count)
      and ``num_valid_tokens`` (M * top_k), both runtime-specialized;
    - which of two EM formulas applies (vLLM takes the small-batch one while
      M < BLOCK_SIZE_M, and its result depends on whether M * top_k < E).

    CUDA-graph capture compiles it only at the capture sizes, and batches up to the largest
    capture size are padded to one of those. Every larger batch (prefills, mixed steps) runs
    eagerly with its exact M, so each new (config, class) pair compiles on a request: on the
    GPU host, tiny DeepSeek-V3.2 on vLLM 0.24.0 and 0.26.0 with kwarm's other families, the
    only Triton compiles left in requests were ``fused_moe_kernel`` (two per new M class;
    ``BENCHMARKS.md``). No vLLM release 0.20-0.33 warms it (``kernel_warmup`` runs FlashInfer
    autotune dummy runs, not this kernel).

How:
    1. Probe: one ``runner._dummy_run(M0, cudagraph_runtime_mode=NONE)`` at the smallest
       eager M while vLLM's ``try_get_optimal_moe_config`` is observed (see
       :func:`observed_config_calls`), to learn the exact arguments production passes (weight
       shapes, top_k, quantization dtype name, block shape). No call means the experts run on
       another backend (DeepGEMM, CUTLASS, FlashInfer, Marlin): the family stops there.
    2. Classes: the same function, called for every eager M, splits the range into regions of
       one config (and one side of M < BLOCK_SIZE_M and of M * top_k < E). Inside a region EM
       and num_valid_tokens move with slope top_k, so their integer classes repeat every
       ``16 / gcd(top_k, 16)`` tokens: the first that many M of a region reach every key
       production can reach in it.
    3. Compile ahead: the same dummy runs once with ``fused_moe_kernel``'s launches turned
       into compiles on a thread pool (``triton_compile.launches_compile_only`` inside
       ``parallel_compiles``, one thread per core of this rank): vLLM's own code computes
       every launch's arguments, Triton compiles all the specializations at once instead of
       one per dummy run. Those runs' MoE outputs are never written; they are discarded.
       On empty caches this is most of the family's cost (35 compiles: 18 s one by one on
       Qwen3-Next-80B dimensions, 5.6 s with this step, BENCHMARKS.md). Skipped under
       Triton's interpreter, and, in a worker without torch.distributed peers, when the probe
       compiled nothing: it added no kernel to Triton's on-disk cache, so its kernels were
       loads and the dummy runs would run twice for nothing (1.4 s of a 2.3 s family on a
       warm restart). Where that cache cannot be counted (a cache manager of the user's own),
       the probe's time against its rerun at the same count decides (``COLD_PROBE_S``).
       With peers (tensor, data or expert parallel) the pass always runs: the probe's time
       differs per rank, and every rank must run the same dummy runs for their collectives.
    4. Warm: ``_dummy_run(M, cudagraph_runtime_mode=NONE)`` for each of those M: vLLM's own
       forward over dummy tokens, so the kernel gets production's arguments exactly (and any
       other kernel that specializes on the eager token count comes along); every
       ``fused_moe_kernel`` specialization is now compiled, so these runs only launch.

    Eager M: 1..max_num_batched_tokens when mixed batches run without CUDA graphs
    (``enforce_eager``, ``cudagraph_mode`` NONE or FULL_DECODE_ONLY); else from the largest
    capture size + 1. Safety: ``_dummy_run`` in NONE mode is what vLLM runs itself for its
    compile sizes and the profile run: no attention metadata, so nothing reads or writes KV
    blocks. Every rank computes the same M list from rank-independent inputs (config, shapes),
    so the collectives inside the forward line up under tensor parallelism.

    The V2 model runner (``vllm/v1/worker/gpu``, the default from 0.29) is warmed the same way
    through its own ``_dummy_run`` (see :func:`~kwarm_ext.kernels.model_runner.dummy_runner`).
    Its ``warmup_kernels`` (0.29+) runs a few real prefill, decode and mixed steps, which do not
    reach the eager token counts: on the GPU host with vLLM 0.29.0 and kwarm's other families,
    ``fused_moe_kernel`` still compiled 10 times in requests on both tiny models
    (``BENCHMARKS.md``, vLLM 0.29.0).

Upstream: none that reaches the eager token counts (0.20-0.33).

Remove when:
    vLLM warms its fused-MoE kernel for eager token counts (or stops specializing on them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.families import Plan, Step
from kwarm_ext.kernels.model_runner import dummy_runner, eager_range, one_process
from kwarm_ext.vllm_compat import Missing, bind, resolve, resolve_or_none

NAME = "fused_moe"
KERNEL = "fused_moe_kernel"
TRITON_KERNELS = (KERNEL,)  # what this family compiles at start
_CONFIG_FN = "vllm.model_executor.layers.fused_moe.fused_moe:try_get_optimal_moe_config"
# vLLM 0.34+: block-FP8 experts also look up the down projection's own tuned table (``*_down.json``)
_TABLES_FN = "vllm.model_executor.layers.fused_moe.fused_moe:get_moe_configs"
_KERNEL_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe"  # fused_moe_kernel, 0.20-0.33
# The probe's dummy run meets the kernel's first two specializations: on empty caches two
# compiles of about 0.5 s each (35 took 18 s one by one on Qwen3-Next-80B dimensions, H200,
# vLLM 0.24.0), on a warm restart two loads from Triton's cache. What it added to Triton's
# on-disk cache tells the two apart. Its time does not, even against its rerun: on a warm
# restart of published-size Qwen3-Next on vLLM 0.29.0 the probe took 0.34 s and its rerun
# 0.02 s, loads and first calls only, and sent the start through a 2.3 s compile-ahead pass.
# The time rule, this much over the rerun, is left for a cache that cannot be counted.
COLD_PROBE_S = 0.3
_MOE_PACKAGE = "vllm.model_executor.layers.fused_moe"

# What a MoE layer registers in the forward context: the FusedMoE module (0.20-0.23), its
# MoERunner (0.24+, where FusedMoE became a factory).
MOE_LAYER_CLASSES = ("FusedMoE", "MoERunnerInterface")

# ---------------------------------------------------------------------------- applicability

def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if not view.layers_of(*MOE_LAYER_CLASSES):
        return "no fused-MoE layers"
    if not callable(getattr(view.runner, "_dummy_run", None)):
        return "runner has no _dummy_run"
    return None


def plan(view, forced) -> list | Plan:
    try:
        config_fn = resolve(_CONFIG_FN)
        dummy_run = dummy_runner(view.runner)
    except Missing as exc:
        return [Step("eager_sizes", KERNEL, skip=str(exc))]
    first, last = eager_range(view)
    if first > last:
        return [Step("eager_sizes", KERNEL, skip=f"no eager token counts ({first}..{last})")]
    # at least 2, so that every rank takes the same path (one thread would skip the pass)
    threads = max(2, triton_compile.compile_threads(view.tp_size))
    details: dict = {}
    return Plan([Step("eager_sizes", KERNEL,
                      run=lambda: warm_eager_sizes(config_fn, dummy_run, first, last, threads, one_process(), details))],
                lambda: dict(details))


# ---------------------------------------------------------------------------- the config calls

@dataclasses.dataclass(frozen=True)
class ConfigCall:
    """One way production asks for a config: the arguments of ``try_get_optimal_moe_config``
    by name, with M left out."""

    kwargs: tuple  # sorted (name, value) pairs
    top_k: int | None
    num_experts: int | None

    def config(self, fn, m: int) -> dict:
        return fn(**dict(self.kwargs), M=m)


def config_call(fn, args, kwargs) -> ConfigCall:
    """The :class:`ConfigCall` of one observed call (its arguments bound by name)."""
    named = dict(bind(fn, *args, **kwargs).arguments)
    if named.pop("M", None) is None:
        raise Missing(f"{fn.__qualname__}: no argument M in this call")
    top_k = named.get("top_k")
    w2_shape = named.get("w2_shape")
    num_experts = int(w2_shape[0]) if w2_shape is not None and len(w2_shape) == 3 else None
    frozen = tuple(sorted((k, _freeze(v)) for k, v in named.items()))
    return ConfigCall(frozen, int(top_k) if isinstance(top_k, int) else None, num_experts)


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if type(value).__name__ == "Size":  # torch.Size: a tuple of ints
        return tuple(int(v) for v in value)
    return value


@contextlib.contextmanager
def observed_config_calls(fn, tables_fn=None, down_tables: list | None = None):
    """Record every call of `fn` (vLLM's ``try_get_optimal_moe_config``) made in the block, and
    into `down_tables` every down-projection table `tables_fn` (``get_moe_configs`` called with
    ``down_moe=True``, vLLM 0.34+) returned there.

    Why this patch exists: the fused-MoE experts (``experts/triton_moe.py`` from 0.24,
    ``fused_moe.py`` in 0.20-0.23) import the function by name and pass it arguments built
    deep inside the modular kernel (weight views, the quant config's dtype name, block
    shape), which no public API exposes. From 0.34 block-FP8 experts also pick the down
    projection's config from a table of its own, the entry nearest the token count, in the same
    place. Every module of ``vllm.model_executor.layers.fused_moe`` that holds `fn` (or
    `tables_fn`) gets a recording stand-in for the duration of the block, calling through, and
    gets the original back in a ``finally``. Needed on every vLLM that has this function
    (0.20-0.34); it can go with this family.
    """
    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return fn(*args, **kwargs)

    def recording_tables(*args, **kwargs):
        table = tables_fn(*args, **kwargs)
        if down_tables is not None and table and bind(tables_fn, *args, **kwargs).arguments.get("down_moe"):
            if all(table is not t for t in down_tables):
                down_tables.append(table)
        return table

    swaps = [(name, orig, new) for name, orig, new in (("try_get_optimal_moe_config", fn, recording),
                                                       ("get_moe_configs", tables_fn, recording_tables))
             if orig is not None]
    holders = [(mod, name, orig, new) for modname, mod in list(sys.modules.items()) if modname.startswith(_MOE_PACKAGE)
               for name, orig, new in swaps if getattr(mod, name, None) is orig]
    for mod, name, _, new in holders:
        setattr(mod, name, new)
    try:
        yield calls
    finally:
        for mod, name, orig, _ in holders:
            setattr(mod, name, orig)


def nearest(table: dict, m: int) -> dict:
    """The entry of a tuned table production takes at token count `m` (the nearest key)."""
    return table[min(table, key=lambda k: abs(k - m))]


# ---------------------------------------------------------------------------- classes

def period(top_k: int | None) -> int:
    """How many consecutive M cover every integer class of M * top_k (and of EM)."""
    return 16 // math.gcd(top_k, 16) if top_k else 16


def region_key(fn, calls, m: int, down_tables=()) -> tuple:
    """What decides the kernel's key at token count `m`, for every observed call shape (and
    every down-projection table, 0.34+)."""
    key = []
    for call in calls:
        cfg = call.config(fn, m)
        block_m = cfg.get("BLOCK_SIZE_M", 0)
        small = m < block_m
        key.append((tuple(sorted(cfg.items())), small,
                    small and call.top_k is not None and call.num_experts is not None
                    and m * call.top_k < call.num_experts))
    for table in down_tables:
        key.append((tuple(sorted(nearest(table, m).items())),))
    return tuple(key)


def regions(fn, calls, first: int, last: int, down_tables=()) -> list:
    """[[lo, hi, key]] for maximal runs of token counts with one :func:`region_key`."""
    out: list = []
    for m in range(first, last + 1):
        key = region_key(fn, calls, m, down_tables)
        if out and out[-1][2] == key:
            out[-1][1] = m
        else:
            out.append([m, m, key])
    return out


def representatives(spans, step: int) -> list:
    """The first `step` token counts of every region."""
    return [m for lo, hi, _ in spans for m in range(lo, min(hi, lo + step - 1) + 1)]


# ---------------------------------------------------------------------------- warm

def compile_ahead(dummy_run, sizes, threads: int) -> str:
    """Step 3 of the module docstring: the summary's words for what happened."""
    if not sizes:
        return "nothing to compile ahead"

    def run():
        for m in sizes:
            dummy_run(m)

    return triton_compile.compile_ahead([(_KERNEL_MODULE, KERNEL)], run, threads,
                                       "fused_moe: compile ahead failed, compiling one token count at a time")


def _probe_compiled(dummy_run, first: int, probe_s: float, cached: int | None) -> tuple:
    """Whether the probe compiled (rather than loaded from Triton's cache), and the summary's
    words for how that was told: the kernels it added to Triton's on-disk cache, or, where
    those cannot be counted, its time against a rerun at the same count."""
    now = triton_compile.disk_cache_entries()
    if cached is not None and now is not None:
        return now > cached, f"probe {probe_s:.2f} s, {now - cached} kernels new in Triton's cache"
    t0 = time.perf_counter()
    dummy_run(first)  # the probe again, nothing left to compile or load: the run alone
    rerun_s = time.perf_counter() - t0
    return probe_s - rerun_s >= COLD_PROBE_S, f"probe {probe_s:.2f} s, its rerun {rerun_s:.2f} s"


def _run_sizes(dummy_run, sizes: list, torch) -> list:
    """One dummy run per token count, smallest first; where one runs out of memory (kwarm's bound,
    a GPU at ``--gpu-memory-utilization 0.92``), that count and the larger ones are left (their
    activations only grow) and what the failed run held goes back. Returns the counts left.

    Why: one count over the bound used to fail the whole step, every count's result with it, and
    kept the failed run's activations (0.9 GB at published Qwen3-Next dimensions, H100, 0.92)."""
    ordered = sorted(sizes)
    for i, m in enumerate(ordered):
        try:
            dummy_run(m)
        except torch.OutOfMemoryError:
            left = ordered[i:]
            break
    else:
        return []
    from kwarm_ext import memory

    memory.release()  # after the except block: the failed run's frames (its activations) are gone
    return left


def warm_eager_sizes(config_fn, dummy_run, first: int, last: int, threads: int = 1,
                     alone: bool = True, details: dict | None = None) -> list:
    """Probe, find the config regions, compile ahead, run one token count per region's
    period; what it found goes into `details` (the summary line's)."""
    details = {} if details is None else details
    import torch

    with torch.inference_mode():
        cached = triton_compile.disk_cache_entries()
        t0 = time.perf_counter()
        down_tables: list = []
        with observed_config_calls(config_fn, resolve_or_none(_TABLES_FN), down_tables) as seen:
            dummy_run(first)
        probe_s = time.perf_counter() - t0
        if not seen:
            details["summary"] = (f"probe M={first}: no Triton fused-MoE config requested "
                                   "(the experts run on another backend)")
            return [f"probe M={first}"]
        calls = sorted({config_call(config_fn, a, k) for a, k in seen}, key=repr)
        step = max(period(c.top_k) for c in calls)
        spans = regions(config_fn, calls, first, last, down_tables)
        sizes = representatives(spans, step)
        if not alone:
            ahead = compile_ahead(dummy_run, [m for m in sizes if m != first], threads) + f" (probe {probe_s:.2f} s)"
        else:
            cold, timing = _probe_compiled(dummy_run, first, probe_s, cached)
            if cold:
                ahead = compile_ahead(dummy_run, [m for m in sizes if m != first], threads) + f" ({timing})"
            else:  # its compiles were loads from Triton's cache: a second pass would only cost
                ahead = f"no compile ahead ({timing}: Triton's cache is warm)"
        too_big = _run_sizes(dummy_run, [m for m in sizes if m != first], torch)
    if too_big:
        ahead += f"; M {too_big[0]}..{too_big[-1]} over kwarm's memory bound, left to the requests"
        details["left_to_requests"] = [{"count": len(too_big), "what": "fused-MoE token counts",
                                        "why": f"M {too_big[0]}..{too_big[-1]}: out of memory within kwarm's bound"}]
    details.update(
        summary=(f"{len(sizes) - len(too_big)} eager token counts in {len(spans)} config regions "
                 f"(M {first}..{last}, every {step} per region); {ahead}"),
        regions=[{"M": [lo, hi], "config": dict(key[0][0])} for lo, hi, key in spans], probe_s=round(probe_s, 3),
        token_counts=sizes, config_calls=len(calls), down_tables=len(down_tables))
    return [f"M={lo}..{hi}: {', '.join(str(m) for m in sizes if lo <= m <= hi)}" for lo, hi, _ in spans]
