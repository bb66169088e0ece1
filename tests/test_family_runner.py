"""The ``runner`` family against vLLM's real block tables, KV-block zeroer and Triton kernels.

Each release runs in a fresh interpreter (``run_py(release=...)``) with Triton's interpreter on
CPU (``cpu_triton_env``): the real ``MultiGroupBlockTable`` (two KV-cache groups shaped like a
tiny hybrid Qwen3-Next: 272-token attention blocks split into 16-token kernel blocks, one GDN
state block per request) and the real ``KVBlockZeroer`` over a real attention KV tensor run the
real ``_compute_slot_mapping_kernel`` / ``_zero_kv_blocks_kernel``. Only the model runner is a
stand-in (``SimpleNamespace``): ``GPUModelRunner`` cannot be built without a GPU; it carries the
real objects at the attributes vLLM's runner has them (``input_batch.block_table``,
``_kv_block_zeroer``). Pinned memory is switched off in vLLM (no driver on CPU).

0.34 has no V1 runner: tests/scenarios/runner_v2.py stands in for Model Runner V2 the same way,
with V2's real ``BlockTables`` and the real ``KVBlockZeroer`` at ``kv_block_zeroer``.
"""
from __future__ import annotations

import functools

import pytest

from conftest import MATRIX, cpu_triton_env, result_of, run_cases, run_py, run_scenario_cases


SCENARIO = r'''
import inspect, json, sys, types
import torch
import vllm.utils.torch_utils
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import runner as fam
from vllm.v1.worker import block_table as btmod
from vllm.v1.worker.utils import AttentionGroup, KVBlockZeroer
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as Backend

for mod in list(sys.modules.values()):  # no pinned memory without a driver
    if getattr(mod, "__name__", "").startswith("vllm") and hasattr(mod, "PIN_MEMORY"):
        mod.PIN_MEMORY = False

CASES = json.loads(__ARGS__)
CPU = torch.device("cpu")
MAX_TOKENS = 64


def build(fn, **kw):  # call with the keyword arguments this release's signature takes
    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kw.items() if k in names})


seen = []
# Spy on the real compute_slot_mapping: what the kernel wrote, before kwarm restores it.
original = btmod.BlockTable.compute_slot_mapping


def spy(self, num_reqs, query_start_loc, positions):
    original(self, num_reqs, query_start_loc, positions)
    n = int(positions.shape[0])
    seen.append({"block_size": int(self.block_size), "T": n,
                 "positions": positions.tolist(),
                 "row0": self.block_table.gpu[0, :2].tolist(),
                 "slots": self.slot_mapping.gpu[: n + 3].tolist(),
                 "tail_pad": bool((self.slot_mapping.gpu[n:] == -1).all())})
btmod.BlockTable.compute_slot_mapping = spy


def run_case(ARGS):
    seen.clear()
    modes = getattr(btmod, "SlotMappingMode", None)
    tables = build(btmod.MultiGroupBlockTable, max_num_reqs=4, max_model_len=4096,
                   max_num_batched_tokens=MAX_TOKENS, pin_memory=False, device=CPU,
                   block_sizes=[272, 4096], kernel_block_sizes=[16, 4096], max_num_blocks=[16, 1],
                   cp_kv_cache_interleave_size=1,
                   slot_mapping_modes=[modes.TOKEN_TO_KV_SLOT, modes.NONE] if modes else None)
    for table in tables.block_tables:  # leftovers a previous step may have left
        table.slot_mapping.gpu.fill_(-7)

    layer_name = "model.layers.3.self_attn.attn"
    kv = torch.randn((8, 2, 16, 2, 128), dtype=torch.bfloat16)
    context = {layer_name: types.SimpleNamespace(kv_cache=kv)}
    group = AttentionGroup(backend=Backend, layer_names=[layer_name],
                           kv_cache_spec=FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128,
                                                           dtype=torch.bfloat16),
                           kv_cache_group_id=0)
    zeroer = build(KVBlockZeroer, device=CPU, pin_memory=False, attn_groups_iter=[group],
                   kernel_block_sizes=[16], cache_dtype="auto", static_forward_context=context,
                   runner_only_attn_layers=set(), num_blocks=8)
    if getattr(zeroer, "_meta", None) is None and hasattr(zeroer, "init_meta"):  # 0.20-0.22
        build(zeroer.init_meta, attn_groups_iter=[group], kernel_block_sizes=[16], cache_dtype="auto",
              runner_only_attn_layers=set(), static_forward_context=context)

    # Stand-in runner: GPUModelRunner needs a GPU; the objects it carries are vLLM's own.
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(block_table=tables),
        kv_cache_config=types.SimpleNamespace(num_blocks=8),
        query_start_loc=types.SimpleNamespace(gpu=torch.zeros(5, dtype=torch.int32)),
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
        is_pooling_model=ARGS["pooling"])
    if ARGS["zeroer"]:
        runner._kv_block_zeroer = zeroer
    layers = {}
    if ARGS["gdn"]:
        MambaBase = type("MambaBase", (), {})
        layers["model.layers.0.linear_attn"] = type("QwenGatedDeltaNetAttention", (MambaBase,), {})()
    view = EngineView(runner=runner, runner_kind=ARGS["kind"], model_type=ARGS["model_type"],
                      backends=ARGS["backends"], forward_context=layers,
                      max_num_batched_tokens=MAX_TOKENS, is_pooling_model=ARGS["pooling"])

    fam._WARM_BLOCK_ID = ARGS["block_id"]
    out = {"applies": fam.applies(view), "steps": []}
    if out["applies"] is None:
        before_row = tables[0].block_table.np[0].copy()
        for step in fam.plan(view, ARGS["forced"]):
            rec = {"name": step.name, "kernel": step.kernel, "skip": step.skip}
            if step.run is not None:
                rec["labels"] = step.run()
            out["steps"].append(rec)
        out["seen"] = list(seen)
        out["restored"] = {
            "row_np": bool((tables[0].block_table.np[0] == before_row).all()),
            "row_gpu": bool((tables[0].block_table.gpu[0] == 0).all()),
            "row_count": int(tables[0].num_blocks_per_row[0]),
            "slot_buffers": [bool((t.slot_mapping.gpu == -7).all()) for t in tables.block_tables]}
        out["kv_block0_zero"] = bool((kv[0] == 0).all())
        out["kv_others_intact"] = bool((kv[1:] != 0).any(dim=tuple(range(1, kv.dim()))).all())
    return out


print("RESULT " + json.dumps({name: run_case(args) for name, args in CASES.items()}))
'''

