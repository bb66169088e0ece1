"""The DSA attention's query kernel on vLLM 0.33+: ``_fused_q_kernel``
(``vllm/models/deepseek_v32/common/kernels.py``), launched by ``fused_q`` from
``DeepseekV32Attention.forward`` on every forward of every DSA layer (RoPE and FP8 packing of
the MLA query, RoPE and FP8 quantization of the indexer's query, the indexer's weights).

Its compile key holds no token count: strides and pointers stay multiples of 16 whatever the
batch, so it is the constexprs that make its variants, and the layer's forward picks between
two query layouts (``_should_prepare_mqa_query``):

- MQA (decodes, FULL CUDA graphs, capture, prefills that do not take the sparse MHA path):
  the query's no-RoPE part absorbed into the latent space (``QL_NOPE_DIM`` = the weight
  ``W_UK_T``'s last dim, the KV LoRA rank), FP8-packed where the backend takes an FP8 query
  (``_fp8_query``);
- MHA (prefills that take the dense or masked sparse-MHA path): the no-RoPE part as it comes
  out of ``q_b_proj`` (``QL_NOPE_DIM`` = ``qk_nope_head_dim``), never FP8-packed.

Capture and the V2 runner's warmup steps reach the MQA layout only: the MHA one was compiled
by the first prefill that took it (DeepSeek-V3.2 at published dimensions, vLLM 0.33.0: request
4 x 333 tokens, 0.29 s against 0.05 s for its repeat; BENCHMARKS.md). This step launches
vLLM's own ``fused_q`` in both layouts for each distinct layer configuration (heads, dims,
indexer or not, RoPE interleave), with two tokens of fresh tensors shaped as the forward
shapes them: the launch options, constexprs and dtypes are production's. Releases before 0.33
have no ``fused_q``: the step is skipped there.
"""
from __future__ import annotations

import dataclasses
import sys

from kwarm_ext.kernels.attention_groups import model_dtype
from kwarm_ext.kernels.dsa_indexer.common import FUSED_Q_KERNEL, _device, _need, _synchronize
from kwarm_ext.vllm_compat import Missing, resolve_or_none

ATTENTION_CLASSES = ("DeepseekV32Attention",)  # GLM-5's DSA layers are this class too (0.33)
_KERNELS = "vllm.models.deepseek_v32.common.kernels"
TOKENS = 2


@dataclasses.dataclass(frozen=True)
class FusedQVariant:
    """One launch of ``fused_q``: a layer configuration and a query layout."""
    heads: int
    nope_dim: int
    rope_dim: int
    latent_dim: int  # QL_NOPE_DIM of the MQA layout
    indexer_heads: int  # 0: no indexer on this layer
    indexer_dim: int
    interleave: bool
    mqa: bool  # the MQA layout (else MHA)
    quantize: bool  # FP8-pack the MQA query

    def label(self) -> str:
        layout = f"MQA{' fp8' if self.quantize else ''}" if self.mqa else "MHA"
        return f"{layout}, {self.heads} heads{', indexer' if self.indexer_heads else ''}"


def fused_q_entry(layer=None):
    """The ``fused_q`` the layer's module calls (production's binding), else the kernels
    module's; raises Missing where this vLLM has none (before 0.33)."""
    owner = sys.modules.get(type(layer).__module__) if layer is not None else None
    fn = getattr(owner, "fused_q", None) or resolve_or_none(f"{_KERNELS}:fused_q")
    if fn is None:
        raise Missing("no fused_q in this vLLM (DSA attention's query kernel, 0.33+)")
    return fn


