"""Scenario of tests/test_family_qwen_gdn.py, run once per release in a fresh interpreter
(``run_cases``) under Triton's interpreter on CPU.

Arguments (JSON): the cases (name -> layer and engine settings) and the path of the tiny
Qwen3-Next's config.json. For each case it builds vLLM's own GDN layer (see the test module's
docstring), plans and runs the family's steps with spies on the entry functions, and prints one
``RESULT`` line of JSON: case name -> what applied, the steps, what the spies saw.
"""
from __future__ import annotations

import inspect
import json
import sys
import types

import torch

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import qwen_gdn as fam
from kwarm_ext.vllm_compat import resolve
import vllm.model_executor.layers.mamba.ops.causal_conv1d as conv_mod

SMS = 132
LAYER_CLS = resolve("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention",
                    "vllm.model_executor.layers.mamba.gdn_linear_attn:GatedDeltaNetAttention")
NORM_CLS = resolve("vllm.model_executor.layers.layernorm:RMSNormGated")
try:  # 0.33+: prefill checkpoints of prefix caching
    import vllm.model_executor.layers.mamba.checkpoint as CHECKPOINT
except ImportError:
    CHECKPOINT = None

# What the recorders saw in the current case, and the bound caches of its layer.
seen = {}
conv_cache = ssm_cache = None


def bare(cls):
    """vLLM's own class without its __init__ (which needs a TP group and a vLLM config)."""
    obj = torch.nn.Module.__new__(cls)
    torch.nn.Module.__init__(obj)
    return obj


def ptr16(t):
    return t.data_ptr() % 16 == 0


class ConvRecorder:
    """Stands in for _causal_conv1d_fwd_kernel (not runnable in Triton's interpreter)."""

    def __init__(self, real):
        self.fn = real  # what kwarm reads the kernel's specialization from (.fn, like Heuristics)
        self.names = list(inspect.signature(real.fn).parameters)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.names, args), **kwargs)
            keep = ("dim", "seqlen", "num_cache_lines", "stride_x_dim", "stride_x_token", "stride_o_dim",
                    "stride_o_token", "stride_cache_indices", "stride_istate_seq", "HAS_BIAS",
                    "SILU_ACTIVATION", "HAS_NULL_BLOCK", "IS_APC_ENABLED")
            rec = {k: named[k] for k in keep if k in named}
            rec["x_dtype"] = str(named["x_ptr"].dtype)
            rec["conv_state_is_bound"] = named["initial_states_ptr"].data_ptr() == conv_cache.data_ptr()
            rec["batch_ptr_from_metadata"] = named["batch_ptr"] is not None
            seen["conv_fwd"].append(rec)
        return launch


def spy(mod, attr, record):
    real = getattr(mod, attr)

    def wrapper(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs).arguments
        record(bound)
        return real(*args, **kwargs)
    setattr(mod, attr, wrapper)


class CheckpointSpy:
    """Around the real store_cache_checkpoints_kernel (0.33+): records the arguments its Triton key
    reads, then launches the real kernel."""

    def __init__(self, real):
        self.real = real
        self.names = list(inspect.signature(real.fn).parameters)

    def __getitem__(self, grid):
        launch = self.real[grid]

        def record(*args, **kwargs):
            named = dict(zip(self.names, args), **kwargs)
            rec = {k: (v if isinstance(v, (int, bool)) else None) for k, v in named.items()
                   if not k.endswith("_ptr")}
            rec = {k: v for k, v in rec.items() if v is not None}
            rec["rows16"] = ptr16(named["recurrent_rows_ptr"])
            rec["bound"] = (named["conv_state_ptr"].data_ptr() == conv_cache.data_ptr()
                            and named["recurrent_state_ptr"].data_ptr() == ssm_cache.data_ptr())
            rec["dtypes"] = [str(named[k].dtype) for k in ("x_ptr", "recurrent_checkpoint_ptr",
                                                             "checkpoint_state_indices_ptr", "recurrent_rows_ptr")]
            seen["checkpoint"].append(rec)
            return launch(*args, **kwargs)
        return record


def install_recorders():
    """CPU settings (no pinned memory, an H200's SM count) and the recorders around the kernels."""
    norm_mod = sys.modules[fam.fla("layernorm_guard", "layer_norm_fwd").__module__]
    post_mod = sys.modules[fam.fla("fused_gdn_prefill_post_conv", "fused_post_conv_prep").__module__]
    sig_mod = sys.modules[fam.fla("fused_sigmoid_gating", "fused_sigmoid_gating_delta_rule_update").__module__]
    rec_mod = sys.modules[fam.fla("fused_recurrent", "fused_recurrent_gated_delta_rule_packed_decode").__module__]
    for mod in list(sys.modules.values()):  # CPU: no pinned memory, no SM count
        if getattr(mod, "__name__", "").startswith("vllm"):
            if hasattr(mod, "PIN_MEMORY"):
                mod.PIN_MEMORY = False
            if hasattr(mod, "num_compute_units"):
                mod.num_compute_units = lambda index=None: SMS
    conv_mod._causal_conv1d_fwd_kernel = ConvRecorder(conv_mod._causal_conv1d_fwd_kernel)
    if CHECKPOINT is not None:
        CHECKPOINT.store_cache_checkpoints_kernel = CheckpointSpy(CHECKPOINT.store_cache_checkpoints_kernel)
    spy(post_mod, "fused_post_conv_prep", lambda a: seen["post_conv"].append(dict(
        L=a["conv_output"].shape[0], x_tok=a["conv_output"].stride(0), x16=ptr16(a["conv_output"]),
        a_tok=a["a"].stride(0), a16=ptr16(a["a"]), b16=ptr16(a["b"]), g_exp=a.get("output_g_exp"))))
    spy(sig_mod, "fused_sigmoid_gating_delta_rule_update", lambda a: seen["sigmoid"].append(dict(
        index_stride=a["ssm_state_indices"].stride(0), index_ndim=a["ssm_state_indices"].dim(),
        bound_state=a["initial_state"].data_ptr() == ssm_cache.data_ptr(), l2=a["use_qk_l2norm_in_kernel"])))
    spy(conv_mod, "causal_conv1d_update", lambda a: seen["update"].append(dict(
        batch=a["x"].shape[0], pitch=a["x"].stride(0), index_stride=a["conv_state_indices"].stride(0))))
    spy(rec_mod, "fused_recurrent_gated_delta_rule_packed_decode", lambda a: seen["packed"].append(dict(
        pitch=a["mixed_qkv"].stride(0), a_tok=a["a"].stride(0), a16=ptr16(a["a"]),
        bound_state=a["initial_state"].data_ptr() == ssm_cache.data_ptr())))
    spy(norm_mod, "layer_norm_fwd", lambda a: seen["norm"].append(dict(
        M=a["x"].shape[0], rows_per_block=norm_mod.calc_rows_per_block(a["x"].shape[0], a["x"].device))))


