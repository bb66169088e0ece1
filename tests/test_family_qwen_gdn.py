"""The ``qwen_gdn`` family against vLLM's real GDN entry functions and Triton kernels.

Each release runs tests/scenarios/qwen_gdn.py in a fresh interpreter (``run_scenario_cases``) with
Triton's interpreter on CPU (``cpu_triton_env``), shapes of the tiny Qwen3-Next (gpu-kit/models/tiny-qwen3-next: linear
heads k=2 v=4, head dims 128, conv kernel 4). What is real and what stands in:

- the layer is an instance of vLLM's own class (``QwenGatedDeltaNetAttention``, 0.20's
  ``GatedDeltaNetAttention``) and its ``norm`` of ``RMSNormGated``, built with
  ``nn.Module.__init__`` only: their ``__init__`` needs a tensor-parallel group and a current
  vLLM config, neither of which exists on CPU. The attributes are the ones ``__init__`` sets, the
  bound ``kv_cache`` has the layout of this release (``is_conv_state_dim_first``). The norm's
  dispatch is pointed at ``forward_cuda``, as on a GPU with the custom op enabled.
- ``_causal_conv1d_fwd_kernel`` cannot run in Triton's interpreter (its body uses a builtin the
  interpreter rejects), so it is replaced by a recorder: vLLM's real ``causal_conv1d_fn`` prepares
  the launch and the test checks the specialization-relevant arguments it would pass (token
  strides = the production row pitch, state-index stride, ``num_cache_lines``, seqlen).
  Everything else (post-conv, sigmoid gating, conv update, packed decode, gated RMSNorm) runs
  vLLM's real kernels; spies around the entry functions record the strides/alignments passed.
- the SM count (no device on CPU) is 132, an H200's; pinned memory is off.
"""
from __future__ import annotations

import functools

import pytest

from conftest import MATRIX, REPO, cpu_triton_env, result_of, run_py, run_scenario_cases

CONFIG = str(REPO / "bench" / "models" / "tiny-qwen3-next" / "config.json")

BASE = dict(model_type="qwen3_next", tp=1, num_spec=0, eager=True, cudagraph_mode="NONE", max_tokens=64,
            pooling=False, bound=True, norm_native=False, forced=False)

# Cases per release, each run once in that release's interpreter (one vLLM import per release).
CASES = {
    "0.20.0": {"eager": {}, "qwen3_5": dict(model_type="qwen3_5")},
    "0.22.0": {"eager": {}, "qwen3_5_moe": dict(model_type="qwen3_5_moe")},
    "0.24.0": {"eager": {}, "qwen3_5": dict(model_type="qwen3_5"), "rpb": dict(max_tokens=8192),
               "tp2": dict(tp=2),
               "captured": dict(eager=False, cudagraph_mode="FULL_AND_PIECEWISE", norm_native=True),
               "llama": dict(model_type="llama"), "pooling": dict(pooling=True), "unbound": dict(bound=False)},
    "0.26.0": {"eager": {}, "spec": dict(num_spec=2)},
    "0.28.0": {"eager": {}, "forced": dict(forced=True)},
    "0.33.0": {"checkpoint": dict(checkpoint=True), "checkpoint_qwen3_5_spec": dict(
        checkpoint=True, model_type="qwen3_5", num_spec=2), "checkpoint_one_seq": dict(checkpoint=True, max_reqs=1),
               "no_checkpoint": {}},
    "0.34.0": {"checkpoint": dict(checkpoint=True), "checkpoint_qwen3_5_spec": dict(
        checkpoint=True, model_type="qwen3_5", num_spec=2), "checkpoint_one_seq": dict(checkpoint=True, max_reqs=1),
               "no_checkpoint": {}},
}


@functools.lru_cache(maxsize=None)
def _batch(release: str) -> dict:
    cases = {name: dict(BASE, **overrides) for name, overrides in CASES[release].items()}
    return run_scenario_cases("qwen_gdn", cases, release, CONFIG)


def _run(release: str, case: str) -> dict:
    return _batch(release)[case]


