"""The DSA indexer family's constants and the helpers its three parts share."""
from __future__ import annotations

import logging

from kwarm_ext import vllm_compat
from kwarm_ext.kernels.attention_groups import vllm_config as _vllm_config
from kwarm_ext.vllm_compat import Missing


logger = logging.getLogger("kwarm")

INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
SPARSE_MLA_BACKEND = "FLASHMLA_SPARSE"
CHUNK_KERNEL = "_build_prefill_chunk_metadata_kernel"
CONVERT_KERNEL = "_convert_req_index_to_global_index_kernel"
CHUNK_KERNEL_033 = "BuildPrefillChunkMetadataKernel.kernel"  # the same kernel, a JIT-kernel class's on 0.33+
# The convert kernel as a JIT-kernel class's (0.33-0.34 here; the qualname Triton reports for it)
CONVERT_KERNEL_033 = "ConvertReqIndexToGlobalIndexKernel.sparse_mla_index_remap_kernel"
FUSED_Q_KERNEL = "_fused_q_kernel"  # the DSA attention's query kernel (0.33+)
UPCAST_KERNEL = "_upcast_logits_kernel"  # 0.34's as_fp32_logits, on bf16 MQA logits (logits_dtype.py)
TRITON_KERNELS = (CHUNK_KERNEL, CHUNK_KERNEL_033, CONVERT_KERNEL, CONVERT_KERNEL_033,
                  FUSED_Q_KERNEL, UPCAST_KERNEL)  # what this family compiles at start (besides DeepGEMM's)

_INDEXER = "vllm.v1.attention.backends.mla.indexer"
_SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"
_FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"
_KERNEL_WARMUP = "vllm.model_executor.warmup.kernel_warmup"
_UPSTREAM_SPARSE = "vllm.model_executor.warmup.sparse_mla_triton_warmup"

# (query_slice_start, query_slice_stop): every pair of Triton int classes production can
# reach (stop > start, so stop == 1 only with start == 0; 0 is in the multiple-of-16 class).
QUERY_SLICES = ((0, 1), (0, 16), (0, 15), (1, 16), (1, 15), (5, 16), (5, 7))
# Decode rows ahead of the prefill rows: seq_lens[start_idx:] at +0 B (aligned) or +4 B.
DECODES_AHEAD = {True: 0, False: 1}
# The prefill rows of the warm batch: one chunk of 16 query tokens, so every slice fits.
PREFILL_QUERY_LENS = (8, 8)
PREFILL_CONTEXT_LENS = (3, 21)
DECODE_SEQ_LEN = 9
# The convert kernel's warm batch: request 0 decodes, request 1 prefills (a mixed batch).
CONVERT_REQ_IDS = (0, 0, 1, 1)
CONVERT_PREFILL_IDS = (-1, -1, 0, 0)

# DeepGEMM: the wrappers of vllm.utils.deep_gemm that production calls (their names are the
# steps' kernel names), the modules production imports them into, and their pre-FP4 names.
MQA_LOGITS = "fp8_fp4_mqa_logits"
PAGED_MQA_LOGITS = "fp8_fp4_paged_mqa_logits"
PAGED_METADATA = "get_paged_mqa_logits_metadata"
_DEEP_GEMM = "vllm.utils.deep_gemm"
_SPARSE_ATTN_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
_ENTRY_OWNERS = {MQA_LOGITS: _SPARSE_ATTN_INDEXER, PAGED_MQA_LOGITS: _SPARSE_ATTN_INDEXER,
                 PAGED_METADATA: _INDEXER}
_LEGACY_NAMES = {MQA_LOGITS: "fp8_mqa_logits", PAGED_MQA_LOGITS: "fp8_paged_mqa_logits"}
MIN_CAPABILITY = (9, 0)  # DeepGEMM's MQA-logits kernels: SM90 (Hopper), SM100, SM120
# get_paged_mqa_logits_metadata's JIT key has kAlignedBatchSize = align(context_lens rows, 32).
METADATA_ROW_ALIGN = 32
# The warm prefill call: query rows (two tokens of one request) and gathered K rows.
PREFILL_ROWS = 2
# -- the live engine -----------------------------------------------------------------------

def _device(view):
    import torch

    device = getattr(view.runner, "device", None) or view.device
    if device is None:
        raise Missing("runner has no device")
    return torch.device(device)


def _jit_warmup_enabled(view) -> bool:
    kernel_config = getattr(_vllm_config(view), "kernel_config", None)
    return bool(getattr(kernel_config, "enable_jit_warmup", True))


def _full_graphs(view) -> bool:
    """Whether CUDA-graph capture runs decode batches with attention metadata (FULL modes)."""
    if view.enforce_eager:
        return False
    return "FULL" in (view.cudagraph_mode or "").upper()


def _registry_keys(view, kernel) -> list | None:
    """Compile keys the runner's JIT warmup registry (0.30+) holds for `kernel`, or None."""
    registry = getattr(view.runner, "jit_warmup_registry", None)
    registrations = getattr(registry, "_registrations", None)
    if not isinstance(registrations, dict) or not _jit_warmup_enabled(view):
        return None
    if kernel not in registrations:
        return None
    keys = []
    for args, kwargs in registrations[kernel]:
        if not args and not kwargs and "vllm_config" in vllm_compat.params(kernel.get_warmup_keys):
            kwargs = {"vllm_config": getattr(registry, "vllm_config", None) or _vllm_config(view)}
        keys.extend(kernel.get_warmup_keys(*args, **kwargs))
    return keys


def _first_attr(obj, *names, default=None):
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


# -- helpers -----------------------------------------------------------------------------------

def _upstream_keys(source: str, fn, *args):
    """Upstream's own compile keys; None (so kwarm warms them too) when they can't be read."""
    try:
        return fn(*args)
    except Exception as exc:
        logger.debug("kwarm: dsa_indexer: keys of upstream %s not readable, warming them too: %s: %s",
                     source, type(exc).__name__, exc)
        return None


def _need(obj, attr: str, what: str):
    value = getattr(obj, attr, None)
    if value is None:
        raise Missing(f"{what} has no {attr}")
    return value



def _synchronize(device) -> None:
    """Surface an asynchronous launch error inside this step, not a later one."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
