"""dsa_indexer, DeepGEMM's MQA-logits output dtype (vLLM 0.34+): which dtype production's
indexer asks DeepGEMM for (:func:`production_logits_dtype`), and the upcast production runs
on logits that are not fp32 (:func:`upcast_as_production`). ``mqa_logits`` calls both.

Before 0.34 the MQA-logits kernels emit fp32 only and the wrappers take no ``logits_dtype``.
0.34's take ``logits_dtype`` (fp32 or bf16; a template parameter of DeepGEMM's kernels, so
each dtype compiles kernels of its own): ``SparseAttnIndexer`` resolves it once, at
construction, from ``attention_config.indexer_logits_dtype`` through vLLM's
``resolve_indexer_logits_dtype("float32")``, after DeepSeek-V3.2's config hook has resolved
"auto" (bfloat16 where the kernels take MX inputs, SM100; float32 elsewhere). A user may set
"bfloat16" on Hopper too: then production's logits are bf16 and, for the fp32 top-k kernels,
upcast through ``as_fp32_logits`` (a Triton kernel, ``_upcast_logits_kernel``).
"""
from __future__ import annotations

from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.kernels.dsa_indexer.common import _SPARSE_ATTN_INDEXER, UPCAST_KERNEL
from kwarm_ext.vllm_compat import resolve_or_none


def production_logits_dtype(op, view) -> str | None:
    """The dtype name (``"float32"``, ``"bfloat16"``) production's indexer op passes to DeepGEMM's
    MQA-logits wrappers: the op's own ``logits_dtype`` (0.34's ``SparseAttnIndexer``), else, where
    no op was found, what its constructor would resolve from the engine's attention config with
    vLLM's resolver; None where this vLLM passes none (before 0.34: fp32 logits)."""
    dtype = getattr(op, "logits_dtype", None)
    if dtype is not None:
        return str(dtype).replace("torch.", "")
    attention = getattr(_vllm_config(view), "attention_config", None)
    resolver = getattr(attention, "resolve_indexer_logits_dtype", None)
    return str(resolver("float32")) if resolver is not None else None


def torch_dtype(name: str | None):
    """The torch dtype of a :func:`production_logits_dtype` name (None stays None)."""
    import torch

    return None if name is None else getattr(torch, name)


def upcast_as_production(output, row_ends) -> str:
    """Production's ``as_fp32_logits(logits, row_ends)`` on a warm call's logits, where they are
    not fp32 and this vLLM has it (0.34+): prefill upcasts every chunk's bf16 logits (DeepSelect,
    SM100, aside), decode those its top-k cannot rank as bf16. Returns what the label adds."""
    import torch

    fn = resolve_or_none(f"{_SPARSE_ATTN_INDEXER}:as_fp32_logits")
    if fn is None or not isinstance(output, torch.Tensor) or output.dtype == torch.float32:
        return ""
    fn(output, row_ends.reshape(-1).to(torch.int32).contiguous())
    return f" +{UPCAST_KERNEL}"
