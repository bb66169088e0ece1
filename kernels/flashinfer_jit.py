"""Warmup family ``flashinfer_jit``: FlashInfer modules that vLLM's chosen backends build with nvcc
on their first call.

Why:
    The FlashInfer wheel ``pip install vllm`` installs (0.7.2.post1) ships no compiled module:
    each is built with nvcc (ninja) into ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` the
    first time it is called, and loaded from there in every later process. vLLM builds some of
    them before it is ready (the sampling module, in its start-up sampler check), not all. Measured
    with ``vllm serve`` at DeepSeek-V3.2's dimensions on vLLM 0.33.0 (BENCHMARKS.md, serving
    benchmark): one request built ``concat_mla`` (6.3 s), which the sparse-MLA prefill calls through
    ``torch.ops.vllm.flashinfer_concat_mla_k`` where its impl says ``_use_flashinfer_concat_mla_k``
    (FlashInfer and ninja present, 128 heads, 128/64 nope/rope dims: DeepSeek-V3/V3.2, GLM-5).

How:
    ``concat_mla_k``: for each distinct (dtype, heads, nope dim, rope dim) of the forward context's
    attention layers whose ``impl._use_flashinfer_concat_mla_k`` is true, the op vLLM calls, on one
    token of tensors of kwarm's own: the module is built (cold cache) or loaded (warm) now, and
    the request finds it loaded. Nothing of the engine's is written.

Upstream (0.33): nothing builds or loads ``concat_mla`` before the first prefill that uses it.

Remove when:
    vLLM loads the FlashInfer modules its chosen backends call before it reports ready, or the
    FlashInfer vLLM installs ships them compiled (``flashinfer-jit-cache``).
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize

FLAG = "_use_flashinfer_concat_mla_k"
OP = "flashinfer_concat_mla_k"


def concat_layers(view) -> dict:
    """Forward-context prefix -> impl of the layers that call FlashInfer's concat_mla_k."""
    return {prefix: layer.impl for prefix, layer in view.forward_context.items()
            if getattr(getattr(layer, "impl", None), FLAG, False)}


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if concat_layers(view):
        return None
    return "no attention layer calls a FlashInfer JIT module on first use (concat_mla_k)"


def plan(view, forced: bool) -> list:
    import torch

    try:
        op = getattr(torch.ops.vllm, OP)
    except (AttributeError, RuntimeError):
        op = None
    if op is None:
        return [Step("concat_mla_k", "flashinfer concat_mla",
                     skip=f"torch.ops.vllm.{OP} is not registered (vLLM registers it where FlashInfer imports)")]
    dtype = getattr(getattr(view.runner, "model_config", None), "dtype", None) or torch.bfloat16
    shapes = sorted({(int(i.num_heads), int(i.qk_nope_head_dim), int(i.qk_rope_head_dim))
                     for i in concat_layers(view).values()})
    device = torch.device(getattr(view.runner, "device", None) or view.device or "cuda")
    return [Step("concat_mla_k", "flashinfer concat_mla", run=lambda: warm_concat(op, shapes, dtype, device))]


def warm_concat(op, shapes, dtype, device) -> list:
    """The op on one token per shape; returns its labels."""
    import torch

    labels = []
    with torch.inference_mode():
        for heads, nope, rope in shapes:
            k_nope = torch.zeros(1, heads, nope, dtype=dtype, device=device)
            k_pe = torch.zeros(1, 1, rope, dtype=dtype, device=device)
            k = torch.empty(1, heads, nope + rope, dtype=dtype, device=device)
            op(k, k_nope, k_pe)
            labels.append(f"{str(dtype).replace('torch.', '')} {heads}x{nope}+{rope}")
    synchronize(device)
    return labels
