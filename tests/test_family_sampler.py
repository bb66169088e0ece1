"""The ``sampler`` family against vLLM 0.33's real Model Runner V2 sampling code on CPU (Triton's
interpreter): ``compute_topk_scores`` with its real ``_topk_log_softmax_kernel`` and ``_ranks_kernel``,
``InputBatch.make_dummy`` over real ``InputBuffers`` and real ``SamplingParams``. Only the model (its
``compute_logits``: a real ``torch.nn.Linear``) and the runner around the sampler are stand-ins:
neither a GPU model runner nor vLLM's config can be built without a GPU; the sampler is a recorder
of what it was given (its own kernels need the GPU runner's request state)."""
from __future__ import annotations

import types

import pytest

from conftest import cpu_triton_env, result_of, run_py


SCENARIO = r'''
import json, sys, types
import torch
import vllm.utils.torch_utils
for mod in list(sys.modules.values()):  # no pinned memory without a driver
    if getattr(mod, "__name__", "").startswith("vllm") and hasattr(mod, "PIN_MEMORY"):
        mod.PIN_MEMORY = False
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import sampler as fam
from kwarm_ext.surfaces.triton.compat import int_class
from vllm.v1.worker.gpu.sample import logprob
from vllm.v1.worker.gpu import input_batch as ib

ARGS = json.loads(__ARGS__)
VOCAB, HIDDEN = 300, 32

# every (TOPK_BLOCK_SIZE, class of the count of columns, logits dtype) the real kernel launches
launched = set()
real_kernel = logprob._topk_log_softmax_kernel


class Spy:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launched.add((kwargs["TOPK_BLOCK_SIZE"], int_class(int(args[5])), str(args[1].dtype)))
            return real_kernel[grid](*args, **kwargs)
        return launch


logprob._topk_log_softmax_kernel = Spy()


class Recorder:  # the runner's sampler: what kwarm adds, then each call's batch
    logprobs_mode = ARGS["mode"]

    def __init__(self):
        self.pending, self.calls = {}, []

    def add_request(self, i, params):
        self.pending[i] = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                           "min_p": params.min_p, "seed": params.seed}

    def apply_staged_writes(self):
        pass

    def __call__(self, logits, batch):
        n = batch.num_reqs
        self.calls.append({"n": n, "logits": list(logits.shape), "dtype": str(logits.dtype),
                           "idx": batch.idx_mapping.tolist(), "params": [self.pending[i] for i in range(n)]})


torch.manual_seed(0)
head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
model = types.SimpleNamespace(compute_logits=lambda h: head(h))
config = types.SimpleNamespace(get_hidden_size=lambda: HIDDEN, dtype=torch.bfloat16, max_logprobs=ARGS["max_logprobs"])
buffers = ib.InputBuffers(**{k: v for k, v in dict(max_num_reqs=4, max_num_tokens=16, device=torch.device("cpu"),
                                                    pin_memory=False).items()
                             if k in __import__("inspect").signature(ib.InputBuffers.__init__).parameters})
runner = types.SimpleNamespace(sampler=Recorder(), model=model, model_config=config, input_buffers=buffers,
                               device=torch.device("cpu"), max_num_reqs=4)
compiled = []
if ARGS.get("registry"):
    # vLLM's registry derives its Triton keys from the driver's binder (none on CPU): each dispatcher
    # hands out three keys of its own; compile records whether Triton's AsyncCompileMode was active
    from triton.runtime import _async_compile
    runner.vllm_config = object()
    for name, d in fam.registry_dispatchers():
        d.get_warmup_keys = (lambda name: lambda vllm_config: [
            (name, i, vllm_config is runner.vllm_config) for i in range(3)])(name)
        d.compile = lambda key: compiled.append([*key, _async_compile.active_mode.get() is not None])
view = EngineView(runner_kind="V2", runner=runner, is_pooling_model=False, max_num_reqs=ARGS["max_num_reqs"],
                  tp_size=1)
out = {"applies": fam.applies(view)}
steps = fam.plan(view, forced=False)
out["steps"] = {s.name: (s.skip or s.run()) for s in steps}
out["calls"] = runner.sampler.calls
out["compiled"] = compiled
out["order"] = [s.name for s in steps]
out["launched"] = sorted(map(list, launched))
# what production can reach: every count of logprobs 0..max_logprobs, on the logits' dtype
reach = set()
for k in range(0, (ARGS["max_logprobs"] if ARGS["max_logprobs"] >= 0 else 1024) + 1):
    cols = k + 1
    reach.add((min(1 << (cols - 1).bit_length(), 1024), int_class(cols)))
out["reach"] = sorted(map(list, reach))
print("RESULT " + json.dumps(out))
'''


