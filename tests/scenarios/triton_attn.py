"""Scenario of tests/test_family_triton_attn.py, run once per release in a fresh interpreter
(``run_cases``) under Triton's interpreter on CPU.

Argument: the cases as JSON (name -> engine shape). For each case it builds the engine from
vLLM's real ``TRITON_ATTN`` objects (see the test module's docstring), lets the family choose
its batches, records the kernels' keys of those batches and of every production batch, and
prints one ``RESULT`` line of JSON: case name -> what it found.
"""
from __future__ import annotations

import inspect
import json
import sys
import time
import types

import torch

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import triton_attn as fam
from kwarm_ext.kernels.attention_groups import common_metadata
from vllm.config import CUDAGraphMode

try:
    from vllm.model_executor.layers.attention.attention import Attention
except ImportError:  # 0.20-0.2x
    from vllm.attention.layer import Attention
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                     TritonAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.utils import AttentionGroup
import vllm.v1.utils as v1_utils

import block_tables  # tests/scenarios/block_tables.py

NS = types.SimpleNamespace
BLOCK, D, MAXLEN = 16, 64, 4096


def accepted(fn, **kwargs):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def engine(case):
    H, HKV, SEQS, TOKENS = case["heads"], case["kv_heads"], case["seqs"], case["tokens"]
    caps = case["capture_sizes"]

    class ModelConfig:
        def get_num_attention_heads(self, parallel_config):
            return H

        def get_num_kv_heads(self, parallel_config):
            return HKV

        def get_head_size(self):
            return D

        rswa_window = None  # 0.26+
    vllm_config = NS(
        model_config=ModelConfig(), parallel_config=NS(), speculative_config=None, cache_config=NS(block_size=BLOCK),
        compilation_config=NS(cudagraph_mode=getattr(CUDAGraphMode, case["mode"]), cudagraph_capture_sizes=caps,
                              max_cudagraph_capture_size=max(caps) if caps else 0),
        scheduler_config=NS(max_num_seqs=SEQS, max_num_batched_tokens=TOKENS))
    spec = FullAttentionSpec(**accepted(FullAttentionSpec, block_size=BLOCK, num_kv_heads=HKV, head_size=D,
                                        dtype=torch.bfloat16))
    name = "model.layers.3.self_attn.attn"
    impl = TritonAttentionImpl(**accepted(TritonAttentionImpl, num_heads=H, head_size=D, scale=D ** -0.5,
                                          num_kv_heads=HKV, alibi_slopes=None, sliding_window=None,
                                          kv_cache_dtype="auto"))
    layer = Attention.__new__(Attention)  # vLLM's class, without its __init__ (see the module docstring)
    torch.nn.Module.__init__(layer)
    vllm_config.compilation_config.static_forward_context = {name: layer}  # 0.26+ builders count heads there
    if hasattr(TritonAttentionBackend, "get_kv_cache_shape"):
        shape = TritonAttentionBackend.get_kv_cache_shape(8, BLOCK, HKV, D)
    else:  # 0.33: the layer's cache arrives as (blocks, kv heads, block size, 2 * head size)
        shape = (8, HKV, BLOCK, 2 * D)
    layer.__dict__.update(num_heads=H, num_kv_heads=HKV, head_size=D, head_size_v=D, dtype=torch.bfloat16,
                          impl=impl, kv_cache=torch.zeros(shape, dtype=torch.bfloat16), query_quant=None,
                          layer_name=name, _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0),
                          _q_scale=torch.tensor(1.0))
    builder = TritonAttentionMetadataBuilder(spec, [name], vllm_config, torch.device("cpu"))
    _, held, _ = block_tables.build(SEQS, MAXLEN, TOKENS, BLOCK)
    if hasattr(AttentionGroup, "build_metadata"):  # 0.33+: the runners build metadata through the group
        group = AttentionGroup(**accepted(AttentionGroup, backend=TritonAttentionBackend, layer_names=[name],
                                          kv_cache_spec=spec, kv_cache_group_id=0, metadata_builders=[builder]))
    else:
        group = NS(backend=TritonAttentionBackend, layer_names=[name], kv_cache_group_id=0, metadata_builders=[builder])
    runner = NS(attn_groups=[[group]], device=torch.device("cpu"), max_num_reqs=SEQS, **held)
    view = EngineView(runner=runner, worker=NS(vllm_config=vllm_config), forward_context={name: layer},
                      backends=[["TRITON_ATTN"]], max_num_reqs=SEQS, max_num_batched_tokens=TOKENS, device="cpu",
                      tp_size=1)
    return view, group, builder, layer


