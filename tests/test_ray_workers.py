"""kwarm in vLLM's Ray workers, on the mechanism vLLM itself uses (no Ray cluster: Ray is not in the
test environment). vLLM's Ray executor copies to its workers only the variables that its real
``get_env_vars_to_copy`` names (``vllm/ray/ray_env.py``); a worker sets them
(``update_environment_variables``) and loads the general plugins (``load_general_plugins``), where
kwarm's entry point opens the door. Each step runs in a fresh interpreter started, as a Ray worker
is, without KWARM_ENABLE."""
from __future__ import annotations

import json

from conftest import clean_env, result_of, run_py

LAUNCHER = r'''
import json, os
import kwarm_ext
active = kwarm_ext.activate("test")
from vllm.ray.ray_env import get_env_vars_to_copy
names = get_env_vars_to_copy(destination="RayWorkerWrapper")
print("RESULT " + json.dumps({"active": active, "copied": {n: os.environ[n] for n in sorted(names)
                                                          if n in os.environ and n.startswith("KWARM_")},
                              "prefixes": os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY")}))
'''

WORKER = r'''
import json, os, sys
from kwarm_ext import activation
before = activation.is_active()
from vllm.utils.system_utils import update_environment_variables
update_environment_variables(json.loads(sys.argv[1]))
from vllm.plugins import load_general_plugins
load_general_plugins()
print("RESULT " + json.dumps({"before": before, "after": activation.is_active(), "sources": activation.SOURCES,
                              "warmups": os.environ.get("KWARM_WARMUPS")}))
'''


def _launcher(**env):
    return result_of(run_py(LAUNCHER, env=clean_env(CUDA_VISIBLE_DEVICES="", **env), timeout=240))


def test_kwarm_settings_reach_a_ray_worker_and_activate_kwarm_there():
    launched = _launcher(KWARM_ENABLE="1", KWARM_WARMUPS="-eager_gemm", VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="MY_")
    assert launched["active"] and launched["prefixes"] == "MY_,KWARM_"  # the user's own prefixes kept
    assert launched["copied"] == {"KWARM_ENABLE": "1", "KWARM_WARMUPS": "-eager_gemm"}
    code = WORKER.replace("sys.argv[1]", repr(json.dumps(launched["copied"])))
    worker = result_of(run_py(code, env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=240))
    assert worker == {"before": False, "after": True, "sources": ["plugin"], "warmups": "-eager_gemm"}


def test_without_kwarm_vllm_copies_none_of_its_settings():
    launched = _launcher(KWARM_WARMUPS="-eager_gemm")  # kwarm off: nothing added, nothing copied
    assert not launched["active"] and launched["prefixes"] is None and launched["copied"] == {}


def test_kwarm_run_adds_the_prefix_once():
    from kwarm_ext.activation import share_with_ray_workers

    env = {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "A_, KWARM_"}
    share_with_ray_workers(env)
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "A_, KWARM_"
    env = {}
    share_with_ray_workers(env)
    assert env == {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "KWARM_"}
