"""dsa_indexer's ``fused_q`` steps against the real ``fused_q`` and ``_fused_q_kernel`` of vLLM
0.33.0 and 0.34.0, on CPU under ``TRITON_INTERPRET=1``, with every launch recorded with the key
Triton would compile for it on a GPU (tests/scenarios/dsa_indexer.py's ``spec_of``).

Stand-ins: the DSA attention layers (a ``DeepseekV32Attention`` needs a whole engine), namespaces
holding what the family reads, with vLLM's real RoPE modules (``get_rope``) at DeepSeek-V3.2's
published dimensions (128 heads at TP 1, no-RoPE 128, RoPE 64, KV LoRA rank 512, indexer 64 x 128).

The oracle: the key vLLM 0.33.0 compiled in a request on the H200 (BENCHMARKS.md, DeepSeek-V3.2
at published dimensions, request 4 x 333 tokens), copied from that run's JIT monitor. It holds for
0.34.0 too: its ``vllm/models/deepseek_v32/common/kernels.py`` is 0.33.0's, and its
``DeepseekV32Attention.forward`` calls ``fused_q`` with the same arguments.
"""
from __future__ import annotations

import json

import pytest

from conftest import REPO, cpu_triton_env, run_py

RELEASES = ("0.33.0", "0.34.0")  # the releases with fused_q (0.34's _fused_q_kernel and its call are 0.33's)

# vLLM 0.33.0 on the H200, the compile of _fused_q_kernel in request 6 (4 x 333 tokens): each
# argument's (type, specialization), constexprs as values. USE_PDL is the GPU's (True; the
# interpreter's platform has no PDL), the one entry left out of the comparison.
GPU_KEY = [
    ["*i64", "D"], ["*bf16", "D"], ["i32", "D"], ["i32", "D"], ["constexpr", 128], ["*bf16", "D"], ["i32", "D"],
    ["constexpr", 32], ["*bf16", "D"], ["i32", "D"], ["i32", "D"], ["constexpr", 64], ["*bf16", "D"], ["i32", "D"],
    ["constexpr", 32], ["*fp8e4nv", "D"], ["i32", "D"], ["i32", "D"], ["constexpr", 128], ["*bf16", "D"],
    ["i32", "D"], ["i32", "D"], ["*bf16", "D"], ["i32", "D"], ["i32", "D"], ["*fp32", "D"], ["constexpr", 128],
    ["constexpr", 128], ["*bf16", "D"], ["i32", "D"], ["i32", "D"], ["*bf16", "D"], ["i32", "D"], ["fp32", None],
    ["fp32", None], ["*fp32", "D"], ["i32", "D"], ["constexpr", True], ["constexpr", False], ["constexpr", False],
    ["constexpr", "USE_PDL"], ["constexpr", 448.0], ["constexpr", False]]

SCRIPT = """
import json, sys, types
import torch
sys.path.insert(0, {scenarios!r})
from dsa_indexer import spec_of
from triton.runtime.interpreter import InterpretedFunction
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import dsa_indexer as fam

launches = []
_run = InterpretedFunction.run
def recording(self, *args, grid, warmup, **kwargs):
    if self.fn.__name__ == fam.FUSED_Q_KERNEL:
        launches.append(spec_of(self, args, kwargs)["spec"])
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)
InterpretedFunction.run = recording

NS = types.SimpleNamespace
rope = dict(rope_type="default", rope_theta=10000.0)
indexer = NS(n_head=64, head_dim=128, softmax_scale=128 ** -0.5)
Layer = type("DeepseekV32Attention", (NS,), {{}})  # the class name the family looks for
def layer(has_indexer, heads=128):
    return Layer(num_local_heads=heads, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_lora_rank=512,
                 W_UK_T=torch.zeros(heads, 128, 512, dtype=torch.bfloat16),
                 indexer=indexer if has_indexer else None, skip_topk=False, _fp8_query=False,
                 _index_rope_interleave=False, _q_scale=torch.ones(1),
                 rotary_emb=get_rope(64, max_position=64, rope_parameters=rope, is_neox_style=False,
                                     dtype=torch.bfloat16),
                 indexer_rope_emb=get_rope(64, max_position=64, rope_parameters=rope, is_neox_style=True,
                                           dtype=torch.bfloat16))

with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    layers = {{"model.layers.0.self_attn.attn": layer(True), "model.layers.1.self_attn.attn": layer(True),
              "model.layers.2.self_attn.attn": layer(False)}}
    view = EngineView(device="cpu", forward_context=layers,
                      layers={{k: type(v).__name__ for k, v in layers.items()}})
    view.runner = NS(device=torch.device("cpu"))
    steps = fam.plan(view, forced=False)
    fused = [s for s in steps if s.kernel == fam.FUSED_Q_KERNEL]
    labels = [s.run() for s in fused]
    by_tokens = {{}}  # the keys a layout launches at other token counts
    from kwarm_ext.kernels.dsa_indexer import fused_q as fq
    for tokens in (1, 3):
        fq.TOKENS = tokens
        launches.clear()
        for variant in fam.layer_variants(layers["model.layers.0.self_attn.attn"]):
            fam.run_variant(fq.fused_q_entry(), layers["model.layers.0.self_attn.attn"], variant,
                            torch.device("cpu"), torch.bfloat16)
        by_tokens[tokens] = list(launches)
print("RESULT " + json.dumps({{"names": [s.name for s in fused], "labels": labels, "tokens": by_tokens}}))
"""


