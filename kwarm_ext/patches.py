"""kwarm's three monkey-patches: ``vllm.v1.worker.gpu_worker.kernel_warmup`` (the worker's
warmup), ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` (what must follow
CUDA-graph capture, documented at :func:`_wrap_compile_or_warm_up_model`) and
``vllm.v1.engine.input_processor.InputProcessor.__init__`` (the front end's, documented at
:func:`_wrap_input_processor_init`).

Why: vLLM compiles Triton kernels lazily, on the first request that hits each
specialization. ``Worker.compile_or_warm_up_model`` calls ``kernel_warmup(self)``
after the KV caches are bound and the attention groups built, and before CUDA-graph
capture, Model Runner V2's ``warmup_kernels`` and vLLM's JIT monitor: the one point
where kwarm can inspect the real runner and compile what production will launch,
without the monitor counting it as inference JIT.

How: a wrapt post-import hook on ``vllm.v1.worker.gpu_worker`` wraps that module's
attribute ``kernel_warmup`` (imported there by name, so patching
``vllm.model_executor.warmup.kernel_warmup`` after gpu_worker has been imported would
have no effect). The original runs first, with ``*args, **kwargs`` passed through
(``process_local_only=`` appears in 0.27); kwarm's warmup runs after it returns.

vLLM versions: needed for every release kwarm supports, 0.20.0 to 0.33.0 (checked at
each release by ``kwarm doctor`` and tests/test_hook.py). It can go when vLLM offers a
public warmup-extension point that runs at the same moment (the JIT-warmup registry
of 0.29+ is per kernel, not per deployment, and absent from 0.20–0.28).
"""
from __future__ import annotations

import logging

from kwarm_ext.log import fail_open

logger = logging.getLogger("kwarm")

TARGET_MODULE = "vllm.v1.worker.gpu_worker"
TARGET_ATTRIBUTE = "kernel_warmup"
AFTER_CAPTURE_TARGET = "Worker.compile_or_warm_up_model"
FRONTEND_MODULE = "vllm.v1.engine.input_processor"

_installed = False


def install() -> None:
    """Register the post-import hook; it fires at once if gpu_worker is already imported."""
    global _installed
    if _installed:
        return
    import wrapt

    wrapt.register_post_import_hook(
        _guarded(patch, f"wrap {TARGET_MODULE}.{TARGET_ATTRIBUTE}, kwarm's warmup will not run"), TARGET_MODULE)
    wrapt.register_post_import_hook(
        _guarded(patch_after_capture, f"wrap {TARGET_MODULE}.{AFTER_CAPTURE_TARGET}, kwarm's after-capture "
                                      "steps will not run"), TARGET_MODULE)
    wrapt.register_post_import_hook(
        _guarded(patch_input_processor, f"wrap {FRONTEND_MODULE}.InputProcessor.__init__, the front-end "
                                        "warmup will not run"), FRONTEND_MODULE)
    _installed = True


def _guarded(patch_module, what: str):
    """A post-import hook calling ``patch_module(module)``: wrapt lets a hook's exception fail
    the user's import, so one never gets out."""

    def hook(module) -> None:
        with fail_open(f"could not {what}"):
            patch_module(module)

    return hook


def patch(module) -> bool:
    """Wrap ``module.kernel_warmup`` once. Returns whether this call wrapped it."""
    import wrapt

    current = getattr(module, TARGET_ATTRIBUTE, None)
    if current is None:
        logger.warning("kwarm: %s has no attribute %s in this vLLM; kwarm's warmup will not run",
                       TARGET_MODULE, TARGET_ATTRIBUTE)
        return False
    if is_patched(module):
        return False
    wrapt.wrap_function_wrapper(module, TARGET_ATTRIBUTE, _wrap_kernel_warmup)
    logger.info("kwarm: hooked %s.%s: kwarm's warmup runs after vLLM's", TARGET_MODULE, TARGET_ATTRIBUTE)
    return True


def unpatch(module) -> bool:
    """Restore the original ``kernel_warmup`` (tests; ``kwarm`` never unpatches itself)."""
    if not is_patched(module):
        return False
    setattr(module, TARGET_ATTRIBUTE, getattr(module, TARGET_ATTRIBUTE).__wrapped__)
    return True


