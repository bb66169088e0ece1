"""Scenario of tests/test_family_triton_mla.py, run once per release in a fresh interpreter
(``run_scenario``) under Triton's interpreter on CPU.

Argument: the engine shape as JSON (heads, kv_lora_rank, rope, block, max_model_len, sms). It
builds the engine from vLLM's real ``TRITON_MLA`` objects: ``TritonMLAImpl`` (its
``forward_mqa``; built without its ``__init__``, which asks the platform for a CUDA device, with
the attributes ``__init__`` would set), ``TritonMLABackend``, the runner's real block tables
(V1's ``MultiGroupBlockTable``, 0.20-0.33; V2's ``BlockTables``, 0.34+: block_tables.py),
vLLM's MLA metadata classes and decode kernels. It lets the family choose its decodes, records
the keys of those and of production's decodes (1 to 16 requests, every longest context from 1 to
``max_model_len`` in steps, and the powers of two around each split switch), runs the family's
steps for real, and prints one ``RESULT`` line of JSON.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import sys
import time
import types

import torch

from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import triton_mla as fam
from kwarm_ext.kernels.launches import observed_launches
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl
import vllm.v1.utils as v1_utils

import block_tables  # tests/scenarios/block_tables.py

NS = types.SimpleNamespace
NAME = "model.layers.0.self_attn.attn"


def engine(shape):
    H, R, P, BLOCK, MAXLEN = shape["heads"], shape["kv_lora_rank"], shape["rope"], shape["block"], shape["max_model_len"]
    impl = object.__new__(TritonMLAImpl)
    impl.__dict__.update(num_heads=H, kv_lora_rank=R, qk_rope_head_dim=P, scale=(R + P) ** -0.5,
                         _sm_count=shape["sms"], dcp_world_size=1, kv_cache_dtype="auto",
                         decode_sliding_window=shape.get("window"))  # 0.34+ (windowed drafts' decode)
    layer = NS(impl=impl, kv_cache=torch.zeros(MAXLEN // BLOCK, BLOCK, R + P, dtype=torch.bfloat16),
               _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    _, held, rows = block_tables.build(16, MAXLEN, MAXLEN, BLOCK)
    group = NS(backend=TritonMLABackend, layer_names=[NAME], kv_cache_group_id=0)
    runner = NS(attn_groups=[[group]], device=torch.device("cpu"), **held)
    vllm_config = NS(model_config=NS(dtype=torch.bfloat16, max_model_len=MAXLEN))
    view = EngineView(runner=runner, worker=NS(vllm_config=vllm_config), forward_context={NAME: layer},
                      backends=[["TRITON_MLA"]], device="cpu", tp_size=1)
    return view, layer, rows


def query_lens() -> tuple:
    """Decode query lengths production reaches: 1, and 3 (a decode verifying 2 speculative tokens)
    where forward_mqa runs several query rows per request (0.28+: it repeats each request's
    block-table row and extent per row)."""
    return (1, 3) if "repeat_interleave" in inspect.getsource(TritonMLAImpl.forward_mqa) else (1,)


def production(shape, layer, rows, kernels, classes):
    """Decodes of 1..16 requests (of each of :func:`query_lens`) at many longest contexts, built as
    the MLA builder builds them for forward_mqa: their launches' keys -> the first (requests,
    longest context) reaching it."""
    H, R, P, MAXLEN = shape["heads"], shape["kv_lora_rank"], shape["rope"], shape["max_model_len"]
    outer, inner = classes
    lengths = set(range(1, MAXLEN + 1, 97)) | {MAXLEN}
    power = fam.WORK_PER_SPLIT
    while power <= MAXLEN:
        lengths |= {power - 1, power, power + 1}
        power *= 2
    keys = {}
    with torch.inference_mode():
        for ql, n in itertools.product(query_lens(), (1, 2, 5, 16)):
            for longest in sorted(x for x in lengths if ql <= x <= MAXLEN):
                seq_lens = torch.tensor([max(ql, longest - i) for i in range(n)], dtype=torch.int32)
                decode = fam.dataclass_instance(inner, block_table=rows(n), seq_lens=seq_lens,
                                       dcp_tot_seq_lens=None)
                metadata = fam.dataclass_instance(outer, decode=decode, num_reqs=n, max_query_len=ql, max_seq_len=longest,
                                         num_actual_tokens=n * ql, num_decodes=n, num_decode_tokens=n * ql,
                                         num_prefills=0, query_start_loc=torch.arange(n + 1, dtype=torch.int32) * ql,
                                         slot_mapping=torch.full((n * ql,), -1, dtype=torch.int64), prefill=None,
                                         causal=True)
                q = (torch.zeros(n * ql, H, R, dtype=torch.bfloat16), torch.zeros(n * ql, H, P, dtype=torch.bfloat16))
                with observed_launches(kernels, launch=False) as seen:
                    layer.impl.forward_mqa(q, layer.kv_cache, metadata, layer)
                keys.setdefault(repr(tuple(seen)), [n, longest])
    return keys


def main(argv: list[str]) -> None:
    shape = json.loads(argv[0])
    if getattr(v1_utils, "PIN_MEMORY", False):  # 0.33 pins per copy when a GPU is expected
        v1_utils.PIN_MEMORY = False
    view, layer, rows = engine(shape)
    out = {"applies": fam.applies(view), "applies_none": fam.applies(EngineView(runner=NS(attn_groups=[]))),
           "metadata_fields": sorted(f.name for f in dataclasses.fields(fam.metadata_classes()[0]))}
    kernels, classes = fam.ops_kernels(), fam.metadata_classes()
    target = fam.target_of(view, view.runner.attn_groups[0][0], "group 0")
    t0 = time.perf_counter()
    chosen = fam.choose_lengths(target, kernels, classes)
    out["choose_s"] = time.perf_counter() - t0
    out["chosen"] = {repr(k): v for k, v in chosen.items()}
    out["splits"] = sorted(fam.splits_of(k) for k in chosen)
    prod = production(shape, layer, rows, kernels, classes)
    out["production"] = prod
    out["query_lens"] = query_lens()
    out["missing"] = [v for k, v in prod.items() if k not in out["chosen"]]
    out["extra"] = [v for k, v in out["chosen"].items() if k not in prod]
    planned = fam.plan(view, False)
    t0 = time.perf_counter()
    out["steps"] = [s.run() if s.run else s.skip for s in planned.steps]
    out["run_s"] = time.perf_counter() - t0
    out["details"] = planned.details()
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
