"""The front-end warmup against the real ``InputProcessor`` class and vLLM's real
logits-processor plugin loader (``cached_load_custom_logitsprocs``, an ``lru_cache``).

Each case runs in a fresh process, so that the cache starts empty: a child forked from the
0.24.0 fork server (tests/forkserver.py: vLLM imported, no plugin loaded), where the scenario
activates kwarm through its API (the .pth door itself: tests/test_doors.py). Building a real
``InputProcessor`` needs an engine's ``VllmConfig`` (a model, a device): the wrapped
``__init__`` is called with a stand-in for the original, on an object carrying only the
``model_config.logits_processors`` the warmup reads.
"""
from __future__ import annotations

import pytest

from conftest import cpu_triton_env, result_of, run_scenario


def _run(procs=None, **env):
    """tests/scenarios/frontend.py with the model's `procs` (logits_processors), kwarm enabled."""
    return result_of(run_scenario("frontend", procs, env=cpu_triton_env(**env), release="0.24.0", timeout=240))


def test_plugins_load_at_init_and_the_first_request_hits_the_cache():
    r = _run()
    assert r["patched"][1] is False and r["wrapped_ok"], "wrapped once (activation may have done it already)"
    assert r["inits"] == 1, "vLLM's own __init__ runs first"
    assert r["after_warm"]["misses"] == 1 and r["after_warm"]["currsize"] == 1
    assert r["after_request"]["hits"] == 1 and r["after_request"]["misses"] == 1, \
        "the first request's validation is a cache hit"
    assert any("front end: logits-processor plugins loaded" in m for m in r["logs"])


def test_warmups_without_frontend_load_nothing():
    r = _run(KWARM_WARMUPS="*,-frontend")
    assert r["inits"] == 1
    assert r["after_warm"]["currsize"] == 0


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_plugin_that_fails_to_load_is_one_warning(strict):
    r = _run(["kwarm_no_such_module.Processor"], KWARM_STRICT=strict)
    assert r["inits"] == 1
    if strict == "1":
        assert r["raised"] is not None
    else:
        assert r["raised"] is None
        warnings = [m for m in r["logs"] if "front-end warmup failed" in m]
        assert len(warnings) == 1, r["logs"]


def test_where_vllm_loads_the_plugins_itself_the_front_end_does_nothing(monkeypatch, kwarm_log):
    """vLLM 0.33+: ``InputProcessor.__init__`` builds ``validate_logits_processors_params``, and 0.34
    has no ``vllm.v1.sample.logits_processor``: no import of it, no warning, one info line."""
    import sys
    import types

    from kwarm_ext import frontend

    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", None)  # as on 0.34: import fails
    processor = types.SimpleNamespace(validate_logits_processors_params=lambda params: None,
                                      model_config=types.SimpleNamespace(logits_processors=None))
    assert frontend.warm(processor) is None
    assert kwarm_log.messages() == []
    assert any("covered upstream" in m for m in kwarm_log.messages(0))


def test_on_0_34_the_real_input_processor_loads_them_itself_and_kwarm_stays_silent():
    """vLLM 0.34.0 (no ``vllm.v1.sample.logits_processor``): kwarm's wrapper around a real
    ``InputProcessor`` whose own ``_build_logits_processors_params_validator`` ran, under
    ``KWARM_STRICT=1``: nothing raised, no warning, the validator vLLM built is there."""
    from conftest import run_py

    out = result_of(run_py("""
import importlib.util, json, logging, os
os.environ.update(KWARM_ENABLE="1", KWARM_STRICT="1")
from types import SimpleNamespace
from vllm.v1.engine.input_processor import InputProcessor
from kwarm_ext import patches
logs = []
handler = logging.Handler()
handler.emit = lambda record: logs.append((record.levelname, record.getMessage()))
logging.getLogger("kwarm").addHandler(handler)
processor = InputProcessor.__new__(InputProcessor)
processor.model_config = SimpleNamespace(logits_processors=None, runner_type="generate")
def init(*args, **kwargs):  # the part of vLLM's __init__ that builds the validator
    processor.validate_logits_processors_params = processor._build_logits_processors_params_validator()
patches._wrap_input_processor_init(init, processor, (), {})
print("RESULT " + json.dumps({"module": importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None,
                              "validator": callable(processor.validate_logits_processors_params),
                              "warnings": [m for level, m in logs if level != "INFO"],
                              "covered": any("covered upstream" in m for _, m in logs)}))
""", env=cpu_triton_env(), release="0.34.0", timeout=240))
    assert out == {"module": False, "validator": True, "warnings": [], "covered": True}
