"""The registry of warmup families: one table, importing no family until warmup time.

A family is a module under ``kernels/`` (shipped as ``kwarm_ext.kernels``) with:

- ``applies(view) -> str | None``: ``None`` when the family is for this engine, else
  the reason it is not (logged in the summary line);
- ``plan(view, forced) -> list[Step] | Plan``: the steps, each a call through vLLM's own
  entry function that launches one kernel's production specializations. A step that
  upstream vLLM already runs (and `forced` is false) or whose vLLM symbol is absent carries
  its skip reason instead of running. A :class:`Plan` adds what its steps found out:
  ``details()``, read once they ran; its ``summary`` replaces the family's default text in
  the summary line, and the dict goes into the JSON report. A family keeps no state between
  runs: what its steps find out lives in the plan (a dict their closures share);
- with ``ahead=True`` in the table, the family is planned and run before vLLM's profile run
  (``Worker.determine_available_memory``; where that hook did not run it, before ``kernel_warmup``:
  ``kwarm_ext.warmup.ahead``), for work that makes vLLM's own start cheaper (``deep_gemm`` fills
  DeepGEMM's cache on every core before vLLM's profile run and warmup compile serially);
  its result is part of the worker's summary line and report;
- with ``before_load=True`` as well, its module's ``before_load(worker)`` runs as vLLM starts
  loading the weights (``Worker.load_model``: ``kwarm_ext.warmup.before_load``), to start what
  needs no weights (``deep_gemm``'s compile processes, whose imports then overlap the load),
  its ``model_built(worker, model)`` once vLLM has built the model, before the weights load
  (``initialize_model``: ``kwarm_ext.warmup.model_built``; ``deep_gemm`` sends the weights'
  shapes, so that the compiles overlap the load), and its ``release(worker)`` ends whatever its
  ahead run did not take;
- with ``after_capture=True`` in the table, the family is planned and run once
  ``Worker.compile_or_warm_up_model`` has returned, after vLLM's CUDA-graph capture
  (``kwarm_ext.warmup.after_capture``), instead of in kwarm's warmup. A family with both
  ``ahead`` and ``after_capture`` (``cute_dsl``: load before the profile run, save after capture)
  runs at both; its ``plan`` tells them apart by the view's ``after_capture``.

``replay`` is not a kernel recipe but the learn-and-replay machinery, so it lives in
kwarm_ext/surfaces/triton/replay.py rather than under ``kernels/``. ``frontend`` (kwarm_ext/frontend.py) runs in
vLLM's front-end process, not in the worker: it is not in the table, but ``KWARM_WARMUPS``
selects it by name like the others (:func:`selectable`).

Selection: ``KWARM_WARMUPS`` (see kwarm_ext/config.py) > each family's own ``applies``.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    module: str
    summary: str
    upstream: str = ""  # what vLLM's own warmups cover of it, and what kwarm adds (kwarm doctor)
    after_capture: bool = False  # planned and run after compile_or_warm_up_model
    ahead: bool = False  # planned and run before vLLM's profile run (else its kernel_warmup)
    before_load: bool = False  # its module's before_load(worker) runs as vLLM starts loading weights
    process: str = "worker"  # where it runs: the worker's warmup, or another vLLM process (not planned there)
    keeps_memory: bool = False  # the caching allocator's blocks it grows are its product: not returned after it

    def load(self):
        return importlib.import_module(self.module)


@dataclasses.dataclass
class Plan:
    """A family's steps and the details they found out, read once they ran."""

    steps: list
    details: Callable[[], dict] | None = None


@dataclasses.dataclass
class Step:
    """One isolated warmup call. `run` returns the labels of the variants it launched."""

    name: str
    kernel: str
    run: Callable[[], list] | None = None
    skip: str | None = None
    summary: bool = False  # its labels, once it ran, are the family's summary-line text


