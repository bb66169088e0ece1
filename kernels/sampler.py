"""Warmup family ``sampler``: Model Runner V2's sampling and logprob kernels for the sampling
parameters real requests send.

Why:
    Measured with ``vllm serve`` on vLLM 0.33.0 and FlashInfer 0.7.2 (BENCHMARKS.md, serving
    benchmark), every other compile left in requests by kwarm was one of these, on both model
    families: ``_topk_topp_kernel`` on the first *seeded* top-k/top-p request (4.0-4.7 s to
    compile; a seed takes vLLM off FlashInfer's fused sampler onto its Triton top-k/top-p,
    ``vllm/v1/sample/ops/topk_topp_triton.py``), ``_gumbel_sample_kernel`` on the first ``min_p``
    request (0.4-0.5 s: fp32 logits that no earlier batch had) and ``_topk_log_softmax_kernel`` on
    the first ``prompt_logprobs`` request (0.2-0.4 s). vLLM's own ``_dummy_sampler_run`` samples
    twice (greedy, then ``SamplingParams.for_sampler_warmup()``, which goes to FlashInfer's fused
    sampler), and its JIT warmup registry registers the Triton top-k/top-p kernels on CUDA only
    for speculative decoding.

    The keys differ by what a batch asks for: the logits' dtype (the model's when no request
    needs processing, fp32 otherwise), top-k and/or top-p (constexprs), batch size 1 or more
    (``BATCH_SIZE``'s ``==1`` class), and, for logprobs, ``TOPK_BLOCK_SIZE`` (the next power of
    two of 1 + the number of logprobs) with the ``==1`` and ``%16`` classes of that count.

How:
    - ``sampling``: the runner's own ``sampler(logits, InputBatch.make_dummy(n, n,
      runner.input_buffers))`` as ``_dummy_sampler_run`` calls it, logits from
      ``runner.model.compute_logits`` (production's shape, dtype and strides), after
      ``sampler.add_request(i, params)`` for each dummy request: ``min_p`` alone, seeded top-k,
      seeded top-p, seeded top-k + top-p, for 1 and 2 requests, and a batch that mixes a greedy
      and a sampled request.
    - ``logprobs``: vLLM's ``compute_topk_scores`` (the function both the sampler and the prompt
      logprobs call) on those logits, once per key class of 1 + num_logprobs up to the model's
      ``max_logprobs`` (20 by default), and on fp32 logits too where ``logprobs_mode`` returns
      processed logprobs.

    - ``topk_topp_ahead`` (0.33+, before ``sampling``): the Triton top-k/top-p kernels' compile keys
      as vLLM's own JIT warmup registry derives them from the engine's config (the dispatchers
      ``_topk_topp`` and ``_topp_split_*`` of ``topk_topp_triton.py``, ``get_warmup_keys``), each
      compiled through the dispatcher's own ``compile`` (Triton's ``warmup``: compile only, on
      placeholder tensors, nothing launched), all at once on the rank's share of the cores
      (``AsyncCompileMode``), less those for a logits row stride the vocabulary never gives
      (:func:`reachable`: half of them where the vocabulary is a multiple of 16; 92 keys took
      16.8 s on 16 threads of an H100 host before). One seeded variant takes 4-6 s to compile
      on an H200 host, and ``sampling`` met three of them one after another (17.5 s); it now
      finds them compiled.

    Safety: the dummy requests occupy request slots 0..n-1 of the sampler's state, as vLLM's own
    ``_dummy_sampler_run`` leaves them; a real request's ``add_request`` overwrites its slot before
    its first step. Nothing touches the KV cache.

Upstream (0.33): ``_dummy_sampler_run`` covers the model-dtype greedy path and FlashInfer's fused
sampler; ``register_top_k_top_p_warmups`` (JIT registry) covers top-k/top-p only with speculative
decoding (then this family's ``sampling`` step still runs: its other kernels are not covered).

Remove when:
    vLLM's own sampler warmup runs the seeded, min_p and logprob paths.
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.vllm_compat import Missing, resolve

TRITON_KERNELS = ("_topk_topp_kernel", "_gumbel_sample_kernel", "_min_p_kernel", "_topk_log_softmax_kernel",
                  "_ranks_kernel")  # what this family compiles at start
SAMPLING_KERNELS = "_topk_topp_kernel, _gumbel_sample_kernel, _min_p_kernel"
LOGPROB_KERNELS = "_topk_log_softmax_kernel, _ranks_kernel"
DEFAULT_MAX_LOGPROBS = 20  # ModelConfig.max_logprobs' default
PROCESSED_MODES = ("processed_logprobs", "processed_logits")

# (label, one SamplingParams keyword dict per dummy request): each reaches keys the others do not
SAMPLING_BATCHES = (
    ("min_p", ({"temperature": 0.7, "min_p": 0.1},)),
    ("seeded top_k", ({"temperature": 0.8, "top_k": 40, "seed": 1},)),
    ("seeded top_p", ({"temperature": 0.8, "top_p": 0.9, "seed": 1},)),
    ("seeded top_k+top_p", ({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1},)),
    ("min_p", ({"temperature": 0.7, "min_p": 0.1},) * 2),
    ("seeded top_k", ({"temperature": 0.8, "top_k": 40, "seed": 1},) * 2),
    ("seeded top_p", ({"temperature": 0.8, "top_p": 0.9, "seed": 1},) * 2),
    ("seeded top_k+top_p", ({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1},) * 2),
    ("greedy + sampled", ({"temperature": 0.0}, {"temperature": 0.8, "top_k": 40, "top_p": 0.9})),
)


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if view.is_pooling_model:
        return "pooling model: no sampler"
    if view.runner_kind != "V2":
        return "V1 runner: its sampler is not warmed by kwarm (Model Runner V2 only)"
    if getattr(view.runner, "sampler", None) is None:
        return "runner has no sampler (not the last pipeline stage)"
    return None


def plan(view, forced: bool) -> list:
    runner = view.runner
    try:
        make_dummy = resolve("vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy")
        params_cls = resolve("vllm.sampling_params:SamplingParams")
        scores = resolve("vllm.v1.worker.gpu.sample.logprob:compute_topk_scores")
    except Missing as exc:
        return [Step("sampling", SAMPLING_KERNELS, skip=str(exc)), Step("logprobs", LOGPROB_KERNELS, skip=str(exc))]
    for attr in ("input_buffers", "model"):
        if getattr(runner, attr, None) is None:
            reason = f"runner has no {attr}"
            return [Step("sampling", SAMPLING_KERNELS, skip=reason), Step("logprobs", LOGPROB_KERNELS, skip=reason)]
    max_reqs = view.max_num_reqs or getattr(runner, "max_num_reqs", None) or 1
    batches = [b for b in SAMPLING_BATCHES if len(b[1]) <= max_reqs]
    return [ahead_step(view),
            Step("sampling", SAMPLING_KERNELS, run=lambda: warm_sampling(runner, make_dummy, params_cls, batches)),
            Step("logprobs", LOGPROB_KERNELS, run=lambda: warm_logprobs(runner, scores))]


TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_triton"
DISPATCHERS = ("_topk_topp", "_topp_split_stats", "_topp_split_step", "_topp_split_mask")


def registry_dispatchers() -> list:
    """vLLM's top-k/top-p dispatchers that carry their warmup keys (0.33+), by name."""
    found = []
    for name in DISPATCHERS:
        try:
            dispatcher = resolve(f"{TOPK_TOPP}:{name}")
        except Missing:
            continue
        if callable(getattr(dispatcher, "get_warmup_keys", None)) and callable(getattr(dispatcher, "compile", None)):
            found.append((name, dispatcher))
    return found