def production(case, group, target, kernels):
    """Every batch of up to `seqs` requests: decode, uniform prefill (several query lengths),
    mixed (decodes plus one prefill): its launches' keys -> the first batch that reached it."""
    seqs, tokens = case["seqs"], case["tokens"]
    keys = {}
    with torch.inference_mode():
        for n in range(1, seqs + 1):
            batches = [[1] * n] + [[q] * n for q in case["prefill_lens"]]
            batches += [[1] * (n - 1) + [q] for q in case["prefill_lens"] if n > 1]
            for lens in batches:
                if sum(lens) > tokens:
                    continue
                common = common_metadata(target.table(n), lens, [x + 1 for x in lens], "cpu")
                if hasattr(group, "build_metadata"):  # what the runner calls (0.33+)
                    metadata = group.build_metadata(common)
                else:
                    metadata = target.builder.build(common_prefix_len=0, common_attn_metadata=common)
                q = torch.zeros(sum(lens), case["heads"], D, dtype=torch.bfloat16)
                kv = torch.zeros(sum(lens), case["kv_heads"], D, dtype=torch.bfloat16)
                out = torch.zeros_like(q)
                with fam.observed_launches(kernels, launch=False) as seen:
                    target.layer.impl.forward(target.layer, q, kv, kv, target.kv_cache, metadata, output=out)
                keys.setdefault(repr(tuple(seen)), [n, lens[-1], "mixed" if len(set(lens)) > 1 else "uniform"])
    return keys



def run_case(case):
    """The family's batches for this engine against production's: their keys, the forms reached."""
    view, group, builder, layer = engine(case)
    kernels = fam.ops_kernels()
    target = fam.target_of(view, group, "group 0")
    t0 = time.perf_counter()
    batches, probes = fam.choose_batches(target, kernels)
    chosen_s = time.perf_counter() - t0
    warmed = {}
    with torch.inference_mode():
        for b in batches:
            with fam.observed_launches(kernels, launch=False) as seen:
                fam.run_batch(target, b)
            warmed[repr(tuple(seen))] = b.label()
    prod = production(case, group, target, kernels)
    result = {"threshold": builder.seq_threshold_3D, "batches": [b.label() for b in batches], "probes": probes,
              "choose_s": chosen_s, "warmed": sorted(warmed), "production": sorted(prod),
              "missing": [prod[k] for k in prod if k not in warmed],
              "extra": [warmed[k] for k in warmed if k not in prod],
              "forms": sorted({"3D" if "reduce_segments" in k else "2D" for k in prod})}
    if case.get("run"):  # the family's own steps, launches included (Triton's interpreter)
        planned = fam.plan(view, False)
        t0 = time.perf_counter()
        result["steps"] = [s.run() if s.run else s.skip for s in planned.steps]
        result["run_s"] = time.perf_counter() - t0
        result["details"] = planned.details()
    return result


def main(argv: list[str]) -> None:
    cases = json.loads(argv[0])
    if getattr(v1_utils, "PIN_MEMORY", False):  # 0.33 pins per copy when a GPU is expected
        v1_utils.PIN_MEMORY = False
    print("RESULT " + json.dumps({label: run_case(case) for label, case in cases.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
