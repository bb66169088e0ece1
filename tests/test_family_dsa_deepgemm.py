"""The dsa_indexer family's DeepGEMM steps against the real vLLM, on CPU.

The family warms DeepGEMM's indexer kernels through vLLM's wrappers in
``vllm.utils.deep_gemm`` (``fp8_fp4_mqa_logits``, ``get_paged_mqa_logits_metadata``,
``fp8_fp4_paged_mqa_logits``). DeepGEMM is a CUDA library that JIT-compiles for SM90+; it
cannot run here. So each release (0.20.0, 0.22.0, 0.24.0, 0.26.0, 0.28.0, 0.33.0, 0.34.0) runs
once in a fresh interpreter that:

1. resolves the wrappers as the family does and binds production's call shape to their real
   signatures (symbol level: every release, 0.33.0 included);
2. plans the family on this CPU, where DeepGEMM cannot run, and records the skip reasons;
3. swaps in stand-ins, each labelled ``STAND-IN`` in the scenario, and plans and runs the
   family, then drives production itself with the same stand-ins: the real
   ``DeepseekV32IndexerMetadataBuilder`` (``build``) and the real ``sparse_attn_indexer`` op
   (through ``SparseAttnIndexer.forward_cuda``) on small batches (prefill, plain decode,
   MTP decode, FULL-graph capture batches). Both call the same real wrappers, so the
   recorded calls show what production passes and what the warmup passes.

Real vLLM objects: the wrappers and their ``_lazy_init`` fast path, the metadata builder
(constructed on CPU), ``CommonAttentionMetadata``, ``build_prefill_chunk_metadata`` (Triton
interpreter), ``sparse_attn_indexer`` / ``SparseAttnIndexer``, ``DeepseekV32IndexerCache``
(its ``get_kv_cache_spec`` gives the builder's spec), ``AttentionGroup`` and the backend.

Stand-ins, and why:
- DeepGEMM itself: ``vllm.utils.deep_gemm._<wrapper>_impl`` become recording fakes returning
  tensors of the real output shapes, dtypes and 1024-byte row strides (the CUDA library cannot
  load without a GPU; 0.28+ vendor it as ``vllm.third_party.deep_gemm``, whose ``_C`` loads a
  compiled ``_C_extension*.so``, absent from the .py-only release folders: vLLM logs that its
  trial import failed, and the fakes stand behind the real wrappers as on every release);
- the platform: ``is_cuda`` and ``get_device_capability`` (9.0 = H200; 8.0 and 10.0 for the
  skip paths), and ``num_compute_units`` = 132 (the H200's SMs) for the builder;
- ``has_deep_gemm`` (0.26+ trial-imports DeepGEMM's CUDA extension, absent here);
- the CUDA ops around the DeepGEMM calls in ``sparse_attn_indexer`` (K-cache insert/gather,
  top-k): no-ops (0.33+: vLLM's own ``SparseIndexerTopk`` with its kernels not run, so that
  0.34's ``takes_bf16_logits`` decides as in production); the workspace manager: plain
  allocations of the requested shapes; the forward context: a namespace holding the built
  metadata. 0.34's ``as_fp32_logits`` (bf16 logits upcast for the fp32 top-k) runs for real
  (Triton interpreter), its launches recorded with Triton's specialization;
- the vLLM config: a namespace with the fields these objects read (a real ``VllmConfig``
  needs a model directory and a device), its attention config's resolvers vLLM's own
  (``AttentionConfig.resolve_indexer_*``), and 0.34's DeepSeek-V3.2 config hook
  (``_set_deepseek_indexer_logits_dtype``) run on it as ``verify_and_update_config`` does;
- the indexer module that owns the cache: an ``nn.Module`` carrying ``n_head`` /
  ``head_dim`` and the real cache and op (the real ``Indexer`` builds quantized linear
  layers that need the parallel state); the bound cache is a real-shaped uint8 tensor
  ``[4 blocks, 64, 132]`` (FP8: 128 bytes + a 4-byte fp32 scale per token).

The tests compare DeepGEMM JIT keys computed from the recorded calls (``jit_key``): the
template parameters DeepGEMM's SM90 kernels are specialized on (read in the wheels'
``include/deep_gemm/impls/sm90_fp8_*mqa_logits.cuh`` and
``scheduler/*paged_mqa_logits.cuh``) plus the dtypes and keywords production passes.
"""
from __future__ import annotations