def is_patched(module) -> bool:
    import wrapt

    current = getattr(module, TARGET_ATTRIBUTE, None)
    return isinstance(current, wrapt.FunctionWrapper) and current._self_wrapper is _wrap_kernel_warmup


def _wrap_kernel_warmup(wrapped, instance, args, kwargs):
    """Run vLLM's own ``kernel_warmup(worker, ...)``, then kwarm's warmup on the same worker."""
    result = wrapped(*args, **kwargs)
    worker = args[0] if args else kwargs.get("worker")
    with fail_open("warmup failed, the engine starts without it"):
        from kwarm_ext import warmup

        warmup.run(worker)  # isolates each of its own steps
    return result


# ---------------------------------------------------------------------------- after capture

def patch_after_capture(module) -> bool:
    """Wrap ``module.Worker.compile_or_warm_up_model`` once. Returns whether this call wrapped it."""
    import wrapt

    cls = after_capture_class(module)
    if cls is None:
        logger.warning("kwarm: %s has no %s in this vLLM; kwarm's after-capture steps will not run",
                       TARGET_MODULE, AFTER_CAPTURE_TARGET)
        return False
    if is_after_capture_patched(module):
        return False
    wrapt.wrap_function_wrapper(cls, "compile_or_warm_up_model", _wrap_compile_or_warm_up_model)
    return True


def after_capture_class(module):
    """``module.Worker`` where it has a ``compile_or_warm_up_model`` to wrap, else None."""
    cls = getattr(module, "Worker", None)
    return cls if callable(getattr(cls, "compile_or_warm_up_model", None)) else None


def is_after_capture_patched(module) -> bool:
    import wrapt

    current = getattr(getattr(module, "Worker", None), "__dict__", {}).get("compile_or_warm_up_model")
    return isinstance(current, wrapt.FunctionWrapper) and current._self_wrapper is _wrap_compile_or_warm_up_model


def _wrap_compile_or_warm_up_model(wrapped, instance, args, kwargs):
    """Run vLLM's ``Worker.compile_or_warm_up_model``, then kwarm's after-capture steps.

    Why: ``capture_model`` empties torch's caching allocator (``empty_cache()``) after
    kwarm's warmup (the ``kernel_warmup`` hook runs before capture), so the first request
    starts a new small-pool segment with ``cudaMalloc`` and its repeat does not (both tiny
    models, vLLM 0.24.0, engine benchmark calls 23-26; see kernels/caching_allocator.py,
    the one family that runs here). The worker's ``compile_or_warm_up_model`` is the
    last thing vLLM runs on a worker before serving, in every release 0.20-0.33, whichever
    runner (V1 or V2) and whether or not it captures. It can go when vLLM stops emptying the
    allocator after capture, or offers a hook after it.
    """
    result = wrapped(*args, **kwargs)
    with fail_open("after-capture steps failed, the engine starts without them"):
        from kwarm_ext import warmup

        warmup.after_capture(instance)
    return result


# ---------------------------------------------------------------------------- front end

def patch_input_processor(module) -> bool:
    """Wrap ``module.InputProcessor.__init__`` once. Returns whether this call wrapped it."""
    import wrapt

    cls = getattr(module, "InputProcessor", None)
    if cls is None:
        logger.warning("kwarm: %s has no InputProcessor in this vLLM; the front-end warmup will not run",
                       FRONTEND_MODULE)
        return False
    current = cls.__dict__.get("__init__")
    if isinstance(current, wrapt.FunctionWrapper) and current._self_wrapper is _wrap_input_processor_init:
        return False
    wrapt.wrap_function_wrapper(cls, "__init__", _wrap_input_processor_init)
    return True


def _wrap_input_processor_init(wrapped, instance, args, kwargs):
    """Build vLLM's ``InputProcessor``, then run kwarm's front-end warmup on it.

    Why: the first request's ``SamplingParams.verify`` loads the logits-processor plugins
    (an entry-point scan, 34-54 ms measured on vLLM 0.24.0); the process that does it is the
    front end, where no worker hook reaches. ``InputProcessor`` is built once per engine
    client, before any request, in every release 0.20-0.33 (``vllm/v1/engine/
    input_processor.py``). It can go when vLLM loads those plugins at start-up.
    """
    result = wrapped(*args, **kwargs)
    with fail_open("front-end warmup failed, skipped"):
        from kwarm_ext import frontend

        frontend.warm(instance)
    return result
