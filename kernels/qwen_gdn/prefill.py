"""qwen_gdn, prefill and mixed batches: ``causal_conv1d_fn``, the fused post-conv prep and the
sigmoid-gating recurrent update that mixed batches run for their decodes (see the package docstring)."""
from __future__ import annotations

import types

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import classes_for
from kwarm_ext.kernels.specializations import int_key
from kwarm_ext.kernels.specializations import split_by_key
from kwarm_ext.kernels.specializations import split_steps
from kwarm_ext.surfaces.triton.compat import param_mode
from kwarm_ext.vllm_compat import Missing
from kwarm_ext.vllm_compat import bind
from kwarm_ext.vllm_compat import resolve
from kwarm_ext.kernels.qwen_gdn.common import POST_CONV_LENGTHS, Shape, _CONV, fla, logger


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
    g_exp = production_g_exp(layer)
    labels = []
    with torch.inference_mode():
        for nd, align, length in variants:
            out = conv_output(s, nd + length, dtype, device)[nd:]
            a, b = gate_inputs(s, nd + length, dtype, device)
            a, b = a[nd:], b[nd:]
            kwargs = dict(conv_output=out, a=a, b=b, A_log=layer.A_log, dt_bias=layer.dt_bias,
                          num_k_heads=s.h, head_k_dim=s.k, head_v_dim=s.v, apply_l2norm=True,
                          output_g_exp=g_exp)
            bind(fn, **kwargs)
            fn(**kwargs)
            labels.append(f"L={length},offset_rows={nd},aligned={''.join('yn'[not x] for x in align)}"
                          + (",exp(g)" if g_exp else ""))
        synchronize(device)
    return labels


def production_g_exp(layer) -> bool:
    """The ``output_g_exp`` (a constexpr of ``_fused_post_conv_kernel``) production's prefill passes
    to ``fused_post_conv_prep``: from vLLM 0.34 True under FlashInfer's GDN prefill, which takes
    exp(g) straight from the kernel (``output_g_exp=self.gdn_prefill_backend == "flashinfer"``);
    0.23-0.33 pass False whatever the backend. Told apart by the release's own Qwen warmup config,
    which 0.34 gave the same flag (``post_conv_g_exp``)."""
    import dataclasses

    from kwarm_ext.vllm_compat import resolve_or_none

    if getattr(layer, "gdn_prefill_backend", None) != "flashinfer":
        return False
    config = resolve_or_none("vllm.model_executor.warmup.qwen_triton_warmup:_QwenGDNWarmupConfig")
    return dataclasses.is_dataclass(config) and "post_conv_g_exp" in {f.name for f in dataclasses.fields(config)}


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