# Order is run order: replay first, so that the hand-written families find its kernels compiled;
# eager_gemm last, so that its fill, which stops when KWARM_BUDGET is spent, ends the warmup.
FAMILIES = {
    f.name: f
    for f in (
        Family("deep_gemm", "kwarm_ext.kernels.deep_gemm",
               "block-FP8 models: DeepGEMM's GEMM kernels for every weight vLLM runs on DeepGEMM and "
               "every token count or grouped layout that selects one, compiled on every core of the rank "
               "from the moment vLLM has built the model (child processes, on the weights' shapes during "
               "the load, then on the engine's weights through CUDA IPC), beside the profile run's "
               "torch.compile where it has one, so that the profile run and vLLM's warmup load them",
               "vLLM compiles its profile run's kernels and then its own list one by one (deep_gemm_warmup, "
               "0.20-0.34); before 0.33 it skips weights whose N is not a multiple of 128, and every "
               "release skips grouped layouts between its counts; kwarm compiles all of them in "
               "parallel first", ahead=True, before_load=True),
        Family("cute_dsl", "kwarm_ext.kernels.cute_dsl",
               "CuTe DSL kernels FlashInfer and vLLM keep in memory only (FlashInfer's SM90 GDN prefill, vLLM's "
               "bf16 router GEMM): saved after CUDA-graph capture, loaded before the next start's profile run "
               "instead of compiled again",
               "none: FlashInfer (0.7.2) compiles its SM90 GDN prefill kernels and vLLM (0.33) its router GEMM's "
               "on every start, and neither persists them", ahead=True, after_capture=True),
        Family("replay", "kwarm_ext.surfaces.triton.replay",
               "learn and replay: compiles what earlier runs of this deployment compiled late "
               "(KWARM_LEARN); applies when a manifest exists",
               "none: it replays what this deployment still compiled after every other warmup"),
        Family("runner", "kwarm_ext.kernels.runner",
               "per-step runner kernels of hybrid and MLA models: slot mapping, KV-block zeroing",
               "KVBlockZeroer.warmup covers zeroing, from kernel_warmup on V1 (0.27-0.33) and from Model Runner "
               "V2's warmup_kernels (vLLM's, or kwarm's v2_warmup when vLLM skips it; kwarm zeroes block 0 "
               "itself where neither runs); 0.27-0.28 warm_v1_block_table_kernels and the 0.29+ JIT warmup "
               "registry cover slot mapping on V1; kwarm adds the integer classes they leave (0.20-0.26: all)"),
        Family("qwen_gdn", "kwarm_ext.kernels.qwen_gdn",
               "Qwen3-Next / Qwen3.5 gated delta-net layers: conv1d, post-conv, gating, gated RMSNorm",
               "0.25+ qwen_triton_warmup warms one key each of conv fwd, post-conv and sigmoid gating "
               "(0.30+: the gated RMSNorm too), and kwarm skips those keys; kwarm adds the other integer "
               "classes, the mixed-batch variants, other layer shapes and the eager decode kernels"),
        Family("dsa_indexer", "kwarm_ext.kernels.dsa_indexer",
               "GLM-5 / DeepSeek-V3.2 DSA indexer: prefill chunk metadata, sparse-MLA index conversion, DeepGEMM MQA logits, "
               "and the DSA attention's query kernel (fused_q, 0.33+) in both query layouts",
               "0.25-0.29 sparse_mla_triton_warmup and the 0.30+ JIT warmup registry warm chunk-metadata "
               "keys (0.33: all 9 classes), and kwarm skips those; kwarm adds the other keys, the index "
               "conversion where upstream skips it, the indexer's DeepGEMM kernels (no release warms them) "
               "and fused_q's MHA layout (capture reaches the MQA one only)"),
        Family("triton_attn", "kwarm_ext.kernels.triton_attn",
               "TRITON_ATTN attention: kernel_unified_attention (2D and 3D) and reduce_segments at "
               "every batch class vLLM's selection code reaches, through its metadata builder and "
               "the layer's own forward; compiled ahead on a thread pool",
               "CUDA-graph capture compiles the captured decode sizes and the V2 runner's warmup_kernels "
               "(0.29+) a few real steps; kwarm adds every other batch class, on both sides of the 3D threshold"),
        Family("triton_mla", "kwarm_ext.kernels.triton_mla",
               "TRITON_MLA attention: the MLA decode kernels at every NUM_KV_SPLITS (a power of two from "
               "the batch's longest context) the release's forward_mqa chooses up to max_model_len, "
               "through the layer's own forward_mqa",
               "none (0.20-0.34); CUDA-graph capture compiles the split count of its dummy batches, and "
               "kwarm adds every other one"),
        Family("fused_moe", "kwarm_ext.kernels.fused_moe",
               "MoE models: vLLM's Triton fused-MoE GEMM at every eager token-count class "
               "(config region x integer class), through the runner's own dummy runs",
               "none (0.20-0.34): the V2 runner's warmup_kernels (0.29+) runs a few real steps, which do "
               "not reach the eager token counts; kwarm warms every class, on the V1 and V2 runners"),
        Family("sampler", "kwarm_ext.kernels.sampler",
               "Model Runner V2's sampler: seeded top-k/top-p (Triton), min_p and temperature (fp32 Gumbel), "
               "a mixed greedy/sampled batch, and the logprob kernels at every count class up to max_logprobs, "
               "through the runner's own sampler and vLLM's compute_topk_scores",
               "vLLM's _dummy_sampler_run covers greedy and FlashInfer's fused sampler (0.29-0.33), and its JIT "
               "registry the Triton top-k/top-p only with speculative decoding (0.33); kwarm adds the rest"),
        Family("flashinfer_jit", "kwarm_ext.kernels.flashinfer_jit",
               "FlashInfer modules the chosen backends build with nvcc on first call: concat_mla_k of "
               "128-head MLA layers (DeepSeek-V3/V3.2, GLM-5), built or loaded at start",
               "none (0.33): vLLM's start-up sampler check builds the sampling module; nothing builds concat_mla"),
        Family("eager_attention", "kwarm_ext.kernels.eager_attention",
               "one eager prefill and one mixed dummy step with attention metadata: the first use "
               "of the attention layers' eager prefill path (torch ops, cuBLAS shapes) before serving",
               "vLLM's own FlashInfer dummy runs (kwarm skips FlashInfer) and the V2 runner's warmup_kernels "
               "(0.29+: kwarm does not run it there); kwarm adds it for the V1 runner's other backends"),
        Family("eager_gemm", "kwarm_ext.kernels.eager_gemm",
               "cuBLAS GEMMs of the unquantized linear layers, the LM head and MLA's absorbed "
               "attention at the token counts that run outside CUDA graphs: exact small and learned "
               "counts and a kernel grid, then a fill within KWARM_BUDGET; captured, not run, on CUDA, "
               "on the calling thread (the MoE router gate runs through its own forward)",
               "none: no release warms GEMM shapes outside CUDA-graph capture (0.20-0.34), but the MoE router "
               "gate's own small-count GEMM (0.28+), which kwarm leaves to vLLM"),
        Family("v2_warmup", "kwarm_ext.kernels.v2_warmup",
               "Model Runner V2's own warmup_kernels (real prefill and decode steps: the runner's input-"
               "preparation, KV-zeroing and Mamba state kernels) where vLLM does not run it, after start-up "
               "without CUDA graphs",
               "vLLM runs it itself with its JIT warmup on (0.29-0.34) or an extensible KV cache (0.34), "
               "for every V2 engine before 0.29; enforce_eager turns the JIT warmup off, and kwarm runs it "
               "then", after_capture=True),
        Family("caching_allocator", "kwarm_ext.kernels.caching_allocator",
               "torch's CUDA caching allocator, after CUDA-graph capture: blocks allocated and freed on the "
               "model's and vLLM's aux stream, and FLASH_ATTN_MLA_SPARSE's forward_mqa at each one-request "
               "decode size (FlashAttention 3's scratch), and vLLM's eager dummy step at max_num_batched_tokens "
               "(the large pool), so that the first requests' allocations find them",
               "none (0.20-0.34)", after_capture=True, keeps_memory=True),
    )
}

