"""Warmup family ``triton_attn``: every specialization of the ``TRITON_ATTN`` backend's
kernels that a batch can reach, found through vLLM's own metadata builder and attention code.

Why:
    ``unified_attention`` (``vllm/v1/attention/ops/triton_unified_attention.py``) launches
    ``kernel_unified_attention`` in a 2D form (one program per query block and KV head) or a
    3D form (the KV sequence split into segments, then ``reduce_segments``). Which one, and the
    Triton key, depend on the batch: the number of sequences (``num_seqs``, an integer Triton
    specializes as 1, a multiple of 16 or other), the longest query, and the builder's
    ``seq_threshold_3D``. Nothing vLLM runs at start reaches these with attention metadata
    except CUDA-graph capture (decode batches of the capture sizes). On the GPU host (vLLM
    0.24.0, Qwen3-Next on ``TRITON_ATTN``, empty caches, no manifest) the kernel compiled in
    the first 200-token prefill and again in the first 4-request prefill, 0.6-0.8 s each;
    with ``enforce_eager`` the decode forms and ``reduce_segments`` compiled too (issue 20).

How:
    For each attention group on ``TRITON_ATTN``, with its first layer, its bound KV cache, its
    real metadata builder and the runner's real block table:

    1. Probe: dummy batches of ``n`` requests with query length ``q`` (``q`` = 1, 2 and, where
       the release defines ``MAX_3D_QUERY_LEN``, one above it) go through
       ``builder.build(...)`` (through the group's ``build_metadata`` where it has one, 0.33+,
       as the runner calls it) and ``layer.impl.forward(...)``, vLLM's own code, with both
       kernels' launches recorded instead of run (their Triton key: constexpr values, integer
       classes, dtypes). For each ``q``, a bisection over ``n`` in 1..``max_num_seqs``
       (and ``n * q <= max_num_batched_tokens``) finds where the key changes other than by
       ``num_seqs``' class: the switch between the 2D and 3D forms, wherever the release's
       selection code puts it. In each stretch, the smallest ``n`` of every integer class
       ``num_seqs`` takes is a representative; one batch per distinct key is kept.
       Mixed batches (decodes plus a prefill) take the form of a uniform batch with the same
       ``n`` and longest query; tests/test_family_triton_attn.py checks that against every
       batch of up to 16 requests, per release.
    2. Compile ahead: those batches once more with the kernels' launches turned into compiles
       on a thread pool (``triton_compile.launches_compile_only``), as ``fused_moe`` does.
    3. Launch: the batches for real, so the binaries are loaded before the first request.

    Safety: the batches' slot mapping is all -1 (padding: no KV write; the Triton backend's
    ``forward`` writes no KV cache in 0.20-0.34 anyway, ``forward_includes_kv_cache_update``
    is False), their block-table rows are the runner's, empty before serving (block 0, the
    null block, only read), and the outputs are kwarm's own tensors.

Upstream: the V2 model runner's ``warmup_kernels`` (0.29+) runs a few real prefill and decode
steps, not every class; CUDA-graph capture compiles the captured decode sizes. Both run after
this family and only find compiled what it compiled first. 0.34's JIT warmup registry and its
``kernel_warmup`` (FlashInfer's mixed-batch warmup) do not reach these kernels. The block-table
rows are the V1 runner's or Model Runner V2's (``input_block_tables``; the only runner from 0.34).

Remove when:
    vLLM warms its Triton attention kernels per batch class, or stops specializing on them.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time

from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.families import Plan, Step
from kwarm_ext.kernels.launches import observed_launches
from kwarm_ext.kernels.attention_groups import (backend_reason, block_table, bound_kv_cache, common_metadata,
                                                group_id_of, group_layer, groups_of, metadata_build,
                                                metadata_builder, model_dtype)
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import classes_for
from kwarm_ext.surfaces.triton.compat import int_class, param_mode
from kwarm_ext.vllm_compat import Missing, resolve

NAME = "triton_attn"
BACKEND = "TRITON_ATTN"
KERNEL = "kernel_unified_attention"
OPS_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
KERNELS = (KERNEL, "reduce_segments")
TRITON_KERNELS = KERNELS  # what this family compiles at start
BATCH_PARAM = "num_seqs"


def applies(view) -> str | None:
    return backend_reason(view, BACKEND)


@dataclasses.dataclass
class Target:
    """One attention group: what a dummy batch needs to go through vLLM's code."""

    label: str
    layer: object
    kv_cache: object
    builder: object
    build: object  # CommonAttentionMetadata -> the backend's metadata, as the runner builds it
    table: object  # n -> the runner's block-table rows of this group
    device: object
    dtype: object
    max_reqs: int
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Batch:
    q: int  # query tokens per request
    n: int  # requests

    def label(self) -> str:
        return f"decode x{self.n}" if self.q == 1 else f"prefill {self.n}x{self.q}"


