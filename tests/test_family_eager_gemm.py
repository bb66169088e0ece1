"""The ``eager_gemm`` family against each release's real linear layers: ``ColumnParallelLinear``,
``RowParallelLinear`` (with bias), ``ReplicatedLinear`` and ``ParallelLMHead``, built on CPU
in a one-process gloo group, with their real ``UnquantizedLinearMethod`` /
``UnquantizedEmbeddingMethod``, and ``MLAAttention`` with its real ``_v_up_proj``, through
kwarm's whole warmup.

What cannot exist on CPU is stood in for, and only that: the model runner (``GPUModelRunner``
needs a GPU), a namespace with the attributes the family reads and the real model as
``get_model()``; ``MLAAttention.__init__``, which picks a GPU attention backend (vLLM has no
MLA on CPU), so those layers are the real class made with ``nn.Module.__init__`` and given
the attributes ``__init__`` and ``process_weights_after_loading`` set (``W_UK_T``, ``W_UV`` as
the same views of a ``kv_b_proj`` weight). The quant methods' ``apply`` is wrapped, calling through, to see which rows
each GEMM got; what the GPU gains (cuBLAS choosing and loading kernels) is measured by
``bench/gemm_first_call.py`` and the engine benchmark, not here.
"""
from __future__ import annotations

import functools
import os

import pytest

from conftest import MATRIX, run_cases