def build_layer(args, config):
    global conv_cache, ssm_cache
    tp = args["tp"]
    bf16 = torch.bfloat16
    h, hv = config["linear_num_key_heads"] // tp, config["linear_num_value_heads"] // tp
    K, V, W = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    conv_dim = 2 * h * K + hv * V
    layer = bare(LAYER_CLS)
    for name, value in dict(num_k_heads=config["linear_num_key_heads"], num_v_heads=config["linear_num_value_heads"],
                            head_k_dim=K, head_v_dim=V, conv_kernel_size=W, tp_size=tp, tp_rank=0,
                            activation=config["hidden_act"], num_spec=args["num_spec"], prefix="model.layers.0.linear_attn",
                            gqa_interleaved_layout=args["model_type"] == "qwen3_next",
                            key_dim=K * config["linear_num_key_heads"], value_dim=V * config["linear_num_value_heads"],
                            enable_packed_recurrent_decode=True).items():
        setattr(layer, name, value)
    layer.conv1d = torch.nn.Module()
    layer.conv1d.weight = torch.nn.Parameter(torch.randn(conv_dim, 1, W, dtype=bf16), requires_grad=False)
    layer.conv1d.bias = None
    layer.A_log = torch.nn.Parameter(torch.randn(hv, dtype=torch.float32), requires_grad=False)
    layer.dt_bias = torch.nn.Parameter(torch.ones(hv, dtype=bf16), requires_grad=False)
    norm = bare(NORM_CLS)
    norm.weight = torch.nn.Parameter(torch.ones(V, dtype=bf16), requires_grad=False)
    norm.register_parameter("bias", None)
    for name, value in dict(eps=1e-6, group_size=None, norm_before_gate=True, activation="silu").items():
        setattr(norm, name, value)
    norm._forward_method = norm.forward_native if args["norm_native"] else norm.forward_cuda
    layer.norm = norm
    blocks = 6
    dim_first = resolve("vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first")()
    conv_cache = torch.randn((blocks, conv_dim, W - 1) if dim_first else (blocks, W - 1, conv_dim), dtype=bf16)
    ssm_cache = torch.randn((blocks, hv, V, K), dtype=torch.float32)
    layer.kv_cache = (conv_cache, ssm_cache) if args["bound"] else (torch.tensor([]), torch.tensor([]))
    if args.get("checkpoint"):  # what __init__ sets with mamba_cache_mode=align and FlashInfer's GDN prefill
        layer._checkpoint_exporter = CHECKPOINT.MambaPrefillCheckpointExporter(state_len=W - 1)
        layer.gdn_prefill_backend = "flashinfer"
        # cached properties that read the vLLM config: the values they take with a 64-token grid
        layer.__dict__.update(_exports_checkpoints=True,
                              _checkpoint_buffer_spec=((-(-args["max_tokens"] // 64), hv, V, K), torch.float32))
    snapshot = (conv_cache.clone(), ssm_cache.clone())
    return layer, snapshot


def run_case(args, config):
    global seen
    seen = {"conv_fwd": [], "post_conv": [], "sigmoid": [], "update": [], "packed": [], "norm": [],
            "checkpoint": []}
    layer, snapshot = build_layer(args, config)
    context = {"model.layers.0.linear_attn": layer, "model.layers.3.self_attn.attn": types.SimpleNamespace()}
    view = EngineView(runner=types.SimpleNamespace(max_num_tokens=args["max_tokens"]), runner_kind="V1",
                      model_type=args["model_type"], forward_context=context,
                      max_num_batched_tokens=args["max_tokens"], max_num_reqs=args.get("max_reqs", 16),
                      enforce_eager=args["eager"], cudagraph_mode=args["cudagraph_mode"],
                      is_pooling_model=args["pooling"])
    out = {"applies": fam.applies(view), "steps": [], "seen": seen}
    if out["applies"] is None:
        for step in fam.plan(view, args["forced"]):
            rec = {"name": step.name, "kernel": step.kernel, "skip": step.skip}
            if step.run is not None:
                rec["labels"] = step.run()
            out["steps"].append(rec)
    out["states_untouched"] = torch.equal(conv_cache, snapshot[0]) and torch.equal(ssm_cache, snapshot[1])
    return out


def main(argv: list[str]) -> None:
    cases, config = json.loads(argv[0]), json.load(open(json.loads(argv[1])))
    install_recorders()
    print("RESULT " + json.dumps({name: run_case(args, config) for name, args in cases.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
