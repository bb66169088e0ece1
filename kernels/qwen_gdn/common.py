"""The qwen_gdn family's constants, its GDN layers' shapes and the engine facts its parts share."""
from __future__ import annotations

import dataclasses
import logging

from kwarm_ext.kernels.specializations import INT_CLASSES
from kwarm_ext.vllm_compat import Missing
from kwarm_ext.vllm_compat import resolve


logger = logging.getLogger("kwarm")

NAME = "qwen_gdn"
# The Triton kernels this family compiles at start (bench/table.py names their owner from these).
TRITON_KERNELS = ("_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "_fused_post_conv_kernel",
                  "fused_sigmoid_gating_delta_rule_update_kernel",
                  "fused_recurrent_gated_delta_rule_packed_decode_kernel", "layer_norm_fwd_kernel",
                  "store_cache_checkpoints_kernel")

MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
MODEL_TYPE_PREFIXES = ("qwen4_exp",)
LAYER_CLASSES = ("QwenGatedDeltaNetAttention", "GatedDeltaNetAttention")

_FLA = ("vllm.third_party.flash_linear_attention.ops", "vllm.model_executor.layers.fla.ops")
_CONV = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
POST_CONV_LENGTHS = INT_CLASSES  # L == 1, L other, L % 16 == 0 (BLOCK_T = 16)


def fla(module: str, attr: str):
    return resolve(*(f"{root}.{module}:{attr}" for root in _FLA))


def bound_states(layer):
    """(conv_state as the kernels want it: (..., dim, width-1), ssm_state) or None."""
    cache = getattr(layer, "kv_cache", None)
    if not isinstance(cache, (tuple, list)) or len(cache) < 2:
        return None
    conv, ssm = cache[0], cache[1]
    if getattr(conv, "numel", lambda: 0)() == 0 or getattr(ssm, "numel", lambda: 0)() == 0:
        return None
    try:
        dim_first = resolve("vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first")()
    except Missing:
        dim_first = False  # releases without the DS layout store (blocks, width-1, dim)
    return (conv if dim_first else conv.transpose(-1, -2)), ssm


# ---------------------------------------------------------------------------- layer shapes

@dataclasses.dataclass(frozen=True)
class Shape:
    """Everything of a layer that enters these kernels' Triton keys (TP-local)."""

    h: int
    hv: int
    k: int
    v: int
    width: int
    conv_dim: int
    pitch: int  # mixed_qkv row stride
    ab_stride: int  # b/a row stride
    a_off: int  # a's element offset in its row buffer
    b_off: int
    index_stride: int  # state-index row stride: 1 + num_spec
    act_dtype: str
    conv_state: tuple  # shape, strides, dtype
    ssm_state: tuple
    has_bias: bool
    activation: str
    norm: tuple


def shape_of(layer, conv_state, ssm_state) -> Shape:
    tp = int(getattr(layer, "tp_size", 1) or 1)
    h, hv = int(layer.num_k_heads) // tp, int(layer.num_v_heads) // tp
    k, v = int(layer.head_k_dim), int(layer.head_v_dim)
    conv_dim = 2 * h * k + hv * v
    interleaved = bool(getattr(layer, "gqa_interleaved_layout", False))
    separate_qkv = hasattr(layer, "in_proj_qkv")  # LoRA: mixed_qkv is its own projection
    # forward_cuda: cat (Qwen3-Next) or own projection -> dense; split of qkvz (Qwen3.5) -> view
    pitch = conv_dim if (interleaved or separate_qkv) else conv_dim + hv * v
    ab_stride, a_off, b_off = hv, 0, 0
    if interleaved and int(layer.num_k_heads) // tp == 1:
        # fix_query_key_value_ordering: b, a = split of the [T, 1, 2*HV] view; reshape keeps views
        ab_stride, a_off, b_off = 2 * hv, hv, 0
    norm = getattr(layer, "norm", None)
    weight = layer.conv1d.weight
    return Shape(
        h=h, hv=hv, k=k, v=v, width=int(weight.shape[-1]), conv_dim=conv_dim, pitch=pitch,
        ab_stride=ab_stride, a_off=a_off, b_off=b_off,
        index_stride=1 + int(getattr(layer, "num_spec", 0) or 0),
        act_dtype=str(weight.dtype),
        conv_state=(tuple(conv_state.shape), tuple(conv_state.stride()), str(conv_state.dtype)),
        ssm_state=(tuple(ssm_state.shape), tuple(ssm_state.stride()), str(ssm_state.dtype)),
        has_bias=getattr(layer.conv1d, "bias", None) is not None,
        activation=str(getattr(layer, "activation", "silu")),
        norm=(str(getattr(getattr(norm, "weight", None), "dtype", None)),
              bool(getattr(norm, "norm_before_gate", True)), str(getattr(norm, "activation", None)),
              getattr(norm, "group_size", None)),
    )


@dataclasses.dataclass
class LayerWork:
    """One distinct shape: its first layer (whose real tensors are used) and the shape."""

    prefix: str
    layer: object
    conv_state: object
    ssm_state: object
    shape: Shape
    upstream: bool  # upstream's qwen warmup uses this layer's shape (the first bound layer)


def distinct_layers(view) -> list:
    out, seen, first = [], {}, None
    for prefix, layer in view.layers_of(*LAYER_CLASSES).items():
        states = bound_states(layer)
        if states is None:
            continue
        shape = shape_of(layer, *states)
        if first is None:
            first = shape
        if shape in seen:
            continue
        seen[shape] = prefix
        out.append(LayerWork(prefix, layer, states[0], states[1], shape, upstream=shape == first))
    return out


def max_num_tokens(view) -> int:
    return int(view.max_num_batched_tokens or getattr(view.runner, "max_num_tokens", 0) or 16)


def decode_runs_eagerly(view):
    """(True, None) when decode batches are not compiled by FULL CUDA-graph capture."""
    if view.enforce_eager:
        return True, None
    mode = view.cudagraph_mode
    if mode is None:
        return False, "cudagraph mode unknown: assuming FULL decode capture compiles the decode kernels"
    if "FULL" in str(mode).upper():
        return False, f"compiled by FULL CUDA-graph capture of decode batches (cudagraph_mode={mode})"
    return True, None


def has_mixed_split_path() -> bool:
    """0.23+: mixed batches peel decodes off to the recurrent kernel (prefill tail sliced)."""
    try:
        meta = resolve("vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata")
    except Missing:
        return False
    return "prefill_state_indices" in getattr(meta, "__dataclass_fields__", {})
