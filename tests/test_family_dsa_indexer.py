"""The dsa_indexer family against the real vLLM, on CPU.

Each release (0.20.0, 0.22.0, 0.24.0, 0.26.0, 0.28.0, and 0.33.0) runs once, in a fresh
interpreter under ``TRITON_INTERPRET=1`` (``cpu_triton_env()``): the family plans and runs
its steps against vLLM's real Triton kernels with CPU tensors shaped like the tiny
DeepSeek-V3.2 (bench/models/tiny-deepseek-v32: index_topk 256, 64 heads,
max_position_embeddings 8192; KV block size 64, the only one FLASHMLA_SPARSE and the V3.2
indexer support, checked below). Every interpreted launch is recorded with the key Triton
would compile for it on a GPU (``native_specialize_impl`` per argument: pointer dtype and
16-byte alignment, the 1 / multiple-of-16 / other class of ints, constexpr values, launch
options), so the tests compare real specialization keys, not our labels.

Real vLLM objects: the attention backends, ``AttentionGroup``, ``MultiGroupBlockTable`` (the
V1 runner's block table, with its real width), the entry functions and their kernels,
``split_indexer_prefill_chunks``, upstream's own warmups and (0.33) ``JitWarmupRegistry``.
Stand-ins, because they cannot exist without a GPU: the metadata builders (their
constructors read the device's SM count and allocate CUDA buffers; the stand-ins carry the
attributes the family reads), the runner and worker (namespaces holding the real block table
and attention groups), the vLLM config (the fields upstream's ``get_warmup_keys`` reads) and
the FLASHMLA_SPARSE layer (it lends ``impl.topk_indices_buffer`` and a ``kv_cache`` of the
fp8_ds_mla shape).

0.33.0's vLLM does not import whole on this venv (``humming``), but the modules the family
touches do, so beyond resolving and binding its symbols the family's plan and steps run there
too.
"""
from __future__ import annotations

import itertools
import pytest

from conftest import MATRIX, REPO, PerRelease, cpu_triton_env, marked_json, run_py
from conftest import plan_steps as steps
from conftest import release_version as v

CONFIG = str(REPO / "bench" / "models" / "tiny-deepseek-v32" / "config.json")
MARK = "KWARM-DSA-RESULT "
RELEASES = (*MATRIX, "0.33.0")
TABLE_WIDTH = 128  # cdiv(8192, 64): the real block-table width of both KV-cache groups
# Rows committed to the runner's block table: group 0 (FLASHMLA_SPARSE), group 1 (indexer).
TABLE_ROWS = {0: [[10, 11], [12, 13]], 1: [[20, 21], [22, 23]]}