def _steps(result, prefix):
    return [s for s in result["steps"] if s["name"].split("[")[0] == prefix]


def _ran(result, prefix):
    return [lab for s in _steps(result, prefix) if s["skip"] is None for lab in s["labels"]]


def _skips(result, prefix):
    return [s["skip"] for s in _steps(result, prefix) if s["skip"] is not None]


@pytest.fixture(scope="module", params=MATRIX)
def eager(request):
    """Per release: tiny Qwen3-Next, TP=1, enforce_eager (every step reachable)."""
    return request.param, _run(request.param, "eager")


# Per release, from each release's source (see kernels/qwen_gdn.py's docstring):
#   conv fwd `seqlen` is a specialized argument up to 0.22; 0.26/0.28 upstream warms T=1 with the
#   production key for Qwen3-Next; the mixed-batch split path (misaligned a/b, sigmoid) is 0.23+.
UPSTREAM = {"0.20.0": False, "0.22.0": False, "0.24.0": False, "0.26.0": True, "0.28.0": True}
SEQLENS = {"0.20.0": [1, 2, 16], "0.22.0": [1, 2, 16], "0.24.0": [1]}
SPLIT = {"0.20.0": False, "0.22.0": False, "0.24.0": True, "0.26.0": True, "0.28.0": True}


def test_applies(eager):
    assert eager[1]["applies"] is None


def test_prefill_conv(eager):
    release, result = eager
    if UPSTREAM[release]:
        assert _skips(result, "causal_conv1d_fn") == ["covered by upstream qwen_triton_warmup (causal_conv1d_fn)"]
        assert not _ran(result, "causal_conv1d_fn") and not result["seen"]["conv_fwd"]
        return
    assert _ran(result, "causal_conv1d_fn") == [f"seqlen={t},pitch=1024" for t in SEQLENS[release]]
    calls = result["seen"]["conv_fwd"]
    assert len(calls) == len(SEQLENS[release])
    for call, t in zip(calls, SEQLENS[release]):
        # Qwen3-Next: mixed_qkv is a torch.cat, row pitch conv_dim; out = empty_like(x) -> same
        assert call["stride_x_token"] == 1024 and call["stride_o_token"] == 1024
        assert call["stride_x_dim"] == 1 and call["stride_o_dim"] == 1
        assert call["stride_cache_indices"] == 1  # block_table[:, 0] of a 1-column mamba table
        assert call["num_cache_lines"] == 6 and call["conv_state_is_bound"]
        assert call["dim"] == 1024 and call["HAS_BIAS"] is False and call["SILU_ACTIVATION"] is True
        assert call["batch_ptr_from_metadata"] and call["x_dtype"] == "torch.bfloat16"
        assert call.get("seqlen", t) == t


def test_post_conv(eager):
    release, result = eager
    aligned = [f"L={n},offset_rows=0,aligned=yyy" for n in (1, 2, 16)]
    # HV=4 bf16 rows are 8 bytes: one decode token in front makes a/b misaligned
    misaligned = [f"L={n},offset_rows=1,aligned=ynn" for n in (1, 2, 16)]
    if UPSTREAM[release]:
        assert _ran(result, "fused_post_conv_prep") == misaligned
        assert _skips(result, "fused_post_conv_prep") == [
            "covered by upstream qwen_triton_warmup (fused_post_conv_prep)"]
    else:
        assert _ran(result, "fused_post_conv_prep") == aligned + (misaligned if SPLIT[release] else [])
        assert not _skips(result, "fused_post_conv_prep")
    calls = result["seen"]["post_conv"]
    expected_alignments = ({(False, False)} if UPSTREAM[release] else
                           {(True, True), (False, False)} if SPLIT[release] else {(True, True)})
    assert {(c["a16"], c["b16"]) for c in calls} == expected_alignments
    assert all(c["x_tok"] == 1024 and c["a_tok"] == 4 and c["x16"] for c in calls)
    assert sorted({c["L"] for c in calls}) == [1, 2, 16]


