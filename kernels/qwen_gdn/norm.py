"""qwen_gdn, the gated RMSNorm of each GDN layer at the row counts its Triton kernel specializes on
(see the package docstring)."""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import int_key
from kwarm_ext.vllm_compat import bind
from kwarm_ext.vllm_compat import resolve
from kwarm_ext.kernels.qwen_gdn.common import fla


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
