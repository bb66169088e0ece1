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

import dataclasses
import logging
import types

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import INT_CLASSES, classes_for, int_key, split_by_key, split_steps
from kwarm_ext.upstream import upstream_qwen_module
from kwarm_ext.triton_compat import param_mode
from kwarm_ext.vllm_compat import Missing, bind, resolve

logger = logging.getLogger("kwarm")

NAME = "qwen_gdn"
# The Triton kernels this family compiles at start (bench/table.py names their owner from these).
TRITON_KERNELS = ("_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel", "_fused_post_conv_kernel",
                  "fused_sigmoid_gating_delta_rule_update_kernel",
                  "fused_recurrent_gated_delta_rule_packed_decode_kernel", "layer_norm_fwd_kernel")

MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
MODEL_TYPE_PREFIXES = ("qwen4_exp",)
LAYER_CLASSES = ("QwenGatedDeltaNetAttention", "GatedDeltaNetAttention")

_FLA = ("vllm.third_party.flash_linear_attention.ops", "vllm.model_executor.layers.fla.ops")
_CONV = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
POST_CONV_LENGTHS = INT_CLASSES  # L == 1, L other, L % 16 == 0 (BLOCK_T = 16)


def fla(module: str, attr: str):
    return resolve(*(f"{root}.{module}:{attr}" for root in _FLA))


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


# --- prefill conv ------------------------------------------------------------------------

def _conv_steps(work, tag, upstream, max_tokens) -> list:
    name, kernel_name = f"causal_conv1d_fn{tag}", "_causal_conv1d_fwd_kernel"
    try:
        fn = resolve(f"{_CONV}:causal_conv1d_fn")
        kernel = resolve(f"{_CONV}:_causal_conv1d_fwd_kernel")
    except Missing as exc:
        return [Step(name, kernel_name, skip=str(exc))]
    modes = {p: param_mode(kernel, p) for p in ("seqlen", "stride_x_token", "stride_o_token")}
    s = work.shape
    counts = tuple(t for t in classes_for(modes["seqlen"]) if t <= max_tokens) or (1,)

    def key(t, x_pitch, out_pitch, index_stride, has_bias):
        return (int_key(t, modes["seqlen"]), int_key(x_pitch, modes["stride_x_token"]),
                int_key(out_pitch, modes["stride_o_token"]), index_stride, has_bias)

    up_keys = set()
    if upstream is not None and hasattr(upstream, "_warm_causal_conv1d_fwd_kernel"):
        # upstream: x = [1, conv_dim].T (dense), state indices [1] (stride 1), no bias
        up_keys = {key(1, s.conv_dim, s.conv_dim, 1, False)}
    todo, covered = split_by_key(
        counts, lambda t: key(t, s.pitch, conv_output(s, t).stride(0), s.index_stride, s.has_bias), up_keys)
    return split_steps(name, kernel_name, todo, covered, "qwen_triton_warmup (causal_conv1d_fn)",
                       lambda: warm_conv_fwd(work, fn, todo))


def warm_conv_fwd(work, fn, counts) -> list:
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(-1))
    labels = []
    with torch.inference_mode():
        for count in counts:
            rows = torch.empty((count, s.pitch), dtype=dtype, device=device)
            x = rows[:, : s.conv_dim].transpose(0, 1)  # mixed_qkv_non_spec.transpose(0, 1)
            qsl = torch.tensor([0, count], dtype=torch.int32, device=device)
            kwargs = dict(activation=layer.activation, conv_states=work.conv_state,
                          has_initial_state=torch.zeros(1, dtype=torch.bool, device=device),
                          cache_indices=state_indices(1, s.index_stride, device),
                          query_start_loc=qsl, metadata=conv_metadata(qsl, device))
            bind(fn, x, weight, layer.conv1d.bias, **kwargs)
            fn(x, weight, layer.conv1d.bias, **kwargs)
            labels.append(f"seqlen={count},pitch={s.pitch}")
        synchronize(device)
    return labels


def state_indices(n: int, row_stride: int, device):
    """``block_table[:, 0]`` of n rows, every entry the null block: the kernels skip it."""
    import torch

    null = int(resolve("vllm.v1.attention.backends.utils:NULL_BLOCK_ID"))
    return torch.full((n, row_stride), null, dtype=torch.int32, device=device)[:, 0]