def plan(view, forced) -> list | Plan:
    try:
        kernels = ops_kernels()
    except Missing as exc:
        return [Step("batches", KERNEL, skip=str(exc))]
    steps, groups = [], []  # groups: one summary text per group warmed
    for group in groups_of(view, BACKEND):
        label = f"group {getattr(group, 'kv_cache_group_id', '?')}"
        try:
            target = target_of(view, group, label)
        except Missing as exc:
            steps.append(Step(label, KERNEL, skip=str(exc)))
            continue
        steps.append(Step(label, KERNEL, run=functools.partial(warm, target, kernels, view.tp_size, groups)))
    if not steps:
        return [Step("batches", KERNEL, skip=f"no {BACKEND} attention group in the runner")]
    return Plan(steps, lambda: {"summary": "; ".join(groups), "groups": list(groups)} if groups else {})


def ops_kernels() -> dict:
    """``{name: kernel}`` of the backend's Triton kernels, as the ops module holds them."""
    return {name: resolve(f"{OPS_MODULE}:{name}") for name in KERNELS}


def target_of(view, group, label: str) -> Target:
    builder = metadata_builder(group)
    if builder is None or not callable(getattr(builder, "build", None)):
        raise Missing(f"{label}: no metadata builder")
    layer = group_layer(view, group)
    if layer is None or getattr(layer, "impl", None) is None:
        raise Missing(f"{label}: no attention layer in the forward context")
    kind = getattr(getattr(layer.impl, "attn_type", None), "value", getattr(layer.impl, "attn_type", "decoder"))
    if str(kind).lower() != "decoder":
        raise Missing(f"{label}: {kind} attention (no KV cache)")
    kv_cache = bound_kv_cache(layer)
    group_id = group_id_of(group, label)
    max_reqs = view.max_num_reqs or getattr(view.runner, "max_num_reqs", None)
    max_tokens = view.max_num_batched_tokens
    if not isinstance(max_reqs, int) or not isinstance(max_tokens, int):
        raise Missing(f"{label}: max_num_seqs / max_num_batched_tokens unknown")
    dtype = getattr(layer, "dtype", None) or model_dtype(view)
    if dtype is None:
        raise Missing(f"{label}: the model's dtype is unknown")
    return Target(label, layer, kv_cache, builder, metadata_build(group, builder),
                  functools.partial(block_table, view, group_id),
                  kv_cache.device, dtype, max_reqs, max_tokens)


# ---------------------------------------------------------------------------- one batch

def run_batch(target: Target, batch: Batch) -> None:
    """One dummy batch through the group's metadata build and ``impl.forward``."""
    import torch

    layer, n, q = target.layer, batch.n, batch.q
    query_lens = [q] * n
    seq_lens = [q + 1 if q == 1 else q] * n  # a decode reads one earlier token
    common = common_metadata(target.table(n), query_lens, seq_lens, target.device)
    metadata = target.build(common)
    tokens, dtype = n * q, target.dtype
    heads, kv_heads, head = layer.num_heads, layer.num_kv_heads, layer.head_size
    head_v = getattr(layer, "head_size_v", head)
    query = torch.zeros(tokens, heads, head, dtype=dtype, device=target.device)
    if getattr(layer, "query_quant", None) is not None and getattr(layer.impl, "supports_quant_query_input", False):
        query = query.to(resolve("vllm.platforms:current_platform").fp8_dtype())
    key = torch.zeros(tokens, kv_heads, head, dtype=dtype, device=target.device)
    value = torch.zeros(tokens, kv_heads, head_v, dtype=dtype, device=target.device)
    output = torch.zeros(tokens, heads, head_v, dtype=dtype, device=target.device)
    layer.impl.forward(layer, query, key, value, target.kv_cache, metadata, output=output)


