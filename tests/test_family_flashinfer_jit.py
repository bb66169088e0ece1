"""The ``flashinfer_jit`` family: which layers it warms and how it calls vLLM's op. FlashInfer cannot
build here (no CUDA), so ``torch.ops.vllm.flashinfer_concat_mla_k`` is a stand-in registered by the
test with vLLM's signature (k written in place from k_nope and a broadcast k_pe), recording its calls,
under a name of its own in vLLM's op namespace (vLLM registers the real one where FlashInfer imports);
without it the step is skipped with the reason."""
from __future__ import annotations

import types

import torch

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import flashinfer_jit as fam

CALLS = []


STANDIN = "kwarm_test_concat_mla_k"


@torch.library.custom_op(f"vllm::{STANDIN}", mutates_args=["k"])
def _standin(k: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor) -> None:
    CALLS.append((tuple(k.shape), tuple(k_nope.shape), tuple(k_pe.shape), str(k.dtype)))
    k[..., : k_nope.shape[-1]] = k_nope
    k[..., k_nope.shape[-1]:] = k_pe


def _layer(flag, heads=128, nope=128, rope=64):
    impl = types.SimpleNamespace(num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope)
    if flag is not None:
        setattr(impl, fam.FLAG, flag)
    return types.SimpleNamespace(impl=impl)


def _view(layers):
    runner = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16), device=torch.device("cpu"))
    return EngineView(runner=runner, forward_context=layers, device="cpu")


def test_warms_each_shape_of_the_layers_that_call_concat_mla_once(monkeypatch):
    monkeypatch.setattr(fam, "OP", STANDIN)
    CALLS.clear()
    view = _view({"model.layers.0.attn": _layer(True), "model.layers.1.attn": _layer(True),
                  "model.layers.2.attn": _layer(False), "model.layers.3.mlp": types.SimpleNamespace()})
    assert fam.applies(view) is None and list(fam.concat_layers(view)) == ["model.layers.0.attn", "model.layers.1.attn"]
    (step,) = fam.plan(view, forced=False)
    assert step.skip is None and step.run() == ["bfloat16 128x128+64"]
    assert CALLS == [((1, 128, 192), (1, 128, 128), (1, 1, 64), "torch.bfloat16")]


def test_no_layer_with_the_flag_is_a_reason_and_a_missing_op_a_skip(monkeypatch):
    assert "concat_mla_k" in fam.applies(_view({"a": _layer(False), "b": _layer(None)}))
    assert fam.applies(EngineView()) == "no model runner"
    monkeypatch.setattr(fam, "OP", "no_such_flashinfer_op")
    (step,) = fam.plan(_view({"a": _layer(True)}), forced=False)
    assert step.run is None and "not registered" in step.skip