def conv_metadata(query_start_loc, device):
    """What the GDN metadata builder hands causal_conv1d_fn (``metadata=attn_metadata``)."""
    try:
        build = resolve("vllm.v1.attention.backends.utils:compute_causal_conv1d_metadata")
        nums, batch_ptr, offsets = build(query_start_loc.cpu(), device=device)
    except (Missing, TypeError) as exc:
        logger.debug("kwarm: conv metadata unavailable (%s); causal_conv1d_fn builds its own", exc)
        return None
    return types.SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)


# --- post-conv ----------------------------------------------------------------------------

def conv_output(s: Shape, rows: int, dtype=None, device="cpu"):
    """The prefill conv's output as post-conv gets it: ``causal_conv1d_fn`` returns
    ``torch.empty_like(x)`` for ``x = mixed_qkv.T`` (so its token stride is the pitch when that
    x is dense, i.e. rows == 1, else conv_dim), transposed back by ``_forward_core``. Planning
    asks for the layout with a small uint8 CPU tensor: CPU and CUDA share ``empty_like``'s
    stride rule, the meta device does not (it makes size-1 dims contiguous)."""
    import torch

    dtype = torch.uint8 if dtype is None else dtype

    x = torch.empty((rows, s.pitch), dtype=dtype, device=device)[:, : s.conv_dim].transpose(0, 1)
    return torch.empty_like(x).transpose(0, 1)


def post_conv_variants(s: Shape, split_path: bool, itemsize: int, lengths, key) -> list:
    """(num_decode_tokens, (conv, a, b) 16-byte aligned?, L), one per distinct Triton key.

    Prefill-only batches start at the buffers' base; mixed batches (split path) slice off
    ``num_decode_tokens`` rows in front. The conv output's row stride follows conv_output().
    """
    seen, out = set(), []
    for nd in (range(0, 17) if split_path else (0,)):
        for length in lengths:
            pitch = conv_output(s, nd + length).stride(0)
            align = ((nd * pitch * itemsize) % 16 == 0,
                     ((s.a_off + nd * s.ab_stride) * itemsize) % 16 == 0,
                     ((s.b_off + nd * s.ab_stride) * itemsize) % 16 == 0)
            k = key(length, pitch, s.ab_stride, align)
            if k not in seen:
                seen.add(k)
                out.append((nd, align, length, k))
    return out


def _post_conv_steps(work, tag, upstream, max_tokens, split_path) -> list:
    import torch

    name, kernel_name = f"fused_post_conv_prep{tag}", "_fused_post_conv_kernel"
    try:
        fn = fla("fused_gdn_prefill_post_conv", "fused_post_conv_prep")
        kernel = fla("fused_gdn_prefill_post_conv", "_fused_post_conv_kernel")
    except Missing as exc:
        return [Step(name, kernel_name, skip=str(exc))]
    s = work.shape
    itemsize = torch.empty((), dtype=work.layer.conv1d.weight.dtype).element_size()
    modes = {p: param_mode(kernel, p) for p in ("L", "stride_x_tok", "stride_a_tok", "stride_b_tok")}

    def key(length, x_tok, ab_tok, align):
        return (int_key(length, modes["L"]), int_key(x_tok, modes["stride_x_tok"]),
                int_key(ab_tok, modes["stride_a_tok"]), align)

    lengths = tuple(n for n in POST_CONV_LENGTHS if n <= max_tokens) or (1,)
    variants = [v[:3] for v in post_conv_variants(s, split_path, itemsize, lengths, key)]
    up_keys = set()
    if upstream is not None and hasattr(upstream, "_warm_fused_post_conv_kernel"):
        # upstream: fresh contiguous [L, conv_dim] conv output, aligned contiguous [L, HV] a/b
        up_lengths = tuple(getattr(upstream, "_FLA_POST_CONV_WARMUP_LENGTHS", POST_CONV_LENGTHS))
        up_keys = {key(n, s.conv_dim, s.hv, (True, True, True)) for n in up_lengths}
    todo, covered = split_by_key(
        variants, lambda v: key(v[2], conv_output(s, v[0] + v[2]).stride(0), s.ab_stride, v[1]), up_keys)
    return split_steps(name, kernel_name, todo, covered, "qwen_triton_warmup (fused_post_conv_prep)",
                       lambda: warm_post_conv(work, fn, todo))


def warm_post_conv(work, fn, variants) -> list:
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    labels = []
    with torch.inference_mode():
        for nd, align, length in variants:
            out = conv_output(s, nd + length, dtype, device)[nd:]
            a, b = gate_inputs(s, nd + length, dtype, device)
            a, b = a[nd:], b[nd:]
            kwargs = dict(conv_output=out, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                          num_k_heads=s.h, head_k_dim=s.k, head_v_dim=s.v, apply_l2norm=True,
                          output_g_exp=False)
            bind(fn, **kwargs)
            fn(**kwargs)
            labels.append(f"L={length},offset_rows={nd},aligned={''.join('yn'[not x] for x in align)}")
        synchronize(device)
    return labels


