"""Warmup family ``qwen_gdn``: the Triton kernels of Qwen3-Next / Qwen3.5 gated delta-net layers.

Why:
    ``QwenGatedDeltaNetAttention._forward_core`` (``GatedDeltaNetAttention`` in 0.20) runs
    its kernels eagerly inside the ``qwen_gdn_attention_core`` custom op, and only two of
    its paths are compiled before the first request: the chunk kernels and post-conv at
    L=64 (in-layer ``_warmup_prefill_kernels`` during the profile run) and the decode-only
    path (FULL CUDA-graph capture). The rest JIT-compiles on the first requests (0.24 on a
    tiny Qwen3-Next: ``_causal_conv1d_fwd_kernel`` and ``_fused_post_conv_kernel`` in
    request 0).

How:
    Through vLLM's own entry functions, once per distinct TP-local layer shape, with that
    layer's real bound ``conv_state``/``ssm_state`` (their strides and ``size(0)`` are
    constexpr), ``A_log``, ``dt_bias``, ``conv1d`` weight/bias and ``norm``, and with the
    layouts ``forward_cuda`` hands to ``_forward_core`` (read in the source of each
    release):

    - ``mixed_qkv`` row pitch: ``conv_dim`` when it is a ``torch.cat`` (Qwen3-Next,
      ``gqa_interleaved_layout``) or its own projection (LoRA ``in_proj_qkv``);
      ``conv_dim + value_dim/tp`` when it is the ``split`` view of ``in_proj_qkvz``'s output
      (Qwen3.5). Prefill conv gets ``mixed_qkv.T`` (token stride = pitch; constexpr in 0.20).
    - ``b``/``a``: contiguous ``[T, HV]`` except Qwen3-Next with one local key head group,
      where ``fix_query_key_value_ordering`` returns views of the ``[T, 2*HV]`` projection
      (row stride 2*HV, ``a`` offset by HV).
    - state indices: ``block_table[:, 0]`` of the mamba group, row stride 1 + num_spec.

    Every call names only the null block (``NULL_BLOCK_ID``) as its state slot, which the
    kernels skip (conv fwd/update return, sigmoid/packed decode return before touching the
    state), so no state a request could own is read or written; inputs are small fresh
    allocations freed after the step, under ``torch.inference_mode()``, with no collective.
    Kernels and classes warmed per shape:

    - ``causal_conv1d_fn`` → ``_causal_conv1d_fwd_kernel``: seqlen ∈ {1, 2, 16} where
      ``seqlen`` is a specialized argument (≤0.22), else one launch; conv metadata built
      by vLLM's ``compute_causal_conv1d_metadata`` as the GDN metadata builder does.
    - ``fused_post_conv_prep`` → ``_fused_post_conv_kernel``: L ∈ {1, 2, 16} × each
      reachable 16-byte alignment of (conv_output, a, b): prefill-only batches start at the
      buffers' base, mixed batches (0.23+, ``GDNAttentionMetadata.prefill_state_indices``)
      pass ``[num_decode_tokens:]`` slices.
    - ``fused_sigmoid_gating_delta_rule_update`` (mixed batches' decode head, non-spec;
      0.23+; also decode-only batches when the packed decode is disabled and not captured).
    - ``causal_conv1d_update`` (batch ∈ {1, 2, 16}) and
      ``fused_recurrent_gated_delta_rule_packed_decode``: only when CUDA-graph capture will
      not compile them (enforce_eager, or a cudagraph mode without FULL).
    - ``MambaPrefillCheckpointExporter.export`` → ``store_cache_checkpoints_kernel`` (0.33+), when
      the layer exports prefix-cache checkpoints (prefix caching with FlashInfer's GDN prefill):
      see ``checkpoint.py``.
    - ``layer_norm_fwd_kernel`` via the layer's ``norm.forward_cuda`` (``RMSNormGated``),
      only when the norm dispatches to it (or the 0.28 fused-norm path calls it): one M per
      (integer class of M, ROWS_PER_BLOCK) reachable with M = tokens · HV_local,
      tokens ∈ 1..max_num_batched_tokens, ROWS_PER_BLOCK = min(next_pow2(cdiv(M, 2·SMs)), 4)
      with the device's SM count.

Upstream (decided by feature; a covered part is a skipped step unless forced):
    ``qwen_triton_warmup(runner, model_config)``, called by ``kernel_warmup`` from 0.25 for
    the model types in its ``_QWEN_MODEL_TYPES``, warms the first bound GDN layer's shape
    with: conv fwd at T=1, pitch ``conv_dim``, state-index stride 1
    (``_warm_causal_conv1d_fwd_kernel``); post-conv L ∈ ``_FLA_POST_CONV_WARMUP_LENGTHS``
    with aligned contiguous a/b (``_warm_fused_post_conv_kernel``); sigmoid gating with
    index stride 1 (``_warm_fused_sigmoid_gating_delta_rule_update_kernel``); from 0.30 the
    gated RMSNorm over all M keys (``_warm_gated_rms_norm_kernel``). A kwarm variant is
    skipped when its Triton key equals one of those. Still kwarm's on 0.25+: misaligned
    a/b post-conv variants (mixed batches), spec-decode index strides, other layer shapes,
    the gated RMSNorm before 0.30, and the eager decode kernels (never warmed upstream).
    FLA lives in ``vllm.model_executor.layers.fla.ops`` up to 0.25 and
    ``vllm.third_party.flash_linear_attention.ops`` from 0.26: both are tried.

Remove when:
    the oldest supported vLLM warms every production key of these kernels at engine start
    (misaligned post-conv, spec strides, eager decode included), as checked with
    ``--jit-monitor-mode=error`` on a hybrid Qwen model, enforce_eager included.
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.upstream import upstream_qwen_module
from kwarm_ext.kernels.qwen_gdn.common import (
    LAYER_CLASSES, MODEL_TYPE_PREFIXES, MODEL_TYPES, NAME, TRITON_KERNELS, bound_states, decode_runs_eagerly,
    distinct_layers, fla, has_mixed_split_path, max_num_tokens)
from kwarm_ext.kernels.qwen_gdn.checkpoint import _checkpoint_steps
from kwarm_ext.kernels.qwen_gdn.decode import _decode_steps
from kwarm_ext.kernels.qwen_gdn.norm import _norm_steps
from kwarm_ext.kernels.qwen_gdn.prefill import _conv_steps, _post_conv_steps, _sigmoid_steps
from kwarm_ext.surfaces.triton.compat import param_mode

# The family's parts (one module each, beside the shapes and helpers they share in common):
# prefill, prefill checkpoints, decode and norm. What the tests and the family table read:
__all__ = ["applies", "plan", "NAME", "TRITON_KERNELS", "fla", "has_mixed_split_path", "param_mode"]


# ---------------------------------------------------------------------------- applicability

def applies(view) -> str | None:
    if view.is_pooling_model:
        return "pooling model: out of scope, as for upstream's qwen warmup up to 0.26"
    model_type = view.model_type or ""
    if model_type not in MODEL_TYPES and not model_type.startswith(MODEL_TYPE_PREFIXES):
        return f"model type {model_type or '?'} is not Qwen3-Next/3.5"
    layers = view.layers_of(*LAYER_CLASSES)
    if not layers:
        return "no GatedDeltaNet layers in the forward context"
    if not any(bound_states(layer) for layer in layers.values()):
        return "GatedDeltaNet layers have no bound KV cache"
    return None


# ---------------------------------------------------------------------------- planning

def plan(view, forced: bool) -> list:
    upstream = None if forced else upstream_qwen_module(view)
    max_tokens = max_num_tokens(view)
    decode_eager, decode_reason = decode_runs_eagerly(view)
    split_path = has_mixed_split_path()
    steps = []
    works = distinct_layers(view)
    for work in works:
        tag = f"[{work.prefix}]" if len(works) > 1 else ""
        up = upstream if work.upstream else None
        steps += _conv_steps(work, tag, up, max_tokens)
        steps += _post_conv_steps(work, tag, up, max_tokens, split_path)
        steps += _checkpoint_steps(work, tag, view)
        packed = bool(getattr(work.layer, "enable_packed_recurrent_decode", True))
        if split_path or (decode_eager and not packed):
            steps += _sigmoid_steps(work, tag, up)
        else:
            steps.append(Step(f"sigmoid_gating{tag}", "fused_sigmoid_gating_delta_rule_update_kernel",
                              skip="no mixed-batch split path in this vLLM (mixed batches take the "
                                   "chunk path) and decode-only batches take the packed decode"))
        if decode_eager:
            steps += _decode_steps(work, tag, view, packed)
        else:
            steps.append(Step(f"decode{tag}", "_causal_conv1d_update_kernel", skip=decode_reason))
        steps += _norm_steps(work, tag, up, max_tokens)
    return steps
