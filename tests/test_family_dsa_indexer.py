"""The dsa_indexer family against the real vLLM, on CPU.

Each release (0.20.0, 0.22.0, 0.24.0, 0.26.0, 0.28.0, 0.33.0 and 0.34.0) runs once, in a fresh
interpreter under ``TRITON_INTERPRET=1`` (``cpu_triton_env()``): the family plans and runs
its steps against vLLM's real Triton kernels with CPU tensors shaped like the tiny
DeepSeek-V3.2 (bench/models/tiny-deepseek-v32: index_topk 256, 64 heads,
max_position_embeddings 8192; KV block size 64, the only one FLASHMLA_SPARSE and the V3.2
indexer support, checked below). Every interpreted launch is recorded with the key Triton
would compile for it on a GPU (``native_specialize_impl`` per argument: pointer dtype and
16-byte alignment, the 1 / multiple-of-16 / other class of ints, constexpr values, launch
options), so the tests compare real specialization keys, not our labels.

Real vLLM objects: the attention backends, ``AttentionGroup``, the runner's block tables with
their real width (0.20-0.33: the V1 runner's ``MultiGroupBlockTable``; 0.34, which removed the V1
runner: Model Runner V2's ``BlockTables``, its rows gathered into ``input_block_tables`` by its own
kernels), the entry functions and their kernels, production's prefill chunking
(``split_indexer_prefill_chunks``; the builder's static ``_split_indexer_prefill_chunks`` on
0.33+), upstream's own warmups and (0.33+) ``JitWarmupRegistry``.
Stand-ins, because they cannot exist without a GPU: the metadata builders (their
constructors read the device's SM count and allocate CUDA buffers; the stand-ins carry the
attributes the family reads), the runner and worker (namespaces holding the real block table
and attention groups), the vLLM config (the fields upstream's ``get_warmup_keys`` reads) and
the FLASHMLA_SPARSE layer (it lends ``impl.topk_indices_buffer`` and a ``kv_cache`` of the
fp8_ds_mla shape).

0.33.0's vLLM does not import whole on this venv (``humming``), but the modules the family
touches do, so beyond resolving and binding its symbols the family's plan and steps run there
too. On 0.34 the indexer on ShardQ (``use_shardq``) passes the token positions: those cases run
beside the others.
"""
from __future__ import annotations

import itertools
import pytest

from conftest import MATRIX, REPO, PerRelease, cpu_triton_env, marked_json, run_scenario
from conftest import plan_steps as steps
from conftest import release_version as v

CONFIG = str(REPO / "bench" / "models" / "tiny-deepseek-v32" / "config.json")
MARK = "KWARM-DSA-RESULT "
RELEASES = (*MATRIX, "0.33.0", "0.34.0")
TABLE_WIDTH = 128  # cdiv(8192, 64): the real block-table width of both KV-cache groups
# Rows committed to the runner's block table: group 0 (FLASHMLA_SPARSE), group 1 (indexer).
TABLE_ROWS = {0: [[10, 11], [12, 13]], 1: [[20, 21], [22, 23]]}

SCENARIOS = PerRelease(lambda release: _scenario(release))
_prefetch = SCENARIOS.autouse_fixture()


scenario = SCENARIOS.result  # the results for one release (one subprocess per release per session)


def _scenario(release: str) -> tuple[bool, object]:
    """tests/scenarios/dsa_indexer.py in a fresh interpreter: one MARK line of JSON."""
    proc = run_scenario("dsa_indexer", CONFIG, TABLE_ROWS, env=cpu_triton_env(), release=release, timeout=240)
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
SLICES = ((0, 1), (0, 16), (0, 15), (1, 16), (1, 15), (5, 16), (5, 7))
ALL_CASES = [[s, e, a] for a in (True, False) for s, e in SLICES]
SHARDQ_CASES = [[s, e, a, p] for p in (True, False) for a in (True, False) for s, e in SLICES]


def shardq_release(release: str) -> bool:
    return v(release) >= (0, 34)  # build_prefill_chunk_metadata takes positions (ShardQ)


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
    """Every planned step either ran, with labels and the launches its run made, or was skipped with a
    reason (issue 59: ``error is None`` alone passed a step that silently did nothing)."""
    plans = scenario(release)["plans"]
    assert plans
    for plan, planned in plans.items():
        assert planned, plan
        for step in planned:
            assert step["error"] is None, (plan, step)
            if step["skip"] is None:
                assert step["labels"] and step["launches"], (plan, step)
            else:
                assert isinstance(step["skip"], str) and step["skip"].strip(), (plan, step)


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
    assert {s["skip"].split(" (")[0] for s in broken if s not in triton} == {
        "not a CUDA platform", "no DeepseekV32Attention layer"}  # fused_q: tests/test_family_dsa_fused_q.py


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
    if shardq_release(release):  # with positions: the same metadata (they are the tokens' own)
        assert [c["case"] for c in scenario(release)["shardq_cases"]] == SHARDQ_CASES
        cases = cases + scenario(release)["shardq_cases"]
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
    assert result["production"]["sub_chunks"] == [[4, 5, 0, 8], [4, 5, 8, 16], [4, 5, 16, 20]]
    assert result["production"]["two_chunks"] == [[2, 3, 0, 6], [3, 4, 0, 6], [3, 4, 6, 7]]
    if v(release) >= (0, 34):  # the fused MQA+top-k kernel's chunks: one of 16384 rows at most
        assert result["production"]["fused_topk"] == [[1, 2, 0, 40]]
    production = result["production_chunk_launches"]
    specs = [launch["spec"] for launch in production]
    # the oracle really reaches the hard classes
    assert ["*i32", ""] in [s["uncompressed_seq_lens_ptr"] for s in specs]
    assert SPEC_OF_CLASS["one"] in [s["query_slice_stop"] for s in specs]
    assert [SPEC_OF_CLASS["other"], SPEC_OF_CLASS["div16"]] in [[s["query_slice_start"], s["query_slice_stop"]]
                                                              for s in specs]
    (forced,) = [s for s in result["plans"]["forced"] if s["name"] == "prefill_chunk_metadata"]
    assert keys(production) <= keys(forced["launches"])
    if not shardq_release(release):
        assert "production_shardq" not in result
        return
    # ShardQ (0.34): build's positions, chunk by chunk, reach every alignment of positions and
    # seq_lens, each a key the forced ShardQ warmup compiled
    shardq = result["production_shardq_launches"]
    assert {(s["spec"]["positions_ptr"][1], s["spec"]["uncompressed_seq_lens_ptr"][1]) for s in shardq} == {
        ("D", "D"), ("D", ""), ("", "D"), ("", "")}
    (forced,) = [s for s in result["plans"]["shardq_forced"] if s["name"] == "prefill_chunk_metadata"]
    assert keys(shardq) <= keys(forced["launches"])
    assert not keys(shardq) & keys(production)  # positions are their own keys


