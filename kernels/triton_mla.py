"""Warmup family ``triton_mla``: the ``TRITON_MLA`` backend's decode kernels at every
``NUM_KV_SPLITS`` a decode step can reach, found through the layer's own ``forward_mqa``.

Why:
    ``TritonMLAImpl.forward_mqa`` (``vllm/v1/attention/backends/mla/triton_mla.py``) splits each
    decode's KV sequence into ``num_kv_splits`` parts: the next power of two of the batch's
    ``max_seq_len // 512``, at most twice the GPU's SM count (0.20-0.34; ``_compute_num_kv_splits``
    from 0.26; 0.34 clamps the context to a windowed layer's ``decode_sliding_window`` first and
    passes the window as the constexpr ``SLIDING_WINDOW``). ``decode_attention_fwd`` passes it to its Triton kernels as the constexpr
    ``NUM_KV_SPLITS``, so every power of two is a compile of its own. CUDA-graph capture
    compiles the one its dummy batches reach; every decode step outside a FULL graph (mixed
    prefill-decode batches, eager mode, batches above the largest capture size) compiles again
    when the longest context in the batch first reaches 1024, 1536, 2560, 4608, ... tokens
    (its 512-token share reaching a new power of two): in the middle of a generation. Read from vLLM's source; not measured on the GPU host yet
    (BENCHMARKS.md, "Not measured yet").

How:
    For each KV-cache group on ``TRITON_MLA``, with its first layer and that layer's bound KV
    cache, and the runner's real block table:

    1. Probe: a one-request decode with the longest context ``L`` = 512, 1024, 2048, ... up to
       ``max_model_len`` goes through ``layer.impl.forward_mqa``, vLLM's own code, with the
       decode kernels' launches recorded instead of run (their Triton key, constexprs by value:
       ``kernels/launches.py``). One ``L`` per distinct key is kept: the split counts are what
       the release's own code chooses for this GPU, not a list.
    2. Launch: those decodes for real, so the binaries are compiled and loaded before the
       first request.

    The decode's query is built as the MLA layer builds it (the absorbed ``q_nope`` and
    ``q_pe``, in the model's dtype, ``num_heads`` times the DCP world size), its metadata is
    vLLM's ``MLACommonMetadata`` with an ``MLACommonDecodeMetadata`` holding the runner's
    block-table row (empty before serving: block 0, the null block, only read) and ``L``.
    ``forward_mqa`` writes no KV cache; the outputs are its own tensors. A decode verifying
    speculative tokens (several query rows per request, 0.28+) reaches the same keys
    (tests/test_family_triton_mla.py), so one query row per probe is enough on the V1 runner and
    on Model Runner V2 alike (0.34: V2 only; the block-table rows are then V2's
    ``input_block_tables``, what its attention metadata holds).

Upstream: none (0.20-0.34: neither ``kernel_warmup``, V2's ``warmup_kernels`` beyond its few real
steps, nor 0.34's JIT warmup registry names these kernels); CUDA-graph capture compiles the split
count of its dummy batches, after this family, so finds it compiled.

Remove when:
    vLLM warms its Triton MLA decode kernels per split count, or stops specializing on it.
"""
from __future__ import annotations

import dataclasses
import functools
import time

from kwarm_ext.families import Plan, Step
from kwarm_ext.kernels.attention_groups import (backend_reason, block_table, bound_kv_cache, dataclass_instance,
                                                group_id_of, group_layer, groups_of, vllm_config)
from kwarm_ext.kernels.launches import observed_launches
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.vllm_compat import Missing, resolve_or_none

NAME = "triton_mla"
BACKEND = "TRITON_MLA"
KERNEL = "_fwd_grouped_kernel_stage1"
OPS_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
KERNELS = (KERNEL, "_fwd_kernel_stage1", "_fwd_kernel_stage2")
TRITON_KERNELS = KERNELS  # what this family compiles at start
WORK_PER_SPLIT = 512  # forward_mqa's min_work_per_split (0.20-0.34): where the probes start
_METADATA = ("vllm.model_executor.layers.attention.mla_attention", "vllm.v1.attention.backends.mla.common")


def applies(view) -> str | None:
    return backend_reason(view, BACKEND)


@dataclasses.dataclass
class Target:
    """One group's layer, its cache and what a decode of it needs."""

    label: str
    layer: object
    kv_cache: object
    table: object  # num_reqs -> rows of the runner's real block table
    device: object
    dtype: object
    heads: int
    max_model_len: int


def plan(view, forced) -> list | Plan:
    try:
        kernels = ops_kernels()
        classes = metadata_classes()
    except Missing as exc:
        return [Step("decode", KERNEL, skip=str(exc))]
    steps, groups = [], []  # groups: one summary text per group warmed
    for group in groups_of(view, BACKEND):
        label = f"group {getattr(group, 'kv_cache_group_id', '?')}"
        try:
            target = target_of(view, group, label)
        except Missing as exc:
            steps.append(Step(label, KERNEL, skip=str(exc)))
            continue
        steps.append(Step(label, KERNEL, run=functools.partial(warm, target, kernels, classes, groups)))
    if not steps:
        return [Step("decode", KERNEL, skip=f"no {BACKEND} attention group in the runner")]
    return Plan(steps, lambda: {"summary": "; ".join(groups), "groups": list(groups)} if groups else {})