def test_sigmoid_gating(eager):
    release, result = eager
    if not SPLIT[release]:
        assert _skips(result, "sigmoid_gating")[0].startswith("no mixed-batch split path")
        assert not result["seen"]["sigmoid"]
    elif UPSTREAM[release]:
        assert _skips(result, "sigmoid_gating") == [
            "covered by upstream qwen_triton_warmup (fused_sigmoid_gating_delta_rule_update)"]
    else:
        assert _ran(result, "sigmoid_gating") == ["non-spec,index_stride=1"]
        assert result["seen"]["sigmoid"] == [dict(index_stride=1, index_ndim=1, bound_state=True, l2=True)]


def test_eager_decode_kernels(eager):
    _, result = eager
    assert _ran(result, "conv_update") == ["batch=1", "batch=2", "batch=16"]
    updates = result["seen"]["update"]
    assert [c["batch"] for c in updates[:3]] == [1, 2, 16]  # the 4th feeds the packed decode
    assert all(c["pitch"] == 1024 and c["index_stride"] == 1 for c in updates)
    assert _ran(result, "packed_decode") == ["pitch=1024,ab_stride=4"]
    assert result["seen"]["packed"] == [dict(pitch=1024, a_tok=4, a16=True, bound_state=True)]


def test_gated_rmsnorm(eager):
    _, result = eager
    # M = 4 * tokens, tokens <= 64, 132 SMs: rows_per_block 1; classes "other" (M=4) and %16 (M=16)
    assert _ran(result, "gated_rmsnorm") == ["M=4,rows_per_block=1", "M=16,rows_per_block=1"]
    assert result["seen"]["norm"] == [dict(M=4, rows_per_block=1), dict(M=16, rows_per_block=1)]


def test_no_state_written(eager):
    assert eager[1]["states_untouched"], "only the null block may be named, and the kernels skip it"


def test_rows_per_block_classes():
    """Up to 8192 tokens every ROWS_PER_BLOCK (1, 2, 4) is reachable; vLLM's own calc agrees."""
    result = _run("0.24.0", "rpb")
    expected = [(4, 1), (16, 1), (268, 2), (272, 2), (532, 4), (544, 4)]
    assert _ran(result, "gated_rmsnorm") == [f"M={m},rows_per_block={r}" for m, r in expected]
    assert [(c["M"], c["rows_per_block"]) for c in result["seen"]["norm"]] == expected


@pytest.mark.parametrize("release", ["0.20.0", "0.24.0"])
def test_qwen3_5_row_pitch(release):
    """Qwen3.5: mixed_qkv is the split view of in_proj_qkvz's output: pitch conv_dim + value_dim."""
    result = _run(release, "qwen3_5")
    calls = result["seen"]["conv_fwd"]
    assert {c["stride_x_token"] for c in calls} == {1536}
    # out = torch.empty_like(x): x [conv_dim, T] with strides (1, 1536) is dense only for T == 1
    assert {c.get("seqlen", 1): c["stride_o_token"] for c in calls} == (
        {1: 1536, 2: 1024, 16: 1024} if release == "0.20.0" else {1: 1536})
    # post-conv reads the conv output: token stride 1536 at L == 1 (prefill-only), else dense
    assert {(c["L"], c["x_tok"]) for c in result["seen"]["post_conv"]} >= {(1, 1536), (2, 1024), (16, 1024)}
    assert {c["pitch"] for c in result["seen"]["update"]} == {1536}
    assert result["seen"]["packed"][0]["pitch"] == 1536
    assert result["states_untouched"]


def test_tp2_local_shapes_and_interleaved_views():
    """TP=2: h=1, hv=2 per rank; with one local key-head group Qwen3-Next's b/a stay views."""
    result = _run("0.24.0", "tp2")
    assert _ran(result, "causal_conv1d_fn") == ["seqlen=1,pitch=512"]
    assert result["seen"]["packed"] == [dict(pitch=512, a_tok=4, a16=False, bound_state=True)]
    assert {(c["a_tok"], c["a16"], c["b16"]) for c in result["seen"]["post_conv"]} == {(4, False, True),
                                                                                    (4, False, False)}
    assert result["states_untouched"]