SCENARIO = r'''
import json, logging, os, socket
from types import SimpleNamespace

import torch
from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers import linear, vocab_parallel_embedding as vpe

import kwarm_ext.warmup as warmup
from kwarm_ext import config

CASES = json.loads(__ARGS__)
TMP = __import__("tempfile").mkdtemp()
calls = []


def spy(cls):
    real = cls.apply

    def apply(self, layer, x, bias=None):
        calls.append({"layer": layer.kwarm_name, "M": x.shape[0], "bias": bias is not None,
                      "grad": torch.is_grad_enabled()})
        return real(self, layer, x, bias)

    cls.apply = apply


spy(linear.UnquantizedLinearMethod)
spy(vpe.UnquantizedEmbeddingMethod)
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
real_gate_forward = GateLinear.forward


def gate_forward(self, x):
    calls.append({"layer": self.kwarm_name + ".forward", "M": x.shape[0], "dtype": str(x.dtype).split(".")[-1]})
    return real_gate_forward(self, x)


GateLinear.forward = gate_forward
real_bmm = torch.bmm


def bmm(a, b, *, out):
    calls.append({"layer": getattr(b, "kwarm_name", "?"), "M": a.shape[1], "grad": torch.is_grad_enabled(),
                  "token_major": not out.is_contiguous()})
    return real_bmm(a, b, out=out)


torch.bmm = bmm
HEADS, NOPE, ROPE, LORA, V = 4, 16, 8, 32, 16


def mla(name, sparse, pad_heads=None, aiter=False):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    layer = MLAAttention.__new__(MLAAttention)
    torch.nn.Module.__init__(layer)
    kv_b = torch.randn(LORA, HEADS, NOPE + V, dtype=torch.bfloat16)  # kv_b_proj's weight, (L, N, P + V)
    w_uk, w_uv = kv_b.split([NOPE, V], dim=-1)
    layer.W_UV, layer.W_UK_T = w_uv.transpose(0, 1), w_uk.permute(1, 2, 0)
    layer.W_UV.kwarm_name, layer.W_UK_T.kwarm_name = name + ".W_UV", name + ".W_UK_T"
    layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim = HEADS, NOPE, ROPE
    layer.kv_lora_rank, layer.v_head_dim = LORA, V
    layer.q_pad_num_heads, layer.use_sparse = pad_heads, sparse
    layer.is_aiter_triton_fp8_bmm_enabled, layer.is_aiter_triton_fp4_bmm_enabled = aiter, False
    layer.is_amx_bmm_enabled = False
    layer.kwarm_weights = (kv_b, kv_b.clone())
    return layer


def sm90_gate(weight_dtype, **flags):
    from vllm.model_executor.kernels.linear.cute_dsl import ll_bf16, ll_fp32w
    # STAND-IN for the CuTe DSL GEMMs (they need the GPU): the same product, fp32 out
    ll_bf16.ll_bf16_gemm = ll_fp32w.LL_FP32W_GEMM_KERNEL = lambda x, w: x.float() @ w.float().T
    gate = GateLinear(64, 8, out_dtype=torch.float32, params_dtype=weight_dtype)
    gate.__dict__.update(flags)
    return gate


class Model(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16)
        make = {"column": lambda: linear.ColumnParallelLinear(64, 128, bias=False, **kw),
                "column_twin": lambda: linear.ColumnParallelLinear(64, 128, bias=False, **kw),
                "row_bias": lambda: linear.RowParallelLinear(128, 64, bias=True, **kw),
                "row_skip_bias": lambda: linear.RowParallelLinear(128, 64, bias=True, skip_bias_add=True, **kw),
                "router": lambda: linear.ReplicatedLinear(64, 8, bias=False, **kw),
                # the MoE router gate: bf16 hidden states, here a fp32 weight (force_fp32_compute
                # off a GPU) of the shape "router" has, fp32 logits out
                "gate": lambda: GateLinear(64, 8, out_dtype=torch.float32, params_dtype=torch.float32),
                "gate_bf16": lambda: GateLinear(64, 8, out_dtype=torch.float32, params_dtype=torch.bfloat16),
                # STAND-INS for gates built on an SM90+ GPU (vLLM sets these flags at build there)
                "gate_ll_bf16": lambda: sm90_gate(torch.bfloat16, allow_ll_bf16_gemm=True),
                "gate_ll_fp32w": lambda: sm90_gate(torch.float32, allow_ll_fp32w_gemm=True),
                "lm_head": lambda: vpe.ParallelLMHead(1000, 64, **kw),
                "mla_sparse": lambda: mla("mla_sparse", sparse=True),
                "mla_sparse_twin": lambda: mla("mla_sparse_twin", sparse=True),
                "mla_dense": lambda: mla("mla_dense", sparse=False, pad_heads=8),
                "mla_aiter": lambda: mla("mla_aiter", sparse=True, aiter=True)}
        for name in layers:
            layer = make[name]()
            layer.kwarm_name = name
            setattr(self, name, layer)
            for param in layer.parameters():
                torch.nn.init.normal_(param)


def run_case(case):
    calls.clear()
    model = Model(case["layers"])
    before = {n: p.clone() for n, p in model.named_parameters()}
    # V1 runner: reorder_batch_threshold; Model Runner V2 (the only one from 0.34): decode_query_len
    decode = ({"decode_query_len": case["decode_query_len"]} if "decode_query_len" in case
              else {"reorder_batch_threshold": case.get("decode_threshold", 1)})
    runner = SimpleNamespace(
        get_model=lambda: model, device=case.get("device"), max_num_reqs=case["max_num_reqs"], max_num_tokens=case["max_tokens"],
        **decode,
        compilation_config=SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, case["mode"]),
                                           max_cudagraph_capture_size=case["capture"],
                                           static_forward_context={}))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama"), enforce_eager=False,
                                     dtype=torch.bfloat16),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=case["max_tokens"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kernel_config=SimpleNamespace(enable_jit_warmup=case.get("jit", False)),
        compilation_config=runner.compilation_config)
    os.environ["KWARM_WARMUPS"] = "eager_gemm"
    for var in ("KWARM_BUDGET", "KWARM_MANIFEST"):
        os.environ.pop(var, None)
    os.environ.update(case.get("env", {}))
    if case.get("learned"):
        import sys
        sys.path.insert(0, case["tests_dir"])
        import replay_kernels  # STAND-IN for the GPU driver a manifest's stamp names (none on CPU)
        replay_kernels.install_fake_driver()
        from kwarm_ext import manifest_files
        os.environ["KWARM_MANIFEST"] = path = os.path.join(TMP, "learned.json")
        manifest_files.save(path, manifest_files.current_stamp(model=None, tp_size=1), token_counts=case["learned"])
    config.reset()
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("kwarm").addHandler(handler)
    report = warmup.run(SimpleNamespace(model_runner=runner, vllm_config=vllm_config))
    logging.getLogger("kwarm").removeHandler(handler)
    family = next(f for f in report["families"] if f["name"] == "eager_gemm")
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    changed += [n for n, m in model.named_children() if hasattr(m, "kwarm_weights") and not torch.equal(*m.kwarm_weights)]
    return {"family": family, "calls": list(calls), "logs": logs, "changed": changed}


def heuristics_cache():
    """kwarm's capacity calls on the cuBLASLt library this torch loaded (no GPU needed); the
    capacity is put back afterwards."""
    import ctypes
    from kwarm_ext.kernels import cublaslt, eager_gemm
    libs = cublaslt.libraries_loaded()
    if not libs:
        return {"libraries": 0}
    capacity = ctypes.c_size_t()
    libs[0].cublasLtHeuristicsCacheGetCapacity(ctypes.byref(capacity))
    start = capacity.value
    out = {"libraries": len(libs), "start": start,
           "raised": cublaslt.reserve_heuristics_cache(start + 1000),
           "kept": cublaslt.reserve_heuristics_cache(10),
           "step": cublaslt.reserve_step(5, details := {})(), "details": details.get("heuristics_cache"),
           "none": cublaslt.reserve_heuristics_cache(10, libraries=[])}
    for lib in libs:
        lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(start))
    return out


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    results = {name: run_case(case) for name, case in CASES.items()}
    results["heuristics_cache"] = heuristics_cache()
    print("RESULT " + json.dumps(results))
'''