def ahead_step(view) -> Step:
    name, kernels = "topk_topp_ahead", "_topk_topp_kernel, _topp_split_*"
    dispatchers = registry_dispatchers()
    if not dispatchers:
        return Step(name, kernels, skip="no JIT warmup registry on vLLM's top-k/top-p dispatchers (0.33+)")
    config = getattr(view.runner, "vllm_config", None)
    if config is None:
        return Step(name, kernels, skip="runner has no vllm_config")
    return Step(name, kernels, run=lambda: compile_ahead(dispatchers, config, view.tp_size))


def compile_ahead(dispatchers, config, tp_size) -> list:
    """Every warmup key of `dispatchers` for `config`, compiled at once; one label per dispatcher."""
    import time

    from kwarm_ext.surfaces.triton import compile as triton_compile

    keys, failed, unreached = [], [], 0
    vocab = _vocab_size(config)
    for name, d in dispatchers:
        try:
            derived = d.get_warmup_keys(vllm_config=config)
        except Exception as exc:  # one dispatcher's inputs this config cannot make: the others go on
            failed.append(f"{name}: no keys ({type(exc).__name__}: {exc})")
            continue
        reached = [key for key in derived if reachable(key, vocab)]
        unreached += len(derived) - len(reached)
        keys += [(name, d, key) for key in reached]
    threads = triton_compile.compile_threads(tp_size)
    t0 = time.perf_counter()
    with triton_compile.parallel_compiles(threads) as parallel:
        for _, dispatcher, key in keys:
            dispatcher.compile(key)
    how = f"on {threads} threads" if parallel else "one at a time"
    counts = {name: sum(1 for n, _, _ in keys if n == name) for name, _ in dispatchers}
    skipped = [f"{unreached} keys of a logits row stride this vocabulary ({vocab}) never has"] if unreached else []
    return [f"{name}: {n} keys" for name, n in counts.items() if n] + failed + skipped + [
        f"compiled {how} in {time.perf_counter() - t0:.1f} s"]


