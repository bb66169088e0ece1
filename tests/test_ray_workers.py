"""kwarm in vLLM's Ray workers. vLLM's Ray executor copies to its workers only the variables that
its real ``get_env_vars_to_copy`` names (``vllm/ray/ray_env.py``); a worker sets them
(``update_environment_variables``) and loads the general plugins (``load_general_plugins``), where
kwarm's entry point opens the door. First on that mechanism alone, each step in a fresh interpreter
started, as a Ray worker is, without KWARM_ENABLE; then on a real local Ray cluster started
beforehand with ``ray start --head`` from an environment without KWARM_ variables, with vLLM's
real ``RayWorkerWrapper`` as the Ray actor."""
from __future__ import annotations

import json

import pytest

from conftest import clean_env, require, result_of, run_py

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


# -- a real local Ray cluster ---------------------------------------------------------------------

RAY_DRIVER = r'''
import json, os
import cloudpickle, ray
from kwarm_ext import activation
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_utils import RayWorkerWrapper

def state(wrapper):
    import os
    from kwarm_ext import activation
    return {"active": activation.is_active(), "sources": activation.SOURCES, "pid": os.getpid(),
            "enable": os.environ.get("KWARM_ENABLE"), "warmups": os.environ.get("KWARM_WARMUPS")}

def init_worker_plugins(wrapper):
    # what RayWorkerWrapper.init_worker does before it builds the worker (it needs a GPU config)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    return state(wrapper)

ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
# as RayDistributedExecutor._init_workers_ray: the wrapper as a Ray actor, then the variables
# get_env_vars_to_copy names, sent with update_environment_variables
worker = ray.remote(num_cpus=0)(RayWorkerWrapper).remote(rpc_rank=0)
before = ray.get(worker.execute_method.remote(cloudpickle.dumps(state)))
names = get_env_vars_to_copy(destination="RayWorkerWrapper")
env = {n: os.environ[n] for n in names if n in os.environ}
ray.get(worker.execute_method.remote("update_environment_variables", [env]))
after = ray.get(worker.execute_method.remote(cloudpickle.dumps(init_worker_plugins)))
print("RESULT " + json.dumps({"driver": activation.is_active(), "driver_pid": os.getpid(), "before": before,
                              "after": after}))
'''


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster started beforehand with ``ray start --head``, from an environment without
    any KWARM_ variable (what a raylet started by an operator has)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    require("ray")  # tests/run.sh installs it
    ray_cli = Path(sys.executable).with_name("ray")
    temp = tempfile.mkdtemp(prefix="kr", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    env = clean_env(CUDA_VISIBLE_DEVICES="", RAY_USAGE_STATS_ENABLED="0")
    start = [str(ray_cli), "start", "--head", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"]
    proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(ray_cli), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kwarm_activates_in_the_ray_worker_of_a_real_cluster(ray_cluster):
    """``KWARM_ENABLE=1 vllm serve --distributed-executor-backend ray`` against a cluster started
    without kwarm: vLLM's real RayWorkerWrapper runs as a Ray actor in a process the raylet started
    (no KWARM_ variable, kwarm inactive), gets the variables vLLM's own get_env_vars_to_copy names
    (KWARM_ among them, through the prefix kwarm's activation added in the driver) and, as
    init_worker does, loads the general plugins: kwarm is active there, with the driver's settings."""
    got = result_of(run_py(RAY_DRIVER, env=clean_env(CUDA_VISIBLE_DEVICES="", KWARM_ENABLE="1",
                                                     KWARM_WARMUPS="-eager_gemm", RAY_ADDRESS=ray_cluster,
                                                     RAY_USAGE_STATS_ENABLED="0"), timeout=300))
    assert got["driver"]
    assert got["before"]["pid"] == got["after"]["pid"] != got["driver_pid"]  # one actor, not the driver
    assert got["before"] == dict(got["before"], active=False, enable=None, warmups=None)
    assert got["after"]["active"] and got["after"]["sources"] == ["plugin"]
    assert (got["after"]["enable"], got["after"]["warmups"]) == ("1", "-eager_gemm")


def test_without_the_prefix_a_ray_worker_stays_without_kwarm(ray_cluster):
    """The same with the prefix taken back out of vLLM's list: the worker never sees KWARM_ENABLE
    (what happens to a kwarm that does not add it), so the test above can fail."""
    code = RAY_DRIVER.replace("names = get_env_vars_to_copy(destination=\"RayWorkerWrapper\")",
                              "os.environ['VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY'] = ''\n"
                              "names = get_env_vars_to_copy(destination=\"RayWorkerWrapper\")")
    got = result_of(run_py(code, env=clean_env(CUDA_VISIBLE_DEVICES="", KWARM_ENABLE="1", RAY_ADDRESS=ray_cluster,
                                               RAY_USAGE_STATS_ENABLED="0"), timeout=300))
    assert got["driver"] and not got["after"]["active"] and got["after"]["enable"] is None