@pytest.fixture(scope="module", params=RELEASES)
def result(request):
    proc = run_py(SCRIPT.format(scenarios=str(REPO / "tests" / "scenarios")), env=cpu_triton_env(),
                  release=request.param, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _key(spec: dict) -> list:
    """A recorded launch as the GPU key lists it: (type, specialization), constexprs by value."""
    out = []
    for name, entry in spec.items():
        if entry[0] == "constexpr":
            value = eval(entry[1])  # noqa: S307  (repr of a bool, int or float, written by spec_of)
            out.append(["constexpr", "USE_PDL" if name == "USE_PDL" else value])
        else:
            out.append([entry[0], None if entry[1] == "None" else entry[1]])
    return out


def test_both_query_layouts_of_each_distinct_layer_are_steps(result):
    # two indexer layers share one configuration; the shared (no-indexer) layer is another
    assert result["names"] == ["fused_q MQA, 128 heads, indexer", "fused_q MHA, 128 heads, indexer",
                               "fused_q MQA, 128 heads", "fused_q MHA, 128 heads"]
    assert result["labels"] == [[name.removeprefix("fused_q ")] for name in result["names"]]


def test_the_mha_layout_launches_the_key_a_request_compiled_on_the_gpu(result):
    mqa, mha = (_key(spec) for spec in result["tokens"]["3"])
    assert mha == GPU_KEY
    assert mqa != GPU_KEY and mqa[26] == ["constexpr", 512], "the MQA layout: the latent no-RoPE part"


def test_the_key_holds_no_token_count(result):
    assert result["tokens"]["1"] == result["tokens"]["3"]


def test_releases_without_fused_q_skip_the_step():
    # the venv's vLLM 0.24.0 has no DSA query kernel: one skipped step, saying why
    from types import SimpleNamespace

    from kwarm_ext.kernels.dsa_indexer import fused_q as fq
    from kwarm_ext.vllm_compat import Missing

    with pytest.raises(Missing, match="no fused_q in this vLLM"):
        fq.fused_q_entry()
    view = SimpleNamespace(layers_of=lambda *names: {"a": type("DeepseekV32Attention", (), {})()})
    (step,) = fq._fused_q_steps(view, forced=False)
    assert step.skip == "no fused_q in this vLLM (DSA attention's query kernel, 0.33+)" and step.run is None


def test_a_layer_without_what_the_forward_reads_is_a_skip_naming_it(monkeypatch):
    from types import SimpleNamespace

    from kwarm_ext.kernels.dsa_indexer import fused_q as fq

    monkeypatch.setattr(fq, "fused_q_entry", lambda layer=None: object())  # 0.33's, stood in on 0.24's venv
    layer = type("DeepseekV32Attention", (SimpleNamespace,), {})(num_local_heads=128, qk_nope_head_dim=128,
                                                                     kv_lora_rank=512)
    view = SimpleNamespace(layers_of=lambda *names: {"a": layer})
    (step,) = fq._fused_q_steps(view, forced=False)
    assert step.skip == "DeepseekV32Attention has no qk_rope_head_dim" and step.run is None
