"""kwarm's monkey-patches of vLLM and Triton, declared in one table (``PATCHES``, at the end: target,
wrapper, releases, what is lost without it) and applied, checked and removed by one :class:`Patch`.
Triton's: ``triton.runtime.jit.serialize_specialization_data`` on Triton 3.4-3.6 (documented at
``triton_compat._wrap_serialize_specialization_data``, defined beside what it wraps). vLLM's: ``vllm.v1.worker.gpu_worker.kernel_warmup`` (the worker's
warmup), ``vllm.v1.worker.gpu_worker.Worker.determine_available_memory`` (kwarm's ``ahead`` families before
vLLM's profile run, documented at :func:`_wrap_determine_available_memory`),
``vllm.v1.worker.gpu_worker.Worker.load_model`` (kwarm's ``before_load`` steps, documented at
:func:`_wrap_load_model`), ``vllm.model_executor.model_loader.base_loader.initialize_model`` (their
``model_built`` steps, documented at :func:`_wrap_initialize_model`),
``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` (serving's torch thread count
before vLLM's warmups, and what must follow CUDA-graph capture, documented at
:func:`_wrap_compile_or_warm_up_model`) and
``vllm.v1.worker.gpu_worker.warmup_kernels`` (which runners vLLM ran Model Runner V2's warmup on,
documented at :func:`_wrap_warmup_kernels`),
``vllm.v1.engine.input_processor.InputProcessor.__init__`` (the front end's, documented at
:func:`_wrap_input_processor_init`) and ``vllm.engine.arg_utils.EngineArgs.create_engine_config``
(deep_gemm's early start, documented at :func:`_wrap_create_engine_config`), and
``vllm.v1.structured_output.StructuredOutputManager.__init__`` and ``.grammar_init`` (xgrammar's
backend built at start, documented at :func:`_wrap_structured_output_init`), and ``serve_http`` in
the API server's module (kwarm's warm requests before the server listens, documented at
:func:`_wrap_serve_http`). FlashInfer's:
``flashinfer.jit.core.JitSpec.build_and_load`` (each JIT module built or loaded, for the monitor and
the learner: defined and documented beside its surface, kwarm_ext/surfaces/flashinfer.py).

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

vLLM versions: needed for every release kwarm supports, 0.20.0 to 0.34.0 (checked at
each release by ``kwarm doctor`` and tests/test_hook.py). It can go when vLLM offers a
public warmup-extension point that runs at the same moment (the JIT-warmup registry
of 0.29+ is per kernel, not per deployment, and absent from 0.20–0.28).

Elsewhere, by design: the scoped, instance-level ``run`` shadows of compile-ahead and launch
recording (``triton_compile.launches_compile_only``, ``kernels/launches.observed_launches``),
which patch Triton objects for the length of a ``with`` block, and the model runner's
``profile_run`` shadowed on the instance for one ``determine_available_memory`` call
(``warmup.beside_profile_run``, documented at :func:`_wrap_determine_available_memory`).
"""
from __future__ import annotations

import contextlib
import logging

from kwarm_ext.log import fail_open
from kwarm_ext.patching import Patch
from kwarm_ext.surfaces.flashinfer import FLASHINFER_BUILD
from kwarm_ext.surfaces.triton.compat import SERIALIZER

logger = logging.getLogger("kwarm")

TARGET_MODULE = "vllm.v1.worker.gpu_worker"
TARGET_ATTRIBUTE = "kernel_warmup"
AFTER_CAPTURE_TARGET = "Worker.compile_or_warm_up_model"
FRONTEND_MODULE = "vllm.v1.engine.input_processor"
LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"
ENGINE_ARGS_MODULE = "vllm.engine.arg_utils"
# vLLM 0.28+: lowers torch's thread count for serving (see _wrap_compile_or_warm_up_model)
SERVING_THREADS = "vllm.utils.torch_utils:set_torch_threads_for_runtime"


_installed = False


