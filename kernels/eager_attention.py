"""Warmup family ``eager_attention``: one eager prefill step and one mixed step through the
attention layers, with attention metadata, before the first request.

Why:
    Every dummy forward vLLM runs at startup on the V1 runner (compile sizes, the profile
    run, kwarm's ``fused_moe`` sizes) has no attention metadata, so the attention layers
    return early; CUDA-graph capture builds metadata for decode batches only. The first
    prefill is therefore the first time the attention layers' eager prefill code runs, and
    it pays the first use of what that code calls outside Triton. Profiled on the GPU host
    (cProfile of request 0, vLLM 0.24.0, after learn-and-replay left no Triton compile):

    - tiny Qwen3-Next: 64-88 ms inside ``QwenGatedDeltaNetAttention._forward_core``
      against 0.6 ms in the repeat (the prefill path's boolean-mask state reset and the
      other torch ops it runs for the first time);
    - tiny DeepSeek-V3.2: 13 ms of first ``torch.mm`` calls in the MLA prefill path (cuBLAS
      picking and loading its kernels for new shapes).

    vLLM itself does this only for FlashInfer attention (``kernel_warmup``'s
    ``_dummy_run(16, force_attention=True, create_mixed_batch=True)``, 0.20-0.28) and, on the
    V2 runner, with real steps (``warmup_kernels``).

How:
    ``runner._dummy_run(N, cudagraph_runtime_mode=NONE, force_attention=True)`` for an
    all-prefill batch, then the same with ``create_mixed_batch=True`` (decodes plus one
    prefill), where N is the smallest token count that runs eagerly (the largest CUDA-graph
    capture size + 1, or 16 without graphs), as a real prefill of that size would. Any Triton
    kernel reached on the way compiles here rather than on a request.

    One size only, on purpose: a ladder of larger sizes (up to ``max_num_batched_tokens``)
    was tried on the GPU host (vLLM 0.24.0) and ended in an illegal memory access, for both
    tiny models: vLLM runs ``force_attention`` dummy steps only at CUDA-graph capture sizes
    and 16 tokens, and a CUDA fault cannot be caught.

    Safety: the calls are vLLM's own warmup path (its FlashInfer warmup makes the same call);
    the dummy requests' block-table rows are empty, so their slots point at the null block
    (block 0), never handed to a request (``BlockPool``), as during CUDA-graph capture.

Upstream: FlashInfer attention only (0.20-0.28, skipped here then); V2 runner (0.29+):
``warmup_kernels``, so this family does not run there. vLLM 0.34 removed the V1 runner
(``vllm/v1/worker/gpu_model_runner.py``): there the family never applies (its reason says so;
tests/test_family_eager_attention.py), the eager path being warmed by ``warmup_kernels``, run by
vLLM with its JIT warmup or an extensible KV cache and by kwarm's ``v2_warmup`` otherwise.

Remove when:
    the oldest supported vLLM is 0.34 (no V1 runner), or vLLM's V1 runner warms the eager
    attention path for every backend.
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import dummy_runner, eager_range
from kwarm_ext.vllm_compat import Missing

NAME = "eager_attention"
KERNEL = "attention layers (eager prefill path)"
# Token count when no CUDA graphs bound it: vLLM's own FlashInfer warmup uses 16.
_DEFAULT_TOKENS = 16
V2_REASON = ("V1 runner only: Model Runner V2 (the only runner from vLLM 0.34) runs real prefill and decode "
             "steps with attention metadata in its warmup_kernels (vLLM's, or kwarm's v2_warmup where "
             "vLLM's is off)")


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if view.runner_kind == "V2":
        return V2_REASON
    if view.is_pooling_model:
        return "pooling model"
    if not callable(getattr(view.runner, "_dummy_run", None)):
        return "runner has no _dummy_run"
    if not any(view.backends):
        return "no attention backends"
    return None


def plan(view, forced) -> list:
    first, last = eager_range(view)
    tokens = min(first if first > 1 else _DEFAULT_TOKENS, last)
    if tokens < 2:
        return [Step("prefill", KERNEL, skip=f"no eager prefill size (max tokens {last})")]
    if not forced and _upstream_covers(view):
        return [Step("prefill", KERNEL, skip="covered by upstream kernel_warmup (FlashInfer attention)")]
    steps = []
    for name, extra in (("prefill", {}), ("mixed", {"create_mixed_batch": True})):
        try:
            run = dummy_runner(view.runner, force_attention=True, **extra)
        except Missing as exc:
            steps.append(Step(name, KERNEL, skip=str(exc)))
            continue
        steps.append(Step(name, KERNEL, run=_labelled(run, tokens, name)))
    return steps


def _labelled(run, tokens: int, name: str):
    def step():
        import torch

        with torch.inference_mode():
            run(tokens)
        return [f"{name} {tokens} tokens"]

    return step


def _upstream_covers(view) -> bool:
    """vLLM's kernel_warmup runs the same dummy run when every backend is FlashInfer."""
    names = [n for group in view.backends for n in group]
    return bool(names) and all(n.upper().startswith("FLASHINFER") for n in names)
