"""The families that warm through the runner's dummy runs, ``fused_moe`` and
``eager_attention``, against each release's real ``try_get_optimal_moe_config``,
``CUDAGraphMode``, ``TritonAttentionBackend`` and ``GPUModelRunner._dummy_run`` signature,
through kwarm's whole warmup.

What cannot exist on CPU is stood in for, and only that:

- the model runner: ``GPUModelRunner`` needs a GPU. The stand-in carries the attributes the
  family reads, and its ``_dummy_run`` has the release's real signature; in place of a model
  forward it does what vLLM's Triton experts do at that point, ask the real
  ``try_get_optimal_moe_config`` for the step's config through the module attribute
  production calls it by (``experts/triton_moe.py``, or ``fused_moe.py`` before 0.22);
- the MoE layer: a real ``MoERunner`` (0.24+; ``FusedMoE`` before) made without
  ``__init__`` (which needs a distributed setup); only its class is read;
- a FlashInfer backend (not installed on CPU): a stand-in with its name;
- the device name that picks vLLM's tuned config file comes from the driver: it is set to
  "NVIDIA H200" (the GPU host's), so the real tuned tables shipped with vLLM are used.
"""
from __future__ import annotations

import functools

import pytest

from conftest import MATRIX, run_cases


SCENARIO = r'''
import inspect, json, logging, os, sys
from types import SimpleNamespace

import vllm.platforms
from vllm.config import CUDAGraphMode
from vllm.model_executor.layers.fused_moe import fused_moe as fm
try:  # what registers in the forward context: MoERunner (0.24+), else the FusedMoE module
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner as MoELayer
except ImportError:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE as MoELayer
try:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
except ImportError:  # 0.34 removed the V1 runner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend


class FlashInferStandIn:
    @staticmethod
    def get_name():
        return "FLASHINFER"

vllm.platforms.current_platform.get_device_name = lambda device_id=0: "NVIDIA H200"
try:
    import vllm.model_executor.layers.fused_moe.experts.triton_moe as production
except ImportError:
    production = fm
REAL = fm.try_get_optimal_moe_config

import kwarm_ext.warmup as warmup
from kwarm_ext import config
from kwarm_ext.kernels import fused_moe as family

CASES = json.loads(__ARGS__)


class Runner:
    def __init__(self, case):
        self.case = case
        self.calls = []
        self.compilation_config = SimpleNamespace(
            cudagraph_mode=getattr(CUDAGraphMode, case["mode"]),
            max_cudagraph_capture_size=case["capture"],
            static_forward_context={"model.layers.1.mlp.experts": MoELayer.__new__(MoELayer)})
        self.max_num_tokens = case["max_tokens"]
        backend = FlashInferStandIn if case.get("backend") == "flashinfer" else TritonAttentionBackend
        self.attn_groups = [[SimpleNamespace(backend=backend)]]

    def _dummy_run(self, num_tokens, *args, **kwargs):
        self.calls.append({"M": num_tokens, "mode": getattr(kwargs.get("cudagraph_runtime_mode"), "name", None),
                           "skip_eplb": kwargs.get("skip_eplb"),
                           "attention": kwargs.get("force_attention", False),
                           "mixed": kwargs.get("create_mixed_batch", False)})
        if num_tokens == self.case.get("fail_at"):
            raise RuntimeError("dummy run failed")
        if self.case.get("experts", "triton") == "triton":
            production.try_get_optimal_moe_config(
                tuple(self.case["w1"]), tuple(self.case["w2"]), self.case["top_k"], self.case.get("dtype"),
                num_tokens, block_shape=self.case.get("block"))
            if self.case.get("down"):  # 0.34's block-FP8 experts: the down projection's own table
                production.get_moe_configs(self.case["w2"][0], self.case["w2"][2], self.case["dtype"], 128, 128,
                                           down_moe=True)


Runner._dummy_run.__signature__ = inspect.signature(GPUModelRunner._dummy_run)

try:  # the V2 model runner (opt-in in 0.20-0.28, the default from 0.29)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
except ImportError:
    GPUModelRunnerV2 = None


def v2_runner_class():
    """Runner, with the V2 runner's module (what kwarm's engine view tells the kinds by) and
    its real ``_dummy_run`` signature."""
    def _dummy_run(self, num_tokens, *args, **kwargs):
        return Runner._dummy_run(self, num_tokens, *args, **kwargs)
    _dummy_run.__signature__ = inspect.signature(GPUModelRunnerV2._dummy_run)
    return type("GPUModelRunner", (Runner,), {"__module__": "vllm.v1.worker.gpu.model_runner",
                                               "_dummy_run": _dummy_run})


def run_case(case):
    if case.get("v2"):
        if GPUModelRunnerV2 is None:
            return {"no_v2": True}
        runner = v2_runner_class()(case)
    else:
        runner = Runner(case)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v32"),
                                     enforce_eager=case.get("enforce_eager", False)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=case["max_tokens"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=runner.compilation_config)
    worker = SimpleNamespace(model_runner=runner, vllm_config=vllm_config)
    os.environ["KWARM_WARMUPS"] = case.get("warmups", "fused_moe")
    config.reset()
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("kwarm").addHandler(handler)
    report = warmup.run(worker)
    logging.getLogger("kwarm").removeHandler(handler)
    fam = next(f for f in report["families"] if f["name"] == "fused_moe")
    eager = next(f for f in report["families"] if f["name"] == "eager_attention")
    return {"family": fam, "eager": eager, "calls": runner.calls, "logs": logs,
            "restored": all(getattr(m, "try_get_optimal_moe_config", REAL) is REAL
                            for n, m in list(sys.modules.items()) if n.startswith("vllm.model_executor.layers.fused_moe")),
            "eager_range": list(family.eager_range(SimpleNamespace(
                runner=runner, max_num_batched_tokens=case["max_tokens"],
                enforce_eager=case.get("enforce_eager", False)))),
            "table": {str(m): REAL(tuple(case["w1"]), tuple(case["w2"]), case["top_k"], case.get("dtype"), m,
                                   case.get("block"))
                      for m in case.get("table_at", [])},
            "down_table": {str(m): dict(family.nearest(down, m)) for m in case.get("table_at", [])
                           for down in ([fm.get_moe_configs(case["w2"][0], case["w2"][2], case.get("dtype"), 128, 128,
                                                            down_moe=True)] if case.get("down") else []) if down}}


print("RESULT " + json.dumps({name: run_case(case) for name, case in CASES.items()}))
'''

