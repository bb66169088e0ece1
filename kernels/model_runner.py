"""What the warmup families read from and run through vLLM's model runner: the token counts a
step runs without a CUDA graph, the runner's models, its own eager dummy run, and a device
synchronization that surfaces a launch error inside the step that caused it."""
from __future__ import annotations

from kwarm_ext.vllm_compat import Missing, bind, params, resolve


def eager_range(view) -> tuple:
    """(first, last) token count a step runs without a CUDA graph, from the runner's config."""
    runner = view.runner
    limits = [x for x in (view.max_num_batched_tokens, getattr(runner, "max_num_tokens", None))
              if isinstance(x, int)]
    last = min(limits, default=0)
    compilation = getattr(runner, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if view.enforce_eager or mode is None:
        return 1, last
    mixed = mode.mixed_mode() if callable(getattr(mode, "mixed_mode", None)) else mode
    if getattr(mixed, "name", "NONE") == "NONE":
        return 1, last
    top = getattr(compilation, "max_cudagraph_capture_size", None)
    if not isinstance(top, int):
        top = max(getattr(compilation, "cudagraph_capture_sizes", None) or [0])
    return int(top) + 1, last


def runner_models(runner) -> list:
    """The runner's models, each once: its own (``get_model()``, without the CUDA-graph
    wrapper, else ``runner.model``), then a speculative drafter's; those not loaded are left out."""
    models = []
    candidates = [lambda: runner.get_model(), lambda: runner.model,
                  lambda: runner.drafter.model, lambda: runner.speculator.model]
    for get in candidates:
        try:
            model = get()
        except Exception:  # absent, not loaded yet, or no drafter
            continue
        if callable(getattr(model, "modules", None)) and all(model is not m for m in models):
            models.append(model)
    return models


def dummy_runner(runner, **extra):
    """``lambda M: runner._dummy_run(M, ...)``: vLLM's own eager forward over dummy tokens,
    bound to this release's signature first, so a change there is a logged skip.

    The V1 runner (``gpu_model_runner``) is told ``cudagraph_runtime_mode=NONE``. The V2 runner
    (``vllm/v1/worker/gpu``: opt-in in 0.20-0.28, the default from 0.29) takes no mode: its
    ``CudaGraphManager.dispatch`` picks one from the batch, and it is NONE at the exact token
    count until ``capture_model`` has run, which is after the kernel warmup kwarm wraps (and
    above the largest capture size after it). ``skip_eplb=True`` where the signature has it.
    A runner without ``_dummy_run`` raises :class:`Missing`.
    """
    if not callable(getattr(runner, "_dummy_run", None)):
        raise Missing("runner has no _dummy_run")
    names = params(runner._dummy_run)
    kwargs = dict(extra)
    if "cudagraph_runtime_mode" in names:
        kwargs["cudagraph_runtime_mode"] = resolve("vllm.config:CUDAGraphMode",
                                                   "vllm.config.compilation:CUDAGraphMode").NONE
    if "skip_eplb" in names:
        kwargs["skip_eplb"] = True
    bind(runner._dummy_run, 1, **kwargs)

    def run(num_tokens: int):
        return runner._dummy_run(num_tokens, **kwargs)

    return run


def one_process() -> bool:
    """Whether this worker is alone (no torch.distributed peers). With peers, every rank must
    run the same dummy runs (their collectives pair up), so nothing that differs per rank (a
    probe's timing, the free memory) may decide whether one runs."""
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    except Exception:
        return False


def synchronize(device) -> None:
    if device is None or getattr(device, "type", None) != "cuda":
        return
    import torch

    torch.cuda.synchronize(device)
