"""qwen_gdn, decode-only batches outside CUDA graphs: the conv update and the packed recurrent
decode (see the package docstring)."""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import classes_for
from kwarm_ext.surfaces.triton.compat import param_mode
from kwarm_ext.vllm_compat import Missing
from kwarm_ext.vllm_compat import bind
from kwarm_ext.vllm_compat import resolve
from kwarm_ext.kernels.qwen_gdn.common import _CONV, fla, max_num_tokens
from kwarm_ext.kernels.qwen_gdn.prefill import gate_inputs, state_indices


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
