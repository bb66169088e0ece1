"""Scenario of tests/test_frontend.py, run in a fresh process (``run_scenario``).

Argument: the model's ``logits_processors`` as JSON (``null`` for none). Prints one ``RESULT``
line of JSON: whether the patch applied (twice), whether vLLM's ``__init__`` is wrapped once,
the wrapped ``__init__``'s calls, the plugin loader's cache before and after request 0, what the
warmup raised and what the ``kwarm`` logger said.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import wrapt
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import input_processor as module
from vllm.v1.sample import logits_processor as lp

import kwarm_ext
from kwarm_ext import patches


def main(argv: list[str]) -> None:
    # kwarm enabled and activated as the .pth door would at start-up (the door itself:
    # tests/test_doors.py), here after the fork server's imports
    os.environ["KWARM_ENABLE"] = "1"
    kwarm_ext.activate("api")
    procs = json.loads(argv[0])
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("kwarm").addHandler(handler)

    first, second = patches.patch_input_processor(module), patches.patch_input_processor(module)
    wrapper = module.InputProcessor.__dict__["__init__"]
    wrapped_ok = (isinstance(wrapper, wrapt.FunctionWrapper)  # vLLM's own __init__, wrapped once
                  and not isinstance(wrapper.__wrapped__, wrapt.FunctionWrapper)
                  and wrapper.__wrapped__.__module__ == module.__name__)

    instance = SimpleNamespace(model_config=SimpleNamespace(logits_processors=procs))
    inits = []
    raised = None
    try:
        patches._wrap_input_processor_init(lambda *a, **k: inits.append(1), instance, (), {})
    except Exception as exc:
        raised = type(exc).__name__
    after_warm = lp.cached_load_custom_logitsprocs.cache_info()._asdict()
    if raised is None and procs is None:
        lp.validate_logits_processors_parameters(None, SamplingParams())  # what request 0 does
    after_request = lp.cached_load_custom_logitsprocs.cache_info()._asdict()
    print("RESULT " + json.dumps({"patched": [first, second], "wrapped_ok": wrapped_ok, "inits": len(inits),
                                  "after_warm": after_warm, "after_request": after_request,
                                  "raised": raised, "logs": logs}))


if __name__ == "__main__":
    main(sys.argv[1:])