def _vocab_size(config) -> int | None:
    try:
        return int(config.model_config.get_vocab_size())
    except Exception:
        return None


def reachable(key, vocab: int | None) -> bool:
    """Whether a registry key's logits row stride can occur with this vocabulary. The registry
    derives each key for a row stride divisible by 16 and for one that is not
    (``WarmupChoices(16, 2)`` in ``topk_topp_triton.py``); the sampler's fp32 logits have rows of
    the vocabulary (a copy) or of the padded vocabulary (a view of the LM head's output, padded to
    a multiple of 64): a vocabulary divisible by 16 never gives the second. Keys without a logits
    input, or with one of another make, are kept."""
    if not vocab or vocab % 16:
        return True
    logits = dict(getattr(key, "inputs", ()) or ()).get("logits")
    try:
        return int(logits.stride(0)) % 16 == 0
    except Exception:
        return True


def dummy_logits(runner, num_reqs: int):
    """``runner.model.compute_logits`` on `num_reqs` rows of hidden states: production's logits."""
    import torch

    config = runner.model_config
    hidden = torch.randn(num_reqs, config.get_hidden_size(), dtype=config.dtype, device=runner.device)
    return runner.model.compute_logits(hidden)


def warm_sampling(runner, make_dummy, params_cls, batches) -> list:
    """The runner's sampler on one dummy batch per entry of `batches`; returns their labels."""
    import torch

    sampler, labels = runner.sampler, []
    with torch.inference_mode():
        for label, per_request in batches:
            n = len(per_request)
            for i, kwargs in enumerate(per_request):
                sampler.add_request(i, params_cls(**kwargs))
            sampler.apply_staged_writes()
            sampler(dummy_logits(runner, n), make_dummy(n, n, runner.input_buffers))
            labels.append(f"{label} x{n}")
    synchronize(runner.device)
    return labels


def logprob_counts(max_logprobs: int | None) -> list:
    """One count of logprobs (0 = the sampled token's only) per key class of 1 + count:
    next power of two, ``==1`` and ``%16``, up to `max_logprobs` (-1, all of the vocabulary:
    up to vLLM's 1024-wide block cap)."""
    from kwarm_ext.surfaces.triton.compat import int_class

    top = DEFAULT_MAX_LOGPROBS if max_logprobs is None else (1024 if max_logprobs < 0 else max_logprobs)
    seen, counts = set(), []
    for k in range(0, top + 1):
        cols = k + 1
        key = (min(1 << (cols - 1).bit_length(), 1024), int_class(cols))
        if key not in seen:
            seen.add(key)
            counts.append(k)
    return counts


def warm_logprobs(runner, scores) -> list:
    """vLLM's ``compute_topk_scores`` at each logprob count class, on the model's logits and, where
    ``logprobs_mode`` returns processed logprobs, on fp32 ones; returns the labels."""
    import torch

    counts = logprob_counts(getattr(runner.model_config, "max_logprobs", None))
    mode = getattr(getattr(runner, "sampler", None), "logprobs_mode", "raw_logprobs")
    labels = []
    with torch.inference_mode():
        logits = dummy_logits(runner, 2)
        variants = [(str(logits.dtype).replace("torch.", ""), logits)]
        if mode in PROCESSED_MODES and logits.dtype != torch.float32:
            variants.append(("float32", logits.float()))
        sampled = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        for dtype, values in variants:
            for k in counts:
                scores(values, k, sampled)
            labels.append(f"{dtype} logprobs {','.join(map(str, counts))}")
    synchronize(runner.device)
    return labels