def install() -> None:
    """Register one post-import hook per patch; each fires at once if its module is imported."""
    global _installed
    if _installed:
        return
    import wrapt

    for entry in PATCHES:
        wrapt.register_post_import_hook(_hook(entry), entry.module)
    wrapt.register_post_import_hook(_share_triton_compiles, "triton.runtime.cache")
    _installed = True


def _share_triton_compiles(module) -> None:
    """Triton's cache manager becomes kwarm's ``NodeCacheManager``: ranks that share a cache folder
    compile each key once (kwarm_ext/surfaces/triton/node_cache.py says why and until when)."""
    with fail_open("could not share Triton compiles between this node's ranks, each compiles its own"):
        from kwarm_ext.surfaces.triton import node_cache

        node_cache.install()


def _hook(entry: Patch):
    """A post-import hook applying `entry`: wrapt lets a hook's exception fail the user's
    import, so one never gets out."""

    def hook(module) -> None:
        with fail_open(f"could not wrap {entry.target}, {entry.lost}"):
            entry.apply(module)

    return hook


# The names the rest of kwarm, doctor and the tests use.
def patch(module) -> bool:
    return KERNEL_WARMUP.apply(module)


def unpatch(module) -> bool:
    return KERNEL_WARMUP.remove(module)


def is_patched(module) -> bool:
    return KERNEL_WARMUP.applied(module)


def patch_before_profile(module) -> bool:
    return BEFORE_PROFILE.apply(module)


def is_before_profile_patched(module) -> bool:
    return BEFORE_PROFILE.applied(module)


def patch_after_capture(module) -> bool:
    return AFTER_CAPTURE.apply(module)


def is_after_capture_patched(module) -> bool:
    return AFTER_CAPTURE.applied(module)


def after_capture_class(module):
    """``module.Worker`` where it has a ``compile_or_warm_up_model`` to wrap, else None."""
    return AFTER_CAPTURE.holder(module)


def patch_input_processor(module) -> bool:
    return INPUT_PROCESSOR.apply(module)


def _wrap_kernel_warmup(wrapped, instance, args, kwargs):
    """Run kwarm's ``ahead`` families, vLLM's own ``kernel_warmup(worker, ...)``, then kwarm's
    warmup on the same worker."""
    worker = args[0] if args else kwargs.get("worker")
    with fail_open("warmup ahead of vLLM's failed, vLLM's own warmup runs as before"):
        from kwarm_ext import warmup

        warmup.ahead(worker)  # isolates each of its own steps
        warmup.finish_ahead(worker)  # what it left compiling, if the profile run did not wait for it
    result = wrapped(*args, **kwargs)
    with fail_open("warmup failed, the engine starts without it"):
        from kwarm_ext import warmup

        with warmup.outside_kv_cache_sizing(worker):  # vLLM 0.34+: kwarm's peak is no serving transient
            warmup.run(worker)  # isolates each of its own steps
    return result


def _wrap_determine_available_memory(wrapped, instance, args, kwargs):
    """Run kwarm's ``ahead`` families (``deep_gemm``), then vLLM's
    ``Worker.determine_available_memory``.

    Why: its profile run is the model's first forward, at ``max_num_batched_tokens`` tokens. On a
    block-FP8 model every linear weight's DeepGEMM kernel for that count is compiled there by NVCC,
    one after another, before ``kernel_warmup`` is reached: 40 s of a 237 s cold start for GLM-5's
    FP8 dimensions on vLLM 0.29.0 (BENCHMARKS.md; 4 s on a run whose DeepGEMM kernels were
    built). Run first, ``deep_gemm`` compiles those with all the others on every core, and
    the profile run loads them. Where the profile run starts with ``torch.compile`` (tens of
    seconds before its first DeepGEMM call) the compiles run on beside it, and
    ``warmup.beside_profile_run`` shadows the runner's ``profile_run`` on the instance, for this
    call only, to wait for them as it returns. Either way the child processes have exited, and
    kwarm's scratch memory is back with the driver, before vLLM reads the memory the profile run
    used: that measures what it always measured.
    Where this wrapper could not run them, the families run before ``kernel_warmup`` as before
    (:func:`_wrap_kernel_warmup`; once per worker either way).
    vLLM versions: 0.20-0.34, where ``Worker.determine_available_memory`` runs the profile run.
    It can go with ``deep_gemm`` (when vLLM compiles DeepGEMM's kernels in parallel or ships them).
    """
    beside = contextlib.nullcontext()
    with fail_open("warmup ahead of vLLM's profile run failed, it runs before vLLM's kernel warmup instead"):
        from kwarm_ext import warmup

        if any(result.status == "ran" for result in warmup.ahead(instance, before_profile_run=True)):
            release_cached_memory()
        beside = warmup.beside_profile_run(instance)
    with beside:
        return wrapped(*args, **kwargs)


