"""Family ``v2_warmup``: Model Runner V2's own ``warmup_kernels`` where vLLM did not run it, on the
real ``gpu_worker`` module of each release with kwarm's patch that notes vLLM's call, through kwarm's
real ``warmup.run`` / ``warmup.after_capture``. The steps themselves cannot run without a GPU:
``vllm.v1.worker.gpu.warmup.warmup_kernels`` is replaced by a recorder for the call kwarm makes."""
from __future__ import annotations

import pytest

from conftest import clean_env, result_of, run_py

SCRIPT = r"""
import json, os, types
import vllm.v1.worker.gpu_worker as gpu_worker
import vllm.v1.worker.gpu.warmup as v2
from vllm.config import CUDAGraphMode
from kwarm_ext import config, patches, warmup

ns = types.SimpleNamespace
calls = []
v2.warmup_kernels = lambda *args: calls.append(args)  # a GPU's prefill and decode steps
os.environ["KWARM_WARMUPS"] = "*"  # not by name: a named family is forced
config.reset()


def worker(eager, mode, module="vllm.v1.worker.gpu.model_runner"):
    runner = type("GPUModelRunner", (), {"__module__": module})()
    runner.__dict__.update(attn_groups=[], device="cpu", max_num_reqs=16, is_pooling_model=False,
                           compilation_config=ns(static_forward_context={}, cudagraph_mode=getattr(CUDAGraphMode, mode)))
    model_config = ns(enforce_eager=eager, hf_text_config=ns(model_type="qwen3_next"),
                      hf_config=ns(architectures=["Qwen3NextForCausalLM"]))
    vllm_config = ns(model_config=model_config, scheduler_config=ns(max_num_batched_tokens=2048),
                     parallel_config=ns(tensor_parallel_size=1))
    return ns(model_runner=runner, vllm_config=vllm_config, execute_model=lambda *a: None,
              sample_tokens=lambda *a: None)


def after(w):
    warmup.run(w)
    family = next(f for f in warmup.after_capture(w)["families"] if f["name"] == "v2_warmup")
    return {"status": family["status"], "reason": family.get("reason"),
            "steps": [(s["status"], s.get("reason") or s.get("variants")) for s in family["steps"]]}


out = {}
w = worker(True, "NONE")
out["unpatched"] = after(w)
assert patches.V2_WARMUP.apply(gpu_worker) is True
out["eager"] = after(w)
out["eager_call"] = [list(c) == [w.model_runner, w.execute_model, w.sample_tokens] for c in calls]
calls.clear()
w = worker(True, "NONE")
try:  # vLLM's own call (the real function: it fails on a stand-in runner, after kwarm's note)
    gpu_worker.warmup_kernels(w.model_runner, w.execute_model, w.sample_tokens)
except Exception:
    pass
out["vllm_ran"] = after(w)
out["graphs"] = after(worker(False, "FULL_AND_PIECEWISE"))
out["v1"] = after(worker(True, "NONE", module="vllm.v1.worker.gpu_model_runner"))
out["calls_after"] = len(calls)
os.environ["KWARM_WARMUPS"] = "v2_warmup"  # named: forced past vLLM's own call, never past captured graphs
config.reset()
out["forced"] = after(w)
out["forced_graphs"] = after(worker(False, "FULL_AND_PIECEWISE"))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.24.0", "0.28.0", "0.33.0", "0.34.0"])
def test_runs_vllms_own_warmup_kernels_only_where_vllm_did_not(release):
    """Eager (no graph captured) and vLLM did not call it: kwarm calls vLLM's warmup_kernels with the
    worker's runner, execute_model and sample_tokens, once. Where vLLM called it (noted by kwarm's
    patch of the worker module's name, even a call that failed), where graphs were captured, and
    without the patch (the call is unknowable): a skip with its reason; the V1 runner: not applied."""
    out = result_of(run_py(SCRIPT, env=clean_env(CUDA_VISIBLE_DEVICES=""),
                           release=None if release == "0.24.0" else release))
    assert out["unpatched"]["steps"] == [["skipped", "kwarm's note of vLLM's own warmup_kernels call is not "
                                          "installed: whether it ran is unknown"]]
    assert out["eager"]["status"] == "ran" and out["eager"]["steps"] == [["ran", ["prefill and decode steps"]]]
    assert out["eager_call"] == [True]
    assert out["vllm_ran"]["steps"] == [["skipped", "vLLM ran warmup_kernels itself"]]
    assert out["graphs"]["steps"][0][0] == "skipped" and "CUDA graphs were captured" in out["graphs"]["steps"][0][1]
    assert out["v1"]["status"] == "skipped" and out["v1"]["reason"] == "not Model Runner V2"
    assert out["calls_after"] == 0
    assert out["forced"]["steps"] == [["ran", ["prefill and decode steps"]]]
    assert out["forced_graphs"]["steps"][0][0] == "skipped"


@pytest.mark.parametrize("eager, mode, nothing", [(True, "NONE", True), (True, "FULL_AND_PIECEWISE", True),
                                                  (False, "NONE", True), (False, None, True),
                                                  (False, "FULL_AND_PIECEWISE", False), (None, "PIECEWISE", False)])
def test_no_graph_was_captured_when_either_eager_or_mode_none(eager, mode, nothing):
    """All four corners of ``enforce_eager`` x cudagraph mode (issue 59: the scenario above covers two,
    and turning the rule's ``or`` into ``and`` passed it)."""
    from kwarm_ext.engine import EngineView
    from kwarm_ext.kernels import v2_warmup

    assert v2_warmup.captured_nothing(EngineView(enforce_eager=eager, cudagraph_mode=mode)) is nothing