def layer_variants(layer) -> list:
    """Both query layouts of one DSA attention layer, as its forward would launch them."""
    indexer = getattr(layer, "indexer", None)
    has_indexer = indexer is not None and not getattr(layer, "skip_topk", False)
    w_uk_t = getattr(layer, "W_UK_T", None)
    what = type(layer).__name__
    latent = int(w_uk_t.shape[-1]) if w_uk_t is not None else int(_need(layer, "kv_lora_rank", what))
    common = dict(heads=int(_need(layer, "num_local_heads", what)),
                  nope_dim=int(_need(layer, "qk_nope_head_dim", what)),
                  rope_dim=int(_need(layer, "qk_rope_head_dim", what)), latent_dim=latent,
                  indexer_heads=int(indexer.n_head) if has_indexer else 0,
                  indexer_dim=int(indexer.head_dim) if has_indexer else 0,
                  interleave=bool(getattr(layer, "_index_rope_interleave", False)))
    return [FusedQVariant(**common, mqa=True, quantize=bool(getattr(layer, "_fp8_query", False))),
            FusedQVariant(**common, mqa=False, quantize=False)]


def run_variant(fn, layer, variant: FusedQVariant, device, dtype) -> list:
    """Launch `fn` (vLLM's ``fused_q``) once in `variant`'s layout, on `layer`'s RoPE caches and
    query scale, with the tensors of a two-token forward."""
    import torch

    t, h = TOKENS, variant.heads
    positions = torch.arange(t, device=device, dtype=torch.int64)
    q = torch.zeros(t, h, variant.nope_dim + variant.rope_dim, device=device, dtype=dtype)
    q_nope, q_pe = q.split([variant.nope_dim, variant.rope_dim], dim=-1)  # views, as the forward's
    if variant.mqa:  # bmm over heads, then back to tokens first: strides (L, T * L, 1)
        ql_nope = torch.zeros(h, t, variant.latent_dim, device=device, dtype=dtype).transpose(0, 1)
    else:
        ql_nope = q_nope
    index_q = index_weights = index_cache = None
    softmax_scale = head_scale = 0.0
    if variant.indexer_heads:
        index_q = torch.zeros(t, variant.indexer_heads, variant.indexer_dim, device=device, dtype=dtype)
        kw = torch.zeros(t, variant.indexer_dim + variant.indexer_heads, device=device, dtype=dtype)
        index_weights = kw[:, variant.indexer_dim:]  # the slice of wk_weights_proj's output
        index_cache = layer.indexer_rope_emb.cos_sin_cache
        softmax_scale, head_scale = float(layer.indexer.softmax_scale), variant.indexer_heads ** -0.5
    q_scale = getattr(layer, "_q_scale", None)
    if q_scale is None:
        q_scale = torch.ones(1, device=device, dtype=torch.float32)
    with torch.inference_mode():
        fn(positions, q_pe, layer.rotary_emb.cos_sin_cache, index_q, index_cache, ql_nope, q_scale,
           index_weights, softmax_scale, head_scale, has_indexer=bool(variant.indexer_heads),
           index_rope_interleave=variant.interleave, quantize_mqa=variant.quantize)
    _synchronize(device)
    return [variant.label()]


def _fused_q_steps(view, forced: bool) -> list:
    from kwarm_ext.families import Step

    layers = view.layers_of(*ATTENTION_CLASSES)
    if not layers:
        return [Step("fused_q", FUSED_Q_KERNEL, skip="no DeepseekV32Attention layer")]
    todo = {}  # variant -> a layer that launches it
    try:
        fn = fused_q_entry(next(iter(layers.values())))
        for layer in layers.values():
            for variant in layer_variants(layer):
                todo.setdefault(variant, layer)
        device = _device(view)
    except Missing as exc:  # no fused_q (before 0.33), or a layer without what the forward reads
        return [Step("fused_q", FUSED_Q_KERNEL, skip=str(exc))]
    dtype = model_dtype(view)
    return [Step(f"fused_q {variant.label()}", FUSED_Q_KERNEL,
                 run=lambda variant=variant, layer=layer: run_variant(
                     fn, layer, variant, device, dtype or layer.rotary_emb.cos_sin_cache.dtype))
            for variant, layer in todo.items()]