def release_cached_memory() -> None:
    """Give what torch's caching allocator holds unused (kwarm's scratch) back to the driver."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _wrap_load_model(wrapped, instance, args, kwargs):
    """Run kwarm's ``before_load`` steps, then vLLM's ``Worker.load_model``.

    Why: ``deep_gemm`` compiles on processes forked by one that imports torch and vLLM first,
    seconds before the first call (fifteen separate imports took 17 s); started after the load, as the
    ahead run did, their imports and the first compiles overlapped nothing (a cold FP8 start on
    vLLM 0.29.0: 15-18 s between the work list going out and the processes' last call ending,
    beyond their busiest's calls; BENCHMARKS.md). Started here, they import while vLLM reads the
    weights. vLLM versions: 0.20-0.34 (``Worker.load_model``). It can go with ``deep_gemm``.
    """
    loading = contextlib.nullcontext()
    with fail_open("steps before weight loading failed, the ahead families start their work later"):
        from kwarm_ext import warmup

        warmup.before_load(instance)
        loading = warmup.loading(instance)
    with loading:  # whose model the initialize_model patch sees built
        return wrapped(*args, **kwargs)


def _wrap_initialize_model(wrapped, instance, args, kwargs):
    """Run vLLM's ``initialize_model`` (the model built, its weights not loaded yet), then
    kwarm's ``model_built`` steps with the model.

    Why: ``deep_gemm``'s compiles depend on the linear layers' shapes only, and those are known
    once the model is built: sent then, they run while vLLM loads the weights (minutes for a
    real checkpoint) instead of after it. vLLM versions: 0.20-0.34 (``BaseModelLoader.load_model``
    calls the ``initialize_model`` its module imported by name; loaders that call their own
    leave the compiles to the ahead run). It can go with ``deep_gemm``.
    """
    model = wrapped(*args, **kwargs)
    with fail_open("steps as the model was built failed, the ahead families start their work after the load"):
        from kwarm_ext import warmup

        warmup.model_built(model)
    return model


def _wrap_compile_or_warm_up_model(wrapped, instance, args, kwargs):
    """Set torch's serving thread count, run vLLM's ``Worker.compile_or_warm_up_model``, then
    kwarm's after-capture steps.

    Why the thread count first: vLLM 0.28-0.32 call ``set_torch_threads_for_runtime()`` (torch
    intra-op threads down to 1 for serving, unless ``OMP_NUM_THREADS`` is set) at the *end* of
    ``compile_or_warm_up_model``, after every warmup. Dynamo guards each ``torch.compile``'d
    function on its global state, ``torch.get_num_threads()`` included, so every function
    compiled during start-up (the ``compile_native`` forwards of disabled custom ops such as
    ``SiluAndMul``, the MoE router's ``grouped_topk``) is traced and compiled again on the first
    request: ``GLOBAL_STATE changed: num_threads`` with ``TORCH_LOGS=recompiles``, request 0 at
    3.4-15x its repeat with no Triton compile (vLLM 0.29.0, both published-dimension bench models;
    BENCHMARKS.md). vLLM 0.33 moved the call to ``load_model`` for this reason; calling it here
    again is a no-op there, and releases before 0.28 have no such function. It can go when kwarm
    drops 0.28-0.32.

    Why after: ``capture_model`` empties torch's caching allocator (``empty_cache()``) after
    kwarm's warmup (the ``kernel_warmup`` hook runs before capture), so the first request
    starts a new small-pool segment with ``cudaMalloc`` and its repeat does not (both tiny
    models, vLLM 0.24.0, the engine benchmark's allocator counters; see kernels/caching_allocator.py,
    the one family that runs here). The worker's ``compile_or_warm_up_model`` is the
    last thing vLLM runs on a worker before serving, in every release 0.20-0.34, whichever
    runner (V1 or V2) and whether or not it captures. It can go when vLLM stops emptying the
    allocator after capture, or offers a hook after it.
    """
    with fail_open("could not set torch's serving thread count before warmup, "
                   "functions torch.compile'd at start-up may compile again on the first request"):
        serving_threads_first()
    result = wrapped(*args, **kwargs)
    with fail_open("after-capture steps failed, the engine starts without them"):
        from kwarm_ext import warmup

        warmup.after_capture(instance)
    return result


def serving_threads_first() -> bool:
    """Apply vLLM's ``set_torch_threads_for_runtime`` now, before the warmups (see
    :func:`_wrap_compile_or_warm_up_model`); returns whether it changed torch's thread count."""
    from kwarm_ext import vllm_compat

    set_threads = vllm_compat.resolve_or_none(SERVING_THREADS)
    if set_threads is None:  # before 0.28: vLLM never changes the count after start-up
        return False
    import torch

    before = torch.get_num_threads()
    set_threads()
    after = torch.get_num_threads()
    if after != before:
        logger.info("kwarm: torch threads %d -> %d (serving's count) before vLLM's warmups, so that "
                    "what they torch.compile is not compiled again on the first request", before, after)
    return after != before


def _wrap_create_engine_config(wrapped, instance, args, kwargs):
    """Tell ``deep_gemm`` the engine's arguments, run vLLM's ``EngineArgs.create_engine_config``,
    then tell it the config, and start the FlashInfer builds the config implies in the background
    (``kwarm_ext.early_builds``: they overlap the engine's start instead of following its profile run).

    Why: ``deep_gemm``'s compile processes are forked by one parent that imports torch and
    vLLM first: 15.6 s beside an 11 s weight load (DeepSeek-V3.2 FP8 dimensions, vLLM 0.29.0,
    BENCHMARKS.md), so started at the load their compiles began after it. The front end knows
    the model is block-FP8 long before a worker builds it (the checkpoint's config.json as the
    call starts; making the config itself took 27 s there): marked in the environment the
    engine's processes inherit, those start the parent as kwarm activates there, beside their
    own imports, and an engine in this process has it started here. vLLM versions: 0.20-0.34
    (``vllm/engine/arg_utils.py``). It can go with ``deep_gemm``.
    """
    family = None
    with fail_open("deep_gemm: reading the checkpoint's config failed, its compile processes start later"):
        from kwarm_ext import config as kwarm_config

        if kwarm_config.get().warmups.wants("deep_gemm"):
            from kwarm_ext.kernels import deep_gemm as family

            family.before_engine_config(instance)
    config = wrapped(*args, **kwargs)
    if family is not None:
        with fail_open("deep_gemm: reading the engine config failed, its compile processes start at weight loading"):
            family.engine_config_made(config)
    with fail_open("could not start FlashInfer's builds at launch, vLLM builds them when it calls them"):
        from kwarm_ext import config as kwarm_config

        if kwarm_config.get().warmups.wants("flashinfer_jit"):
            from kwarm_ext import early_builds

            early_builds.start(config)  # kwarm_ext/early_builds.py says why here
    return config


def _wrap_input_processor_init(wrapped, instance, args, kwargs):
    """Build vLLM's ``InputProcessor``, then run kwarm's front-end warmup on it.

    Why: the first request's ``SamplingParams.verify`` loads the logits-processor plugins
    (an entry-point scan, 34-54 ms measured on vLLM 0.24.0); the process that does it is the
    front end, where no worker hook reaches. ``InputProcessor`` is built once per engine
    client, before any request, in every release 0.20-0.34 (``vllm/v1/engine/
    input_processor.py``). It can go when vLLM loads those plugins at start-up.
    """
    result = wrapped(*args, **kwargs)
    with fail_open("front-end warmup failed, skipped"):
        from kwarm_ext import frontend

        frontend.warm(instance)
    return result


def _wrap_structured_output_init(wrapped, instance, args, kwargs):
    """Build vLLM's ``StructuredOutputManager``, then start building xgrammar's backend beside the
    engine's start (``kwarm_ext.structured_output.prepare``).

    Why: vLLM builds the backend on the first structured request, in that request's time (475 ms at
    a 129k vocabulary, BENCHMARKS.md); the manager is built once per engine core, before any request,
    in every release 0.20-0.34 (``vllm/v1/structured_output/__init__.py``). It can go when vLLM builds
    its structured-output backend at start-up.
    """
    result = wrapped(*args, **kwargs)
    with fail_open("structured-output warmup failed, skipped"):
        from kwarm_ext import structured_output

        structured_output.prepare(instance)
    return result


def _wrap_grammar_init(wrapped, instance, args, kwargs):
    """Give the manager the backend kwarm built, if the first structured request resolves to xgrammar,
    then run vLLM's ``grammar_init`` (which then finds a backend and builds none). Releases and removal:
    as :func:`_wrap_structured_output_init`."""
    with fail_open("structured-output warmup failed, skipped"):
        from kwarm_ext import structured_output

        if args or "request" in kwargs:
            structured_output.adopt(instance, args[0] if args else kwargs["request"])
    return wrapped(*args, **kwargs)


def _wrap_serve_http(wrapped, instance, args, kwargs):
    """Send kwarm's warm requests to the app (``kwarm_ext.warm_requests``), then run vLLM's
    ``serve_http``, which starts uvicorn on it.

    Why: with every kernel compiled at start, the first request of each kind still pays for
    Python's, the tokenizer's, xgrammar's and torch's first use (1.4-4.6x its repeat, issue 60);
    ``serve_http`` is the last call before the server listens, with the app's state complete, in
    every release 0.20-0.34 (imported by name into ``vllm/entrypoints/openai/api_server.py`` before
    0.33 and ``vllm/entrypoints/launchers/api_server/entry.py`` since: that module's attribute is what
    is wrapped). It can go when vLLM warms its request path before it listens.
    """

    async def warm_then_serve():
        app = args[0] if args else kwargs.get("app")
        with fail_open("warm requests failed, the first requests pay for their first use"):
            from kwarm_ext import warm_requests

            await warm_requests.run(app)
        return await wrapped(*args, **kwargs)

    return warm_then_serve()


def _launchers_absent() -> bool:
    """Whether this vLLM predates 0.33's ``vllm.entrypoints.launchers`` (its API server is then
    ``vllm.entrypoints.openai.api_server``, which 0.33 keeps as a shim without ``serve_http``)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.entrypoints.launchers") is None
    except (ImportError, ValueError):
        return True


def _launchers_present() -> bool:
    return not _launchers_absent()


_V2_WARMUP_RUNNERS: "weakref.WeakSet" = None  # runners vLLM ran Model Runner V2's warmup_kernels on


def _wrap_warmup_kernels(wrapped, instance, args, kwargs):
    """Run vLLM's Model Runner V2 ``warmup_kernels`` and note on which runner it ran.

    Why: whether vLLM runs it depends on the release (0.20-0.28: every V2 engine; 0.29-0.33:
    ``enable_jit_warmup``, which ``enforce_eager`` turns off; 0.34: that or an extensible KV
    cache), and family ``v2_warmup`` runs it where vLLM did not, never twice. The worker imports
    it by name (``from .gpu.warmup import warmup_kernels``), so the worker module's attribute is
    what is wrapped. vLLM versions: 0.20-0.34 (``vllm/v1/worker/gpu_worker.py``). It can go with
    ``v2_warmup``.
    """
    global _V2_WARMUP_RUNNERS
    runner = args[0] if args else kwargs.get("model_runner")
    with fail_open("could not note that vLLM ran warmup_kernels, v2_warmup may run it again"):
        import weakref

        if _V2_WARMUP_RUNNERS is None:
            _V2_WARMUP_RUNNERS = weakref.WeakSet()
        _V2_WARMUP_RUNNERS.add(runner)
    return wrapped(*args, **kwargs)


def ran_v2_warmup(runner) -> bool:
    """Whether vLLM ran Model Runner V2's ``warmup_kernels`` on `runner` in this process."""
    try:
        return _V2_WARMUP_RUNNERS is not None and runner in _V2_WARMUP_RUNNERS
    except TypeError:  # not weakly referenceable
        return False


# The table: every patch kwarm installs (each wrapper above says why and until when).
KERNEL_WARMUP = Patch(TARGET_MODULE, TARGET_ATTRIBUTE, _wrap_kernel_warmup, "0.20-0.34",
                      "kwarm's warmup will not run", announce="kwarm's families run after vLLM's warmup (its ahead families, deep_gemm, before vLLM's profile run)")
BEFORE_PROFILE = Patch(TARGET_MODULE, "determine_available_memory", _wrap_determine_available_memory, "0.20-0.34",
                       "DeepGEMM kernels of vLLM's profile run compile there one by one", owner="Worker")
BEFORE_LOAD = Patch(TARGET_MODULE, "load_model", _wrap_load_model, "0.20-0.34",
                    "DeepGEMM's compile processes start after weight loading", owner="Worker")
MODEL_BUILT = Patch(LOADER_MODULE, "initialize_model", _wrap_initialize_model, "0.20-0.34",
                    "DeepGEMM's compiles wait for the weights to load")
AFTER_CAPTURE = Patch(TARGET_MODULE, "compile_or_warm_up_model", _wrap_compile_or_warm_up_model, "0.20-0.34",
                      "kwarm's after-capture steps will not run, and on vLLM 0.28-0.32 what start-up "
                      "torch.compiles is compiled again on the first request", owner="Worker")
INPUT_PROCESSOR = Patch(FRONTEND_MODULE, "__init__", _wrap_input_processor_init, "0.20-0.34",
                        "the front-end warmup will not run", owner="InputProcessor")
ENGINE_CONFIG = Patch(ENGINE_ARGS_MODULE, "create_engine_config", _wrap_create_engine_config, "0.20-0.34",
                      "DeepGEMM's compile processes start at weight loading, not with the engine's processes",
                      owner="EngineArgs")
V2_WARMUP = Patch(TARGET_MODULE, "warmup_kernels", _wrap_warmup_kernels, "0.20-0.34",
                  "v2_warmup cannot tell whether vLLM ran Model Runner V2's warmup_kernels and does not run it")
STRUCTURED_OUTPUT_MODULE = "vllm.v1.structured_output"
STRUCTURED_OUTPUT_INIT = Patch(STRUCTURED_OUTPUT_MODULE, "__init__", _wrap_structured_output_init, "0.20-0.34",
                               "xgrammar's backend is built on the first structured request",
                               owner="StructuredOutputManager")
GRAMMAR_INIT = Patch(STRUCTURED_OUTPUT_MODULE, "grammar_init", _wrap_grammar_init, "0.20-0.34",
                     "the backend kwarm built is not used", owner="StructuredOutputManager")
SERVE_HTTP = Patch("vllm.entrypoints.openai.api_server", "serve_http", _wrap_serve_http, "0.20-0.32",
                   "the warm requests do not run, the first requests pay for their first use", when=_launchers_absent)
SERVE_HTTP_LAUNCHERS = Patch("vllm.entrypoints.launchers.api_server.entry", "serve_http", _wrap_serve_http, "0.33-0.34",
                             "the warm requests do not run, the first requests pay for their first use",
                             when=_launchers_present)
PATCHES = (SERIALIZER, ENGINE_CONFIG, BEFORE_LOAD, MODEL_BUILT, BEFORE_PROFILE, KERNEL_WARMUP, V2_WARMUP, AFTER_CAPTURE,
           INPUT_PROCESSOR, STRUCTURED_OUTPUT_INIT, GRAMMAR_INIT, SERVE_HTTP, SERVE_HTTP_LAUNCHERS,
           FLASHINFER_BUILD)