def _run(**args):
    args = {"mode": "raw_logprobs", "max_logprobs": 20, "max_num_reqs": 16, **args}
    code = SCENARIO.replace("__ARGS__", repr(__import__("json").dumps(args)))
    return result_of(run_py(code, release="0.33.0", env=cpu_triton_env(), timeout=400))


@pytest.fixture(scope="module")
def default_run():
    return _run()


def test_logprobs_warm_every_key_class_production_reaches(default_run):
    got = {(b, c) for b, c, dtype in default_run["launched"]}
    assert got == {tuple(r) for r in default_run["reach"]}
    assert {dtype for _, _, dtype in default_run["launched"]} == {"torch.bfloat16"}
    # 0..20 logprobs: 1..21 columns, blocks 1..32 and the %16 class of 16
    assert got == {(1, "one"), (2, "other"), (4, "other"), (8, "other"), (16, "other"), (16, "div16"),
                   (32, "other")}
    assert default_run["steps"]["logprobs"] == ["bfloat16 logprobs 0,1,2,4,8,15,16"]


def test_sampling_batches_reach_the_paths_vllms_own_dummy_run_does_not(default_run):
    calls = default_run["calls"]
    assert [c["n"] for c in calls] == [1, 1, 1, 1, 2, 2, 2, 2, 2]
    for c in calls:  # production's logits and a real dummy batch over the runner's buffers
        assert c["logits"] == [c["n"], 300] and c["dtype"] == "torch.bfloat16" and c["idx"] == list(range(c["n"]))
    first = [c["params"][0] for c in calls[:4]]
    assert first[0]["min_p"] == 0.1 and first[0]["seed"] is None and first[0]["top_p"] == 1.0
    assert [(p["top_k"], p["top_p"], p["seed"]) for p in first[1:]] == [(40, 1.0, 1), (0, 0.9, 1), (40, 0.9, 1)]
    mixed = calls[-1]["params"]
    assert mixed[0]["temperature"] == 0.0 and mixed[1]["temperature"] == 0.8 and mixed[1]["seed"] is None
    assert default_run["steps"]["sampling"][0] == "min_p x1" and default_run["applies"] is None


def test_topk_topp_keys_of_vllms_registry_compile_at_once_before_sampling():
    """0.33+: every warmup key vLLM's own registry derives for its top-k/top-p dispatchers (from the
    engine's config) goes to the dispatcher's compile while Triton's AsyncCompileMode is active (all
    in parallel), before the sampling batches that would meet them one after another."""
    run = _run(registry=True)
    assert run["order"] == ["topk_topp_ahead", "sampling", "logprobs"]
    names = ["_topk_topp", "_topp_split_stats", "_topp_split_step", "_topp_split_mask"]
    assert run["compiled"] == [[n, i, True, True] for n in names for i in range(3)]
    labels = run["steps"]["topk_topp_ahead"]
    assert labels[:4] == [f"{n}: 3 keys" for n in names] and labels[4].startswith("compiled on ")
    # without the engine's config there is nothing to derive keys from: a step that says so
    assert _run()["steps"]["topk_topp_ahead"] == "runner has no vllm_config"