QWEN_HYBRID = dict(model_type="qwen3_next", kind="V1", pooling=False, zeroer=True, gdn=True,
                   backends=[["TRITON_ATTN"], ["GDN_ATTN"]], forced=False, block_id=0)


# Cases per release, each run once in that release's interpreter (one vLLM import per release).
CASES = {
    "0.20.0": {"hybrid": {}},
    "0.22.0": {"hybrid": {}},
    "0.24.0": {"hybrid": {}, "block5": dict(block_id=5),
               "llama": dict(model_type="llama", zeroer=False, gdn=False, backends=[["FLASH_ATTN"]]),
               "pooling": dict(pooling=True),
               "mla": dict(model_type="glm_moe_dsa", zeroer=False, gdn=False,
                           backends=[["FLASHMLA_SPARSE"], ["DEEPSEEK_V32_INDEXER"]]),
               "v2": dict(kind="V2")},
    "0.26.0": {"hybrid": {}, "forced": dict(forced=True)},
    "0.28.0": {"hybrid": {}, "forced": dict(forced=True)},
}


@functools.lru_cache(maxsize=None)
def _batch(release: str) -> dict:
    return run_cases(SCENARIO, {name: dict(QWEN_HYBRID, **overrides) for name, overrides in CASES[release].items()},
                     release)


def _run(release: str, case: str) -> dict:
    return _batch(release)[case]


@pytest.fixture(scope="module", params=MATRIX)
def hybrid(request):
    """Per release: the Qwen3-Next-like hybrid runner, not forced."""
    return request.param, _run(request.param, "hybrid")


def _step(result, name):
    return [s for s in result["steps"] if s["name"] == name]


# Expected per release, read from each release's source (see kernels/runner.py's docstring):
#   slot mapping: num_tokens specialized up to 0.23 -> T in {1, 2, 16}; mamba groups launch
#   until 0.24 (SlotMappingMode.NONE from 0.26); 0.28 upstream warms the real tables.
#   zeroing: n_blocks specialized up to 0.26; 0.26's qwen warmup covers n in {1, 2};
#   0.28's kernel_warmup calls KVBlockZeroer.warmup.
SLOT_COUNTS = {"0.20.0": [1, 2, 16], "0.22.0": [1, 2, 16], "0.24.0": [1], "0.26.0": [1], "0.28.0": None}
SLOT_GROUPS = {"0.20.0": 2, "0.22.0": 2, "0.24.0": 2, "0.26.0": 1, "0.28.0": None}
ZERO_COUNTS = {"0.20.0": [1, 2, 16], "0.22.0": [1, 2, 16], "0.24.0": [1, 2, 16], "0.26.0": [16], "0.28.0": None}


