"""Front-end warmup: what vLLM does once, on the first request, in the process that
validates requests (the API server of ``vllm serve``; the ``LLM`` process offline).

Why:
    ``SamplingParams.verify`` calls ``validate_logits_processors_parameters``, whose
    ``cached_load_custom_logitsprocs`` (an ``lru_cache``) scans every installed
    distribution's entry points for logits-processor plugins on its first call. Profiled on
    the GPU host (cProfile of request 0, vLLM 0.24.0): 34-54 ms of the first request, about
    300 metadata files read; the repeat pays nothing.

How:
    Right after vLLM builds its ``InputProcessor`` (``kwarm_ext.patches`` wraps its
    ``__init__``), make the same call the first request makes, with the same cache key:
    ``validate_logits_processors_parameters(model_config.logits_processors, SamplingParams())``.
    Plugins load where they would have loaded anyway, once; a plugin that fails to load
    fails here as it would on the first request, as one warning.

Upstream: vLLM 0.33 and later load the plugins when they build the ``InputProcessor``
(``validate_logits_processors_params``), and 0.34 removed ``vllm.v1.sample.logits_processor``:
there the warmup says so and does nothing.

This is the ``frontend`` entry of ``KWARM_WARMUPS``; the worker's summary line lists it as
skipped, since it runs in the front end.
"""
from __future__ import annotations

import logging
import time

from kwarm_ext import config

logger = logging.getLogger("kwarm")

NAME = "frontend"


def warm(input_processor) -> float | None:
    """Load the logits-processor plugins for `input_processor`'s model; seconds, or None
    when KWARM_WARMUPS leaves the front end out. Raises what vLLM's call raises."""
    if not config.get().warmups.wants(NAME):
        return None
    if callable(getattr(input_processor, "validate_logits_processors_params", None)):
        # vLLM 0.33+ loads the plugins in InputProcessor.__init__ (0.34 removed the module below)
        logger.info("kwarm: front end: vLLM loaded the logits-processor plugins when it built its "
                    "InputProcessor: covered upstream, nothing to do")
        return None
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    t0 = time.perf_counter()
    model_config = input_processor.model_config
    validate_logits_processors_parameters(getattr(model_config, "logits_processors", None), SamplingParams())
    seconds = time.perf_counter() - t0
    logger.info("kwarm: front end: logits-processor plugins loaded in %.1f ms, before the first request",
                seconds * 1000)
    return seconds