import json

import pytest

from conftest import MATRIX, REPO, PerRelease, cpu_triton_env, marked_json, run_scenario
from conftest import plan_steps as steps
from conftest import release_version as v

CONFIG = str(REPO / "bench" / "models" / "tiny-deepseek-v32" / "config.json")  # index 64 x 128, top-k 256
MARK = "KWARM-DG-RESULT "
RELEASES = (*MATRIX, "0.33.0", "0.34.0")
SEQS = 100  # max_num_seqs: four 32-row metadata classes (32, 64, 96, 128)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]

SCENARIOS = PerRelease(lambda release: _scenario(release))
_prefetch = SCENARIOS.autouse_fixture()


scenario = SCENARIOS.result  # the results for one release (one subprocess per release per session)


def _scenario(release: str) -> tuple[bool, object]:
    proc = run_scenario("dsa_deepgemm", CONFIG, SEQS, CAPTURE_SIZES, env=cpu_triton_env(), release=release,
                        timeout=600)
    return marked_json(proc, MARK)


DG_STEP_NAMES = ("mqa_logits", "paged_mqa_logits", "paged_mqa_logits_metadata")


# -- DeepGEMM JIT keys of recorded calls --------------------------------------------------------

def _val(arg):
    """A scalar's value, or 'tensor' for a tensor argument."""
    return arg["value"] if "value" in arg else "tensor"