GRAPHS = {"mode": "FULL_AND_PIECEWISE", "capture": 32, "max_tokens": 200, "max_num_reqs": 4}
LAYERS = ["column", "column_twin", "row_bias", "row_skip_bias", "router", "lm_head"]
CASES = {
    "model": dict(GRAPHS, layers=LAYERS, env={"KWARM_BUDGET": "unlimited"}),
    "no_budget": dict(GRAPHS, layers=LAYERS, env={"KWARM_BUDGET": "0"}),
    "no_graphs": dict(GRAPHS, mode="NONE", max_tokens=70, layers=["router"], env={"KWARM_BUDGET": "unlimited"}),
    "gates": dict(GRAPHS, layers=["router", "gate", "gate_bf16"], env={"KWARM_BUDGET": "0"}),
    "no_linear": dict(GRAPHS, layers=[]),
    "offloaded": dict(GRAPHS, layers=["router", "lm_head"], device="cuda:0"),  # the layers stay on CPU
    "mla": dict(GRAPHS, decode_threshold=2, layers=["mla_sparse", "mla_sparse_twin", "mla_dense", "mla_aiter"],
                env={"KWARM_BUDGET": "unlimited"}),
    "mla_offloaded": dict(GRAPHS, layers=["mla_sparse"], device="cuda:0"),
    "mla_v2": dict(GRAPHS, decode_query_len=3, layers=["mla_dense"], env={"KWARM_BUDGET": "0"}),
    # last: it installs a stand-in Triton driver, for the manifest's stamp
    "learned": dict(GRAPHS, layers=["router", "lm_head", "mla_sparse"], learned=[150, 77, 3, 5000],
                    env={"KWARM_BUDGET": "0"}, tests_dir=os.path.dirname(os.path.abspath(__file__))),
}
# the eager range is 33..200 (graphs up to 32 tokens, 200 batched tokens at most)
EXACT = list(range(33, 65))
# 33 x 2^(i/8), rounded, up to 200: the kernel grid (its counts up to 64 are exact ones already)
GRID = [33, 36, 39, 43, 47, 51, 55, 61, 66, 72, 78, 86, 93, 102, 111, 121, 132, 144, 157, 171, 187, 200]
FILL = list(range(65, 201))  # every count above 64 (every 8th from 520 on: test_fill_counts)


@pytest.fixture(params=MATRIX)
def release(request):
    return request.param


@functools.lru_cache(maxsize=None)
def _batch(release: str) -> dict:
    return run_cases(SCENARIO, CASES, release)


def _steps(result) -> dict:
    """The family's steps in `result`, by name."""
    return {s["name"]: s for s in result["family"]["steps"]}


