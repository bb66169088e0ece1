"""qwen_gdn, prefill checkpoints: ``MambaPrefillCheckpointExporter.export`` ->
``store_cache_checkpoints_kernel`` (vLLM 0.33+).

Why:
    With prefix caching on (``mamba_cache_mode="align"``, vLLM's default for hybrid models) and
    FlashInfer's GDN prefill (the default on Hopper), every prefill that crosses a prefix-cache
    block stores the conv window and the recurrent state at that block through
    ``store_cache_checkpoints_kernel``. Nothing compiles it before the first such request:
    measured with ``vllm serve`` on vLLM 0.33.0 and FlashInfer 0.7.2.post1 (BENCHMARKS.md), it was
    the one Triton compile left in requests on tiny Qwen3-Next with kwarm (0.12 s, first
    completion and burst).

How:
    Through vLLM's own exporter, the layer's ``_checkpoint_exporter``, with the layer's real
    bound ``conv_state``/``ssm_state`` (every stride of the kernel is constexpr) and a recurrent
    checkpoint buffer of the layer's ``_checkpoint_buffer_spec`` (row size and dtype of the
    workspace buffer the prefill fills). Every checkpoint names the null block as its state, so
    the kernel masks every load and store: no state a request could own is read or written.
    Variants, one per Triton key production reaches:

    - ``recurrent_rows`` is ``plan[len(cu_starts):]`` of one int64 tensor
      (``GDNAttentionMetadataBuilder``): 16-byte aligned when the batch has an odd number of
      prefills, 8 bytes off when even (reachable when ``max_num_seqs`` >= 2);
    - ``raw_qkv`` is ``mixed_qkv``'s view (row pitch of the layer's projection) and, with
      speculative decoding, its ``index_select`` (dense ``conv_dim`` rows).

Upstream (0.33, 0.34): nothing compiles it before the first request.

Remove when:
    vLLM compiles the checkpoint export at engine start (its profile run or its warmup), as
    checked with ``--jit-monitor-mode=error`` on a hybrid Qwen model with prefix caching.
"""
from __future__ import annotations

import dataclasses

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.vllm_compat import Missing
from kwarm_ext.vllm_compat import resolve

KERNEL = "store_cache_checkpoints_kernel"
_CHECKPOINT = "vllm.model_executor.layers.mamba.checkpoint"


def not_exported(layer) -> str | None:
    """Why this layer runs no checkpoint export, or None when its prefills export checkpoints."""
    if getattr(layer, "_checkpoint_exporter", None) is None:
        backend = getattr(layer, "gdn_prefill_backend", None)
        return ("no prefill checkpoints: they are exported with prefix caching "
                "(mamba_cache_mode=align) and FlashInfer's GDN prefill"
                + (f" (GDN prefill backend: {backend})" if backend else ""))
    try:
        exports = bool(layer._exports_checkpoints)
    except Exception as exc:  # the property reads the current vLLM config
        return f"no prefill checkpoints: {type(exc).__name__} reading _exports_checkpoints"
    if not exports:
        return "no prefill checkpoints: a Mamba layer of this model cannot export them"
    return None


def variants(work, view) -> list:
    """(raw_qkv row pitch, recurrent_rows 16-byte aligned?) per reachable key."""
    s = work.shape
    pitches = [s.pitch] + ([s.conv_dim] if s.index_stride > 1 and s.conv_dim != s.pitch else [])
    aligned = [True] + ([False] if (view.max_num_reqs or 2) >= 2 else [])
    return [(p, a) for p in pitches for a in aligned]


def _checkpoint_steps(work, tag, view) -> list:
    name = f"prefill_checkpoint{tag}"
    try:
        meta = resolve(f"{_CHECKPOINT}:MambaPrefillCheckpointMetadata")
    except Missing:
        return [Step(name, KERNEL, skip="no prefill checkpoint export in this vLLM (0.33+)")]
    reason = not_exported(work.layer)
    if reason is not None:
        return [Step(name, KERNEL, skip=reason)]
    todo = variants(work, view)
    return [Step(name, KERNEL, run=lambda: warm_export(work, meta, todo))]


def warm_export(work, meta, todo) -> list:
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    null = int(resolve("vllm.v1.attention.backends.utils:NULL_BLOCK_ID"))
    (_, *row_shape), state_dtype = layer._checkpoint_buffer_spec
    offset = 64  # FlashInfer's GDN chunk; >= the conv window, as 0.34's exporter asserts
    fields = {f.name for f in dataclasses.fields(meta)}
    labels = []
    with torch.inference_mode():
        recurrent = torch.empty((1, *row_shape), dtype=state_dtype, device=device)
        for pitch, aligned in todo:
            checkpoint = meta(**{k: v for k, v in dict(
                checkpoint_offsets=torch.tensor([offset], dtype=torch.int32, device=device),
                state_indices=torch.tensor([null], dtype=torch.int32, device=device),  # block table's
                offsets=[offset], query_lens=[offset]).items() if k in fields})
            raw = torch.empty((offset, pitch), dtype=dtype, device=device)[:, : s.conv_dim]
            plan = torch.zeros(3, dtype=torch.int64, device=device)  # cu_starts + rows, one tensor
            rows = plan[2:] if aligned else plan[1:2]
            layer._checkpoint_exporter.export(
                checkpoint, raw_qkv=raw, conv_state=work.conv_state,
                cu_seqlens=torch.tensor([0, offset], dtype=torch.int32, device=device),
                recurrent_checkpoint=recurrent, recurrent_state=work.ssm_state, recurrent_rows=rows)
            labels.append(f"pitch={pitch},rows_aligned={'yn'[not aligned]}")
        synchronize(device)
    return labels