def gate_inputs(s: Shape, rows: int, dtype, device):
    """b and a as forward_cuda hands them to _forward_core (see shape_of)."""
    import torch

    if s.ab_stride == s.hv:
        return (torch.empty((rows, s.hv), dtype=dtype, device=device),
                torch.empty((rows, s.hv), dtype=dtype, device=device))
    ba = torch.empty((rows, s.ab_stride), dtype=dtype, device=device)
    return ba[:, s.a_off: s.a_off + s.hv], ba[:, s.b_off: s.b_off + s.hv]


# --- recurrent: sigmoid gating (mixed batches' decode head) --------------------------------

def _sigmoid_steps(work, tag, upstream) -> list:
    name, kernel_name = f"sigmoid_gating{tag}", "fused_sigmoid_gating_delta_rule_update_kernel"
    try:
        fn = fla("fused_sigmoid_gating", "fused_sigmoid_gating_delta_rule_update")
    except Missing as exc:
        return [Step(name, kernel_name, skip=str(exc))]
    # N and T are do_not_specialize: one key per shape; upstream's indices are [1, 1] (stride 1)
    covered = (upstream is not None
               and hasattr(upstream, "_warm_fused_sigmoid_gating_delta_rule_update_kernel")
               and work.shape.index_stride == 1)
    return split_steps(name, kernel_name, () if covered else (1,), (1,) if covered else (),
                       "qwen_triton_warmup (fused_sigmoid_gating_delta_rule_update)",
                       lambda: warm_sigmoid(work, fn))


def warm_sigmoid(work, fn) -> list:
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    with torch.inference_mode():
        a, b = gate_inputs(s, 1, dtype, device)
        kwargs = dict(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias,
                      q=torch.empty((1, 1, s.h, s.k), dtype=dtype, device=device),
                      k=torch.empty((1, 1, s.h, s.k), dtype=dtype, device=device),
                      v=torch.empty((1, 1, s.hv, s.v), dtype=dtype, device=device),
                      initial_state=work.ssm_state, inplace_final_state=True,
                      cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device),
                      ssm_state_indices=state_indices(1, s.index_stride, device),
                      use_qk_l2norm_in_kernel=True)
        bind(fn, **kwargs)
        fn(**kwargs)
        synchronize(device)
    return [f"non-spec,index_stride={s.index_stride}"]


# --- decode-only (eager) -------------------------------------------------------------------

def _decode_steps(work, tag, view, packed: bool) -> list:
    steps = []
    try:
        update = resolve(f"{_CONV}:causal_conv1d_update")
        kernel = resolve(f"{_CONV}:_causal_conv1d_update_kernel")
    except Missing as exc:
        return [Step(f"conv_update{tag}", "_causal_conv1d_update_kernel", skip=str(exc))]
    limit = int(view.max_num_reqs or max_num_tokens(view))
    counts = tuple(n for n in classes_for(param_mode(kernel, "batch")) if n <= limit) or (1,)
    steps.append(Step(f"conv_update{tag}", "_causal_conv1d_update_kernel",
                      run=lambda: warm_conv_update(work, update, counts)))
    if packed:
        try:
            decode = fla("fused_recurrent", "fused_recurrent_gated_delta_rule_packed_decode")
        except Missing as exc:
            steps.append(Step(f"packed_decode{tag}", "fused_recurrent_gated_delta_rule_packed_decode_kernel",
                              skip=str(exc)))
        else:
            steps.append(Step(f"packed_decode{tag}", "fused_recurrent_gated_delta_rule_packed_decode_kernel",
                              run=lambda: warm_packed_decode(work, update, decode)))
    return steps


def _decode_inputs(work, batch: int):
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    mixed_qkv = torch.empty((batch, s.pitch), dtype=dtype, device=device)[:, : s.conv_dim]
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(-1))
    return mixed_qkv, weight, state_indices(batch, s.index_stride, device)


def warm_conv_update(work, update, counts) -> list:
    import torch

    layer, labels = work.layer, []
    with torch.inference_mode():
        for batch in counts:
            mixed_qkv, weight, indices = _decode_inputs(work, batch)
            args = (mixed_qkv, work.conv_state, weight, layer.conv1d.bias, layer.activation)
            bind(update, *args, conv_state_indices=indices, validate_data=False)
            update(*args, conv_state_indices=indices, validate_data=False)
            labels.append(f"batch={batch}")
        synchronize(work.conv_state.device)
    return labels


