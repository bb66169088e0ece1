"""deep_gemm's selection: which of a model's layers run on DeepGEMM, at which token counts and
grouped layouts, read from vLLM's own warmup filters, kernel choice and lists (one job per
distinct weight). The family, and why it exists, is the package's ``__init__``.
"""
from __future__ import annotations

import sys

from kwarm_ext.kernels.deep_gemm.processes import _shape

WARMUP_MODULE = "vllm.model_executor.warmup.deep_gemm_warmup"


def linear_data(w_mod, module):
    """``(w, ws)`` of a linear layer whose GEMM runs on DeepGEMM, else None. vLLM 0.33+: the layers
    the DeepGEMM kernel stamped as its own (``_deep_gemm_linear_data``, what vLLM's warmup runs:
    every N that kernel takes). Before: vLLM's warmup filter, or vLLM's kernel choice where the
    filter leaves the layer out (:func:`runs_on_deep_gemm`)."""
    if hasattr(w_mod, "_deep_gemm_linear_data"):
        return w_mod._deep_gemm_linear_data(module)
    if _takes_linear(w_mod, module):
        w, ws, _ = w_mod._extract_data_from_linear_base_module(module)
        return w, ws
    return None


def shape_jobs(model, max_tokens: int) -> list:
    """The linear layers' jobs of a model built but not loaded, by shape: ``{"kind": "linear",
    "shape": (N, K), "ws_shape", "counts"}``, one per distinct weight shape, for the layers
    vLLM's warmup filter takes (0.20-0.32) or whose kernel vLLM chose is DeepGEMM's
    (:func:`runs_on_deep_gemm`; vLLM chooses it as it creates the weights), with vLLM's own
    counts. MoE layers set their experts up as their weights are processed: the ahead run
    takes them (:func:`gemm_jobs`)."""
    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    jobs, seen = [], set()
    for module in model.modules():
        if not _takes_linear(w_mod, module):
            continue
        w = getattr(module, "weight", None)
        ws = getattr(module, "weight_scale_inv", None)
        ws = getattr(module, "weight_scale", None) if ws is None else ws
        if w is None or ws is None or w.ndim != 2 or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        counts = [(m, None, None) for m in w_mod._get_fp8_gemm_nt_m_values(w, max_tokens)]
        jobs.append({"kind": "linear", "shape": tuple(w.shape), "ws_shape": tuple(ws.shape), "counts": counts})
    return jobs


def _takes_linear(w_mod, module) -> bool:
    """Whether a linear layer runs on DeepGEMM by vLLM's kernel choice (:func:`runs_on_deep_gemm`)
    or by the warmup filter of vLLM 0.20-0.32 (``_fp8_linear_may_use_deep_gemm``), loaded or not."""
    may_use = getattr(w_mod, "_fp8_linear_may_use_deep_gemm", None)
    return runs_on_deep_gemm(module) or (may_use is not None and may_use(module))


def job_key(job: dict) -> tuple:
    """What decides a job's kernels: its kind, N and K, and its counts (a job read from the
    loaded model and one from its shapes alone match when these do)."""
    return job["kind"], _shape(job)[-2:], tuple(job["counts"])


def gemm_jobs(model, max_tokens: int) -> list:
    """What the requests can run on DeepGEMM, from vLLM's own filters, kernel choice and lists:
    one job per distinct weight, ``{"kind": "linear"|"grouped", "w", "ws", "counts": [(m, align,
    expert_ids)]}`` (``align`` is None for linear layers; ``expert_ids`` is None: grouped calls
    take theirs from the shared buffers, :func:`_buffers`). Weights vLLM's warmup already ran
    in this process are left out, as it leaves them out."""
    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    jobs, seen = [], set(getattr(w_mod, "FP8_GEMM_NT_WARMUP_CACHE", ()))
    seen_grouped = set(getattr(w_mod, "GROUPED_FP8_GEMM_NT_CONTIGUOUS_WARMUP_CACHE", ()))
    for module in model.modules():
        if (data := linear_data(w_mod, module)) is not None:
            w, ws = data
            if w.size() in seen:
                continue
            seen.add(w.size())
            counts = [(m, None, None) for m in w_mod._get_fp8_gemm_nt_m_values(w, max_tokens)]
            jobs.append({"kind": "linear", "w": w, "ws": ws, "counts": counts})
        elif w_mod._fused_moe_grouped_gemm_may_use_deep_gemm(module):
            w13, w13_s, w2, w2_s, top_k = w_mod._extract_data_from_fused_moe_module(module)
            if w13.size() in seen_grouped and w2.size() in seen_grouped:
                continue
            # what requests reach, and what vLLM's warmup will run after this family (its list
            # has layouts of batches that go to the Triton fallback): all of it compiled here
            _, _, cases = w_mod._get_grouped_gemm_params(w13, w2, top_k, max_tokens)
            layouts = sorted({(m, align, None) for m, align, _ in cases}
                             | set(grouped_layouts(module, w13, w2, top_k, max_tokens)))
            for w, ws in ((w13, w13_s), (w2, w2_s)):
                if layouts and w.size() not in seen_grouped:
                    seen_grouped.add(w.size())
                    jobs.append({"kind": "grouped", "w": w, "ws": ws, "counts": layouts})
    return jobs