def _ms(result, layer):
    return [c["M"] for c in result["calls"] if c["layer"] == layer]


def test_one_layer_per_gemm_shape_exact_then_grid_then_fill(release):
    result = _batch(release)["model"]
    family = result["family"]
    assert family["status"] == "ran", family
    steps = _steps(result)
    assert [s["name"] for s in family["steps"]] == ["heuristics_cache", "mla_bmm", "exact", "grid", "fill"]
    assert all(steps[n]["status"] == "ran" for n in ("exact", "grid", "fill")), steps
    # column and its twin share a shape: only the first is called; a bias the layer adds
    # itself (skip_bias_add) is not passed, so row_skip_bias is a bias-less shape of its own
    column = _ms(result, "column")
    assert _ms(result, "column_twin") == []
    # exact: 64..33, largest first; then the grid's counts above 64, largest first; then the fill, smallest first
    grid_rest = [m for m in GRID if m > 64]
    fill_rest = [m for m in FILL if m not in GRID]
    assert column[:len(EXACT)] == EXACT[::-1]
    grid = column[len(EXACT):len(EXACT) + len(grid_rest)]
    assert grid == grid_rest[::-1]
    fill = column[len(EXACT) + len(grid_rest):]
    assert fill == fill_rest, "each count once, smallest first: a budget cut leaves the largest"
    assert _ms(result, "row_bias") == column and _ms(result, "row_skip_bias") == column
    assert {c["bias"] for c in result["calls"] if c["layer"] == "row_bias"} == {True}
    assert {c["bias"] for c in result["calls"] if c["layer"] == "row_skip_bias"} == {False}
    assert _ms(result, "lm_head") == [4, 3, 2, 1], "the LM head at 1..max_num_seqs rows, once each"
    assert not any(c["grad"] for c in result["calls"]), "under inference mode"
    assert result["changed"] == [], "weights and biases are only read"
    assert steps["mla_bmm"]["status"] == "skipped"
    assert steps["mla_bmm"]["reason"] == "no MLA layers with absorbed cuBLAS weights"
    problems = 4 * len(column) + 4
    assert family["details"]["summary"].startswith(
        f"exact {4 * len(EXACT) + 4} problems, grid {4 * len(grid_rest)} problems, fill {4 * len(fill_rest)} problems, "
        "5 GEMM shapes, run")
    # cuBLASLt's heuristics cache is raised for CUDA runners only
    assert steps["heuristics_cache"]["status"] == "skipped"
    assert steps["heuristics_cache"]["reason"] == f"runner device unknown is not CUDA ({problems} GEMM problems)"


def test_a_spent_budget_leaves_only_the_fill_to_the_requests(release):
    result = _batch(release)["no_budget"]
    steps = _steps(result)
    grid_rest = [m for m in GRID if m > 64]
    assert sorted(_ms(result, "column")) == EXACT + grid_rest, "the exact counts and the grid run whatever the budget"
    summary = result["family"]["details"]["summary"]
    assert f"grid {4 * len(grid_rest)} problems," in summary and "grid 0" not in summary
    left = 4 * len([m for m in FILL if m not in GRID])
    assert steps["fill"]["status"] == "ran"
    # spent before the pass: nothing captured (on CUDA an empty graph would make torch warn)
    assert steps["fill"]["variants"][-1] == f"0 GEMM problems warmed, {left} left to the requests (KWARM_BUDGET)"
    assert f"fill 0 problems ({left} left to the requests: KWARM_BUDGET)" in summary
    # what the summary line counts as left to the requests, and the report lists
    assert result["family"]["details"]["left_to_requests"] == [
        {"step": "fill", "count": left, "what": "GEMM problems", "why": "KWARM_BUDGET"}]