def test_spec_decode_strides_not_covered_upstream():
    """With speculative decoding the state-index stride is 1 + num_spec: upstream's key misses it."""
    result = _run("0.26.0", "spec")
    assert _ran(result, "causal_conv1d_fn") == ["seqlen=1,pitch=1024"]
    assert result["seen"]["conv_fwd"][0]["stride_cache_indices"] == 3
    assert _ran(result, "sigmoid_gating") == ["non-spec,index_stride=3"]
    assert result["seen"]["sigmoid"][0]["index_stride"] == 3


def test_forced_runs_what_upstream_covers():
    result = _run("0.28.0", "forced")
    assert [s["skip"] for s in result["steps"] if s["skip"]] == [
        "no prefill checkpoint export in this vLLM (0.33+)"]
    assert _ran(result, "causal_conv1d_fn") == ["seqlen=1,pitch=1024"]
    assert len(_ran(result, "fused_post_conv_prep")) == 6
    assert _ran(result, "sigmoid_gating") == ["non-spec,index_stride=1"]


def test_captured_decode_and_native_norm_are_skipped():
    result = _run("0.24.0", "captured")
    assert _skips(result, "decode") == [
        "compiled by FULL CUDA-graph capture of decode batches (cudagraph_mode=FULL_AND_PIECEWISE)"]
    assert not result["seen"]["update"] and not result["seen"]["packed"]
    assert _skips(result, "gated_rmsnorm")[0].startswith("RMSNormGated runs forward_native")
    assert _ran(result, "fused_post_conv_prep")  # prefill/mixed kernels still run eagerly


@pytest.mark.parametrize("case,reason", [
    ("llama", "model type llama is not Qwen3-Next/3.5"),
    ("pooling", "pooling model: out of scope, as for upstream's qwen warmup up to 0.26"),
    ("unbound", "GatedDeltaNet layers have no bound KV cache"),
])
def test_silent(case, reason):
    assert _run("0.24.0", case)["applies"] == reason


def test_applies_to_qwen3_5_moe():
    assert _run("0.22.0", "qwen3_5_moe")["applies"] is None