def test_applies_to_hybrid(hybrid):
    _, result = hybrid
    assert result["applies"] is None


def test_slot_mapping_per_release(hybrid):
    release, result = hybrid
    ran = _step(result, "slot_mapping")
    covered = _step(result, "slot_mapping[upstream]")
    if SLOT_COUNTS[release] is None:
        assert not ran and covered
        assert covered[0]["skip"] == "covered by upstream v1_block_table_warmup (real block tables)"
        return
    assert not covered, "upstream's fresh-table warmup is not the production key: never a reason to skip"
    labels = ran[0]["labels"]
    expected = {f"group{g}:bs={bs},T={t}" for g, bs in enumerate((16, 4096)[: SLOT_GROUPS[release]])
                for t in SLOT_COUNTS[release]}
    assert set(labels) == expected
    # The real kernel ran on the real tables: row 0 held the committed block, slots = block*bs + pos
    attn = [s for s in result["seen"] if s["block_size"] == 16]
    assert sorted(s["T"] for s in attn) == SLOT_COUNTS[release]
    for call in attn:
        assert call["row0"][0] == 0
        assert call["slots"][: call["T"]] == call["positions"]
        assert call["tail_pad"], "the kernel pads the rest of the table's slot_mapping with PAD_SLOT_ID"


def test_slot_mapping_leaves_tables_as_found(hybrid):
    release, result = hybrid
    if SLOT_COUNTS[release] is None:
        return
    assert result["restored"] == {"row_np": True, "row_gpu": True, "row_count": 0,
                                  "slot_buffers": [True, True]}


def test_zeroing_per_release(hybrid):
    release, result = hybrid
    ran = _step(result, "zero_kv_blocks")
    covered = _step(result, "zero_kv_blocks[upstream]")
    if ZERO_COUNTS[release] is None:
        assert not ran
        assert covered[0]["skip"] == "covered by upstream KVBlockZeroer.warmup (called by kernel_warmup)"
        return
    assert ran[0]["labels"] == [f"n_blocks={n}" for n in ZERO_COUNTS[release]]
    if release == "0.26.0":
        assert covered[0]["skip"] == "covered by upstream qwen_triton_warmup (zero_block_ids)"
    else:
        assert not covered
    # only the null block was written, and only with zeros
    assert result["kv_block0_zero"] and result["kv_others_intact"]


@pytest.mark.parametrize("release", ["0.26.0", "0.28.0"])
def test_forced_runs_what_upstream_covers(release):
    result = _run(release, "forced")
    assert not [s for s in result["steps"] if s["skip"]]
    labels = {lab for s in result["steps"] for lab in s.get("labels", [])}
    assert "group0:bs=16,T=1" in labels
    if release == "0.28.0":
        assert "warmup()" in labels  # via the zeroer's own warmup where it has one
    else:
        assert {"n_blocks=1", "n_blocks=2", "n_blocks=16"} <= labels
    assert result["kv_block0_zero"] and result["kv_others_intact"]


def test_committed_block_id_is_what_the_kernel_reads():
    """With another committed block id the real kernel's slots move by block_id * block_size."""
    result = _run("0.24.0", "block5")
    call = [s for s in result["seen"] if s["block_size"] == 16][0]
    assert call["row0"][0] == 5 * 17  # kv block 5 = kernel blocks 85..101 (272 / 16 = 17)
    assert call["slots"][: call["T"]] == [85 * 16 + p for p in call["positions"]]


@pytest.mark.parametrize("case,reason", [
    ("llama", "no KV-block zeroer, mamba/GDN layers or MLA/DSA backend"),
    ("pooling", "pooling model: no generation slot mapping or KV-block zeroing"),
])
def test_silent_for_dense_and_pooling(case, reason):
    assert _run("0.24.0", case)["applies"] == reason


def test_applies_for_mla_without_zeroer():
    result = _run("0.24.0", "mla")
    assert result["applies"] is None
    assert _step(result, "zero_kv_blocks")[0]["skip"] == "runner has no KV-block zeroer"
    assert _step(result, "slot_mapping")[0]["labels"] == ["group0:bs=16,T=1", "group1:bs=4096,T=1"]