# tiny DeepSeek-V3.2 (bench/models): 8 experts, top-2, hidden 1024, moe_intermediate 256:
# no tuned table, vLLM's get_default_config; CUDA graphs up to 32 tokens (max_num_seqs 16).
TINY = {"w1": [8, 512, 1024], "w2": [8, 1024, 256], "top_k": 2, "mode": "FULL_AND_PIECEWISE",
        "capture": 32, "max_tokens": 8192}
# A shape with a tuned H200 table in vLLM (E=128, N=192), top-8, graphs up to 512 tokens.
TUNED = {"w1": [128, 384, 2048], "w2": [128, 2048, 192], "top_k": 8, "mode": "FULL_AND_PIECEWISE",
         "capture": 512, "max_tokens": 4096, "table_at": list(range(513, 4097))}
CASES = {
    "tiny": TINY,
    "tiny_v2": dict(TINY, v2=True),
    "tuned": TUNED,
    "decode_only": dict(TINY, mode="FULL_DECODE_ONLY", max_tokens=256),
    "eager": dict(TINY, enforce_eager=True, max_tokens=256),
    "other_backend": dict(TINY, experts="cutlass"),
    "failing": dict(TINY, fail_at=33),
    "attention": dict(TINY, warmups="fused_moe,eager_attention"),
    "attention_no_graphs": dict(TINY, warmups="eager_attention", mode="NONE"),
    # not named (naming a family forces it past upstream's coverage)
    "attention_flashinfer": dict(TINY, warmups="*,-replay,-fused_moe,-frontend", backend="flashinfer"),
}