# Not a worker family: it runs in vLLM's front-end process, when the InputProcessor is built
# (kwarm_ext/patches.py), so the worker's warmup never plans it. KWARM_WARMUPS and
# `kwarm doctor` know it by name like the others.
FRONTEND = Family("frontend", "kwarm_ext.frontend",
                  "front-end process: loads vLLM's logits-processor plugins when its InputProcessor "
                  "is built, not on the first request",
                  "vLLM loads them on the first request (0.20-0.32); 0.33+ loads them as it builds its "
                  "InputProcessor, and kwarm does nothing", process="front-end")
# Not a worker family either: it runs in vLLM's engine core, when the StructuredOutputManager is
# built (kwarm_ext/patches.py), building xgrammar's backend beside the engine's start.
STRUCTURED_OUTPUT = Family("structured_output", "kwarm_ext.structured_output",
                           "engine core: builds xgrammar's structured-output backend (tokenizer info, grammar "
                           "compilers) while the engine starts, for the first structured request to use",
                           "none: vLLM builds it on the first structured request (0.20-0.33)",
                           process="engine core")
# Not a worker family: it runs in the API server of `vllm serve`, just before it listens
# (kwarm_ext/patches.py wraps serve_http), sending one request of each kind through vLLM's app.
WARM_REQUESTS = Family("warm_requests", "kwarm_ext.warm_requests",
                       "API server: one request of each kind (chat, sampling options, logprobs, JSON schema, "
                       "tool call, streaming, a chunked prompt, concurrent streams) through vLLM's own app and "
                       "engine before the server listens; prefix cache reset, vLLM's metrics held back",
                       "none: vLLM warms its chat template's rendering (0.33+), not the request path",
                       process="API server")
PROCESS_FAMILIES = {f.name: f for f in (FRONTEND, STRUCTURED_OUTPUT, WARM_REQUESTS)}


def selectable() -> tuple:
    """Every name KWARM_WARMUPS accepts: the table's families and those of other processes."""
    return (*FAMILIES, *PROCESS_FAMILIES)


def triton_owners() -> dict:
    """Triton kernel name -> the family that compiles it at start, from each family module's
    ``TRITON_KERNELS`` (bench/table.py attributes request-time compiles with it). Imports the
    family modules, not vLLM."""
    owners = {}
    for name, family in FAMILIES.items():
        for kernel in getattr(family.load(), "TRITON_KERNELS", ()):
            owners.setdefault(kernel, name)
    return owners