def test_v2_runner_skips_slot_mapping_with_reason():
    result = _run("0.24.0", "v2")
    assert _step(result, "slot_mapping")[0]["skip"].startswith("V2 runner:")
    assert _step(result, "zero_kv_blocks")[0]["labels"] == ["n_blocks=1", "n_blocks=2", "n_blocks=16"]


def test_symbols_0_33():
    """0.33: the family resolves its kernels, reads their specialization and binds its calls."""
    proc = run_py(r'''
import inspect, json
from kwarm_ext.kernels import runner as fam
from kwarm_ext.vllm_compat import resolve, bind
from vllm.v1.worker.block_table import BlockTable
from vllm.v1.worker.utils import KVBlockZeroer
slot = resolve("vllm.v1.worker.block_table:_compute_slot_mapping_kernel",
               "vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel")
zero = resolve("vllm.v1.worker.utils:_zero_kv_blocks_kernel")
bind(BlockTable.compute_slot_mapping, None, 1, None, None)
bind(KVBlockZeroer.zero_block_ids, None, [0])
bind(KVBlockZeroer.warmup, None, 8)
print("RESULT " + json.dumps([fam.param_mode(slot, "num_tokens"), fam.param_mode(zero, "n_blocks"),
      hasattr(resolve("vllm.v1.worker.block_table:ComputeSlotMappingKernel"), "register_warmup")]))
''', release="0.33.0", env=cpu_triton_env(), timeout=240)
    assert result_of(proc) == ["dns", "absent", True]


# 0.34: Model Runner V2 only. Who runs V2's warmup_kernels (and with it KVBlockZeroer.warmup):
# vLLM with its JIT warmup or an extensible KV cache, kwarm's v2_warmup in an eager engine, else
# nobody and the family zeroes block 0 itself.
V2_CASES = {
    "jit": dict(jit=True, eager=False),
    "extensible": dict(jit=False, eager=False, extensible=True),
    "eager": dict(jit=False, eager=True),
    "eager_without_v2_warmup": dict(jit=False, eager=True, warmups="*,-v2_warmup"),
    "graphs_jit_off": dict(jit=False, eager=False),
    "forced": dict(jit=True, eager=False, forced=True),
}
V2_ZEROING = {
    "jit": "covered by upstream KVBlockZeroer.warmup (called by Model Runner V2's warmup_kernels, run by vLLM)",
    "extensible": "covered by upstream KVBlockZeroer.warmup (called by Model Runner V2's warmup_kernels, run by vLLM)",
    "eager": "covered by upstream KVBlockZeroer.warmup (called by Model Runner V2's warmup_kernels, run by "
             "kwarm's v2_warmup after start-up where vLLM's call is off)",
    "eager_without_v2_warmup": ["n_blocks=1"],
    "graphs_jit_off": ["n_blocks=1"],
    "forced": ["warmup()"],
}


@functools.lru_cache(maxsize=None)
def _v2() -> dict:
    return run_scenario_cases("runner_v2", V2_CASES, "0.34.0")


@pytest.mark.parametrize("case", sorted(V2_CASES))
def test_v2_zeroing_0_34_is_warmed_once_by_whoever_runs_warmup_kernels(case):
    result = _v2()[case]
    assert result["applies"] is None
    expected = V2_ZEROING[case]
    if isinstance(expected, str):
        assert [(s["name"], s["skip"]) for s in result["steps"] if "zero" in s["name"]] == \
            [("zero_kv_blocks[upstream]", expected)]
        assert not result["kv_block0_zero"], "nothing zeroed where warmup_kernels does it"
    else:
        (step,) = [s for s in result["steps"] if s["name"] == "zero_kv_blocks"]
        assert step["labels"] == expected
        assert result["kv_block0_zero"] and result["kv_others_intact"], "only the null block, only zeros"


def test_v2_slot_mapping_0_34_has_one_key_and_says_who_warms_it():
    result = _v2()
    assert len(result["slot_mapping_keys"]) == 1, "no per-step integer specialization: one key for every batch"
    skips = {case: next(s["skip"] for s in result[case]["steps"] if s["name"] == "slot_mapping")
             for case in V2_CASES}
    assert skips["jit"].endswith("(run by vLLM)")
    assert skips["eager"].endswith("(run by kwarm's v2_warmup after start-up where vLLM's call is off)")
    assert skips["graphs_jit_off"].endswith("(run by neither vLLM nor kwarm's v2_warmup here: the first step "
                                            "compiles it)")