@pytest.mark.parametrize("release", RELEASES)
def test_shardq_positions_are_distinct_real_keys(release):
    """0.34: an indexer on ShardQ adds each key class with its positions at an aligned and a
    misaligned address; older releases take no positions, so the builder's flag changes nothing."""
    result = scenario(release)
    assert result["shardq"] == shardq_release(release)
    forced = steps(result, "shardq_forced")["prefill_chunk_metadata"]
    if not shardq_release(release):
        assert len(forced["labels"]) == 14 and not any("positions" in label for label in forced["labels"])
        return
    assert len(forced["labels"]) == 42 and len(keys(forced["launches"])) == 42
    for case in result["shardq_cases"]:
        (launch,) = case["launches"]
        positions = case["case"][3]
        assert case["label"].endswith(f"positions={'aligned' if positions else 'misaligned'}")
        assert launch["spec"]["positions_ptr"] == ["*i32", "D" if positions else ""]
        assert launch["spec"]["uncompressed_seq_lens_ptr"] == ["*i32", "D" if case["case"][2] else ""]
        assert case["positions"] == [s - q + j for q, s in zip(case["query_lens"], case["seq_lens"])
                                     for j in range(q)]  # each token's position in its request
    plain = keys(c["launches"][0] for c in result["chunk_cases"])
    assert not plain & keys(c["launches"][0] for c in result["shardq_cases"])


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
    shardq = steps(result, "shardq")
    if shardq_release(release):  # 0.34's registry: positions at an aligned address (sparse_mla_shard_q)
        assert shardq["prefill_chunk_metadata"]["labels"] == [
            f"qs_start={s}({int_class(s)}) qs_stop={e}({int_class(e)}) seq_lens={a} positions=misaligned"
            for a in ("aligned", "misaligned") for s, e in SLICES]
        assert shardq["prefill_chunk_metadata[upstream]"]["skip"] == (
            "covered by upstream JIT warmup registry (28 of 42 key classes: query slices "
            + " ".join(f"[{s}:{e})" for s, e in SLICES) + " x seq_lens aligned+misaligned; positions aligned: "
            "query slices " + " ".join(f"[{s}:{e})" for s, e in SLICES) + " x seq_lens aligned+misaligned)")
    else:  # no positions before 0.34: what the default plan does
        assert {n: (s["skip"], s["labels"]) for n, s in shardq.items() if n.startswith("prefill_chunk")} == {
            n: (s["skip"], s["labels"]) for n, s in default.items() if n.startswith("prefill_chunk")}
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


@pytest.mark.parametrize("release", RELEASES)
def test_triton_kernels_name_what_the_steps_compile(release):
    """Every kernel a step launches is in TRITON_KERNELS, under the qualname Triton reports
    (bench/table.py attributes request-time compiles by it): 0.33+ names JIT-kernel classes'."""
    from kwarm_ext.kernels.dsa_indexer import TRITON_KERNELS
    launched = {launch["qualname"] for plan in ("forced", "shardq_forced") for step in scenario(release)["plans"][plan]
                if step["kernel"] in ("_build_prefill_chunk_metadata_kernel", "_convert_req_index_to_global_index_kernel")
                for launch in step["launches"]}
    assert len(launched) == 2
    assert {".".join(name.split(".")[-2:]) for name in launched} <= set(TRITON_KERNELS)


def test_importing_vllm_0_33_leaves_no_build_running():
    """vLLM 0.33 imports humming-kernels, whose import starts a background build of its CUDA
    launcher in a child process; the tests' environment turns it off (conftest.clean_env), so a
    test run leaves no process behind. Child processes of the importer are read from /proc."""
    from conftest import result_of, run_py
    got = result_of(run_py(r"""
import json, os
import humming.ops.utils  # what vLLM 0.33's kernel modules import
me = str(os.getpid())
children = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    if stat.rsplit(")", 1)[1].split()[1] == me:
        children.append(open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:200])
print("RESULT " + json.dumps({"children": children, "flag": os.environ.get("HUMMING_DISABLE_PARALLEL_BUILD")}))
""", release="0.33.0", env=cpu_triton_env()))
    assert got == {"children": [], "flag": "1"}