def test_registry_keys_for_a_row_stride_the_vocabulary_never_gives_are_left_out():
    """vLLM's registry derives every top-k/top-p key for a logits row stride divisible by 16 and for
    one that is not; with a vocabulary divisible by 16 (DeepSeek-V3.2's 129280, Qwen3-Next's 151936)
    the sampler's logits rows never have the second. Keys are vLLM's own TritonCompileKey holding
    its TritonWarmupTensor, as get_warmup_keys makes them."""
    got = result_of(run_py(r"""
import json, torch
from kwarm_ext.kernels import sampler as fam
from vllm.model_executor.warmup.jit_warmup_triton_helper import TritonCompileKey, TritonWarmupTensor
def key(stride, i):
    return TritonCompileKey(frozenset({i}), (("logits", TritonWarmupTensor(torch.float32, shape=(4, 129280),
                                                                          strides=(stride, 1))), ("k", None)))
keys = [key(16, 0), key(2, 1), key(129280, 2), key(129283, 3)]
print("RESULT " + json.dumps({str(v): [fam.reachable(k, v) for k in keys] for v in (129280, 151936, 32001, None)}
                             | {"no_logits": fam.reachable(TritonCompileKey(frozenset(), (("x", 1),)), 129280)}))
""", release="0.33.0", env=cpu_triton_env()))
    assert got["129280"] == got["151936"] == [True, False, True, False]
    assert got["32001"] == got["None"] == [True, True, True, True]  # both strides reachable, or unknown
    assert got["no_logits"]


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_mode_also_warms_fp32_and_max_logprobs_bounds_the_classes(mode):
    """Both processed modes return fp32 logprobs (issue 59: only processed_logprobs was tested)."""
    run = _run(mode=mode, max_logprobs=5, max_num_reqs=1)
    assert {dtype for _, _, dtype in run["launched"]} == {"torch.bfloat16", "torch.float32"}
    assert {(b, c) for b, c, _ in run["launched"]} == {tuple(r) for r in run["reach"]}
    # one request at most: no batch of two is sent
    assert [c["n"] for c in run["calls"]] == [1, 1, 1, 1]


def test_compile_ahead_compiles_only_the_keys_the_vocabulary_can_reach():
    """``compile_ahead`` itself leaves out the keys :func:`reachable` refuses (issue 59: the registry
    test stubs keys that carry no logits, so removing the filter passed it). vLLM's real
    TritonCompileKey and TritonWarmupTensor; the dispatcher records what it is asked to compile."""
    got = result_of(run_py(r"""
import json, types, torch
from kwarm_ext.kernels import sampler as fam
from vllm.model_executor.warmup.jit_warmup_triton_helper import TritonCompileKey, TritonWarmupTensor
def key(stride, i):
    return TritonCompileKey(frozenset({i}), (("logits", TritonWarmupTensor(torch.float32, shape=(4, 129280),
                                                                          strides=(stride, 1))), ("k", None)))
compiled = []
dispatcher = types.SimpleNamespace(get_warmup_keys=lambda vllm_config: [key(16, 0), key(2, 1), key(129280, 2), key(129283, 3)],
                                   compile=lambda k: compiled.append(sorted(k.jit_keys)))
config = types.SimpleNamespace(model_config=types.SimpleNamespace(get_vocab_size=lambda: 129280))
labels = fam.compile_ahead([("_topk_topp", dispatcher)], config, 1)
print("RESULT " + json.dumps({"compiled": len(compiled), "labels": labels[:2]}))
""", release="0.33.0", env=cpu_triton_env()))
    assert got["compiled"] == 2
    assert got["labels"] == ["_topk_topp: 2 keys", "2 keys of a logits row stride this vocabulary (129280) never has"]


def test_applies_only_to_a_v2_runner_with_a_sampler():
    from kwarm_ext.engine import EngineView
    from kwarm_ext.kernels import sampler as fam

    runner = types.SimpleNamespace(sampler=object())
    assert fam.applies(EngineView(runner_kind="V2", runner=runner, is_pooling_model=False)) is None
    assert "V1 runner" in fam.applies(EngineView(runner_kind="V1", runner=runner, is_pooling_model=False))
    assert "pooling" in fam.applies(EngineView(runner_kind="V2", runner=runner, is_pooling_model=True))
    assert "no sampler" in fam.applies(EngineView(runner_kind="V2", runner=types.SimpleNamespace(sampler=None),
                                                  is_pooling_model=False))
    assert fam.applies(EngineView()) == "no model runner"


def test_count_classes():
    from kwarm_ext.kernels import sampler as fam

    assert fam.logprob_counts(0) == [0]
    assert fam.logprob_counts(None) == fam.logprob_counts(20) == [0, 1, 2, 4, 8, 15, 16]
    assert fam.logprob_counts(-1)[-1] <= 1024 and len(fam.logprob_counts(-1)) == len(set(fam.logprob_counts(-1)))