def warm_packed_decode(work, update, decode) -> list:
    import torch

    s, layer = work.shape, work.layer
    device, dtype = work.conv_state.device, layer.conv1d.weight.dtype
    with torch.inference_mode():
        mixed_qkv, weight, indices = _decode_inputs(work, 1)
        # the packed kernel reads the conv update's in-place output (same pitch)
        mixed_qkv = update(mixed_qkv, work.conv_state, weight, layer.conv1d.bias, layer.activation,
                           conv_state_indices=indices, validate_data=False)
        a, b = gate_inputs(s, 1, dtype, device)
        out = torch.zeros((1, s.hv, s.v), dtype=dtype, device=device)[:1].unsqueeze(1)
        kwargs = dict(mixed_qkv=mixed_qkv, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                      scale=s.k ** -0.5, initial_state=work.ssm_state, out=out,
                      ssm_state_indices=indices, use_qk_l2norm_in_kernel=True)
        bind(decode, **kwargs)
        decode(**kwargs)
        synchronize(device)
    return [f"pitch={s.pitch},ab_stride={s.ab_stride}"]


# --- gated RMSNorm -------------------------------------------------------------------------

def norm_uses_triton(layer) -> bool:
    """Whether production reaches ``layer_norm_fwd_kernel`` for this layer's gated norm."""
    if getattr(layer, "enable_fused_gdn_decode", False):
        return True  # 0.28 fused path: _rms_norm_gated_cuda calls layer_norm_fwd directly
    norm = getattr(layer, "norm", None)
    method = getattr(norm, "_forward_method", None)
    target = getattr(type(norm), "forward_cuda", None)
    return target is not None and getattr(method, "__func__", None) is target


def sm_count(device) -> int:
    import torch

    if getattr(device, "type", None) == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return int(resolve("vllm.utils.platform_utils:num_compute_units")(getattr(device, "index", None)))


def rows_per_block(m: int, sms: int) -> int:
    blocks = -(-m // (2 * sms))
    return min(1 << max(0, (blocks - 1).bit_length()), 4)


def norm_row_counts(hv: int, max_tokens: int, sms: int) -> list:
    """(tokens, M, ROWS_PER_BLOCK): the first token count of each (class of M, RPB) key."""
    seen, out = set(), []
    for tokens in range(1, max_tokens + 1):
        m = tokens * hv
        key = (int_key(m, "class"), rows_per_block(m, sms))
        if key not in seen:
            seen.add(key)
            out.append((tokens, m, key[1]))
    return out


def _norm_steps(work, tag, upstream, max_tokens) -> list:
    name, kernel_name = f"gated_rmsnorm{tag}", "layer_norm_fwd_kernel"
    layer = work.layer
    if not norm_uses_triton(layer):
        return [Step(name, kernel_name, skip="RMSNormGated runs forward_native here "
                                             "(compiled with the model, no runtime Triton JIT)")]
    if upstream is not None and hasattr(upstream, "_warm_gated_rms_norm_kernel"):
        return [Step(f"{name}[upstream]", kernel_name,
                     skip="covered by upstream qwen_triton_warmup (warmup_layer_norm_fwd)")]
    try:
        forward = layer.norm.forward_cuda
        fla("layernorm_guard", "layer_norm_fwd")
        sms = sm_count(work.conv_state.device)
    except Exception as exc:  # no SM count (no device) or no FLA layer norm
        return [Step(name, kernel_name, skip=f"cannot plan the gated RMSNorm: {type(exc).__name__}: {exc}")]
    counts = norm_row_counts(work.shape.hv, max_tokens, sms)
    return [Step(name, kernel_name, run=lambda: warm_norm(work, forward, counts))]


def warm_norm(work, forward, counts) -> list:
    import torch

    s = work.shape
    device, dtype = work.conv_state.device, work.layer.conv1d.weight.dtype
    labels = []
    with torch.inference_mode():
        for tokens, m, rpb in counts:
            # _output_projection: core_attn_out.reshape(-1, V), z.reshape(-1, V)
            x = torch.empty((m, s.v), dtype=dtype, device=device)
            z = torch.empty((m, s.v), dtype=dtype, device=device)
            bind(forward, x, z)
            forward(x, z)
            labels.append(f"M={m},rows_per_block={rpb}")
        synchronize(device)
    return labels