# Runs in a fresh interpreter, after `CONFIG = ...` and `TABLE_ROWS = ...`. Prints one MARK line of JSON.
SCENARIO = r'''
import dataclasses, inspect, itertools, json, types
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import vllm
from kwarm_ext import vllm_compat
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import dsa_indexer as fam

NS = types.SimpleNamespace
VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
OUT = {"version": vllm.__version__}
LAUNCHES = []
_run = InterpretedFunction.run


def spec_of(fnobj, args, kwargs):
    """Triton's specialization key of one launch (what JITFunction.run would compile)."""
    sig = inspect.signature(fnobj.fn)
    names = list(sig.parameters)
    dns = set(fnobj.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in sig.parameters})
    key, ptrs = [], {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            key.append([name, "constexpr", repr(value)])
            continue
        native = native_specialize_impl(BaseBackend, value, False, name not in dns and i not in dns, True)
        key.append([name, *(x if isinstance(x, str) else repr(x) for x in native)])
        if hasattr(value, "data_ptr"):
            ptrs[name] = value.data_ptr()
    options = sorted([k, repr(v)] for k, v in kwargs.items() if k not in sig.parameters)
    kind = "chunk" if "query_slice_start" in names else "convert" if "HAS_PREFILL" in names else "other"
    return {"kind": kind, "key": json.dumps([key, options]), "spec": {k[0]: k[1:] for k in key},
            "ptrs": ptrs}


def recording_run(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append(dict(spec_of(self, args, kwargs), warmup=bool(warmup)))
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


InterpretedFunction.run = recording_run


def take(kind):
    out = [launch for launch in LAUNCHES if launch["kind"] == kind]
    LAUNCHES.clear()
    return out


def jsonable(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


hf = NS(**json.load(open(CONFIG)))
MAX_MODEL_LEN, BLOCK, TOKENS, SEQS = hf.max_position_embeddings, 64, 8192, 16
vllm_config = NS(
    scheduler_config=NS(max_num_batched_tokens=TOKENS, max_num_seqs=SEQS),
    model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=MAX_MODEL_LEN),
    parallel_config=NS(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                       prefill_context_parallel_size=1),
    kernel_config=NS(enable_jit_warmup=True), cache_config=NS(block_size=BLOCK),
    attention_config=NS(hisparse_config=None))

from vllm.v1.attention.backends.mla import indexer as vllm_indexer
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.worker.block_table import MultiGroupBlockTable
from vllm.v1.worker.utils import AttentionGroup

OUT["kernel_block_sizes"] = [FlashMLASparseBackend.get_supported_kernel_block_sizes(),
                             DeepseekV32IndexerBackend.get_supported_kernel_block_sizes()]
table_kwargs = dict(max_num_reqs=SEQS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=TOKENS,
                    pin_memory=False, device=torch.device("cpu"), block_sizes=[BLOCK, BLOCK],
                    kernel_block_sizes=[BLOCK, BLOCK], max_num_blocks=[-(-MAX_MODEL_LEN // BLOCK)] * 2)
accepted = inspect.signature(MultiGroupBlockTable).parameters
tables = MultiGroupBlockTable(**{k: v for k, v in table_kwargs.items() if k in accepted})
import vllm.v1.utils as v1_utils
if getattr(v1_utils, "PIN_MEMORY", False):  # 0.33 pins per copy when a GPU is expected
    v1_utils.PIN_MEMORY = False
for row, ids in enumerate(zip(*TABLE_ROWS.values())):
    tables.add_row(tuple(ids), row)
tables.commit_block_table(2)
before = [tables[g].get_device_tensor(SEQS).clone() for g in (0, 1)]
OUT["table_width"] = [tables[g].get_device_tensor(1).shape[1] for g in (0, 1)]
OUT["table_ptrs"] = [tables[g].get_device_tensor(1).data_ptr() for g in (0, 1)]


def make_registry():
    """0.30+: the runner's JIT warmup registry, holding what MLAAttention.__init__ registers
    for a DSA layer when enable_jit_warmup is on."""
    if VERSION < (0, 30):
        return None
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    registry = JitWarmupRegistry(vllm_config)
    with registry.activate():
        vllm_indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL.register_warmup()
    return registry


def stand_in_backend(name):
    return type(name, (), {"get_name": staticmethod(lambda: name)})


def make_view(*, fp8=True, heads=64, eager=False, mode="FULL_AND_PIECEWISE", dcp=(0, 1, 1),
              backends=("FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER")):
    spec = NS(block_size=BLOCK)
    mla_builder = NS(use_fp8_kv_cache=fp8, num_heads=heads, topk_tokens=hf.index_topk, kv_cache_spec=spec)
    if VERSION >= (0, 30):  # decided once in the builder's __init__ there
        mla_builder.fp8_use_mixed_batch = heads < 32
    idx_builder = NS(compress_ratio=1, dcp_rank=dcp[0], dcp_world_size=dcp[1],
                     cp_kv_cache_interleave_size=dcp[2], compressed_cp_interleave_size=dcp[2])
    name = "model.layers.0.self_attn.attn"
    real = {"FLASHMLA_SPARSE": (FlashMLASparseBackend, mla_builder),
            "DEEPSEEK_V32_INDEXER": (DeepseekV32IndexerBackend, idx_builder)}
    groups = []
    for gid, backend_name in enumerate(backends):
        backend, builder = real.get(backend_name) or (stand_in_backend(backend_name), NS())
        group = AttentionGroup(backend=backend, layer_names=[name if gid == 0 else name + ".indexer"],
                               kv_cache_spec=spec, kv_cache_group_id=gid)
        group.metadata_builders = [builder]
        groups.append([group])
    runner = NS(attn_groups=groups, input_batch=NS(block_table=tables), device=torch.device("cpu"),
                vllm_config=vllm_config, is_pooling_model=False)
    registry = make_registry()
    if registry is not None:
        runner.jit_warmup_registry = registry
    layer = NS(impl=NS(topk_indices_buffer=torch.empty(4, hf.index_topk, dtype=torch.int32)),
               kv_cache=torch.zeros(4, BLOCK, 656, dtype=torch.uint8))  # fp8_ds_mla layout
    return EngineView(vllm_version=vllm.__version__, runner_kind="V1", model_type=hf.model_type,
                      backends=[[b] for b in backends], device="cpu", max_num_batched_tokens=TOKENS,
                      max_num_reqs=SEQS, enforce_eager=eager, cudagraph_mode="NONE" if eager else mode,
                      is_pooling_model=False, worker=NS(vllm_config=vllm_config, model_runner=runner),
                      runner=runner, forward_context={name: layer})


TABLES = []  # (KV-cache group, rows) of every block table a step asked for
from kwarm_ext.kernels import attention_groups
from kwarm_ext.kernels.dsa_indexer import chunk_metadata, common, index_conversion
_block_table = attention_groups.block_table


def recording_block_table(view, group_id, num_reqs):
    TABLES.append([group_id, num_reqs])
    return _block_table(view, group_id, num_reqs)


chunk_metadata.block_table = index_conversion.block_table = recording_block_table  # the parts that read tables


def planned(view, forced):
    """Each step, the launches its run made and the block tables it read."""
    steps = []
    for step in fam.plan(view, forced):
        LAUNCHES.clear()
        TABLES.clear()
        record = {"name": step.name, "kernel": step.kernel, "skip": step.skip, "labels": None, "error": None}
        if step.skip is None:
            try:
                record["labels"] = list(step.run())
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
        record["launches"] = list(LAUNCHES)
        record["tables"] = list(TABLES)
        LAUNCHES.clear()
        steps.append(record)
    return steps


# -- symbols: resolved, and our calls bound to the real signatures ---------------------------
fn = vllm_compat.resolve(common._INDEXER + ":build_prefill_chunk_metadata")
cfn = vllm_compat.resolve(common._SPARSE_UTILS + ":triton_convert_req_index_to_global_index")
view = make_view()
args = fam.chunk_args(view, fn)
group = attention_groups.groups_of(view, fam.SPARSE_MLA_BACKEND)[0]
cargs = fam.convert_args(view, group, cfn)
runtime, captured = fam.convert_variants(view, group)
vllm_compat.bind(fn, *([None] * 9), query_slice=slice(0, 1), skip_kv_gather=False, **args.dcp)
OUT["chunk_args"] = {"group_id": args.group_id, "compress_ratio": args.compress_ratio, "dcp": args.dcp}
OUT["chunk_params"] = list(vllm_compat.params(fn))
OUT["convert_args"] = dataclasses.asdict(cargs)
OUT["convert_params"] = list(vllm_compat.params(cfn))
OUT["convert_variants"] = [[v.name, v.has_prefill, v.count_valid] for v in runtime + captured]

# -- applicability --------------------------------------------------------------------------
OUT["applies"] = {
    "dsa": fam.applies(make_view()),
    "indexer_other_mla": fam.applies(make_view(backends=("FLASHINFER_MLA_SPARSE", "DEEPSEEK_V32_INDEXER"))),
    "dense": fam.applies(EngineView(backends=[["FLASH_ATTN"]])),
    "mla_dense": fam.applies(EngineView(backends=[["FLASHMLA"]])),
    "qwen_gdn": fam.applies(EngineView(backends=[["FLASH_ATTN"], ["GDN_ATTN"]])),
    "pooling": fam.applies(EngineView(backends=[["FLASH_ATTN"]], is_pooling_model=True)),
    "none": fam.applies(EngineView()),
}

# -- plans ----------------------------------------------------------------------------------
OUT["plans"] = {
    "default": planned(make_view(), False),
    "forced": planned(make_view(), True),
    "eager": planned(make_view(eager=True), False),
    "piecewise": planned(make_view(mode="PIECEWISE"), False),
    "bf16": planned(make_view(fp8=False), False),
    "bf16_eager": planned(make_view(fp8=False, eager=True), False),
    "fp8_mixed": planned(make_view(heads=16), False),
    "fp8_mixed_eager": planned(make_view(heads=16, eager=True), False),
    "other_sparse": planned(make_view(backends=("FLASHINFER_MLA_SPARSE", "DEEPSEEK_V32_INDEXER")), False),
}
if args.dcp:  # 0.25+: DCP world 2, so production's DCP ints differ from upstream's defaults
    OUT["plans"]["dcp2"] = planned(make_view(dcp=(1, 2, 1)), False)


class BrokenRunner:
    @property
    def attn_groups(self):
        raise RuntimeError("attn_groups broke")


OUT["broken_runner"] = planned(EngineView(backends=[["DEEPSEEK_V32_INDEXER"]], runner=BrokenRunner()), False)

# -- every chunk case: its metadata, its launch, its block table -----------------------------
cases = []
for case in fam.CHUNK_CASES:
    r = fam.run_chunk_case(fn, args, torch.device("cpu"), lambda n: _block_table(view, args.group_id, n), case)
    m = r.metadata
    cases.append({
        "case": [case.qs_start, case.qs_stop, case.aligned], "label": r.label, "aligned": r.aligned,
        "start_idx": r.start_idx, "query_lens": r.query_lens, "seq_lens": r.seq_lens,
        "query_slice": [r.query_slice.start, r.query_slice.stop],
        "cu_seqlen_ks": jsonable(m.cu_seqlen_ks), "cu_seqlen_ke": jsonable(m.cu_seqlen_ke),
        "cu_seq_lens": jsonable(m.cu_seq_lens), "token_to_seq": jsonable(m.token_to_seq),
        "total_seq_lens": int(m.total_seq_lens), "token_start": int(m.token_start),
        "token_end": int(m.token_end), "num_reqs": m.num_reqs, "skip_kv_gather": bool(m.skip_kv_gather),
        "block_table": jsonable(m.block_table[:, :2]), "block_table_base": m.block_table.data_ptr()
        - m.block_table.storage_offset() * m.block_table.element_size(),
        "launches": take("chunk"),
    })
OUT["chunk_cases"] = cases

# -- production: DeepseekV32IndexerMetadataBuilder.build's chunking of real batches ------------
def production_batch(decodes, prefill_q, prefill_seq, max_logits_bytes):
    q = [1] * decodes + list(prefill_q)
    s = [9] * decodes + list(prefill_seq)
    qsl_cpu = torch.tensor([0, *itertools.accumulate(q)], dtype=torch.int32)
    seq_cpu = torch.tensor(s, dtype=torch.int32)
    qsl = torch.zeros(SEQS + 1, dtype=torch.int32)[: len(q) + 1]  # the runner's int32 buffers
    qsl.copy_(qsl_cpu)
    seq = torch.zeros(SEQS, dtype=torch.int32)[: len(s)]
    seq.copy_(seq_cpu)
    bt = tables[1].get_device_tensor(len(s))
    specs = vllm_indexer.split_indexer_prefill_chunks(
        seq_cpu[decodes:], torch.diff(qsl_cpu[decodes:]), MAX_MODEL_LEN * 40, max_logits_bytes,
        request_offset=decodes)
    for req_slice, query_slice in specs:
        fn(req_slice.start, req_slice.stop, qsl, qsl_cpu, seq, seq, seq_cpu, bt, 1,
           query_slice=query_slice, skip_kv_gather=query_slice.start > 0, **args.dcp)
    return [[r.start, r.stop, qs.start, qs.stop] for r, qs in specs]

if hasattr(vllm_indexer, "split_indexer_prefill_chunks"):  # a builder method in 0.33
    OUT["production"] = {
        "prefill_only": production_batch(0, [8, 8], [11, 29], 1 << 30),
        "decodes_ahead": production_batch(3, [5, 10], [9, 30], 1 << 30),
        "sub_chunks": production_batch(4, [20], [1000], 32000),
        "query_of_one": production_batch(1, [3], [10], 40),
        "sixteen_wide": production_batch(1, [32], [100], 6400),
    }
    OUT["production_chunk_launches"] = take("chunk")

# -- upstream's own warmup of the chunk kernel, recorded the same way -------------------------
OUT["upstream_chunk_launches"] = None
try:
    from vllm.model_executor.warmup import sparse_mla_triton_warmup as up
except ImportError:
    up = None
if up is not None and hasattr(up, "_warm_prefill_chunk_metadata_kernel"):  # 0.25-0.26: real launches
    up._warm_prefill_chunk_metadata_kernel(torch.device("cpu"), compress_ratio=1, query_len=8)
    OUT["upstream_chunk_launches"] = take("chunk")
elif up is not None and hasattr(vllm_indexer, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL"):  # 0.27-0.29
    vllm_indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL.warmup(vllm_config)  # compile-only launches
    OUT["upstream_chunk_launches"] = take("chunk")

# -- convert: each production variant, its output, its launch ----------------------------------
convert = []
for variant in runtime + captured:
    table = _block_table(view, cargs.group_id, 2)
    r = fam.run_convert_variant(cfn, cargs, torch.device("cpu"), table, variant)
    out, counts = r.output if isinstance(r.output, tuple) else (r.output, None)
    convert.append({"variant": [variant.name, variant.has_prefill, variant.count_valid], "label": r.label,
                    "out": jsonable(out), "counts": jsonable(counts),
                    "inputs": {k: jsonable(v[:, :2] if k == "block_table" else v) for k, v in r.inputs.items()},
                    "launches": take("convert")})
OUT["convert"] = convert

# production's call in FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode (0.20-0.29):
# slices of the builder's req_id_per_token buffer and the layer's topk_indices_buffer
if not cargs.strided:
    n = 4
    kw = dict(BLOCK_SIZE=BLOCK, NUM_TOPK_TOKENS=hf.index_topk, HAS_PREFILL_WORKSPACE=True,
              prefill_workspace_request_ids=torch.full((n,), -1, dtype=torch.int32),
              prefill_workspace_starts=torch.empty(1, dtype=torch.int32))
    if VERSION >= (0, 24):  # the FP8 prefill call passes return_valid_counts=True since 0.24
        kw["return_valid_counts"] = True
    cfn(torch.zeros(TOKENS, dtype=torch.int32)[:n], tables[0].get_device_tensor(2),
        torch.zeros(TOKENS, hf.index_topk, dtype=torch.int32)[:n], **kw)
    OUT["production_convert_launches"] = take("convert")

OUT["tables_untouched"] = all(torch.equal(b, tables[g].get_device_tensor(SEQS)) for g, b in zip((0, 1), before))
print("KWARM-DSA-RESULT " + json.dumps(OUT, default=repr))
'''