def decision(key: tuple) -> tuple:
    """A probe's key without the batch-size parameter's class: what the selection code decided."""
    return tuple((kernel, tuple(p for p in params if p[0] != BATCH_PARAM)) for kernel, params in key)


# ---------------------------------------------------------------------------- choosing batches

def query_lengths() -> list:
    """1 (decode), 2 (the shortest prefill) and, where the release bounds the 3D form's query
    length (``MAX_3D_QUERY_LEN``, 0.33-0.34), one more than that bound."""
    bound = getattr(sys.modules.get(OPS_MODULE), "MAX_3D_QUERY_LEN", None)
    return sorted({1, 2} | ({bound + 1} if isinstance(bound, int) and bound >= 2 else set()))


def smallest_of_class(lo: int, hi: int, cls: str) -> int | None:
    for n in range(lo, min(hi, lo + 17) + 1):
        if int_class(n) == cls:
            return n
    return None


def stretches(probe, lo: int, hi: int) -> list:
    """Maximal [lo, hi] runs of one :func:`decision`, by bisection (the selection switches
    forms monotonically in the batch size)."""
    if decision(probe(lo)) == decision(probe(hi)):
        return [(lo, hi)]
    if hi == lo + 1:
        return [(lo, lo), (hi, hi)]
    mid = (lo + hi) // 2
    out = stretches(probe, lo, mid)
    for part in stretches(probe, mid + 1, hi):
        if decision(probe(out[-1][1])) == decision(probe(part[0])):
            out[-1] = (out[-1][0], part[1])
        else:
            out.append(part)
    return out


def choose_batches(target: Target, kernels: dict) -> tuple[list, int]:
    """(one :class:`Batch` per distinct key, the number of probes)."""
    import torch

    classes = {int_class(n) for n in classes_for(param_mode(kernels[KERNEL], BATCH_PARAM))}
    chosen: dict = {}
    probes = 0
    for q in query_lengths():
        top = min(target.max_reqs, target.max_tokens // q)
        if top < 1:
            continue

        @functools.lru_cache(maxsize=None)
        def probe(n, q=q):
            nonlocal probes
            probes += 1
            with observed_launches(kernels, launch=False) as seen:
                run_batch(target, Batch(q, n))
            return tuple(seen)

        with torch.inference_mode():
            for lo, hi in stretches(probe, 1, top):
                picks = [smallest_of_class(lo, hi, c) for c in sorted(classes)] if len(classes) > 1 else [lo]
                for n in sorted({n for n in picks if n is not None}):
                    key = probe(n)
                    if key:
                        chosen.setdefault(key, Batch(q, n))
    return list(chosen.values()), probes


# ---------------------------------------------------------------------------- warm

def compile_ahead(target: Target, kernels: dict, batches: list, threads: int) -> str:
    """Step 2 of the module docstring: the summary's words for what happened."""

    def run():
        for batch in batches:
            run_batch(target, batch)

    return triton_compile.compile_ahead([(OPS_MODULE, name) for name in kernels], run, threads,
                                       f"triton_attn: {target.label}: compile ahead failed, compiling one batch at a time")


def warm(target: Target, kernels: dict, tp_size, groups: list) -> list:
    """Warm one group's batches; its summary text goes into `groups`."""
    import torch

    t0 = time.perf_counter()
    batches, probes = choose_batches(target, kernels)
    probe_s = time.perf_counter() - t0
    with torch.inference_mode():
        ahead = compile_ahead(target, kernels, batches, triton_compile.compile_threads(tp_size))
        labels = []
        for batch in batches:
            with observed_launches(kernels, launch=True) as seen:
                run_batch(target, batch)
            labels.append(f"{batch.label()}: {' + '.join(name for name, _ in seen)}")
        synchronize(target.device)
    groups.append(
        f"{target.label}: {len(batches)} batches, one per specialization ({probes} probes in "
        f"{probe_s:.2f} s); {ahead}")
    return labels
