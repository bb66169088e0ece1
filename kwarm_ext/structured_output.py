"""Engine-core warmup: xgrammar's backend for structured output, built while the engine starts.

Why:
    vLLM builds its structured-output backend on the first structured request
    (``StructuredOutputManager.grammar_init``: ``if self.backend is None``), in the engine core,
    inside that request's time. For xgrammar, vLLM's default, that is two ``TokenizerInfo``s over the
    whole vocabulary and two grammar compilers: measured with ``vllm serve`` on vLLM 0.33.0
    (BENCHMARKS.md, serving benchmark), 475 ms of the first JSON-schema request at DeepSeek-V3.2's
    129k-token vocabulary (13-17 ms at 4k; 0.54 s for the tokenizer info alone at 152k, xgrammar on CPU).

How:
    When vLLM has built its ``StructuredOutputManager`` (``kwarm_ext.patches`` wraps its
    ``__init__``), a daemon thread builds ``XgrammarBackend(vllm_config, tokenizer=manager.tokenizer,
    vocab_size=model_config.get_vocab_size())``, the call ``grammar_init`` makes, while the engine
    loads, profiles and captures. When the first structured request resolves to xgrammar
    (``grammar_init`` is wrapped too) and the manager has no backend yet, it gets that object, as it
    would have got the one it builds; a build still running is waited for (never longer than
    building it anew). A request that resolves to another backend (``auto`` falls back to guidance
    for what xgrammar cannot do) leaves it unused, so every request gets the backend it would have
    got. Only where ``structured_outputs_config.backend`` is ``auto`` or ``xgrammar`` and vLLM has a
    tokenizer.

This is the ``structured_output`` entry of ``KWARM_WARMUPS``; it runs in the engine core.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from kwarm_ext import config

logger = logging.getLogger("kwarm")

NAME = "structured_output"
PREBUILT = "_kwarm_xgrammar"  # the manager's attribute holding the build's Future
BACKENDS = ("auto", "xgrammar")


def configured_backend(vllm_config) -> str | None:
    """``structured_outputs_config.backend`` (0.22+; ``decoding_config.backend`` before), or None."""
    for attr in ("structured_outputs_config", "decoding_config"):
        backend = getattr(getattr(vllm_config, attr, None), "backend", None)
        if backend is not None:
            return str(backend)
    return None


def prepare(manager) -> str:
    """Start building xgrammar's backend for `manager`; returns what it did (for the log and tests)."""
    if not config.get().warmups.wants(NAME):
        return "not selected (KWARM_WARMUPS)"
    vllm_config = manager.vllm_config
    if getattr(vllm_config.model_config, "skip_tokenizer_init", False) or getattr(manager, "tokenizer", None) is None:
        return "skipped: no tokenizer (skip_tokenizer_init)"
    backend = configured_backend(vllm_config)
    if backend not in BACKENDS:
        logger.info("kwarm: structured output: skipped, backend %r is not xgrammar", backend)
        return f"skipped: backend {backend!r}"
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    kwargs = {"tokenizer": manager.tokenizer, "vocab_size": vllm_config.model_config.get_vocab_size()}
    future: concurrent.futures.Future = concurrent.futures.Future()

    def build():
        t0 = time.perf_counter()
        try:
            future.set_result(XgrammarBackend(vllm_config, **kwargs))
        except BaseException as exc:  # the first request builds it as vLLM does
            future.set_exception(exc)
            logger.warning("kwarm: structured output: building xgrammar's backend failed, the first "
                           "structured request builds it: %s", f"{type(exc).__name__}: {exc}"[:300])
            return
        logger.info("kwarm: structured output: xgrammar's backend built in %.0f ms (vocabulary %d), "
                    "before the first structured request", 1000 * (time.perf_counter() - t0), kwargs["vocab_size"])

    setattr(manager, PREBUILT, future)
    threading.Thread(target=build, name="kwarm-xgrammar", daemon=True).start()
    return "building"


def request_backend(request) -> str | None:
    """The backend vLLM's input processing resolved for `request` (``_backend``), or None."""
    params = getattr(request, "sampling_params", None)
    for attr in ("structured_outputs", "guided_decoding"):
        spec = getattr(params, attr, None)
        if spec is not None:
            return getattr(spec, "_backend", None)
    return None


def adopt(manager, request) -> bool:
    """Before ``grammar_init``: give `manager` the prebuilt backend if this first structured request
    resolves to xgrammar. Returns whether it did."""
    future = getattr(manager, PREBUILT, None)
    if future is None or getattr(request, "structured_output_request", None) is None:
        return False
    if getattr(manager, "backend", None) is not None:
        delattr(manager, PREBUILT)
        return False
    if request_backend(request) != "xgrammar":
        return False
    delattr(manager, PREBUILT)
    try:
        backend = future.result()
    except Exception:
        return False
    manager.backend = backend
    if hasattr(manager, "backend_name"):  # 0.33: grammar_init records the backend it built
        manager.backend_name = "xgrammar"
    return True