def test_the_router_gate_runs_its_own_forward_on_the_hidden_states_dtype(release):
    result = _batch(release)["gates"]
    grid_rest = [m for m in GRID if m > 64]
    counts = EXACT[::-1] + grid_rest[::-1]
    # the plain ReplicatedLinear of the same shape stays a target of its own, through quant_method.apply
    assert _ms(result, "router") == counts
    assert _ms(result, "router.forward") == []
    # each gate (fp32 and bf16 weights: two GEMM shapes) through GateLinear.forward, on bf16 hidden
    # states (the model's dtype), at the same counts; on CPU its forward ends in quant_method.apply
    for gate in ("gate", "gate_bf16"):
        forward = [c for c in result["calls"] if c["layer"] == gate + ".forward"]
        assert [c["M"] for c in forward] == counts, gate
        assert {c["dtype"] for c in forward} == {"bfloat16"}, gate
        assert _ms(result, gate) == counts, gate
    steps = _steps(result)
    assert any(v.startswith("gate (8, 64) router gate (its forward): 32 counts") for v in steps["exact"]["variants"])
    # run, never captured (a CuTe DSL tier may compile and load on its first call)
    assert steps["exact"]["variants"][-1] == f"{3 * len(EXACT)} GEMM problems run; 2 router gates run"
    # the spent budget leaves the fill of all three: nothing said to have run
    fill = len([m for m in FILL if m not in GRID])
    assert steps["fill"]["variants"][-1] == f"0 GEMM problems warmed, {3 * fill} left to the requests (KWARM_BUDGET)"


def test_learned_token_counts_are_warmed_exactly_first(release):
    result = _batch(release)["learned"]
    exact = _steps(result)["exact"]
    assert exact["status"] == "ran"
    router = _ms(result, "router")
    # in the eager range (33..200): 150 and 77 join 33..64; 3 is below it, 5000 above it
    assert router[:len(EXACT) + 2] == sorted(EXACT + [77, 150], reverse=True)
    assert router.count(150) == router.count(77) == 1 and 3 not in router and 5000 not in router
    assert _ms(result, "lm_head") == [4, 3, 2, 1]
    # sparse MLA runs at every count up to 200: exact 1..64 and the learned 77, 150
    mla = _ms(result, "mla_sparse.W_UV")
    assert mla[:66] == sorted(list(range(1, 65)) + [77, 150], reverse=True)
    assert "4 learned token counts" in result["family"]["details"]["summary"]
    assert result["family"]["details"]["learned"] == 4


def test_without_cuda_graphs_from_one_token(release):
    result = _batch(release)["no_graphs"]
    assert sorted(_ms(result, "router")) == list(range(1, 71)), "exact 1..64, the grid, every count of the fill"


def test_no_linear_layers_is_a_skip(release):
    steps = _steps(_batch(release)["no_linear"])
    assert steps["linear"]["status"] == "skipped" and steps["linear"]["reason"] == "no unquantized linear layers"
    assert steps["lm_head"]["reason"] == "no unquantized lm_head layers"


@pytest.mark.parametrize("case, reasons", [
    ("offloaded", {"linear": "no unquantized linear layers on cuda", "lm_head": "no unquantized lm_head layers on cuda"}),
    ("mla_offloaded", {"mla_bmm": "no MLA layers with absorbed cuBLAS weights"}),
])
def test_weights_off_the_runners_device_are_left_alone(release, case, reasons):
    """A weight offloaded to the CPU (linear layers, LM head, MLA) is not warmed on a CUDA runner."""
    result = _batch(release)[case]
    assert result["calls"] == []
    assert {name: _steps(result)[name]["reason"] for name in reasons} == reasons


