"""The ``eager_attention`` family on vLLM 0.34, which has no V1 runner (its runs on 0.20-0.33 are
tested in tests/test_family_dummy_runs.py).

In a 0.34 interpreter: the V1 runner's module is gone, and a worker whose ``model_runner`` is
vLLM's real Model Runner V2 class (made without its ``__init__``, which needs a GPU) is read by
kwarm's own ``engine.build`` as a V2 engine, for which the family says why it does not run.
"""
from __future__ import annotations

from conftest import cpu_triton_env, result_of, run_py


def test_does_not_apply_on_0_34_which_has_only_model_runner_v2():
    result = result_of(run_py(r'''
import importlib.util, json, types
from kwarm_ext import engine
from kwarm_ext.kernels import eager_attention as fam
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

runner = object.__new__(GPUModelRunner)
runner.__dict__.update(attn_groups=[], is_pooling_model=False, max_num_reqs=4, device="cpu")
view = engine.build(types.SimpleNamespace(model_runner=runner, vllm_config=None))
print("RESULT " + json.dumps({"v1_module": importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None,
                              "kind": view.runner_kind, "applies": fam.applies(view)}))
''', release="0.34.0", env=cpu_triton_env(), timeout=240))
    assert result["v1_module"] is False, "0.34 removed vllm/v1/worker/gpu_model_runner.py"
    assert result["kind"] == "V2"
    assert result["applies"].startswith("V1 runner only: Model Runner V2 (the only runner from vLLM 0.34)")