def jit_key(call: dict) -> tuple:
    """What DeepGEMM specializes the JIT on (SM90 templates, vendored 2.5.0-2.8.1), plus the
    dtypes, ranks and keywords production passes; for 0.34's ``_upcast_logits_kernel`` (Triton),
    its specialization.

    - ``sm90_fp8_mqa_logits<kNumHeads, kHeadDim, [kIsCompressedLogits,] BLOCK_Q=128/H, BLOCK_KV,
      stages, kNumSMs, threads, logits dtype>``: heads and head_dim of Q, whether compressed
      logits were asked for (max_seqlen_k > 0), clean_logits (a separate clean kernel);
    - ``sm90_fp8_paged_mqa_logits<kNextN, kNumHeads, kHeadDim, BLOCK_KV, kIsContextLens2D,
      kIsVarlen, stages, SPLIT_KV, threads, [kNumKVMulticast = next_n == 4,] logits dtype>``;
    - ``smxx_paged_mqa_logits_metadata<kAlignedBatchSize = align(rows, 32), SPLIT_KV,
      kNumSMs (the slots the wrapper passes), kIsVarlen>``.
    The batch sizes, sequence lengths and pointers are runtime arguments. The logits dtype is
    0.34's ``logits_dtype`` keyword (fp32 where absent)."""
    if call["impl"] == "upcast":
        return ("upcast", json.dumps(call["spec"]))
    args, kwargs = call["args"], call["kwargs"]
    logits = _val(kwargs.get("logits_dtype", {"value": "torch.float32"}))
    if call["impl"] == "mqa_logits":
        (q, q_sf), (k, k_sf), weights, ks, ke = args[:5]
        max_seqlen_k = args[5]["value"] if len(args) > 5 else kwargs.get("max_seqlen_k", {"value": 0})["value"]
        return ("mqa_logits", q["dtype"], tuple(q["shape"][1:]), _val(q_sf), k["dtype"], k["shape"][1],
                k_sf["dtype"], len(k_sf["shape"]), weights["dtype"], weights["shape"][1], ks["dtype"],
                ke["dtype"], _val(kwargs.get("clean_logits", {"value": None})), max_seqlen_k > 0, logits)
    if call["impl"] == "paged":
        (q, q_sf), kv, weights, lens, table, schedule, max_len = args[:7]
        return ("paged", q["dtype"], tuple(q["shape"][1:]), _val(q_sf), kv["dtype"], tuple(kv["shape"][1:]),
                weights["dtype"], weights["shape"][1], lens["dtype"], tuple(lens["shape"][1:]),
                table["dtype"], len(table["shape"]), schedule["dtype"], max_len["value"],
                _val(kwargs.get("clean_logits", {"value": None})), _val(kwargs.get("indices", {"value": None})), logits)
    lens, block, slots = args[:3]
    return ("metadata", lens["dtype"], len(lens["shape"]), -(-lens["shape"][0] // 32) * 32, block["value"],
            slots["value"], _val(kwargs.get("indices", {"value": None})))


def keys(calls, impl=None) -> set:
    return {jit_key(c) for c in calls if impl is None or c["impl"] == impl}


def warm_calls(result: dict, plan: str, step: str | None = None) -> list:
    return [c for s in result["plans"][plan] if step is None or s["name"] == step for c in s["calls"]]


def production_calls(result: dict, config: str) -> list:
    return [c for calls in result["production"][config].values() for c in calls]


def signature(arg):
    """The structure of an argument: tuple nesting, None, and each tensor's dtype, rank,
    contiguity and innermost stride (what DeepGEMM's host code asserts on)."""
    if isinstance(arg, list):
        return tuple(signature(a) for a in arg)
    if "value" in arg:
        return type(arg["value"]).__name__ if arg["value"] is not None else None
    return (arg["dtype"], len(arg["shape"]), arg["contiguous"], arg["stride"][-1])


# -- symbols ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_wrappers_resolve_and_bind(release):
    """Each release's production binding is vLLM's own wrapper, and the family's call shape
    binds to its real signature (0.33 replaces clean_logits with max_seqlen_k; 0.28 adds indices;
    0.34 logits_dtype)."""
    result = scenario(release)
    assert result["version"] == release
    assert result["problems"] == {}
    assert set(result["entries"]) == {"fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                      "get_paged_mqa_logits_metadata"}
    for name, entry in result["entries"].items():
        assert entry["module"] == "vllm.utils.deep_gemm" and entry["qualname"] == name
        assert entry["is_vllm_wrapper"] and entry["is_production_binding"], name
    assert result["flags"] == {
        "mqa_clean_logits": v(release) < (0, 33), "mqa_max_seqlen_k": v(release) >= (0, 33),
        "paged_clean_logits": v(release) < (0, 33), "paged_indices": v(release) >= (0, 28),
        "metadata_indices": v(release) >= (0, 28), "mqa_logits_dtype": v(release) >= (0, 34),
        "paged_logits_dtype": v(release) >= (0, 34)}
    params = result["entries"]["fp8_fp4_mqa_logits"]["params"]
    assert params[:5] == ["q", "kv", "weights", "cu_seqlen_ks", "cu_seqlen_ke"]
    assert params[5] == ("max_seqlen_k" if v(release) >= (0, 33) else "clean_logits")
    assert result["entries"]["get_paged_mqa_logits_metadata"]["params"][:3] == ["context_lens", "block_size", "num_sms"]


# -- fail-open --------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_skips_on_this_cpu(release):
    """No stand-ins: DeepGEMM cannot run here, so every DeepGEMM step is a skip with the
    reason (0.26+'s has_deep_gemm() trial-imports the CUDA extension; 0.20-0.24 only look
    for the package, so there it is the platform that says no)."""
    result = scenario(release)
    cpu = result["cpu"]
    assert [s["name"] for s in cpu] == list(DG_STEP_NAMES)
    expected = ("DeepGEMM is not installed or does not import (has_deep_gemm() is False)" if not result["has_deep_gemm"] else
                "not a CUDA platform (UnspecifiedPlatform): the indexer's DeepGEMM kernels are CUDA-only")
    assert {s["skip"] for s in cpu} == {expected}
    assert result["has_deep_gemm"] == (v(release) < (0, 26))
    assert all(not s["calls"] for s in cpu)


@pytest.mark.parametrize("release", RELEASES)
def test_skips_where_deep_gemm_is_absent(release):
    assert scenario(release)["absent"] == ["DeepGEMM is not installed or does not import (has_deep_gemm() is False)"] * 3


@pytest.mark.parametrize("release", RELEASES)
def test_skips_below_sm90(release):
    sm80 = scenario(release)["plans"]["sm80"]
    assert [s["name"] for s in sm80] == list(DG_STEP_NAMES)
    for s in sm80:
        assert s["skip"] == "GPU capability 8.0 < 9.0: DeepGEMM's MQA-logits kernels need Hopper (SM90) or newer"


@pytest.mark.parametrize("release", RELEASES)
def test_skips_where_deep_gemm_lacks_the_symbols(release):
    got = steps(scenario(release), "no_impl")
    assert "DeepGEMM has no fp8_fp4_mqa_logits" in got["mqa_logits"]["skip"]
    assert "DeepGEMM has no get_paged_mqa_logits_metadata" in got["paged_mqa_logits_metadata"]["skip"]
    assert got["paged_mqa_logits"]["skip"] is not None
    assert not any(s["calls"] for s in got.values())


@pytest.mark.parametrize("release", RELEASES)
def test_a_wrapper_with_another_signature_skips_its_step_only(release):
    got = steps(scenario(release), "other_signature")
    assert got["paged_mqa_logits"]["skip"].startswith(
        "paged_of_another_release(q, kv_cache, weights, context_lens) does not take this call")
    assert got["mqa_logits"]["labels"] and got["paged_mqa_logits_metadata"]["labels"]
    assert {c["impl"] for c in got["mqa_logits"]["calls"]} == {"mqa_logits"}


@pytest.mark.parametrize("release", RELEASES)
def test_a_legacy_wrapper_name_is_a_skip(release):
    got = steps(scenario(release), "legacy_name")
    assert got["mqa_logits"]["skip"] == ("this vLLM calls DeepGEMM's fp8_mqa_logits (the call shape before "
                                         "fp8_fp4_mqa_logits), which is not modelled")
    assert got["paged_mqa_logits"]["labels"]


@pytest.mark.parametrize("release", RELEASES)
def test_an_mxfp4_indexer_cache_is_a_skip(release):
    fp4 = scenario(release)["plans"]["fp4"]
    assert [(s["name"], s["skip"]) for s in fp4] == [
        (n, "MXFP4 indexer cache (SM100): its DeepGEMM call shape is not modelled") for n in DG_STEP_NAMES]


@pytest.mark.parametrize("release", RELEASES)
def test_sm100_runs_only_the_modelled_call_shapes(release):
    """On SM100 (stand-in capability 10.0) 0.28+ decodes varlen (indices) and 0.33 passes
    MX-scaled inputs: the family skips what it does not model, and production's calls show
    that those shapes differ; what it does run matches production."""
    result = scenario(release)
    got = steps(result, "sm100")
    production = production_calls(result, "sm100")
    prod = {c["impl"]: c for c in production}
    if v(release) < (0, 28):
        assert all(s["skip"] is None and s["labels"] for s in got.values())
        assert keys(production) <= keys(warm_calls(result, "sm100"))
    elif v(release) < (0, 33):
        varlen = "varlen decode (SM100: one row per token, with indices) is not modelled"
        assert got["paged_mqa_logits"]["skip"] == got["paged_mqa_logits_metadata"]["skip"] == varlen
        assert prod["paged"]["kwargs"]["indices"]["dtype"] == "int32"  # production: varlen rows
        assert keys([prod["mqa_logits"]]) == keys(warm_calls(result, "sm100", "mqa_logits"))
    else:
        mx = "MX-scaled MQA-logits inputs (SM100, 0.33+): not modelled"
        assert {s["skip"] for s in got.values()} == {mx}
        q_scale, weights = prod["mqa_logits"]["args"][0][1], prod["mqa_logits"]["args"][2]
        assert (q_scale["dtype"], weights["dtype"]) == ("int32", "bfloat16")  # unit MX scales, bf16 weights


def test_unexpected_planning_error_fails_its_step():
    """An unexpected error while planning the DeepGEMM steps (here: the runner) is one failing
    step, for warmup.py to log and isolate, not an exception out of plan()."""
    broken = scenario("0.24.0")["broken_runner"]
    assert [(s["name"], s["skip"], s["error"]) for s in broken] == [
        ("mqa_logits", None, "RuntimeError: attn_groups broke")]


@pytest.mark.parametrize("release", RELEASES)
def test_no_step_fails(release):
    """Every planned step either ran, with labels and the calls its run made, or was skipped with a
    reason (issue 59: ``error is None`` alone passed a step that silently did nothing)."""
    plans = scenario(release)["plans"]
    assert plans
    for plan, planned in plans.items():
        assert planned, plan
        for step in planned:
            assert step["error"] is None, (plan, step)
            if step["skip"] is None:
                assert step["labels"] and step["calls"], (plan, step)
            else:
                assert isinstance(step["skip"], str) and step["skip"].strip(), (plan, step)


# -- what is warmed -----------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("config", ["eager", "mtp2", "mtp4", "bf16"])
def test_warmup_covers_every_production_key(release, config):
    """Production (the real builder and indexer op) on prefill, plain-decode and MTP batches
    compiles no DeepGEMM key the warmup did not (bf16: ``indexer_logits_dtype="bfloat16"``,
    0.34+; before, the same engine as eager)."""
    result = scenario(release)
    production = production_calls(result, config)
    upcast = {"upcast"} if config == "bf16" and v(release) >= (0, 34) else set()
    assert {c["impl"] for c in production} == {"mqa_logits", "paged", "metadata"} | upcast
    assert keys(production) <= keys(warm_calls(result, config))


@pytest.mark.parametrize("release", RELEASES)
def test_logits_dtype_is_productions(release):
    """0.34's wrappers take ``logits_dtype`` (a template parameter of DeepGEMM's logits kernels):
    the family passes the one production's ``SparseAttnIndexer`` resolved from the attention
    config (float32 by default off SM100, bfloat16 where set), and for bf16 also runs the
    Triton upcast production runs before its fp32 top-k, at production's key. Before 0.34
    neither side passes one (fp32 logits) and the bf16 setting does not exist."""
    result = scenario(release)

    def dtypes(calls):
        return {(c["impl"], _val(c["kwargs"].get("logits_dtype", {"value": None})))
                for c in calls if c["impl"] in ("mqa_logits", "paged")}

    for config, dtype in (("eager", "torch.float32"), ("bf16", "torch.bfloat16")):
        dtype = dtype if v(release) >= (0, 34) else None
        assert dtypes(production_calls(result, config)) == {("mqa_logits", dtype), ("paged", dtype)}
        assert dtypes(warm_calls(result, config)) == {("mqa_logits", dtype), ("paged", dtype)}
    assert not keys(production_calls(result, "eager"), "upcast")
    if v(release) >= (0, 34):
        got = steps(result, "bf16")
        assert "logits=bfloat16 +_upcast_logits_kernel" in got["mqa_logits"]["labels"][0]
        assert keys(production_calls(result, "bf16"), "upcast") == keys(warm_calls(result, "bf16"), "upcast")
        assert keys(production_calls(result, "bf16")) - keys(production_calls(result, "eager"))
    else:
        assert keys(warm_calls(result, "bf16")) == keys(warm_calls(result, "eager"))
        assert keys(production_calls(result, "bf16")) <= keys(production_calls(result, "eager"))


@pytest.mark.parametrize("release", RELEASES)
def test_warm_calls_have_production_structure(release):
    """Argument by argument, the warmup's calls reach DeepGEMM with the structure production's
    do: tuple nesting, None scales, dtypes, ranks, contiguity, keyword names and values."""
    result = scenario(release)
    warm = {c["impl"]: c for c in warm_calls(result, "eager")}
    for call in result["production"]["eager"]["mixed"]:
        mine = warm[call["impl"]]
        assert [signature(a) for a in mine["args"]] == [signature(a) for a in call["args"]], call["impl"]
        assert set(mine["kwargs"]) == set(call["kwargs"]), call["impl"]
        for name, arg in call["kwargs"].items():
            if "value" in arg:
                assert mine["kwargs"][name]["value"] == arg["value"], (call["impl"], name)
    # the values that are not batch sizes: heads, head_dim, block size, SMs, max_model_len
    prod = {c["impl"]: c for c in result["production"]["eager"]["mixed"]}
    assert warm["mqa_logits"]["args"][0][0]["shape"][1:] == prod["mqa_logits"]["args"][0][0]["shape"][1:] == [64, 128]
    assert warm["paged"]["args"][1]["shape"][1:] == prod["paged"]["args"][1]["shape"][1:] == [64, 1, 132]
    assert warm["paged"]["args"][6] == prod["paged"]["args"][6] == {"value": 8192}
    assert warm["metadata"]["args"][1:3] == prod["metadata"]["args"][1:3] == [{"value": 64}, {"value": 132}]


@pytest.mark.parametrize("release", RELEASES)
def test_decode_variants_per_release(release):
    """Kernel next_n values and metadata (aligned batch, slots) classes, from the builder:
    SM90 runs next_n 1 and 2 natively; next_n=4 flattens in 0.20-0.26 (up to 4 x 100 rows)
    and runs natively in 0.28+ (with half the slots), where a 3-deep step flattens."""
    result = scenario(release)

    def paged_next_n(plan):
        return sorted({k[2][0] for k in keys(warm_calls(result, plan, "paged_mqa_logits"), "paged")})

    def metadata(plan):
        return {(k[3], k[5]) for k in keys(warm_calls(result, plan, "paged_mqa_logits_metadata"))}

    plain = {(rows, 132) for rows in (32, 64, 96, 128)}
    assert paged_next_n("eager") == [1] and metadata("eager") == plain
    assert paged_next_n("mtp2") == [1, 2] and metadata("mtp2") == plain
    if v(release) < (0, 28):
        assert paged_next_n("mtp4") == [1]
        assert metadata("mtp4") == {(rows, 132) for rows in range(32, 417, 32)}
    else:
        assert paged_next_n("mtp4") == [1, 2, 4]
        assert metadata("mtp4") == {(rows, 132) for rows in range(32, 321, 32)} | {(rows, 66) for rows in (32, 64, 96, 128)}
    # production agrees: 0.28+ runs a 4-deep step natively with 66 slots, a 3-deep one flattened
    prod = result["production"]["mtp4"]
    d4 = {c["impl"]: jit_key(c) for c in prod["d4"]}
    d3 = {c["impl"]: jit_key(c) for c in prod["d3"]}
    assert d4["paged"][2][0] == (4 if v(release) >= (0, 28) else 1)
    assert d4["metadata"][5] == (66 if v(release) >= (0, 28) else 132)
    assert d3["paged"][2][0] == 1


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("config", ["full", "mtp2_full", "mtp4_full"])
def test_full_decode_graphs_leave_captured_keys_to_capture(release, config):
    """With FULL decode CUDA graphs the family warms only what capture does not compile:
    no key both here and in capture (the real builder and op on the runner's uniform capture
    batches), and together they hold everything the eager plan warms and production reaches."""
    result = scenario(release)
    eager = config.replace("_full", "") if config != "full" else "eager"
    capture = [c for calls in result["capture"][config] for c in calls]
    got = steps(result, config)
    assert "paged_mqa_logits[captured]" in got and "paged_mqa_logits_metadata[captured]" in got
    assert not keys(warm_calls(result, config, "paged_mqa_logits"), "paged") & keys(capture, "paged")
    assert not keys(warm_calls(result, config, "paged_mqa_logits_metadata")) & keys(capture, "metadata")
    together = keys(warm_calls(result, config)) | keys(capture)
    assert keys(warm_calls(result, eager)) <= together
    assert keys(production_calls(result, eager)) <= together


@pytest.mark.parametrize("release", RELEASES)
def test_decode_warmup_reads_only_the_null_block(release):
    """The paged kernel reads the real bound cache through production's quant view, with a
    block table of zeros (the null block, which no request owns) and context lengths within
    one block; it writes only its fresh logits."""
    result = scenario(release)
    for plan in ("eager", "mtp2", "mtp4"):
        for call in warm_calls(result, plan, "paged_mqa_logits"):
            if call["impl"] != "paged":
                continue
            q, kv, lens, table = call["args"][0][0], call["args"][1], call["args"][3], call["args"][4]
            assert kv["ptr"] == result["cache_ptrs"][plan]
            assert set(sum(table["values"], [])) == {0}
            assert max(sum(lens["values"], [])) <= kv["shape"][1]
            assert lens["values"] == [list(range(1, q["shape"][1] + 1))]  # token j sees j + 1 keys


@pytest.mark.parametrize("release", RELEASES)
def test_prefill_warmup_is_one_call(release):
    """The prefill kernel's key holds no batch size or sequence length: production's chunks
    (plain and MTP engines) share one key, the one the single warm call compiles."""
    result = scenario(release)
    prod = {jit_key(c) for config in ("eager", "mtp2", "mtp4") for c in production_calls(result, config)
            if c["impl"] == "mqa_logits"}
    for plan in ("eager", "full", "mtp2", "mtp4_full"):
        calls = warm_calls(result, plan, "mqa_logits")
        assert [c["impl"] for c in calls] == ["mqa_logits"]
        assert keys(calls) == prod


@pytest.mark.parametrize("release", ["0.24.0", "0.33.0"])
def test_metadata_calls_sent_to_the_compile_processes_are_the_wrappers_calls(release):
    """The schedule metadata's row classes go to deep_gemm's compile processes as calls by name
    (their kernels compile with NVCC under the GIL, one after another in one process): the name
    resolves, in a fresh process, to the very wrapper the step calls here, with the step's
    arguments (context lengths [rows, next_n] of int32 ones, the builder's block size and SMs)."""
    from conftest import result_of, run_py
    got = result_of(run_py(r"""
import json
from kwarm_ext.kernels.dsa_indexer import mqa_logits as m
from kwarm_ext.vllm_compat import resolve
entries = m.deep_gemm_entries()
args = m.DecodeArgs(next_n=2, native=(True, True), varlen=False, num_sms=132, block_size=64, max_reqs=100,
                    max_tokens=8192)
call = m.described_metadata_call(entries, args, m.MetadataVariant(rows=64, next_n=2, slots=132))
print("RESULT " + json.dumps({"same": resolve(call["fn"]) is entries.paged_metadata, "call": call}))
""", release=release, env=cpu_triton_env()))
    assert got["same"]
    assert got["call"]["args"] == [{"tensor": [64, 2], "dtype": "int32", "fill": 1}, 64, 132]
    assert got["call"]["kwargs"] == ({"indices": None} if v(release) >= (0, 28) else {})


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_logits_dtype_comes_from_the_op_else_from_vllms_resolver(release):
    """The dtype is the indexer op's own (``SparseAttnIndexer.logits_dtype``, 0.34); where no op
    is found, vLLM's ``AttentionConfig.resolve_indexer_logits_dtype("float32")``, as the op's
    constructor calls it; None where the release has neither (0.33: fp32 logits, no keyword)."""
    from conftest import result_of, run_py
    got = result_of(run_py(r"""
import json, types
import torch
from vllm.config.attention import AttentionConfig
from kwarm_ext.kernels.dsa_indexer.logits_dtype import production_logits_dtype
def view(**kw):
    return types.SimpleNamespace(worker=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        attention_config=AttentionConfig(**kw))), runner=None)
op = types.SimpleNamespace(logits_dtype=torch.bfloat16)
print("RESULT " + json.dumps({"auto": production_logits_dtype(None, view()),
                              "set": production_logits_dtype(None, view(indexer_logits_dtype="bfloat16"))
                                     if "indexer_logits_dtype" in AttentionConfig.__dataclass_fields__ else None,
                              "op": production_logits_dtype(op, view())}))
""", release=release, env=cpu_triton_env()))
    if v(release) >= (0, 34):
        assert got == {"auto": "float32", "set": "bfloat16", "op": "bfloat16"}
    else:
        assert got == {"auto": None, "set": None, "op": "bfloat16"}