def test_mla_absorbed_bmms_at_every_token_count_sparse_and_at_decode_counts_dense(release):
    result = _batch(release)["mla"]
    steps = _steps(result)
    assert steps["exact"]["status"] == "ran", steps
    # sparse MLA (DSA): every token takes the absorbed path, so B runs over all token counts;
    # the query's BMM into both output layouts (no padded heads), the layer's own _v_up_proj
    uv = _ms(result, "mla_sparse.W_UV")
    # exact 1..64, the grid from 1 (2^(i/8)) above 64, and the fill
    ladder = [70, 76, 83, 91, 99, 108, 117, 128, 140, 152, 166, 181, 197, 200]
    assert sorted(uv) == sorted(set(range(1, 65)) | set(ladder) | set(FILL))
    assert len(uv) == len(set(uv)), "each count once"
    assert _ms(result, "mla_sparse.W_UK_T") == [m for m in uv for _ in (0, 1)]
    assert [c["token_major"] for c in result["calls"] if c["layer"] == "mla_sparse.W_UK_T" and c["M"] == 2] == [False, True]
    assert _ms(result, "mla_sparse_twin.W_UK_T") == [], "one layer per shape"
    # dense MLA: only decode tokens, up to max_num_seqs x reorder_batch_threshold = 4 x 2;
    # padded heads: the head-major buffer only
    assert _ms(result, "mla_dense.W_UK_T") == list(range(8, 0, -1))
    assert _ms(result, "mla_dense.W_UV") == list(range(8, 0, -1))
    assert _ms(result, "mla_aiter.W_UK_T") == _ms(result, "mla_aiter.W_UV") == [], "AITER's BMMs are vLLM's"
    assert not any(c["grad"] for c in result["calls"]), "under inference mode"
    assert result["changed"] == [], "the absorbed weights are only read"
    assert "mla_dense W_UK_T (4, 16, 32) W_UV (4, 32, 16): 8 counts (M 1..8)" in steps["exact"]["variants"]


def test_dense_mla_decode_rows_on_model_runner_v2_use_its_decode_query_len(release):
    """Model Runner V2 has no reorder_batch_threshold: a decode runs ``decode_query_len`` tokens
    per request (1 + speculative tokens), so dense MLA's BMMs reach max_num_seqs x 3 = 12 rows."""
    result = _batch(release)["mla_v2"]
    assert _ms(result, "mla_dense.W_UV") == list(range(12, 0, -1))


def test_router_gates_start_above_the_counts_vllm_warms_0_34():
    """On SM90+ a gate's forward takes CuTe DSL GEMMs for few tokens, which vLLM 0.34 warms itself:
    kernel_warmup the ll_bf16 one at 1..16 tokens (bf16 weights), the JIT registry the ll_fp32w
    one at 1..32 (fp32 weights, with enable_jit_warmup). kwarm's calls start above those (a call
    at those counts would reach the CuTe kernel, which the CPU does not have)."""
    case = dict(GRAPHS, mode="NONE", max_tokens=40, layers=["gate_ll_bf16", "gate_ll_fp32w"], jit=True,
                env={"KWARM_BUDGET": "unlimited"})
    without_jit = dict(case, layers=["gate_ll_fp32w"], jit=False)
    result = run_cases(SCENARIO, {"sm90": case, "without_jit": without_jit}, "0.34.0")
    assert sorted(_ms(result["sm90"], "gate_ll_bf16.forward")) == list(range(17, 41))
    assert sorted(_ms(result["sm90"], "gate_ll_fp32w.forward")) == list(range(33, 41))
    # enforce_eager turns the JIT registry off: kwarm's calls then start at 1
    assert sorted(_ms(result["without_jit"], "gate_ll_fp32w.forward")) == list(range(1, 41))


def test_heuristics_cache_capacity_is_raised_never_lowered(release):
    """The real cuBLASLt library of the installed torch (its capacity calls need no GPU)."""
    cache = _batch(release)["heuristics_cache"]
    if not cache["libraries"]:
        pytest.skip("this torch loads no cuBLASLt library (a CPU-only build)")
    start, (before, raised, reason) = cache["start"], cache["raised"]
    # cuBLASLt may round a capacity up (to a multiple of 1024 in CUDA 13's)
    assert before == start and start + 1000 <= raised < start + 1000 + 4096 and reason is None
    assert cache["kept"] == [raised, raised, None], "a larger capacity is kept"
    assert cache["step"] == [f"capacity {raised} -> {raised} (5 problems to warm)"]
    assert cache["details"] == {"problems": 5, "before": raised, "after": raised, "reason": None}
    assert cache["none"] == [None, None, "no cuBLASLt library loaded"]


def test_fill_counts_every_count_to_512_then_every_8th_smallest_first(release):
    from kwarm_ext.kernels import eager_gemm

    assert eager_gemm.fill_counts(33, 600) == list(range(65, 513)) + list(range(520, 601, 8))
    assert eager_gemm.fill_counts(513, 560) == list(range(520, 561, 8))
    assert eager_gemm.fill_counts(1, 64) == [] and eager_gemm.fill_counts(100, 50) == []