SCENARIOS = PerRelease(lambda release: _scenario(release))
_prefetch = SCENARIOS.autouse_fixture()


scenario = SCENARIOS.result  # the results for one release (one subprocess per release per session)


def _scenario(release: str) -> tuple[bool, object]:
    proc = run_py(f"CONFIG = {CONFIG!r}\nTABLE_ROWS = {TABLE_ROWS!r}\n" + SCENARIO, env=cpu_triton_env(),
                  release=release, timeout=240)
    return marked_json(proc, MARK)


def keys(launches) -> set:
    return {launch["key"] for launch in launches}


# -- oracles: what the kernels must compute, from the batch alone -----------------------------

def expected_chunk(case: dict) -> dict:
    """build_prefill_chunk_metadata for chunk [start_idx, end) and a query slice, by hand."""
    q, s, start = case["query_lens"], case["seq_lens"], case["start_idx"]
    qs_start, qs_stop = case["query_slice"]
    qsl = [0, *itertools.accumulate(q)]
    ks, ke, token_to_seq, seq_start, q_off = [], [], [], 0, 0
    for i in range(start, len(q)):
        for j in range(q[i]):
            if qs_start <= q_off + j < qs_stop:
                ks.append(seq_start)
                ke.append(seq_start + (s[i] - q[i]) + 1 + j)  # context + tokens up to j
        token_to_seq += [i - start] * s[i]
        seq_start += s[i]
        q_off += q[i]
    return {"cu_seqlen_ks": ks, "cu_seqlen_ke": ke, "token_to_seq": token_to_seq,
            "cu_seq_lens": [0, *itertools.accumulate(s[start:])], "total_seq_lens": sum(s[start:]),
            "token_start": qsl[start] + qs_start, "token_end": qsl[start] + qs_stop,
            "num_reqs": len(q) - start, "skip_kv_gather": qs_start > 0}