@functools.lru_cache(maxsize=None)
def _batch(release: str) -> dict:
    return run_cases(SCENARIO, CASES, release)


@pytest.fixture(scope="module", params=MATRIX)
def release(request):
    return request.param


def _ms(result):
    return [c["M"] for c in result["calls"]]


def test_tiny_default_config_regions(release):
    """vLLM's default-config thresholds (32/64/96/128/512 tokens, and GROUP_SIZE_M 16 once
    M // E > 128) split the eager range 33..8192; top-2 gives a period of 8 tokens."""
    result = _batch(release)["tiny"]
    fam = result["family"]
    assert fam["status"] == "ran", fam
    regions = [r["M"] for r in fam["details"]["regions"]]
    assert regions[0][0] == 33 and regions[-1][1] == 8192
    assert all(a[1] + 1 == b[0] for a, b in zip(regions, regions[1:])), "regions tile the range"
    bounds = {hi for _, hi in regions[:-1]}
    assert {64, 128, 512} <= bounds
    assert 1031 in bounds, "GROUP_SIZE_M turns 16 at M // 8 > 128"
    expected = [m for lo, hi in regions for m in range(lo, min(hi, lo + 7) + 1)]
    assert _ms(result) == expected[:1] + expected, \
        "one probe at 33 and its rerun (interpreted: Triton's cache cannot be counted), then the first 8 token counts of each region"
    assert all(c["mode"] == "NONE" and c["skip_eplb"] is True for c in result["calls"])
    assert fam["steps"][0]["status"] == "ran" and len(fam["steps"][0]["variants"]) == len(regions)
    assert result["restored"], "the recording stand-in is gone after the step"


def test_v2_runner_warms_the_same_token_counts(release):
    """On the V2 runner (vllm/v1/worker/gpu, opt-in before 0.29) the family runs the same dummy runs as on
    V1, through V2's own ``_dummy_run``, which takes no CUDA-graph mode (it runs eagerly at the
    exact count before capture): on 0.29.0 upstream's warmup left fused_moe_kernel compiles in
    requests (BENCHMARKS.md)."""
    cases = _batch(release)
    result = cases["tiny_v2"]
    assert not result.get("no_v2"), f"vLLM {release} has no vllm.v1.worker.gpu.model_runner"
    assert result["family"]["status"] == "ran", result["family"]
    assert _ms(result) == _ms(cases["tiny"]) and len(_ms(result)) > 1
    assert all(c["mode"] is None and c["skip_eplb"] is True for c in result["calls"]), \
        "no cudagraph_runtime_mode: V2's _dummy_run does not take one"
    assert result["restored"]


def test_tuned_table_regions(release):
    """With a tuned table the config is its nearest entry: each region holds one entry's config,
    neighbours differ, and top-8 needs 2 token counts per region."""
    result = _batch(release)["tuned"]
    fam = result["family"]
    table = {int(m): cfg for m, cfg in result["table"].items()}
    regions = fam["details"]["regions"]
    assert regions[0]["M"][0] == 513 and regions[-1]["M"][1] == 4096
    for region in regions:
        lo, hi = region["M"]
        assert all(table[m] == region["config"] for m in range(lo, hi + 1))
    for a, b in zip(regions, regions[1:]):
        assert a["config"] != b["config"]
    assert len(regions) >= 3
    expected = [m for r in regions for m in range(r["M"][0], min(r["M"][1], r["M"][0] + 1) + 1)]
    assert _ms(result) == expected[:1] + expected, "the probe, its rerun (interpreted), then 2 token counts per region"


