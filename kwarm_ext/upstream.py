"""Upstream vLLM's own kernel warmups, as data: which release has which, found by presence.

kwarm fills the gaps these leave and does not repeat what they cover (see each family).
Detection imports the named module (vLLM is already imported at warmup time); it never
compares version strings.
"""
from __future__ import annotations

import importlib

# name -> (candidate "module:attr" locations, what it warms, releases seen)
UPSTREAM_WARMUPS = {
    "qwen_triton_warmup": (
        ("vllm.model_executor.warmup.qwen_triton_warmup:qwen_triton_warmup",),
        "Qwen GDN: conv1d fwd, post-conv, sigmoid gating (and zero-KV/slot mapping until 0.26)",
        "0.25+ (PR #46750)"),
    "sparse_mla_triton_warmup": (
        ("vllm.model_executor.warmup.sparse_mla_triton_warmup:sparse_mla_triton_warmup_if_needed",
         "vllm.model_executor.warmup.sparse_mla_triton_warmup:sparse_mla_triton_warmup"),
        "DSA indexer prefill chunk metadata (8 keys), sparse-SWA metadata",
        "0.25-0.29 (PR #47285)"),
    "v1_block_table_warmup": (
        ("vllm.model_executor.warmup.v1_block_table_warmup:warm_v1_block_table_kernels",),
        "slot mapping on a fresh BlockTable (other strides than the runner's)", "0.25-0.28"),
    "kv_block_zeroer_warmup": (
        ("vllm.v1.worker.utils:KVBlockZeroer.warmup",),
        "zero-KV-blocks kernel (n_blocks not specialized from 0.27): kernel_warmup calls it on the V1 runner "
        "(0.27-0.33), Model Runner V2's warmup_kernels on V2 (0.34: only there)", "0.27+"),
    "jit_warmup_registry": (
        ("vllm.model_executor.warmup.jit_warmup:VllmJitKernel",),
        "per-kernel compile-key registry (gated by kernel_config.enable_jit_warmup, which enforce_eager "
        "turns off)", "0.27+"),
    "v2_warmup_kernels": (
        ("vllm.v1.worker.gpu.warmup:warmup_kernels",),
        "Model Runner V2: real prefill and decode steps (input preparation, KV zeroing, Mamba state "
        "kernels); every V2 engine before 0.29, then only with enable_jit_warmup (0.34: or an extensible "
        "KV cache): kwarm's v2_warmup runs it where vLLM does not", "0.20+"),
    "mamba_triton_warmup": (
        ("vllm.model_executor.warmup.mamba_triton_warmup",),
        "mamba align-mode batch_memcpy", "0.30-0.33"),
    "replayssm_lifecycle_warmup": (
        ("vllm.model_executor.warmup.replayssm_warmup:replayssm_lifecycle_warmup",),
        "Mamba/SSM request-lifecycle kernels, with FlashInfer's replay-SSM only", "0.34+"),
    "qwen_vl_triton_warmup": (
        ("vllm.model_executor.warmup.qwen_vl_triton_warmup:qwen_vl_triton_warmup",),
        "Qwen3-VL vision tower kernels and M-RoPE (1, 2, 16 tokens)", "0.33+"),
    "flashinfer_attention_warmup": (
        ("vllm.model_executor.warmup.attention_warmup:mixed_batch_attention_warmup",),
        "FlashInfer attention: one mixed prefill+decode batch through execute_model", "0.33+"),
}


# vLLM attention backend name -> (what runs at request time, who warms it). What `kwarm doctor`
# says per backend; the families' docstrings hold the evidence.
ATTENTION_BACKENDS = {
    "FLASH_ATTN": ("precompiled CUDA kernels (vllm-flash-attn)", "nothing compiles at run time: nothing to warm"),
    "FLASHMLA": ("precompiled CUDA kernels (FlashMLA)", "nothing compiles at run time: nothing to warm"),
    "FLASHMLA_SPARSE": ("precompiled CUDA kernels (FlashMLA); its index conversion is Triton",
                        "the Triton part: dsa_indexer"),
    "TRITON_ATTN": ("Triton: kernel_unified_attention (2D/3D), reduce_segments", "triton_attn"),
    "TRITON_MLA": ("Triton: MLA decode kernels, NUM_KV_SPLITS a constexpr (a power of two from the batch's "
                   "longest context / 512): outside FULL CUDA graphs each new power compiles",
                   "triton_mla"),
    "FLASHINFER": ("FlashInfer's own precompiled or JIT modules", "vLLM's kernel_warmup (FlashInfer dummy runs)"),
    "GDN_ATTN": ("Triton: FLA gated delta-net kernels", "qwen_gdn"),
    "DEEPSEEK_V32_INDEXER": ("Triton and DeepGEMM (JIT)", "dsa_indexer"),
}


def present(name: str) -> bool:
    """Whether the installed vLLM has upstream warmup `name` (a key of UPSTREAM_WARMUPS)."""
    from kwarm_ext.vllm_compat import has, module_exists

    for cand in UPSTREAM_WARMUPS[name][0]:
        if ":" in cand and has(cand):
            return True
        if ":" not in cand and module_exists(cand):
            return True
    return False


def detect() -> dict:
    return {name: present(name) for name in UPSTREAM_WARMUPS}


def upstream_qwen_module(view):
    """vLLM's ``qwen_triton_warmup`` module when its ``kernel_warmup`` runs it for this model."""
    if view.is_pooling_model or not kernel_warmup_calls("qwen_triton_warmup"):
        return None
    try:
        mod = importlib.import_module("vllm.model_executor.warmup.qwen_triton_warmup")
    except ImportError:
        return None
    types = getattr(mod, "_QWEN_MODEL_TYPES", None)
    if types is not None and view.model_type not in types:
        return None
    return mod


def kernel_warmup_calls(name: str) -> bool:
    try:
        mod = importlib.import_module("vllm.model_executor.warmup.kernel_warmup")
    except ImportError:
        return False
    return callable(getattr(mod, name, None))
