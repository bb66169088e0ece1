"""The one room behind kwarm's three doors: :func:`activate`, idempotent and fail-open.

Doors (each ends here, each a no-op unless ``KWARM_ENABLE`` is truthy):

1. ``kwarm-ext.pth`` in site-packages: one line that imports nothing unless the
   variable is set, so ``pip install kwarm-ext`` + ``KWARM_ENABLE=1 vllm serve`` works in
   every process vLLM starts, forked or spawned. Set, it arms ``_kwarm_door`` (a ``sys.meta_path``
   finder), which calls :func:`activate` at the first import of vLLM, Triton or FlashInfer, before
   their code runs: a process that imports none of them imports nothing of kwarm.
2. ``kwarm run -- CMD``: ``sitecustomize.py`` from kwarm's bootstrap directory.
3. The ``vllm.general_plugins`` entry point ``kwarm``, which vLLM calls in the engine
   and in every worker before it imports the worker class.

Activation registers import hooks (and, where the front end marked a block-FP8 DeepGEMM model,
starts deep_gemm's compile processes' parent, a process of its own): it never imports vLLM,
torch or Triton. It also adds ``KWARM_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``
(:func:`share_with_ray_workers`): vLLM's Ray workers start from the raylet's environment, and
vLLM copies them only the variables with its own prefixes, so without it ``KWARM_ENABLE`` never
reaches them; with it, door 1 or 3 opens there.
"""
from __future__ import annotations

import os
import sys
import threading

from kwarm_ext import config
from kwarm_ext.log import logger

_lock = threading.RLock()
_active = False
SOURCES: list[str] = []  # every door that knocked in this process, in order


def activate(source: str = "api") -> bool:
    """Install kwarm's hooks once per process. Never raises unless KWARM_STRICT is set."""
    global _active
    try:
        if not config.is_enabled():
            return False
        with _lock:
            SOURCES.append(source)
            if _active:
                return True
            if _prints_json():
                os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the JSON's
            if _is_doctor():
                config.quiet_problems()  # the doctor reports each problem once, itself
            settings = config.get()
            from kwarm_ext import patches

            patches.install()
            share_with_ray_workers()
            _active = True
            _start_compile_parent(settings)
            _start_early_builds(settings)
            logger.debug("kwarm activated from %s (KWARM_WARMUPS=%s)", source, settings.warmups.describe())
            return True
    except Exception as exc:
        logger.warning("kwarm: activation from %s failed, kwarm is off in this process: %r", source, exc)
        if _strict():
            raise
        return False


def _prints_json() -> bool:
    """Whether this process is kwarm's own CLI asked for JSON (``kwarm doctor --json``): its log
    lines, kwarm's and vLLM's, then go to stderr."""
    from _kwarm_door import kwarm_command

    return kwarm_command("--json")


def _is_doctor() -> bool:
    """Whether this process is ``kwarm doctor``."""
    from _kwarm_door import kwarm_command

    return kwarm_command("doctor")


RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def share_with_ray_workers(env=None) -> None:
    """Add ``KWARM_`` to the prefixes vLLM's Ray executor copies to its workers (comma list, additive
    to vLLM's own: ``vllm/ray/ray_env.py``, 0.20-0.33). Needed for ``--distributed-executor-backend
    ray``; it can go when vLLM copies the variables of its plugins itself."""
    env = os.environ if env is None else env
    prefixes = [p.strip() for p in env.get(RAY_PREFIXES_ENV, "").split(",") if p.strip()]
    if "KWARM_" not in prefixes:
        env[RAY_PREFIXES_ENV] = ",".join([*prefixes, "KWARM_"])


def _start_compile_parent(settings) -> None:
    """Where the front end marked a block-FP8 DeepGEMM model (``KWARM_DEEP_GEMM_EARLY``), start
    deep_gemm's compile processes' parent now, beside this process's own imports (it imports
    torch and vLLM in a process of its own; this one imports neither)."""
    if not (os.environ.get(config.DEEP_GEMM_EARLY_ENV) and settings.warmups.wants("deep_gemm")):
        return
    from kwarm_ext.log import fail_open

    with fail_open("deep_gemm: could not start the compile processes' parent early; it starts at weight loading"):
        from kwarm_ext.kernels.deep_gemm import processes

        processes.start_early()


def _start_early_builds(settings) -> None:
    """Where this process is ``vllm serve`` starting, start FlashInfer's sampling build in the
    background now (``kwarm_ext/early_builds.py`` says why this early); it imports nothing heavy."""
    if os.environ.get(config.EARLY_BUILDS_ENV) or not sys.argv or \
            os.path.basename(sys.argv[0]) not in config.SERVE_PROGRAMS:
        return  # an engine process (it inherits the mark), or not vLLM's server: nothing imported
    if not settings.warmups.wants("flashinfer_jit"):
        return
    from kwarm_ext.log import fail_open

    with fail_open("could not start FlashInfer's sampling build at launch, it starts with the engine config"):
        from kwarm_ext import early_builds

        early_builds.start_at_launch()


def is_active() -> bool:
    return _active


def _strict() -> bool:
    return config.strict()


def bootstrap_dir(package_dir: str | None = None, write: bool = True) -> str:
    """The folder holding kwarm's ``sitecustomize.py`` alone (``kwarm_ext/_bootstrap`` when installed).

    From a source checkout (an editable install has no ``_bootstrap``) it is a copy of the
    repository's ``sitecustomize.py`` in ``<kwarm's cache folder>/bootstrap``, not the repository
    root: that root first on ``PYTHONPATH`` let its ``setup.py`` (and any other top-level file)
    shadow a user's module of that name (issue 59). `write` false (``kwarm doctor``): the folder only."""
    here = package_dir or os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "_bootstrap")
    if os.path.isfile(os.path.join(installed, "sitecustomize.py")):
        return installed
    from kwarm_ext import manifest_files

    folder = os.path.join(manifest_files.cache_dir(), "bootstrap")
    if not write:
        return folder
    with open(os.path.join(os.path.dirname(here), "sitecustomize.py")) as f:
        text = f.read()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    target = os.path.join(folder, "sitecustomize.py")
    try:
        with open(target) as f:
            current = f.read()
    except OSError:
        current = None
    if current != text:
        manifest_files.write_atomic(target, text, 0o600)
    return folder