def test_eager_range_follows_cudagraph_mode(release):
    cases = _batch(release)
    assert cases["tiny"]["eager_range"] == [33, 8192]
    assert cases["decode_only"]["eager_range"] == [1, 256], "mixed batches run eagerly at every size"
    assert cases["eager"]["eager_range"] == [1, 256]
    assert _ms(cases["eager"])[0] == 1


def test_other_backend_probes_once_and_says_so(release):
    result = _batch(release)["other_backend"]
    assert _ms(result) == [33]
    assert "another backend" in result["family"]["details"]["summary"]
    assert result["restored"]


def test_failing_dummy_run_is_one_warning(release):
    result = _batch(release)["failing"]
    step = result["family"]["steps"][0]
    assert step["status"] == "failed" and "dummy run failed" in step["reason"]
    warnings = [m for m in result["logs"] if "fused_moe.eager_sizes failed" in m]
    assert len(warnings) == 1, result["logs"]
    assert result["restored"], "restored even when the probe's forward raises"


def test_eager_attention_after_fused_moe(release):
    """An all-prefill then a mixed step at the smallest eager size (33), with attention
    metadata, after the fused-MoE dummy runs (which have none)."""
    result = _batch(release)["attention"]
    calls = result["calls"]
    moe = [c for c in calls if not c["attention"]]
    attention = [c for c in calls if c["attention"]]
    assert moe and calls[: len(moe)] == moe, "fused_moe runs first"
    assert [(c["M"], c["mixed"], c["mode"]) for c in attention] == [(33, False, "NONE"), (33, True, "NONE")]
    assert [s["status"] for s in result["eager"]["steps"]] == ["ran", "ran"]


def test_eager_attention_without_graphs_uses_16_tokens(release):
    result = _batch(release)["attention_no_graphs"]
    assert [(c["M"], c["attention"], c["mixed"]) for c in result["calls"]] == [(16, True, False), (16, True, True)]


def test_eager_attention_leaves_flashinfer_to_upstream(release):
    result = _batch(release)["attention_flashinfer"]
    assert result["calls"] == []
    assert result["eager"]["steps"][0]["reason"] == "covered by upstream kernel_warmup (FlashInfer attention)"


# vLLM 0.34: block-FP8 experts (E=256, N=512, a shape of its H200 "*_down.json" tables) take the down
# projection's config from a table of its own; graphs up to 512 tokens, eager up to 4096.
FP8_DOWN = {"w1": [256, 1024, 7168], "w2": [256, 7168, 512], "top_k": 8, "mode": "FULL_AND_PIECEWISE",
            "capture": 512, "max_tokens": 4096, "dtype": "fp8_w8a8", "block": [128, 128], "down": True,
            "table_at": list(range(513, 4097))}


def test_fp8_down_projection_table_splits_the_regions():
    """0.34's block-FP8 experts pick the down projection's config from ``*_down.json``, the entry
    nearest the token count: a different entry is a different kernel key, so the regions split
    where either table's entry changes, and each region holds one entry of both."""
    result = run_cases(SCENARIO, {"fp8_down": FP8_DOWN}, "0.34.0")["fp8_down"]
    fam = result["family"]
    assert fam["status"] == "ran", fam
    assert fam["details"]["down_tables"] == 1
    table = {int(m): cfg for m, cfg in result["table"].items()}
    down = {int(m): cfg for m, cfg in result["down_table"].items()}
    assert len({repr(sorted(c.items())) for c in down.values()}) > 1, "the down table has several entries here"
    regions = [r["M"] for r in fam["details"]["regions"]]
    assert regions[0][0] == 513 and regions[-1][1] == 4096
    for lo, hi in regions:
        assert all(table[m] == table[lo] and down[m] == down[lo] for m in range(lo, hi + 1)), (lo, hi)
    for (_, hi), (lo, _) in zip(regions, regions[1:]):
        assert table[hi] != table[lo] or down[hi] != down[lo], "neighbours differ in one of the tables"
    assert any(table[hi] == table[lo] for (_, hi), (lo, _) in zip(regions, regions[1:])), \
        "some regions are split by the down table alone"