def runs_on_deep_gemm(module) -> bool:
    """Whether vLLM chose DeepGEMM for this linear layer (its ``fp8_linear`` kernel, or that
    kernel's fallback for larger batches, is ``DeepGemmFp8BlockScaledMMKernel``), which vLLM's
    warmup filter does not ask: it takes only weights whose N is a multiple of 128, while the
    kernel runs every N that is a multiple of 64 (``should_use_deepgemm_for_fp8_linear``), so
    MLA's fused q/kv down-projection (N = 2112 on DeepSeek-V3.2, 2624 on GLM-5) compiled its
    kernels in requests (vLLM 0.24-0.33)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return any(getattr(k, "__name__", "") == "DeepGemmFp8BlockScaledMMKernel"
               for k in (*type(kernel).__mro__, *type(getattr(kernel, "fallback", None)).__mro__))


def grouped_layouts(module, w13, w2, top_k: int, max_tokens: int) -> list:
    """Every ``(M_sum, alignment, None)`` a MoE layer's grouped GEMM can be called with, from
    vLLM's own code: a batch of M tokens is permuted into ``M_sum`` rows, each expert's rows
    padded to the alignment (``compute_aligned_M_and_alignment``, with no per-expert counts on
    the CPU, as the non-EP path calls it), for every M that takes DeepGEMM's path: M up to the
    tokens of one MoE call (DP ranks x ``max_num_batched_tokens``, as vLLM's warmup assumes),
    from the alignment up where the experts fall back to Triton below it
    (``TritonOrDeepGemmExperts``, vLLM's own ``_valid_deep_gemm_shape``).
    DeepGEMM picks the kernel (block N, multicast, stages) from ``M_sum``'s waves, so each
    layout is a call: those sharing a kernel load it from the cache."""
    from vllm.model_executor.layers.fused_moe import deep_gemm_utils
    from vllm.utils.deep_gemm import get_mk_alignment_for_contiguous_layout

    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    tokens = max_tokens * w_mod.get_dp_group().world_size
    block_m = get_mk_alignment_for_contiguous_layout()[0]
    takes = _deep_gemm_takes(module)
    _, k, n = w2.size()
    layouts = {}
    for m in range(1, tokens + 1):
        if takes is not None and not takes(m, n, k):
            continue
        m_sum, align = deep_gemm_utils.compute_aligned_M_and_alignment(
            M=m, num_topk=top_k, local_num_experts=w13.size(0), alignment=block_m, expert_tokens_meta=None)
        layouts[(m_sum, align)] = None
    return [(m_sum, align, None) for m_sum, align in sorted(layouts)]


def fused_experts(module):
    """A MoE layer's experts implementation, where vLLM's own warmup filter reads it:
    ``moe_kernel.impl.fused_experts`` of the layer's quant method (the ``MoERunner``'s
    ``_quant_method`` on 0.24-0.33, the ``FusedMoE`` layer's ``quant_method`` on 0.20-0.23);
    None where the layer has no modular kernel."""
    method = getattr(module, "_quant_method", None) or getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    return getattr(getattr(kernel, "impl", None), "fused_experts", None)


def _deep_gemm_takes(module):
    """vLLM's test of whether M tokens go to DeepGEMM rather than the Triton fallback, where the
    layer's experts have one (``TritonOrDeepGemmExperts`` calls ``_valid_deep_gemm_shape(M, N,
    K)``; on GPUs with E8M0 scales everything goes to DeepGEMM); None: every M does."""
    experts = fused_experts(module)
    if experts is None or type(experts).__name__ != "TritonOrDeepGemmExperts":
        return None
    owner = sys.modules[type(experts).__module__]
    if getattr(owner, "is_deep_gemm_e8m0_used", lambda: False)():
        return None
    return getattr(owner, "_valid_deep_gemm_shape", None)