def expected_convert(entry: dict, block_size: int) -> tuple[list, list]:
    """out[t][c]: the global slot (decode rows) or workspace offset (prefill rows) of top-k index
    c of token t, -1 where invalid; and the count of valid indices per token."""
    inputs = entry["inputs"]
    table, has_prefill = inputs["block_table"], entry["variant"][1]
    rows = []
    for t, (req, tokens) in enumerate(zip(inputs["req_id"], inputs["token_indices"])):
        prefill = has_prefill and inputs["prefill_workspace_request_ids"][t] >= 0
        row = []
        for tok in tokens:
            if tok < 0 or tok // block_size >= TABLE_WIDTH:
                row.append(-1)
            elif prefill:
                row.append(inputs["prefill_workspace_starts"][inputs["prefill_workspace_request_ids"][t]] + tok)
            else:
                row.append(table[req][tok // block_size] * block_size + tok % block_size)
        rows.append(row)
    return rows, [sum(x >= 0 for x in row) for row in rows]


SPEC_OF_CLASS = {"one": ["constexpr", "1"], "div16": ["i32", "D"], "other": ["i32", ""]}
ALL_CASES = [[s, e, a] for a in (True, False) for s, e in
             ((0, 1), (0, 16), (0, 15), (1, 16), (1, 15), (5, 16), (5, 7))]


def int_class(value: int) -> str:
    return "one" if value == 1 else "div16" if value % 16 == 0 else "other"


# -- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_symbols_resolve_and_bind(release):
    result = scenario(release)
    assert result["version"] == release
    assert result["chunk_params"][:9] == [
        "start_idx", "end_idx", "query_start_loc", "query_start_loc_cpu", "uncompressed_seq_lens",
        "compressed_seq_lens", "compressed_seq_lens_cpu", "block_table", "compress_ratio"]
    dcp = result["chunk_args"]["dcp"]
    # 0.25+ production passes the builder's DCP values; older releases have no such parameters.
    assert (set(dcp) == {"dcp_rank", "dcp_world_size", "cp_kv_cache_interleave_size"}) == (v(release) >= (0, 25))
    assert result["chunk_args"]["group_id"] == 1  # the indexer's KV-cache group
    cargs = result["convert_args"]
    assert (cargs["group_id"], cargs["block_size"], cargs["topk"]) == (0, 64, 256)
    assert cargs["strided"] == ("BLOCK_STRIDE_ROWS" in result["convert_params"]) == (v(release) >= (0, 30))
    assert cargs["block_stride_rows"] is None  # 64-token blocks: the FP8 pages are the blocks


@pytest.mark.parametrize("release", RELEASES)
def test_applies_only_to_the_dsa_indexer(release):
    applies = scenario(release)["applies"]
    assert applies["dsa"] is None and applies["indexer_other_mla"] is None
    for engine in ("dense", "mla_dense", "qwen_gdn", "pooling", "none"):
        assert "DEEPSEEK_V32_INDEXER" in applies[engine], engine


@pytest.mark.parametrize("release", RELEASES)
def test_block_size_and_table_are_the_real_ones(release):
    result = scenario(release)
    mla = [64] if v(release) < (0, 30) else ["MultipleOf(64)"]  # 0.30+: any multiple of 64
    assert result["kernel_block_sizes"] == [mla, [64]]
    assert result["table_width"] == [TABLE_WIDTH, TABLE_WIDTH]
    assert result["tables_untouched"]  # neither kernel writes the runner's block table


@pytest.mark.parametrize("release", RELEASES)
def test_no_step_fails(release):
    for plan, planned in scenario(release)["plans"].items():
        for step in planned:
            assert step["error"] is None, (plan, step)


def test_unexpected_planning_error_fails_its_steps_only():
    """An error while planning (here: the runner) is each kernel's failing step, for
    warmup.py to log and isolate, not an exception out of plan()."""
    broken = scenario("0.24.0")["broken_runner"]
    triton = [s for s in broken if s["kernel"] in ("_build_prefill_chunk_metadata_kernel",
                                                   "_convert_req_index_to_global_index_kernel")]
    assert [(s["name"], s["skip"], s["error"]) for s in triton] == [
        ("prefill_chunk_metadata", None, "RuntimeError: attn_groups broke"),
        ("convert_req_index", None, "RuntimeError: attn_groups broke")]
    # The DeepGEMM steps skip on this CPU before reading the runner
    # (tests/test_family_dsa_deepgemm.py covers their broken-runner case).
    assert {s["skip"].split(" (")[0] for s in broken if s not in triton} == {"not a CUDA platform"}


@pytest.mark.parametrize("release", RELEASES)
def test_steps_read_their_groups_block_table(release):
    """The chunk step slices the indexer group's (1) table, the convert step the MLA group's (0)."""
    default = steps(scenario(release), "forced")
    assert default["prefill_chunk_metadata"]["tables"] == [[1, 2]] * 7 + [[1, 3]] * 7
    assert default["convert_req_index"]["tables"] == [[0, 2]]


@pytest.mark.parametrize("release", RELEASES)
def test_chunk_metadata_is_correct(release):
    cases = scenario(release)["chunk_cases"]
    assert [c["case"] for c in cases] == ALL_CASES
    for case in cases:
        got = {k: case[k] for k in expected_chunk(case)}
        assert got == expected_chunk(case), case["label"]
        # block_table[start_idx:end_idx] of the indexer group's real table
        assert case["block_table_base"] == scenario(release)["table_ptrs"][1]
        rows = TABLE_ROWS[1] + [[0, 0]]
        assert case["block_table"] == rows[case["start_idx"]:case["start_idx"] + case["num_reqs"]]


@pytest.mark.parametrize("release", RELEASES)
def test_chunk_variants_are_distinct_real_keys(release):
    """Each case is its own compile: the seq_lens view really is (mis)aligned as labeled, the
    slice bounds fall in the labeled int classes, and no two cases share a key."""
    cases = scenario(release)["chunk_cases"]
    for case in cases:
        (launch,) = case["launches"]
        qs_start, qs_stop, aligned = case["case"]
        assert case["aligned"] == aligned
        assert ("seq_lens=aligned" in case["label"]) == aligned
        assert launch["spec"]["uncompressed_seq_lens_ptr"] == ["*i32", "D" if aligned else ""]
        assert launch["ptrs"]["uncompressed_seq_lens_ptr"] % 16 == (0 if aligned else 4)
        assert launch["spec"]["query_slice_start"] == SPEC_OF_CLASS[int_class(qs_start)]
        assert launch["spec"]["query_slice_stop"] == SPEC_OF_CLASS[int_class(qs_stop)]
        assert launch["spec"]["query_start_loc_ptr"] == ["*i32", "D"]
        assert launch["spec"]["COMPRESS_RATIO"] == ["constexpr", "1"]
    assert len(keys(c["launches"][0] for c in cases)) == len(ALL_CASES)


@pytest.mark.parametrize("release", RELEASES)
def test_chunk_warmup_covers_production_keys(release):
    """Batches chunked the way DeepseekV32IndexerMetadataBuilder.build chunks them compile
    nothing the (forced) warmup did not."""
    result = scenario(release)
    if "production" not in result:
        pytest.skip("split_indexer_prefill_chunks is a builder method in this release")
    assert result["production"]["sub_chunks"] == [[4, 5, 0, 8], [4, 5, 8, 16], [4, 5, 16, 20]]
    production = result["production_chunk_launches"]
    specs = [launch["spec"] for launch in production]
    # the oracle really reaches the hard classes
    assert ["*i32", ""] in [s["uncompressed_seq_lens_ptr"] for s in specs]
    assert SPEC_OF_CLASS["one"] in [s["query_slice_stop"] for s in specs]
    assert [SPEC_OF_CLASS["other"], SPEC_OF_CLASS["div16"]] in [[s["query_slice_start"], s["query_slice_stop"]]
                                                              for s in specs]
    (forced,) = [s for s in result["plans"]["forced"] if s["name"] == "prefill_chunk_metadata"]
    assert keys(production) <= keys(forced["launches"])


@pytest.mark.parametrize("release", RELEASES)
def test_chunk_upstream_coexistence(release):
    result = scenario(release)
    default, forced = steps(result, "default"), steps(result, "forced")
    assert len(forced["prefill_chunk_metadata"]["labels"]) == 14
    assert "prefill_chunk_metadata[upstream]" not in forced
    run = default.get("prefill_chunk_metadata")
    labels = set(run["labels"]) if run else set()
    upstream = default.get("prefill_chunk_metadata[upstream]")
    if v(release) < (0, 25):
        assert len(labels) == 14 and upstream is None
        return
    if v(release) < (0, 27):  # sparse_mla_triton_warmup_if_needed: qs_start {0,1} x qs_stop {16,15}
        gaps = {c for c in labels}
        assert gaps == {f"qs_start={s}({int_class(s)}) qs_stop={e}({int_class(e)}) seq_lens={a}"
                        for s, e in ((0, 1), (5, 16), (5, 7)) for a in ("aligned", "misaligned")}
        assert upstream["skip"].startswith("covered by upstream sparse_mla_triton_warmup_if_needed")
        assert "8 of 14" in upstream["skip"]
    elif v(release) < (0, 30):  # sparse_mla_triton_warmup: qs_start {0,1} x qs_stop {1,15,16}
        assert labels == {f"qs_start=5(other) qs_stop={e}({int_class(e)}) seq_lens={a}"
                          for e in (16, 7) for a in ("aligned", "misaligned")}
        assert upstream["skip"].startswith("covered by upstream sparse_mla_triton_warmup (10 of 14")
    else:  # the JIT warmup registry covers all nine classes
        assert run is None
        assert upstream["skip"] == "covered by upstream JIT warmup registry (all 14 key classes)"
    if result["upstream_chunk_launches"] is not None:
        # upstream's own warmup, recorded: together with ours it has every key, and we repeat none
        theirs, ours = keys(result["upstream_chunk_launches"]), keys(run["launches"])
        assert not theirs & ours
        assert keys(forced["prefill_chunk_metadata"]["launches"]) <= theirs | ours
    if "dcp2" in result["plans"]:  # upstream warms the default DCP ints only
        dcp2 = steps(result, "dcp2")
        if v(release) < (0, 30):
            assert len(dcp2["prefill_chunk_metadata"]["labels"]) == 14
            assert "prefill_chunk_metadata[upstream]" not in dcp2


@pytest.mark.parametrize("release", RELEASES)
def test_convert_variants_per_release(release):
    result = scenario(release)
    counts = v(release) >= (0, 24)  # return_valid_counts=True since the BF16 kernel takes topk_length
    assert result["convert_variants"] == [["prefill-workspace", True, counts], ["decode", False, counts]]
    label = f"HAS_PREFILL=True COUNT_VALID={counts} BLOCK_SIZE=64 topk=256 max_num_blocks_per_req=128"
    expect = {  # plan -> (labels of the run step, skipped step -> reason fragment)
        "default": (["prefill-workspace"], {"convert_req_index[captured]": "FULL CUDA-graph capture: decode"}),
        "eager": (["prefill-workspace", "decode"], {}),
        "piecewise": (["prefill-workspace", "decode"], {}),
        "bf16": (None, {"convert_req_index[captured]": "FULL CUDA-graph capture: bf16"}),
        "bf16_eager": (["bf16"], {}),
        "fp8_mixed": (None, {"convert_req_index[captured]": "FULL CUDA-graph capture: fp8-mixed-batch"}),
        "fp8_mixed_eager": (["fp8-mixed-batch"], {}),
        "other_sparse": (None, {"convert_req_index": "no FLASHMLA_SPARSE group (main MLA backend: FLASHINFER_MLA_SPARSE)"}),
    }
    if v(release) >= (0, 30):  # only the FP8 prefill-workspace call shape is modelled there
        for plan in ("default", "eager", "piecewise"):
            expect[plan] = (["prefill-workspace"], {"convert_req_index[unmodelled]": "decode"})
        for plan in ("bf16", "bf16_eager"):
            expect[plan] = (None, {"convert_req_index[unmodelled]": "bf16"})
        for plan in ("fp8_mixed", "fp8_mixed_eager"):
            expect[plan] = (None, {"convert_req_index[unmodelled]": "fp8-mixed-batch"})
    for plan, (labels, skipped) in expect.items():
        got = {n: s for n, s in steps(result, plan).items() if s["kernel"] == "_convert_req_index_to_global_index_kernel"}
        run = got.get("convert_req_index") if labels is not None else None
        assert [l.split(":")[0] for l in run["labels"]] == labels if run else labels is None, plan
        for name, fragment in skipped.items():
            assert fragment in (got[name]["skip"] or ""), (plan, got[name])
    assert steps(result, "default")["convert_req_index"]["labels"] == [f"prefill-workspace: {label}"]


@pytest.mark.parametrize("release", RELEASES)
def test_convert_launch_is_production_shaped(release):
    result = scenario(release)
    for entry in result["convert"]:
        rows, counts = expected_convert(entry, 64)
        assert entry["out"] == rows, entry["label"]
        if entry["variant"][2]:
            assert entry["counts"] == counts
        (launch,) = entry["launches"]
        spec = launch["spec"]
        assert launch["ptrs"]["block_table_ptr"] == result["table_ptrs"][0]  # group 0's real table
        assert spec["HAS_PREFILL"] == ["constexpr", str(entry["variant"][1])]
        assert spec["COUNT_VALID"] == ["constexpr", str(entry["variant"][2])]
        assert spec["BLOCK_SIZE"] == ["constexpr", "64"]
        if "max_num_blocks_per_req" in spec and spec["max_num_blocks_per_req"][0] == "constexpr":
            assert spec["max_num_blocks_per_req"] == ["constexpr", str(TABLE_WIDTH)]
    if "production_convert_launches" in result:
        # FlashMLASparse's FP8 prefill call compiles the key the warmup compiled
        (prefill,) = [e for e in result["convert"] if e["variant"][1]]
        assert keys(result["production_convert_launches"]) == keys(prefill["launches"])
