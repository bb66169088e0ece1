"""Scenario of tests/test_family_runner.py on Model Runner V2 (0.34+: the only runner), run in a
fresh interpreter (``run_scenario_cases``) under Triton's interpreter on CPU.

Argument: the cases as JSON (name -> engine settings). Real: ``KVBlockZeroer`` over a real
attention KV tensor (``_zero_kv_blocks_kernel`` runs), V2's ``BlockTables`` (block_tables.py) and
its ``compute_slot_mappings``. Stood in (``GPUModelRunner`` needs a GPU): the runner, a namespace
holding those objects where V2's runner has them (``kv_block_zeroer``, ``block_tables``) and the
config settings the family reads (``kernel_config.enable_jit_warmup``,
``cache_config.enable_extensible_kv_cache``). Prints one ``RESULT`` line of JSON: case name ->
the family's steps, and the keys of the V2 slot-mapping kernel at several batch shapes.
"""
from __future__ import annotations

import json
import os
import sys
import types

import torch

from kwarm_ext import config
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import runner as fam
from kwarm_ext.kernels.launches import observed_launches
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu import block_table as v2_tables
from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer

import block_tables  # tests/scenarios/block_tables.py

NS = types.SimpleNamespace
CPU = torch.device("cpu")
LAYER = "model.layers.3.self_attn.attn"


def zeroer_over(kv):
    group = AttentionGroup(backend=TritonAttentionBackend, layer_names=[LAYER], kv_cache_group_id=0,
                           kv_cache_spec=FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128,
                                                           dtype=torch.bfloat16))
    return KVBlockZeroer(CPU, attn_groups_iter=[group], kernel_block_sizes=[16],
                         static_forward_context={LAYER: NS(kv_cache=kv)}, num_blocks=8)


def run_case(args):
    os.environ["KWARM_WARMUPS"] = args.get("warmups", "*")
    config.reset()
    kv = torch.randn((8, 2, 16, 2, 128), dtype=torch.bfloat16)
    tables, held, _ = block_tables.build(4, 4096, 64, 16)
    vllm_config = NS(kernel_config=NS(enable_jit_warmup=args["jit"]),
                     cache_config=NS(enable_extensible_kv_cache=args.get("extensible", False)))
    runner = NS(kv_block_zeroer=zeroer_over(kv), kv_cache_config=NS(num_blocks=8), vllm_config=vllm_config,
                is_pooling_model=False, **held)
    worker = NS(vllm_config=vllm_config, execute_model=None, sample_tokens=None)
    view = EngineView(runner=runner, worker=worker, runner_kind="V2", model_type="qwen3_next",
                      backends=[["TRITON_ATTN"], ["GDN_ATTN"]], max_num_batched_tokens=64, is_pooling_model=False,
                      enforce_eager=args["eager"], cudagraph_mode="NONE" if args["eager"] else "FULL_AND_PIECEWISE")
    out = {"applies": fam.applies(view), "steps": []}
    for step in fam.plan(view, args.get("forced", False)):
        rec = {"name": step.name, "kernel": step.kernel, "skip": step.skip}
        if step.run is not None:
            rec["labels"] = step.run()
        out["steps"].append(rec)
    out["kv_block0_zero"] = bool((kv[0] == 0).all())
    out["kv_others_intact"] = bool((kv[1:] != 0).any(dim=tuple(range(1, kv.dim()))).all())
    return out


def slot_mapping_keys():
    """The V2 slot-mapping kernel's key at several batch shapes, through the real
    ``BlockTables.compute_slot_mappings`` (launches recorded, not run)."""
    tables, _, _ = block_tables.build(8, 4096, 64, 16)
    kernels = {"_compute_slot_mappings_kernel": v2_tables._compute_slot_mappings_kernel}
    keys = set()
    for lens in ([1], [1, 1], [16], [5, 1, 11], [1] * 8, [64]):
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens]).to(torch.int64)
        with observed_launches(kernels, launch=False) as seen:
            tables.compute_slot_mappings(torch.arange(len(lens), dtype=torch.int32), starts, positions, sum(lens))
        keys.add(repr(seen))
    return sorted(keys)


def main(argv: list[str]) -> None:
    for mod in list(sys.modules.values()):  # no pinned memory without a driver
        if getattr(mod, "__name__", "").startswith("vllm") and hasattr(mod, "PIN_MEMORY"):
            mod.PIN_MEMORY = False
    cases = json.loads(argv[0])
    result = {name: run_case(args) for name, args in cases.items()}
    result["slot_mapping_keys"] = slot_mapping_keys()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
