"""Warmup family ``dsa_indexer``: GLM-5 / DeepSeek-V3.2 DSA prefill chunk metadata, sparse-MLA
indices, and the indexer's DeepGEMM logits kernels.

Why:
    Two plain ``@triton.jit`` kernels of DSA models are first compiled by a request, not by
    engine start (gpu-baseline, H200, vLLM 0.24: ``build_prefill_chunk_metadata`` costs
    1.17 s on its first call, inside the tiny DeepSeek-V3.2's first request):

    - ``_build_prefill_chunk_metadata_kernel`` (``v1/attention/backends/mla/indexer.py``),
      launched by ``build_prefill_chunk_metadata`` for every prefill chunk of the indexer.
      Its runtime-specialized arguments are ``query_slice_start`` / ``query_slice_stop``
      (Triton int classes: ``1``, multiple of 16, other) and the 16-byte alignment of
      ``uncompressed_seq_lens[start_idx:end_idx]``: decodes come first in a batch, so that
      int32 view is misaligned whenever ``start_idx % 4 != 0``. On 0.34 an indexer on ShardQ
      (``use_shardq``: tensor parallelism, ``sparse_mla_shard_q`` on, FLASHMLA_SPARSE with an
      FP8 cache under 32 heads a rank or FlashInfer's sparse MLA, no DCP/PCP) also passes the
      tokens' ``positions``, sliced at the chunk's first token: one more pointer, misaligned
      whenever that many tokens precede it ``% 4 != 0``. Capture never builds prefill metadata
      (MRV2's prefill warmup step, 0.29+, compiles its one batch's key), so each
      (start, stop, alignment) class is a first-request compile.
    - ``_convert_req_index_to_global_index_kernel`` (``v1/attention/backends/mla/sparse_utils.py``),
      launched by FLASHMLA_SPARSE through ``triton_convert_req_index_to_global_index``.
      FULL CUDA-graph capture compiles the decode variant; the FP8-KV prefill-workspace
      variant (``HAS_PREFILL=True``) only ever appears at runtime, and with eager execution
      (or piecewise-only graphs) every variant does.

    And the indexer's DeepGEMM kernels, which DeepGEMM JIT-compiles (nvcc, cached in
    ``DG_JIT_CACHE_DIR``) at first use, invisible to Triton's compile hook and to vLLM's JIT
    monitor (gpu-baseline, H200, vLLM 0.26: the first 1 x 200-token request took 3.77 s vs
    0.032 s for its repeat, 2.76 s of it inside ``deep_gemm._C.fp8_fp4_mqa_logits``):

    - ``fp8_fp4_mqa_logits`` (every prefill chunk of ``sparse_attn_indexer``): nothing at
      engine start runs a prefill through the indexer (the profile run returns early,
      capture records decode batches only), so the first prompt always compiles it;
    - ``fp8_fp4_paged_mqa_logits`` and ``get_paged_mqa_logits_metadata`` (decode; the
      metadata is built eagerly by ``DeepseekV32IndexerMetadataBuilder.build``). FULL decode
      CUDA-graph capture compiles the logits kernel for the capture batches' ``next_n`` and
      the metadata kernel for the captured batch classes; eager engines, piecewise-only
      graphs, MTP steps shorter than ``1 + num_speculative_tokens`` (short prefills count as
      decodes), and decode batches beyond the captured sizes compile at runtime.

    And, on 0.33+, the DSA attention's query kernel ``_fused_q_kernel`` (``fused_q``, every
    forward of every DSA layer): capture and the V2 warmup steps reach its MQA layout only, so
    the first prefill on the sparse-MHA path compiled the MHA one (DeepSeek-V3.2 at published
    dimensions, vLLM 0.33.0: 0.29 s in a 4 x 333-token request, 0.05 s its repeat). Both layouts
    of each distinct layer, through vLLM's ``fused_q`` (``fused_q.py``).

How:
    Through vLLM's own entry functions, called the way the production callers call them
    (``DeepseekV32IndexerMetadataBuilder.build`` -> ``split_indexer_prefill_chunks`` ->
    ``build_prefill_chunk_metadata``; ``FlashMLASparseImpl._forward_*``), so launch options,
    constexprs and argument dtypes (int32 ``query_start_loc`` / ``seq_lens``) are the
    production ones. Small fresh tensors on the runner's device under
    ``torch.inference_mode()``; the block table passed in is a row slice of the runner's
    real one for that KV-cache group (read only: neither kernel writes it, and nothing here
    touches KV blocks): the V1 runner's ``MultiGroupBlockTable`` (0.20-0.33), Model Runner V2's
    ``input_block_tables`` (the only runner on 0.34). DCP arguments (0.25+) and ShardQ (0.34:
    ``use_shardq``, the positions of the warm batch's tokens) come from the live indexer
    metadata builder;
    the convert variants from the live FLASHMLA_SPARSE builder (KV dtype, mixed-batch
    choice), the CUDA-graph mode and the entry's signature. 0.30+ changed the convert call
    (BLOCK_STRIDE_ROWS, index groups): only its FP8 prefill-workspace call is modelled
    there. No collectives.

    DeepGEMM: through the wrappers of ``vllm.utils.deep_gemm`` as production's modules import
    them (``sparse_attn_indexer`` and the indexer metadata module), with production's
    keywords as each release's signature takes them (``clean_logits=False`` 0.20-0.28,
    ``max_seqlen_k`` 0.33; ``indices=None`` 0.28+; a wrapper whose signature does not bind
    is a skipped step). What specializes DeepGEMM's JIT (SM90 templates of the vendored
    DeepGEMM 2.5-2.8, ``include/deep_gemm/impls/sm90_fp8_*mqa_logits.cuh`` and
    ``scheduler/*paged_mqa_logits.cuh``; runtime values are sizes, lengths, pointers):

    - prefill ``<heads, head_dim, [compressed logits], BLOCK_Q = 128 / heads, BLOCK_KV,
      stages, SMs, threads, logits dtype>``: no sequence length, so one call per indexer
      shape (Q ``[2, H, D]`` fp8, K ``[2, D]`` fp8 and fp32 scales shaped by production's
      ``_gather_workspace_shapes``, fp32 weights, int32 ``cu_seqlen_ks/ke``);
    - decode logits ``<next_n, heads, head_dim, BLOCK_KV = cache block size,
      2-D context_lens, varlen, ..., [KV multicast = next_n == 4 on SM90], logits dtype>``:
      one call per kernel ``next_n`` (Q ``[1, next_n, H, D]``, the bound cache through
      production's ``kv_cache_as_quant_view``, context lengths ``[[1 .. next_n]]``, a block
      table of zeros, so only the null block 0, which no request owns, is read; the kernel
      writes only its fresh logits);
    - metadata ``<aligned batch = align(rows, 32), SPLIT_KV, SM slots, varlen>``: one call
      per 32-row class up to the most rows a decode step can have, per slot count.

    Heads and head_dim come from the indexer module owning the bound
    ``DeepseekV32IndexerCache`` (``n_head``: replicated across TP ranks in every release),
    block size and bytes per token from the bound cache, the FP8/MXFP4 layout and
    ``max_model_len`` from its ``SparseAttnIndexer``; the SM count, ``next_n = 1 +
    num_speculative_tokens``, flattening and the metadata block size from the live metadata
    builder. A step whose longest decode is ``d`` runs the kernel with ``next_n = d`` when
    native (``use_flattening`` off; 0.28+ also ``_supports_native_decode(d)``: SM90 takes
    1, 2, 4) and else flattens to ``next_n = 1`` with one row per token. Under FULL decode
    graphs the capture's ``next_n`` and its batch classes (from ``cudagraph_capture_sizes``,
    ``min(max_num_seqs, cdiv(size, next_n))`` requests) are left to capture, named in
    ``[captured]`` skipped steps. DeepGEMM caches: none of ``DG_JIT_CACHE_DIR``,
    ``TRITON_CACHE_DIR``, ``VLLM_CACHE_ROOT`` is written here (vLLM's ``_lazy_init`` sets
    ``DG_JIT_CACHE_DIR`` where unset). Skipped steps, with the reason: no DeepGEMM
    (``has_deep_gemm()``; ``VLLM_USE_DEEP_GEMM=0`` does not turn the indexer's DeepGEMM off,
    so it does not gate this), not CUDA, capability < 9.0, a wrapper's DeepGEMM symbol
    missing after ``_lazy_init``, an older release's ``fp8_mqa_logits`` names, and the SM100
    shapes that are not modelled (MXFP4 indexer cache, 0.28+ varlen decode, 0.33 MX inputs).

Upstream:
    vLLM 0.25-0.26 ``sparse_mla_triton_warmup_if_needed`` warms the chunk kernel for
    ``qs_start`` in {0, 1} x ``qs_stop`` in {16, 15} x aligned/+4 B (8 keys, default DCP
    arguments); 0.27-0.29 ``sparse_mla_triton_warmup`` ->
    ``_BUILD_PREFILL_CHUNK_METADATA_KERNEL.warmup`` (0.28: ``qs_start`` in {0, 1},
    ``qs_stop`` in {1, 15, 16}); 0.30+ the JIT warmup registry (0.33-0.34: all 3 x 3 classes,
    and the convert kernel for flat/BF16 KV caches only; 0.34 with ``sparse_mla_shard_q``, its
    default, also ShardQ's positions, but at an aligned address only, so the misaligned ones are
    kwarm's). Each is gated as upstream gates it (``enable_jit_warmup``, which 0.34's
    ``enforce_eager`` turns off, pooling, backends). This family computes the keys upstream warms
    (calling upstream's own ``get_warmup_keys`` where it exists), warms only the rest and
    names the covered keys in a ``[upstream]`` skipped step, unless forced.
    No release (0.20-0.33) warms the indexer's DeepGEMM kernels: ``deep_gemm_warmup`` covers
    the FP8 GEMMs only and the 0.30+ JIT warmup registry holds Triton/CuTe/TileLang kernels.
    The V2 model runner's ``warmup_kernels`` (MRV2, after kwarm) runs one real prefill step
    and decode steps of ``1 + num_speculative_tokens`` tokens, which compile the prefill key
    and that one decode shape; kwarm warms them anyway (DeepGEMM's in-process cache makes the
    later call free) since nothing else there covers other ``next_n`` or batch classes.

Remove when:
    The oldest supported vLLM warms every ``qs_start`` class of the chunk kernel (0.33's
    registry does) and ShardQ's misaligned positions (0.34's does not), and the FP8-KV
    prefill-workspace variant of the convert kernel (0.33-0.34 do not: they register the
    convert kernel only for flat KV caches); and warms the indexer's
    ``fp8_fp4_mqa_logits``, its paged logits for every native ``next_n`` and the metadata
    kernel for every batch class (none does yet); and warms ``fused_q``'s MHA query layout
    (0.33 does not).
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.dsa_indexer.chunk_metadata import CHUNK_CASES, SHARDQ_CASES, _chunk_steps, chunk_args, run_chunk_case
from kwarm_ext.kernels.dsa_indexer.common import (
    CHUNK_KERNEL, CONVERT_KERNEL, FUSED_Q_KERNEL, INDEXER_BACKEND, MQA_LOGITS, PAGED_METADATA, PAGED_MQA_LOGITS,
    SPARSE_MLA_BACKEND, TRITON_KERNELS)
from kwarm_ext.kernels.dsa_indexer.fused_q import _fused_q_steps, layer_variants, run_variant
from kwarm_ext.kernels.dsa_indexer.index_conversion import (
    _convert_steps, convert_args, convert_variants, run_convert_variant)
from kwarm_ext.kernels.dsa_indexer.mqa_logits import _deep_gemm_steps, deep_gemm_entries

# The family's parts (one module each, beside the constants and helpers they share in common):
# chunk_metadata, index_conversion, mqa_logits and fused_q. What the tests and `kwarm doctor` read:
__all__ = ["applies", "plan", "TRITON_KERNELS", "CHUNK_KERNEL", "CONVERT_KERNEL", "MQA_LOGITS",
           "PAGED_MQA_LOGITS", "PAGED_METADATA", "INDEXER_BACKEND", "SPARSE_MLA_BACKEND", "CHUNK_CASES", "SHARDQ_CASES",
           "chunk_args", "run_chunk_case", "convert_args", "convert_variants", "run_convert_variant",
           "deep_gemm_entries", "FUSED_Q_KERNEL", "layer_variants", "run_variant"]


def applies(view) -> str | None:
    if view.has_backend(INDEXER_BACKEND):
        return None
    return f"no {INDEXER_BACKEND} attention backend"


def plan(view, forced: bool) -> list:
    return [*_planned(_chunk_steps, "prefill_chunk_metadata", CHUNK_KERNEL, view, forced),
            *_planned(_convert_steps, "convert_req_index", CONVERT_KERNEL, view, forced),
            *_planned(_deep_gemm_steps, "mqa_logits", MQA_LOGITS, view, forced),
            *_planned(_fused_q_steps, "fused_q", FUSED_Q_KERNEL, view, forced)]


def _planned(steps_of, name: str, kernel: str, view, forced: bool) -> list:
    """`steps_of`'s steps; an unexpected error while planning one kernel becomes that
    kernel's failing step (a warning naming it), not the whole family's failure."""
    try:
        return steps_of(view, forced)
    except Exception as exc:
        def fail(error=exc):
            raise error
        return [Step(name, kernel, run=fail)]