def ops_kernels() -> dict:
    """``{name: kernel}`` of the decode kernels the ops module holds (the grouped stage 1, the
    plain one and stage 2)."""
    found = {name: kernel for name in KERNELS
             if (kernel := resolve_or_none(f"{OPS_MODULE}:{name}")) is not None}
    if KERNEL not in found:
        raise Missing(f"{OPS_MODULE} has no {KERNEL}")
    return found


def metadata_classes() -> tuple:
    """vLLM's ``(MLACommonMetadata, MLACommonDecodeMetadata)``, wherever the release keeps them."""
    for module in _METADATA:
        outer = resolve_or_none(f"{module}:MLACommonMetadata")
        inner = resolve_or_none(f"{module}:MLACommonDecodeMetadata")
        if outer is not None and inner is not None:
            return outer, inner
    raise Missing("no MLACommonMetadata / MLACommonDecodeMetadata in this vLLM")


def target_of(view, group, label: str) -> Target:
    layer = group_layer(view, group)
    impl = getattr(layer, "impl", None)
    if impl is None or not callable(getattr(impl, "forward_mqa", None)):
        raise Missing(f"{label}: no MLA layer with forward_mqa in the forward context")
    kv_cache = bound_kv_cache(layer)
    if kv_cache is None or not getattr(kv_cache, "numel", lambda: 0)():
        raise Missing(f"{label}: the layer has no bound KV cache")
    group_id = group_id_of(group, label)
    model_config = getattr(vllm_config(view), "model_config", None)
    dtype, max_len = getattr(model_config, "dtype", None), getattr(model_config, "max_model_len", None)
    if dtype is None or not isinstance(max_len, int):
        raise Missing(f"{label}: the model's dtype or max_model_len is unknown")
    for attr in ("num_heads", "kv_lora_rank", "qk_rope_head_dim"):
        if not isinstance(getattr(impl, attr, None), int):
            raise Missing(f"{label}: the MLA impl has no {attr}")
    heads = impl.num_heads * (getattr(impl, "dcp_world_size", 1) or 1)
    return Target(label, layer, kv_cache, functools.partial(block_table, view, group_id), kv_cache.device,
                  dtype, heads, max_len)


def decode(target: Target, classes: tuple, seq_len: int) -> None:
    """One one-request decode whose longest context is `seq_len`, through ``forward_mqa``."""
    import torch

    impl, device = target.layer.impl, target.device
    q_nope = torch.zeros(1, target.heads, impl.kv_lora_rank, dtype=target.dtype, device=device)
    q_pe = torch.zeros(1, target.heads, impl.qk_rope_head_dim, dtype=target.dtype, device=device)
    outer, inner = classes
    one = torch.ones(1, dtype=torch.int32, device=device)
    inner_metadata = dataclass_instance(inner, block_table=target.table(1), seq_lens=one * seq_len,
                                        dcp_tot_seq_lens=None)
    metadata = dataclass_instance(outer, decode=inner_metadata, num_reqs=1, max_query_len=1, max_seq_len=seq_len,
                                  num_actual_tokens=1,
                                  query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
                                  slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
                                  num_decodes=1, num_decode_tokens=1, num_prefills=0, prefill=None, causal=True)
    impl.forward_mqa((q_nope, q_pe), target.kv_cache, metadata, target.layer)


def context_lengths(max_model_len: int) -> list:
    """The probes' longest contexts: 512, 1024, ... below `max_model_len`, then it."""
    out, length = [], WORK_PER_SPLIT
    while length < max_model_len:
        out.append(length)
        length *= 2
    return out + [max_model_len]


def choose_lengths(target: Target, kernels: dict, classes: tuple) -> dict:
    """``{key: longest context}``: one decode per distinct key of the probes."""
    chosen: dict = {}
    for length in context_lengths(target.max_model_len):
        with observed_launches(kernels, launch=False) as seen:
            decode(target, classes, length)
        if seen:
            chosen.setdefault(tuple(seen), length)
    return chosen


def splits_of(key: tuple) -> str:
    """A key's NUM_KV_SPLITS, for the summary line."""
    values = {value for _, params in key for name, value in params if name == "NUM_KV_SPLITS"}
    return "/".join(map(str, sorted(values))) or "?"


def warm(target: Target, kernels: dict, classes: tuple, groups: list) -> list:
    """Probe, then launch one decode per distinct key; the group's summary goes into `groups`."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        chosen = choose_lengths(target, kernels, classes)
        probe_s = time.perf_counter() - t0
        labels = []
        for key, length in chosen.items():
            with observed_launches(kernels, launch=True) as seen:
                decode(target, classes, length)
            labels.append(f"context {length}: NUM_KV_SPLITS {splits_of(key)}: {' + '.join(name for name, _ in seen)}")
        synchronize(target.device)
    groups.append(f"{target.label}: {len(chosen)} split counts ({'/'.join(splits_of(k) for k in chosen)}), "
                  f"{len(context_lengths(target.max_model_len))} probes in {probe_s:.2f} s")
    return labels