def test_symbols_0_33():
    """0.33: every entry function and kernel resolves, calls bind to the real signatures."""
    proc = run_py(r"""
import json
from kwarm_ext.kernels import qwen_gdn as fam
from kwarm_ext.vllm_compat import bind, resolve
conv = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
fn = resolve(conv + ":causal_conv1d_fn")
bind(fn, "x", "w", None, activation="silu", conv_states="s", has_initial_state="h", cache_indices="i",
     query_start_loc="q", metadata=None)
update = resolve(conv + ":causal_conv1d_update")
bind(update, "x", "s", "w", None, "silu", conv_state_indices="i", validate_data=False)
post = fam.fla("fused_gdn_prefill_post_conv", "fused_post_conv_prep")
bind(post, conv_output=1, a=1, b=1, A_log=1, dt_bias=1, num_k_heads=1, head_k_dim=1, head_v_dim=1,
     apply_l2norm=True, output_g_exp=False)
sig = fam.fla("fused_sigmoid_gating", "fused_sigmoid_gating_delta_rule_update")
bind(sig, A_log=1, a=1, b=1, dt_bias=1, q=1, k=1, v=1, initial_state=1, inplace_final_state=True,
     cu_seqlens=1, ssm_state_indices=1, use_qk_l2norm_in_kernel=True)
dec = fam.fla("fused_recurrent", "fused_recurrent_gated_delta_rule_packed_decode")
bind(dec, mixed_qkv=1, a=1, b=1, A_log=1, dt_bias=1, scale=1.0, initial_state=1, out=1,
     ssm_state_indices=1, use_qk_l2norm_in_kernel=True)
norm = resolve("vllm.model_executor.layers.layernorm:RMSNormGated")
bind(norm.forward_cuda, None, "x", "z")
resolve("vllm.v1.attention.backends.utils:compute_causal_conv1d_metadata")
assert resolve("vllm.v1.attention.backends.utils:NULL_BLOCK_ID") == 0
layer = resolve("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention")
kernel = resolve(conv + ":_causal_conv1d_fwd_kernel")
up = __import__("vllm.model_executor.warmup.qwen_triton_warmup", fromlist=["x"])
print("RESULT " + json.dumps([fam.has_mixed_split_path(), fam.param_mode(kernel, "seqlen"),
      fam.param_mode(kernel, "stride_x_token"), "qwen4_exp" in up._QWEN_MODEL_TYPES,
      hasattr(up, "_warm_gated_rms_norm_kernel"), [c.__name__ for c in layer.__mro__][:2]]))
""", release="0.33.0", env=cpu_triton_env(), timeout=240)
    assert result_of(proc) == [True, "absent", "class", True, True,
                                         ["QwenGatedDeltaNetAttention", "GatedDeltaNetAttention"]]


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_prefill_checkpoint_export(release):
    """0.33+ with prefix caching and FlashInfer's GDN prefill: vLLM's real exporter launches the real
    store_cache_checkpoints_kernel once per reachable key: the recurrent_rows slice 16-byte aligned
    (odd prefill count) and 8 bytes off (even), with the layer's bound states and nothing written."""
    result = _run(release, "checkpoint")
    assert _ran(result, "prefill_checkpoint") == ["pitch=1024,rows_aligned=y", "pitch=1024,rows_aligned=n"]
    calls = result["seen"]["checkpoint"]
    assert [c["rows16"] for c in calls] == [True, False]
    assert all(c["bound"] and c["HAS_RECURRENT"] and c["HAS_RECURRENT_ROWS"] and not c["HAS_TOKEN_MAP"]
               for c in calls)
    # the production constexprs: the view's pitch, the window, the workspace row (hv*V*K, float32)
    assert {(c["x_stride_0"], c["STATE_LEN"], c["WIDTH"], c["RECURRENT_ROW_SIZE"], c["NULL_STATE_IDX"])
            for c in calls} == {(1024, 3, 1024, 4 * 128 * 128, 0)}
    assert calls[0]["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.int32", "torch.int64"]
    assert result["states_untouched"]


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_prefill_checkpoint_variants(release):
    """Qwen3.5 with speculative decoding: the split view's pitch and index_select's dense rows; one
    sequence per batch: only the aligned rows slice; without checkpoints: a step that says why."""
    spec = _run(release, "checkpoint_qwen3_5_spec")
    assert _ran(spec, "prefill_checkpoint") == [
        "pitch=1536,rows_aligned=y", "pitch=1536,rows_aligned=n",
        "pitch=1024,rows_aligned=y", "pitch=1024,rows_aligned=n"]
    assert [c["x_stride_0"] for c in spec["seen"]["checkpoint"]] == [1536, 1536, 1024, 1024]
    assert _ran(_run(release, "checkpoint_one_seq"), "prefill_checkpoint") == ["pitch=1024,rows_aligned=y"]
    assert _skips(_run(release, "no_checkpoint"), "prefill_checkpoint") == [
        "no prefill checkpoints: they are exported with prefix caching (mamba_cache_mode=align) and "
        "FlashInfer's GDN prefill"]


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_post_conv_takes_the_releases_output_g_exp(release):
    """``output_g_exp`` is a constexpr of ``_fused_post_conv_kernel``: vLLM 0.34's prefill passes True
    under FlashInfer's GDN prefill (the Hopper default), 0.33's False whatever the backend; with
    Triton's prefill both pass False. kwarm's post-conv launches pass what the release passes."""
    flashinfer = _run(release, "checkpoint")  # the layer as __init__ leaves it with FlashInfer's prefill
    triton = _run(release, "no_checkpoint")
    assert flashinfer["seen"]["post_conv"] and triton["seen"]["post_conv"]
    assert {c["g_exp"] for c in flashinfer["seen"]["post_conv"]} == {release == "0.34.0"}
    assert {c["g_exp"] for c in triton["seen"]["post_conv"]} == {False}
    labels = _ran(flashinfer, "fused_post_conv_prep")
    assert labels and all(label.endswith(",exp(g)") is (release == "0.34.0") for label in labels)
