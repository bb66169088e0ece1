"""Scenario of tests/test_family_dsa_indexer.py, run once per release in a fresh interpreter
(``run_scenario``) under Triton's interpreter on CPU.

Arguments (JSON): the path of the tiny DeepSeek-V3.2's config.json, and the rows to commit to
the runner's block table per KV-cache group (group 0: FLASHMLA_SPARSE, group 1: the indexer).
Every interpreted launch is recorded with the key Triton would compile for it on a GPU; the
family's symbols, plans and steps, its chunk and convert cases, production's calls and
upstream's own warmup are run against the real vLLM (see the test module's docstring for what
stands in). Prints one ``KWARM-DSA-RESULT`` line of JSON.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import sys
import types

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import vllm
import vllm.v1.utils as v1_utils
from kwarm_ext import vllm_compat
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import attention_groups
from kwarm_ext.kernels import dsa_indexer as fam
from kwarm_ext.kernels.dsa_indexer import chunk_metadata, common, index_conversion
from vllm.v1.attention.backends.mla import indexer as vllm_indexer
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.worker.utils import AttentionGroup

NS = types.SimpleNamespace
VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
if VERSION < (0, 34):  # the V1 runner's block table (0.34 removed the V1 runner)
    from vllm.v1.worker.block_table import MultiGroupBlockTable
BLOCK, TOKENS, SEQS = 64, 8192, 16
LAUNCHES = []  # every interpreted launch since the last take()
TABLES = []  # (KV-cache group, rows) of every block table a step asked for
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
            "ptrs": ptrs, "qualname": fnobj.fn.__qualname__}


def recording_run(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append(dict(spec_of(self, args, kwargs), warmup=bool(warmup)))
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


def take(kind):
    out = [launch for launch in LAUNCHES if launch["kind"] == kind]
    LAUNCHES.clear()
    return out


def jsonable(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


def make_engine(config_path, table_rows):
    """The model config, the vLLM config's fields the family and upstream read, and the runner's
    real two-group block table with `table_rows` committed."""
    hf = NS(**json.load(open(config_path)))
    max_model_len = hf.max_position_embeddings
    vllm_config = NS(
        scheduler_config=NS(max_num_batched_tokens=TOKENS, max_num_seqs=SEQS),
        model_config=NS(hf_config=hf, hf_text_config=hf, max_model_len=max_model_len),
        parallel_config=NS(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                           prefill_context_parallel_size=1),
        kernel_config=NS(enable_jit_warmup=True), cache_config=NS(block_size=BLOCK),
        attention_config=NS(hisparse_config=None, sparse_mla_shard_q=True))  # 0.34: ShardQ on by default
    rows = list(zip(*table_rows.values()))  # per request: its block ids in each group
    if VERSION >= (0, 34):
        tables = v2_block_tables(max_model_len, rows)
        return NS(hf=hf, max_model_len=max_model_len, vllm_config=vllm_config, tables=tables,
                  runner={"block_tables": tables}, rows=lambda g, n: tables.input_block_tables[g][:n])
    table_kwargs = dict(max_num_reqs=SEQS, max_model_len=max_model_len, max_num_batched_tokens=TOKENS,
                        pin_memory=False, device=torch.device("cpu"), block_sizes=[BLOCK, BLOCK],
                        kernel_block_sizes=[BLOCK, BLOCK], max_num_blocks=[-(-max_model_len // BLOCK)] * 2)
    accepted = inspect.signature(MultiGroupBlockTable).parameters
    tables = MultiGroupBlockTable(**{k: v for k, v in table_kwargs.items() if k in accepted})
    if getattr(v1_utils, "PIN_MEMORY", False):  # 0.33 pins per copy when a GPU is expected
        v1_utils.PIN_MEMORY = False
    for row, ids in enumerate(rows):
        tables.add_row(tuple(ids), row)
    tables.commit_block_table(len(rows))
    return NS(hf=hf, max_model_len=max_model_len, vllm_config=vllm_config, tables=tables,
              runner={"input_batch": NS(block_table=tables)}, rows=lambda g, n: tables[g].get_device_tensor(n))


def v2_block_tables(max_model_len, rows):
    """0.34+: Model Runner V2's ``BlockTables`` of both groups, as wide as the V2 runner makes
    each group's rows, and `rows` committed the way a step commits them: staged, applied and
    gathered into ``input_block_tables`` (what the attention metadata's block tables slice).
    Without a driver there is neither pinned memory nor UVA: its staging buffers take their
    non-UVA form (what vLLM uses where UVA is off), on the "cpu" device type while building."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import get_block_table_width
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.block_table import BlockTables

    current_platform.is_pin_memory_available = lambda: False
    buffer_utils.is_pin_memory_available = buffer_utils.is_uva_available = lambda: False
    saved, current_platform.device_type = current_platform.device_type, "cpu"
    try:
        width = get_block_table_width(-(-max_model_len // BLOCK), BLOCK)  # 128-token aligned rows
        tables = BlockTables(block_sizes=[BLOCK, BLOCK], max_num_reqs=SEQS, max_num_batched_tokens=TOKENS,
                             max_num_blocks_per_group=[width, width], device=torch.device("cpu"))
        for row, ids in enumerate(rows):
            tables.append_block_ids(row, tuple(ids), overwrite=True)
        tables.apply_staged_writes()
        tables.gather_block_tables(torch.arange(len(rows), dtype=torch.int32), num_reqs_padded=len(rows))
    finally:
        current_platform.device_type = saved
    return tables


def make_registry(engine):
    """0.30+: the runner's JIT warmup registry, holding what MLAAttention.__init__ registers
    for a DSA layer when enable_jit_warmup is on."""
    if VERSION < (0, 30):
        return None
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    registry = JitWarmupRegistry(engine.vllm_config)
    with registry.activate():
        vllm_indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL.register_warmup()
    return registry


def stand_in_backend(name):
    return type(name, (), {"get_name": staticmethod(lambda: name)})


def make_view(engine, *, fp8=True, heads=64, eager=False, mode="FULL_AND_PIECEWISE", dcp=(0, 1, 1),
              shardq=False, backends=("FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER")):
    hf = engine.hf
    spec = NS(block_size=BLOCK)
    mla_builder = NS(use_fp8_kv_cache=fp8, num_heads=heads, topk_tokens=hf.index_topk, kv_cache_spec=spec)
    if VERSION >= (0, 30):  # decided once in the builder's __init__ there
        mla_builder.fp8_use_mixed_batch = heads < 32
    idx_builder = NS(compress_ratio=1, dcp_rank=dcp[0], dcp_world_size=dcp[1],
                     cp_kv_cache_interleave_size=dcp[2], compressed_cp_interleave_size=dcp[2])
    if shardq:  # 0.34's builder: whether a layer of its group reads the top-k token-sharded
        idx_builder.use_shardq = True
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
    runner = NS(attn_groups=groups, device=torch.device("cpu"), vllm_config=engine.vllm_config,
                is_pooling_model=False, **engine.runner)
    registry = make_registry(engine)
    if registry is not None:
        runner.jit_warmup_registry = registry
    layer = NS(impl=NS(topk_indices_buffer=torch.empty(4, hf.index_topk, dtype=torch.int32)),
               kv_cache=torch.zeros(4, BLOCK, 656, dtype=torch.uint8))  # fp8_ds_mla layout
    return EngineView(vllm_version=vllm.__version__, runner_kind="V2" if VERSION >= (0, 34) else "V1", model_type=hf.model_type,
                      backends=[[b] for b in backends], device="cpu", max_num_batched_tokens=TOKENS,
                      max_num_reqs=SEQS, enforce_eager=eager, cudagraph_mode="NONE" if eager else mode,
                      is_pooling_model=False, worker=NS(vllm_config=engine.vllm_config, model_runner=runner),
                      runner=runner, forward_context={name: layer})


def record_block_tables():
    """Record the block tables the parts that read them ask for (in TABLES); returns the real
    block_table function."""
    real = attention_groups.block_table

    def recording_block_table(view, group_id, num_reqs):
        TABLES.append([group_id, num_reqs])
        return real(view, group_id, num_reqs)

    chunk_metadata.block_table = index_conversion.block_table = recording_block_table
    return real


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


class BrokenRunner:
    @property
    def attn_groups(self):
        raise RuntimeError("attn_groups broke")


def plans(engine, args, out):
    """Applicability, and the family's plan and steps on each engine shape."""
    out["applies"] = {
        "dsa": fam.applies(make_view(engine)),
        "indexer_other_mla": fam.applies(make_view(engine, backends=("FLASHINFER_MLA_SPARSE", "DEEPSEEK_V32_INDEXER"))),
        "dense": fam.applies(EngineView(backends=[["FLASH_ATTN"]])),
        "mla_dense": fam.applies(EngineView(backends=[["FLASHMLA"]])),
        "qwen_gdn": fam.applies(EngineView(backends=[["FLASH_ATTN"], ["GDN_ATTN"]])),
        "pooling": fam.applies(EngineView(backends=[["FLASH_ATTN"]], is_pooling_model=True)),
        "none": fam.applies(EngineView()),
    }
    out["plans"] = {
        "default": planned(make_view(engine), False),
        "forced": planned(make_view(engine), True),
        "eager": planned(make_view(engine, eager=True), False),
        "piecewise": planned(make_view(engine, mode="PIECEWISE"), False),
        "bf16": planned(make_view(engine, fp8=False), False),
        "bf16_eager": planned(make_view(engine, fp8=False, eager=True), False),
        "fp8_mixed": planned(make_view(engine, heads=16), False),
        "fp8_mixed_eager": planned(make_view(engine, heads=16, eager=True), False),
        "other_sparse": planned(make_view(engine, backends=("FLASHINFER_MLA_SPARSE", "DEEPSEEK_V32_INDEXER")),
                                False),
    }
    # ShardQ's indexer (0.34+: FLASHMLA_SPARSE takes ShardQ with an FP8 cache and under 32 heads a
    # rank; older releases pass no positions, so this is the 16-head plan there)
    out["plans"]["shardq"] = planned(make_view(engine, heads=16, shardq=True), False)
    out["plans"]["shardq_forced"] = planned(make_view(engine, heads=16, shardq=True), True)
    if args.dcp:  # 0.25+: DCP world 2, so production's DCP ints differ from upstream's defaults
        out["plans"]["dcp2"] = planned(make_view(engine, dcp=(1, 2, 1)), False)
    out["broken_runner"] = planned(EngineView(backends=[["DEEPSEEK_V32_INDEXER"]], runner=BrokenRunner()), False)


def chunk_cases(fn, args, block_table, cases_to_run):
    """Every chunk case: its metadata, its launch, its block table."""
    cases = []
    for case in cases_to_run:
        r = fam.run_chunk_case(fn, args, torch.device("cpu"), block_table, case)
        m = r.metadata
        cases.append({
            "case": [case.qs_start, case.qs_stop, case.aligned] + ([] if case.positions is None else [case.positions]),
            "label": r.label, "aligned": r.aligned, "positions": jsonable(r.positions),
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
    return cases


def splitter():
    """Production's chunking of a step's prefills: a module function (0.20-0.28 here), the
    builder's static ``_split_indexer_prefill_chunks`` (0.33+)."""
    return (getattr(vllm_indexer, "split_indexer_prefill_chunks", None)
            or vllm_indexer.DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks)


def production_batch(engine, fn, args, decode_q, prefill_q, prefill_seq, max_logits_bytes, shardq=False,
                     **split_kwargs):
    """DeepseekV32IndexerMetadataBuilder.build's chunking of one real batch, each chunk's call made
    (with `shardq`, 0.34+, as build makes it on ShardQ: with the positions of the gathered tokens,
    here all of them, as on one rank)."""
    decodes = len(decode_q)  # decode rows ahead (query lens above 1: MTP steps)
    q = list(decode_q) + list(prefill_q)
    s = [9] * decodes + list(prefill_seq)
    qsl_cpu = torch.tensor([0, *itertools.accumulate(q)], dtype=torch.int32)
    seq_cpu = torch.tensor(s, dtype=torch.int32)
    qsl = torch.zeros(SEQS + 1, dtype=torch.int32)[: len(q) + 1]  # the runner's int32 buffers
    qsl.copy_(qsl_cpu)
    seq = torch.zeros(SEQS, dtype=torch.int32)[: len(s)]
    seq.copy_(seq_cpu)
    bt = engine.rows(1, len(s))
    extra = {}
    if shardq:  # build's formula: gather index + its request's seq_len - the request's query end
        gathered = torch.arange(sum(q), dtype=torch.int32)
        token_to_req = torch.searchsorted(qsl[1:], gathered, right=True)
        extra["positions"] = gathered + seq[token_to_req] - qsl[token_to_req + 1]
    specs = splitter()(seq_cpu[decodes:], torch.diff(qsl_cpu[decodes:]), engine.max_model_len * 40,
                       max_logits_bytes, request_offset=decodes, **split_kwargs)
    for req_slice, query_slice in specs:
        fn(req_slice.start, req_slice.stop, qsl, qsl_cpu, seq, seq, seq_cpu, bt, 1,
           query_slice=query_slice, skip_kv_gather=query_slice.start > 0, **args.dcp, **extra)
    return [[r.start, r.stop, qs.start, qs.stop] for r, qs in specs]


def upstream_chunk_launches(engine):
    """Upstream's own warmup of the chunk kernel, recorded the same way (None where it has none)."""
    try:
        from vllm.model_executor.warmup import sparse_mla_triton_warmup as up
    except ImportError:
        up = None
    if up is not None and hasattr(up, "_warm_prefill_chunk_metadata_kernel"):  # 0.25-0.26: real launches
        up._warm_prefill_chunk_metadata_kernel(torch.device("cpu"), compress_ratio=1, query_len=8)
        return take("chunk")
    if up is not None and hasattr(vllm_indexer, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL"):  # 0.27-0.29
        vllm_indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL.warmup(engine.vllm_config)  # compile-only launches
        return take("chunk")
    return None


def convert_variants(cfn, cargs, variants, block_table):
    """Each production variant of the index conversion: its output, its launch."""
    convert = []
    for variant in variants:
        r = fam.run_convert_variant(cfn, cargs, torch.device("cpu"), block_table(), variant)
        out, counts = r.output if isinstance(r.output, tuple) else (r.output, None)
        convert.append({"variant": [variant.name, variant.has_prefill, variant.count_valid], "label": r.label,
                        "out": jsonable(out), "counts": jsonable(counts),
                        "inputs": {k: jsonable(v[:, :2] if k == "block_table" else v) for k, v in r.inputs.items()},
                        "launches": take("convert")})
    return convert


def production_convert(engine, cfn):
    """Production's call in FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode
    (0.20-0.29): slices of the builder's req_id_per_token buffer and the layer's
    topk_indices_buffer."""
    n, topk = 4, engine.hf.index_topk
    kw = dict(BLOCK_SIZE=BLOCK, NUM_TOPK_TOKENS=topk, HAS_PREFILL_WORKSPACE=True,
              prefill_workspace_request_ids=torch.full((n,), -1, dtype=torch.int32),
              prefill_workspace_starts=torch.empty(1, dtype=torch.int32))
    if VERSION >= (0, 24):  # the FP8 prefill call passes return_valid_counts=True since 0.24
        kw["return_valid_counts"] = True
    cfn(torch.zeros(TOKENS, dtype=torch.int32)[:n], engine.rows(0, 2),
        torch.zeros(TOKENS, topk, dtype=torch.int32)[:n], **kw)
    return take("convert")


def main(argv: list[str]) -> None:
    config_path, table_rows = (json.loads(a) for a in argv[:2])
    out = {"version": vllm.__version__}
    InterpretedFunction.run = recording_run
    out["kernel_block_sizes"] = [FlashMLASparseBackend.get_supported_kernel_block_sizes(),
                                 DeepseekV32IndexerBackend.get_supported_kernel_block_sizes()]
    engine = make_engine(config_path, table_rows)
    rows = engine.rows
    before = [rows(g, SEQS).clone() for g in (0, 1)]
    out["table_width"] = [rows(g, 1).shape[1] for g in (0, 1)]
    out["table_ptrs"] = [rows(g, 1).data_ptr() for g in (0, 1)]
    block_table = record_block_tables()

    # -- symbols: resolved, and our calls bound to the real signatures ---------------------------
    fn = vllm_compat.resolve(common._INDEXER + ":build_prefill_chunk_metadata")
    cfn = vllm_compat.resolve(common._SPARSE_UTILS + ":triton_convert_req_index_to_global_index")
    view = make_view(engine)
    args = fam.chunk_args(view, fn)
    group = attention_groups.groups_of(view, fam.SPARSE_MLA_BACKEND)[0]
    cargs = fam.convert_args(view, group, cfn)
    runtime, captured = fam.convert_variants(view, group)
    vllm_compat.bind(fn, *([None] * 9), query_slice=slice(0, 1), skip_kv_gather=False, **args.dcp)
    out["chunk_args"] = {"group_id": args.group_id, "compress_ratio": args.compress_ratio, "dcp": args.dcp}
    out["chunk_params"] = list(vllm_compat.params(fn))
    out["convert_args"] = dataclasses.asdict(cargs)
    out["convert_params"] = list(vllm_compat.params(cfn))
    out["convert_variants"] = [[v.name, v.has_prefill, v.count_valid] for v in runtime + captured]

    plans(engine, args, out)
    table_rows = lambda n: block_table(view, args.group_id, n)  # noqa: E731
    out["chunk_cases"] = chunk_cases(fn, args, table_rows, fam.CHUNK_CASES)
    sargs = fam.chunk_args(make_view(engine, heads=16, shardq=True), fn)
    out["shardq"] = sargs.shardq  # 0.34+: the builder's use_shardq makes production pass positions
    if sargs.shardq:
        out["shardq_cases"] = chunk_cases(fn, sargs, table_rows, fam.SHARDQ_CASES)

    batches = {  # name -> (decode query lens, prefill query lens, prefill seq lens, logits bytes)
        "prefill_only": ([], [8, 8], [11, 29], 1 << 30), "decodes_ahead": ([1] * 3, [5, 10], [9, 30], 1 << 30),
        "sub_chunks": ([1] * 4, [20], [1000], 32000), "query_of_one": ([1], [3], [10], 40),
        "sixteen_wide": ([1], [32], [100], 6400), "two_chunks": ([1] * 2, [6, 7], [300, 300], 8000),
        "mtp_decodes": ([2, 1, 1, 1], [5, 10], [9, 30], 1 << 30),
    }
    out["production"] = {name: production_batch(engine, fn, args, *b) for name, b in batches.items()}
    if "fused_mqa_topk_eligible" in vllm_compat.params(splitter()):  # 0.34: rows bounded by the fused kernel
        out["production"]["fused_topk"] = production_batch(engine, fn, args, [1], [40], [100], 6400,
                                                           fused_mqa_topk_eligible=True)
    out["production_chunk_launches"] = take("chunk")
    if sargs.shardq:
        out["production_shardq"] = {name: production_batch(engine, fn, sargs, *b, shardq=True)
                                    for name, b in batches.items()}
        out["production_shardq_launches"] = take("chunk")

    out["upstream_chunk_launches"] = upstream_chunk_launches(engine)
    out["convert"] = convert_variants(cfn, cargs, runtime + captured,
                                      lambda: block_table(view, cargs.group_id, 2))
    if not cargs.strided:
        out["production_convert_launches"] = production_convert(engine, cfn)

    out["tables_untouched"] = all(torch.equal(b, rows(g, SEQS)) for g, b in zip((0, 1), before))
    print("KWARM-DSA-RESULT " + json.dumps(out, default=repr))


if __name__ == "__main__":
    main(sys.argv[1:])
