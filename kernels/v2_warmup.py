"""Warmup family ``v2_warmup``: Model Runner V2's own ``warmup_kernels``, where vLLM skips it.

Why:
    Model Runner V2 (``vllm/v1/worker/gpu``) prepares each step with Triton kernels of its own
    (``_prepare_prefill_inputs``, ``_gather_block_tables``, ``_compute_slot_mappings``,
    ``_zero_kv_blocks``, ``_apply_write``, ``_combine_sampled_and_draft_tokens``,
    ``_post_update``, ``_prepare_pos_seq_lens``, ``_scatter_num_accepted``), and hybrid models
    add the Mamba state kernels of ``vllm/v1/worker/mamba_utils.py`` (preprocess, postprocess,
    state copy). vLLM compiles them at start by running a few real prefill and decode steps,
    ``vllm.v1.worker.gpu.warmup.warmup_kernels``, which the worker's
    ``compile_or_warm_up_model`` calls only when ``kernel_config.enable_jit_warmup`` is on
    (0.29-0.34; 0.34 also with an extensible KV cache), and ``enforce_eager`` turns it off.
    Measured on vLLM 0.34.0 with ``enforce_eager`` (issue 50): 13 compiles of these kernels stayed
    in request 0 on Qwen3-Next and Nemotron-H, first request 9x and 16.6x its repeat.

How:
    Once ``compile_or_warm_up_model`` has returned (an after-capture family), when vLLM did not
    run ``warmup_kernels`` on this runner (``kwarm_ext.patches`` records each call) and no CUDA
    graph was captured, call vLLM's own ``warmup_kernels(runner, worker.execute_model,
    worker.sample_tokens)``: the same steps, the same kernels and keys vLLM's start would have
    compiled, nothing of kwarm's own. After capture with graphs it is not run: vLLM notes that a
    workspace resize after capture frees what the graphs point at (an engine with graphs and the
    JIT warmup turned off by hand is logged as skipped).

Upstream: vLLM's own call, when ``enable_jit_warmup`` is on (0.29+) or the extensible KV cache
    is (0.34); on 0.28 it runs for every V2 engine. The V1 runner has no such warmup.

Remove when:
    vLLM runs ``warmup_kernels`` for eager engines too.
"""
from __future__ import annotations

from kwarm_ext import vllm_compat
from kwarm_ext.families import Step

WARMUP_KERNELS = "vllm.v1.worker.gpu.warmup:warmup_kernels"
TRITON_KERNELS = ()  # vLLM's own steps: the kernels are whatever its runner launches


def applies(view) -> str | None:
    if view.runner is None or view.worker is None:
        return "no model runner"
    if view.runner_kind != "V2":
        return "not Model Runner V2"
    if vllm_compat.resolve_or_none(WARMUP_KERNELS) is None:
        return "this vLLM has no Model Runner V2 warmup_kernels"
    return None


def plan(view, forced: bool) -> list:
    from kwarm_ext import patches

    import sys

    runner, worker = view.runner, view.worker
    gpu_worker = sys.modules.get(patches.TARGET_MODULE)
    if gpu_worker is None or not patches.V2_WARMUP.applied(gpu_worker):
        return [Step("warmup_kernels", "Model Runner V2 step kernels",
                     skip="kwarm's note of vLLM's own warmup_kernels call is not installed: whether it ran is unknown")]
    if patches.ran_v2_warmup(runner) and not forced:
        return [Step("warmup_kernels", "Model Runner V2 step kernels",
                     skip="vLLM ran warmup_kernels itself")]
    if not captured_nothing(view):
        return [Step("warmup_kernels", "Model Runner V2 step kernels",
                     skip="CUDA graphs were captured, and warmup_kernels after capture could resize "
                          "the workspace they point at")]
    warmup_kernels = vllm_compat.resolve(WARMUP_KERNELS)

    def run() -> list:
        warmup_kernels(runner, worker.execute_model, worker.sample_tokens)
        return ["prefill and decode steps"]

    return [Step("warmup_kernels", "Model Runner V2 step kernels", run=run, summary=True)]


def captured_nothing(view) -> bool:
    """Whether this engine captured no CUDA graph (``enforce_eager``, or cudagraph mode NONE)."""
    return bool(view.enforce_eager) or view.cudagraph_mode in (None, "NONE")
