"""The engine benchmark's CPU-side code: table rendering on a recorded result
(tests/fixtures/bench_result.json: tiny Qwen3-Next, vLLM 0.24.0, kwarm off, cold cache,
the smoke scenario, numbers from shared/reference/gpu-baseline.md), argument parsing,
scenario construction and environment set-up. No GPU, no engine."""
from __future__ import annotations

import copy
import cProfile
import fcntl
import json
import os
import pstats
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
FIXTURE = REPO / "tests" / "fixtures" / "bench_result.json"
sys.path.insert(0, str(BENCH))

import engine_bench  # noqa: E402
import table  # noqa: E402

ROW_OFF = ("| 0.24.0 | off | cold | 127 | — | 3.13 (8), 0.038, 1.15 (3), 0.039, 1.08 (3) | 14 | 82.4 |")


@pytest.fixture
def run():
    (loaded,) = table.load([FIXTURE])
    return loaded


def kwarm_on_run(run: dict) -> dict:
    """The fixture as a warm kwarm-on run: the qwen_gdn and runner compiles are gone."""
    on = copy.deepcopy(run)
    on["kwarm"], on["cache"]["label"] = "on", "warm"
    on["init_s"], on["kwarm_warmup_s"] = 31.2, 8.7
    for r in on["requests"]:
        r["kernels"] = [k for k in r["kernels"] if table.owner(k["name"]) == table.LEARN_AND_REPLAY]
        r["jit"] = len(r["kernels"])
    on["requests"][0]["s"] = 0.29
    report = {"total_s": 8.7, "rank": 0, "pid": 1, "view": {"x": 1}, "families": [
        {"name": "runner", "status": "ran", "reason": None, "seconds": 0.6, "compiled": [{}] * 4,
         "steps": [{"status": "ran"}, {"status": "ran"}]},
        {"name": "qwen_gdn", "status": "ran", "reason": None, "seconds": 8.0, "compiled": [{}] * 9,
         "steps": [{"status": "ran"}] * 5 + [{"status": "skipped"}]},
        {"name": "dsa_indexer", "status": "skipped", "reason": "no DSA indexer layer", "seconds": 0.0,
         "compiled": [], "steps": []},
    ]}
    on["kwarm_report_summary"] = table.summarize_report(report)
    return on


# ----------------------------------------------------------------------------- table

def test_fixture_row_ratio_and_totals(run):
    text = table.render([run])
    assert ROW_OFF in text
    assert "### tiny-qwen3-next (scenario `smoke`)" in text
    assert "Requests: 0 1x200; 1 1x200 (repeat); 2 4x333; 3 4x333 (repeat); 4 1x37." in text
    assert table.total_jit(run) == 14
    assert table.pairs(run) == [(0, 1), (2, 3)]
    assert table.first_steady_ratio(run) == pytest.approx(3.1302 / 0.038)
    assert table.pair_ratio(run, 2) == pytest.approx(1.1498 / 0.0391)
    assert table.pair_ratio(run, 4) is None  # 1x37 has no repeat


def test_first_steady_counters(run):
    assert table.first_steady_counters(run) == {}  # older results have no "host"
    run["requests"][0]["host"] = {"cycles": 300, "instructions": 220, "steal_ms": 0.0}
    run["requests"][1]["host"] = {"cycles": 200, "instructions": 200, "steal_ms": 0.0}
    assert table.first_steady_counters(run) == {"cycles": 1.5, "instructions": 1.1}
    del run["requests"][1]["host"]["cycles"]  # a host without hardware counters
    assert table.first_steady_counters(run) == {"instructions": 1.1}


def test_ratio_and_totals_come_from_the_requests(run):
    run["first_steady_ratio"], run["total_jit"] = 999.0, 999
    run["requests"][1]["s"] = 0.5
    row = table.render_table([run]).splitlines()[-1]
    assert row.endswith("| 14 | 6.26 |")  # 3.1302 / 0.5


def test_ownership_mapping(run):
    assert table.owner("_causal_conv1d_fwd_kernel") == "qwen_gdn"
    assert table.owner("layer_norm_fwd_kernel") == "qwen_gdn"
    assert table.owner("fused_recurrent_gated_delta_rule_packed_decode_kernel") == "qwen_gdn"
    assert table.owner("_zero_kv_blocks_kernel") == "runner"
    assert table.owner("vllm.v1.worker.block_table._compute_slot_mapping_kernel") == "runner"
    assert table.owner("_build_prefill_chunk_metadata_kernel") == "dsa_indexer"
    assert table.owner("_convert_req_index_to_global_index_kernel") == "dsa_indexer"
    assert table.owner("fused_moe_kernel") == "fused_moe"
    assert table.owner("kernel_unified_attention") == "learn-and-replay"
    assert table.owner_counts(run) == {"qwen_gdn": 2, "runner": 4, "fused_moe": 6, "learn-and-replay": 2}

    text = table.render([run])
    assert "14 compiles (fused_moe 6, learn-and-replay 2, qwen_gdn 2, runner 4)" in text
    assert "  - req 0 `_causal_conv1d_fwd_kernel` → qwen_gdn: key `((('*bf16', 'D')" in text
    assert "  - req 4 `_zero_kv_blocks_kernel` → runner: key `" in text
    assert text.count("`fused_moe_kernel` → fused_moe") == 6
    short = table.render([run], keys=False)
    assert "key `" not in short
    assert "  - req 0 `_compute_slot_mapping_kernel` ×2 → runner" in short
    assert "  - req 2 `kernel_unified_attention` → learn-and-replay" in short


def test_several_runs_one_table(run, tmp_path, capsys):
    on = kwarm_on_run(run)
    (tmp_path / "on.json").write_text(json.dumps(on))
    (tmp_path / "off.json").write_text(FIXTURE.read_text())
    (tmp_path / "x.kwarm-report.json").write_text(json.dumps({"total_s": 1.0, "families": []}))
    assert table.main([str(tmp_path / "on.json"), str(tmp_path / "off.json"),
                       str(tmp_path / "x.kwarm-report.json")]) == 0
    out = capsys.readouterr()
    assert "not an engine_bench result" in out.err
    rows = [line for line in out.out.splitlines() if line.startswith("| 0.24.0")]
    assert rows[0] == ROW_OFF  # off before on
    assert rows[1] == "| 0.24.0 | on | warm | 31 | 8.70 | 0.290 (1), 0.038, 1.15 (1), 0.039, 1.08 | 2 | 7.63 |"
    assert out.out.count("### tiny-qwen3-next") == 1
    assert ("warmup 8.70 s: runner ran 0.600 s, 2/2 steps, 4 compiled; qwen_gdn ran 8.00 s, 5/6 steps, "
            "9 compiled; dsa_indexer skipped (no DSA indexer layer)") in out.out
    assert "kwarm on · warm Triton cache**: 2 compiles (learn-and-replay 2)" in out.out


def test_kwarm_on_without_report_is_flagged(run):
    on = kwarm_on_run(run)
    on["kwarm_report_summary"], on["kwarm_warmup_s"] = None, None
    text = table.render([on])
    assert "no kwarm report (the warmup hook did not run?)" in text
    assert "| 0.24.0 | on | warm | 31 | — |" in text


def test_cut_short_run(run):
    run["complete"] = False
    del run["requests"][2:]
    row = table.render_table([run]).splitlines()[-1]
    assert row == "| 0.24.0 | off | cold | 127 | — | 3.13 (8), 0.038, cut short | 8 | 82.4 |"
    run["requests"].clear()
    assert "| — | cut short | 0 | — |" in table.render([run])


def test_summarize_report_counts_steps():
    summary = table.summarize_report({"total_s": 2.5, "rank": 0, "families": [
        {"name": "runner", "status": "ran", "seconds": 1.0, "compiled": [{}, {}],
         "steps": [{"status": "ran"}, {"status": "failed"}, {"status": "skipped"}]}]})
    assert summary["total_s"] == 2.5 and summary["compiled"] == 2
    assert summary["families"][0] == {"name": "runner", "status": "ran", "reason": None, "seconds": 1.0,
                                      "steps": 3, "steps_ran": 1, "steps_skipped": 1, "steps_failed": 1,
                                      "compiled": 2}
    assert table.summarize_report(None) is None

    report = {"families": [], "after_capture": {"families": [
        {"name": "caching_allocator", "status": "ran", "seconds": 0.01, "steps": [{"status": "ran"}]}]}}
    assert [f["name"] for f in table.summarize_report(report)["families"]] == ["caching_allocator (after capture)"]


def test_fmt_s_like_the_baseline():
    assert [table.fmt_s(x) for x in (127.04, 26.2, 3.1302, 0.4141, 0.038)] == ["127", "26", "3.13", "0.414", "0.038"]
    assert table.fmt_s(None) == "—"


# ---------------------------------------------------------------------- engine_bench

def test_allocator_counts_need_cuda_and_subtract_per_counter():
    assert engine_bench.allocator_counts() is None  # CUDA_VISIBLE_DEVICES="": no CUDA here
    before = {"num_device_alloc": 40, "num_host_alloc": 3}
    after = {"num_device_alloc": 46, "num_host_alloc": 3, "num_device_free": 1}
    assert engine_bench.counts_since(before, after) == {"num_device_alloc": 6, "num_host_alloc": 0,
                                                          "num_device_free": 1}
    assert engine_bench.counts_since(None, after) is None


def test_host_counters_count_this_threads_page_faults():
    host = engine_bench.HostCounters()
    try:
        assert bool(host.fds) != bool(host.perf_error)  # counters, or the reason there are none
        snap = host.snapshot()
        block = bytearray(64 << 20)  # touching 64 MiB of new pages faults them in
        delta = host.since(snap)
    finally:
        host.close()
    assert len(block) and delta["minflt"] >= 1000
    assert delta["steal_ms"] is None or delta["steal_ms"] >= 0
    assert all(delta[name] > 0 for name in host.PERF_EVENTS if name in delta)

def test_import_needs_no_vllm_torch_triton():
    code = ("import sys; sys.path.insert(0, %r); import engine_bench, table; "
            "print(sorted(m for m in ('vllm', 'torch', 'triton') if m in sys.modules))" % str(BENCH))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help():
    out = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--kwarm", "--scenario", "--triton-cache", "--cudagraph", "--gdn-prefill-backend",
                 "--attention-backend", "--enforce-eager", "--max-num-seqs", "--out", "--profile",
                 "--sync-lock"):
        assert flag in out.stdout


def _kwargs(argv):
    args = engine_bench.parse_args(argv)
    path = engine_bench.resolve_model(args.model)
    return args, engine_bench.engine_kwargs(args, path, json.loads((path / "config.json").read_text()))


def test_defaults_and_qwen_engine_kwargs():
    args, kw = _kwargs(["tiny-qwen3-next"])
    assert (args.kwarm, args.scenario, args.triton_cache, args.cudagraph) == ("on", "default", "fresh", "on")
    assert kw["model"] == str(BENCH / "models" / "tiny-qwen3-next")
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert (kw["max_num_seqs"], kw["gpu_memory_utilization"], kw["max_model_len"]) == (16, 0.25, 4096)
    assert kw["additional_config"] == {"gdn_prefill_backend": "triton"}  # a GDN model
    assert "compilation_config" not in kw and "attention_backend" not in kw
    assert "kv_cache_memory_bytes" not in kw


def test_engine_kwargs_options():
    _, kw = _kwargs([str(BENCH / "models" / "tiny-qwen3-next"), "--cudagraph", "off", "--enforce-eager",
                     "--attention-backend", "TRITON_ATTN", "--kv-cache-memory-bytes", "4G",
                     "--gdn-prefill-backend", "default", "--max-num-seqs", "8"])
    assert kw["compilation_config"] == {"cudagraph_mode": "NONE"}
    assert kw["enforce_eager"] is True and kw["attention_backend"] == "TRITON_ATTN"
    assert kw["kv_cache_memory_bytes"] == 4 * 2**30 and kw["max_num_seqs"] == 8
    assert "additional_config" not in kw
    _, kw = _kwargs(["tiny-deepseek-v32", "--kwarm", "off"])
    assert "additional_config" not in kw  # not a GDN model


def test_bad_model_folder(tmp_path):
    with pytest.raises(SystemExit):
        engine_bench.resolve_model(str(tmp_path))


def test_parse_bytes():
    assert engine_bench.parse_bytes("4G") == 4 * 2**30
    assert engine_bench.parse_bytes("512MiB") == 512 * 2**20
    assert engine_bench.parse_bytes("1.5g") == int(1.5 * 2**30)
    assert engine_bench.parse_bytes("1000") == 1000
    assert engine_bench.parse_bytes(None) is None


def test_parse_indices():
    assert engine_bench.parse_indices("3,0, 3") == [0, 3]
    assert engine_bench.parse_indices("") == [] and engine_bench.parse_indices(None) == []
    args = engine_bench.parse_args(["tiny-qwen3-next", "--profile", "1,10", "--sync-lock", "/tmp/x.lock"])
    assert args.profile == [1, 10] and args.sync_lock == "/tmp/x.lock"
    args = engine_bench.parse_args(["tiny-qwen3-next"])
    assert args.profile == [] and args.sync_lock is None
    for bad in ("a", "1,-2"):
        with pytest.raises(SystemExit):
            engine_bench.parse_args(["tiny-qwen3-next", "--profile", bad])


def test_smoke_scenario_is_gpu_baseline():
    scenario = engine_bench.build_scenario("smoke")
    assert [(r.batch, r.length, r.max_tokens, r.repeat_of) for r in scenario] == [
        (1, 200, 16, None), (1, 200, 16, 0), (4, 333, 16, None), (4, 333, 16, 2), (1, 37, 16, None)]
    # the very prompts of shared/gpu-kit/smoke.py
    for r in scenario:
        want = [{"prompt_token_ids": [(7 * j + 3 * k) % 4000 + 10 for k in range(r.length)]} for j in range(r.batch)]
        assert engine_bench.prompt_ids(r.batch, r.length, r.seed) == want


def test_default_scenario():
    scenario = engine_bench.build_scenario("default")
    assert len(scenario) == 12
    pairs = [(r.repeat_of, i) for i, r in enumerate(scenario) if r.repeat_of is not None]
    assert pairs == [(0, 1), (5, 6), (7, 8), (10, 11)]
    for first, rep in pairs:
        a, b = scenario[first], scenario[rep]
        assert (a.batch, a.length, a.max_tokens, a.mixed) == (b.batch, b.length, b.max_tokens, b.mixed)
        assert engine_bench.prompt_ids(a.batch, a.length, a.seed) != engine_bench.prompt_ids(b.batch, b.length, b.seed)
    singles = [r.length for r in scenario if r.batch == 1]
    assert {1, 16, 37, 200} <= set(singles)
    assert {(r.batch, r.max_tokens) for r in scenario if r.label.startswith("decode")} == {(8, 64), (3, 64)}
    mixed = [r for r in scenario if r.mixed]
    assert len(mixed) == 2 and mixed[0].mixed == (2, 300) and mixed[0].max_tokens > 16
    assert all(r.max_tokens == 16 for r in scenario if r.label.startswith("prefill"))
    for r in scenario:  # every token id inside both tiny vocabularies (4096)
        for p in engine_bench.prompt_ids(r.batch, r.length, r.seed):
            assert len(p["prompt_token_ids"]) == r.length
            assert all(10 <= t < 4096 for t in p["prompt_token_ids"])
    with pytest.raises(ValueError):
        engine_bench.build_scenario("nope")


def test_prepare_env_fresh(tmp_path):
    args = engine_bench.parse_args(["tiny-qwen3-next", "--kwarm", "on"])
    env = {"HOME": str(tmp_path), "DG_JIT_CACHE_DIR": "/keep/me"}
    cache = engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    root = cache["fresh_root"]
    assert root.startswith(str(tmp_path))
    assert env["TRITON_CACHE_DIR"] == f"{root}/triton" == cache["triton_dir"]
    assert env["VLLM_CACHE_ROOT"] == f"{root}/vllm" == cache["vllm_cache_root"]
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{root}/inductor"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["KWARM_ENABLE"] == "1" and env["KWARM_REPORT"].endswith(".json")
    assert not Path(env["KWARM_REPORT"]).exists()  # kwarm writes it
    assert env["DG_JIT_CACHE_DIR"] == "/keep/me"
    assert cache["label"] == "cold" and cache["mode"] == "fresh"


def test_prepare_env_keeps_user_settings(tmp_path):
    warm = tmp_path / "triton"
    (warm / "abc").mkdir(parents=True)
    args = engine_bench.parse_args(["tiny-qwen3-next", "--kwarm", "off", "--triton-cache", str(warm)])
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "KWARM_ENABLE": "1"}
    cache = engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    assert env["TRITON_CACHE_DIR"] == str(warm) and env["VLLM_CACHE_ROOT"] == str(tmp_path / "v")
    assert "TORCHINDUCTOR_CACHE_DIR" not in env
    assert env["KWARM_ENABLE"] == "0" and "KWARM_REPORT" not in env
    assert (cache["mode"], cache["label"], cache["triton_entries_at_start"]) == ("dir", "warm", 1)

    args = engine_bench.parse_args(["tiny-qwen3-next", "--triton-cache", "fresh"])
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "KWARM_REPORT": str(tmp_path / "r.json")}
    engine_bench.prepare_env(args, env, tmp_root=str(tmp_path))
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "v") and env["KWARM_REPORT"] == str(tmp_path / "r.json")


def test_deepgemm_entries(tmp_path):
    assert engine_bench.deepgemm_entries(str(tmp_path / "none")) == set()
    (tmp_path / "cache" / "kernel.fp8_mqa_logits.0a1b").mkdir(parents=True)
    (tmp_path / "cache" / "kernel.fp8_mqa_logits.0a1b" / "kernel.cubin").write_bytes(b"")
    (tmp_path / "tmp").mkdir()
    assert engine_bench.deepgemm_entries(str(tmp_path)) == {"cache/kernel.fp8_mqa_logits.0a1b"}


# ------------------------------------------------------------------------- profiling

def test_short_path(tmp_path):
    sp = engine_bench.short_path
    assert sp("/usr/lib/python3/dist-packages/vllm/v1/worker/gpu_model_runner.py") == \
        "vllm/v1/worker/gpu_model_runner.py"
    assert sp("/venv/lib/python3.12/site-packages/torch/site-packages/x.py") == "x.py"  # the last one
    assert sp("/a/b/c/d/e/f.py") == "c/d/e/f.py"  # no package: the last 4 components
    assert sp(str(BENCH / "engine_bench.py")) == "bench/engine_bench.py"  # this tree
    assert sp("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"
    assert sp("<string>") == "<string>"
    # outside site-packages (a PYTHONPATH install, this tree): from the outermost package on
    deep = tmp_path / "stage" / "vllm" / "model_executor" / "layers" / "fla" / "ops"
    deep.mkdir(parents=True)
    for d in (deep, *list(deep.parents)[:4]):
        (d / "__init__.py").write_text("")
    assert sp(str(deep / "chunk.py")) == "vllm/model_executor/layers/fla/ops/chunk.py"
    assert sp(str(tmp_path / "stage" / "vllm" / "__init__.py")) == "vllm/__init__.py"
    assert engine_bench.profile_func((str(deep / "chunk.py"), 12, "chunk_fwd")) == \
        "vllm/model_executor/layers/fla/ops/chunk.py:12(chunk_fwd)"
    assert engine_bench.profile_func(("~", 0, "<built-in method time.sleep>")) == "<built-in method time.sleep>"


def test_profile_rows_order_and_fields():
    f, g, h = ("/a/b/c/d/f.py", 1, "f"), ("/x/g.py", 2, "g"), ("~", 0, "<built-in method builtins.len>")
    stats = {f: (2, 5, 0.123456, 0.9, {}), g: (3, 3, 0.5, 0.6, {}), h: (7, 7, 0.01, 0.01, {})}
    by_tot = engine_bench.profile_rows(stats, "tottime", 30)
    assert [r["func"] for r in by_tot] == ["x/g.py:2(g)", "b/c/d/f.py:1(f)", "<built-in method builtins.len>"]
    assert by_tot[1] == {"func": "b/c/d/f.py:1(f)", "ncalls": 2, "tottime": 0.1235, "cumtime": 0.9}  # primitive calls
    by_cum = engine_bench.profile_rows(stats, "cumtime", 2)
    assert [r["func"] for r in by_cum] == ["b/c/d/f.py:1(f)", "x/g.py:2(g)"]
    summary = engine_bench.profile_summary(stats, n=1)
    assert summary == {"total_s": 0.6335, "top_tottime": by_tot[:1], "top_cumtime": by_cum[:1]}
    text = engine_bench.format_profile(by_cum, n=1)
    assert text.splitlines()[1].split() == ["2", "0.1235", "0.9000", "b/c/d/f.py:1(f)"]
    assert len(text.splitlines()) == 2
    with pytest.raises(KeyError):
        engine_bench.profile_rows(stats, "ncalls", 3)


def _leaf(n):
    return sum(range(n))


def _outer():
    return [_leaf(20_000) for _ in range(3)]


def test_profile_rows_from_a_real_profile(tmp_path):
    profiler = cProfile.Profile()
    profiler.enable()
    _outer()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = {re.sub(r".*\((\w+)\)$", r"\1", r["func"]): r for r in engine_bench.profile_rows(stats, "cumtime", 30)}
    assert rows["_leaf"]["ncalls"] == 3 and rows["_outer"]["ncalls"] == 1
    assert rows["_outer"]["cumtime"] >= rows["_leaf"]["cumtime"]
    assert re.fullmatch(r"tests/test_bench\.py:\d+\(_leaf\)", rows["_leaf"]["func"])
    assert engine_bench.profile_path(tmp_path / "run.json", 3) == tmp_path / "run.req3.prof"


# ---------------------------------------------------------------------- EngineLock

HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import engine_bench
lock = engine_bench.EngineLock(sys.argv[2])
with getattr(lock, sys.argv[3])():
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
    open(sys.argv[5], "w").write("released")
"""


@pytest.mark.parametrize("theirs, mine, waits", [("shared", "exclusive", True), ("exclusive", "shared", True),
                                                  ("shared", "shared", False)])
def test_engine_lock_between_processes(tmp_path, theirs, mine, waits):
    """Another process holds the lock `theirs`; taking it `mine` here waits for its release
    unless both are shared."""
    path, marker = tmp_path / "sub" / "engines.lock", tmp_path / "released"
    path.parent.mkdir()
    hold = 0.4 if waits else 0.6
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(BENCH), str(path), theirs, str(hold), str(marker)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with getattr(engine_bench.EngineLock(str(path)), mine)() as waited:
            assert marker.exists() is waits  # released before we got it (or not)
            assert isinstance(waited, float) and waited >= 0
            if waits:
                assert waited > 0.05
    finally:
        assert child.wait(timeout=10) == 0


def _try_flock(path, mode) -> bool:
    """Whether another open file of `path` gets the lock `mode` at once."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_engine_lock_modes_and_release(tmp_path):
    path = tmp_path / "engines.lock"
    lock = engine_bench.EngineLock(str(path))
    with lock.shared() as waited:  # creates the file
        assert path.exists() and waited >= 0
        assert _try_flock(path, fcntl.LOCK_SH) and not _try_flock(path, fcntl.LOCK_EX)
    assert _try_flock(path, fcntl.LOCK_EX)  # released
    with lock.exclusive():
        assert not _try_flock(path, fcntl.LOCK_SH)
    assert _try_flock(path, fcntl.LOCK_EX)
    with pytest.raises(RuntimeError):
        with lock.exclusive():
            raise RuntimeError("init failed")
    assert _try_flock(path, fcntl.LOCK_EX)  # released on an exception too
    nolock = engine_bench.EngineLock(None)
    with nolock.shared() as a, nolock.exclusive() as b:
        assert a == b == 0.0
    assert [p.name for p in tmp_path.iterdir()] == ["engines.lock"]


def test_gpu_run_script_parses():
    out = subprocess.run(["bash", "-n", str(BENCH / "gpu_run.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------- main() against a fake engine

FAKE_VLLM = '''
import json, os, types
__version__ = "0.0.fake"
MONITOR = []


def event(what):
    if os.environ.get("FAKE_EVENTS"):
        with open(os.environ["FAKE_EVENTS"], "a") as f:
            f.write(what + "\\n")


def _compile(name, key):
    from triton import knobs
    hook = knobs.runtime.jit_post_compile_hook
    if hook:
        hook(key=(name, key), repr="", fn=types.SimpleNamespace(name=name, module="fake.mod"),
             compile={}, is_manual_warmup=False, already_compiled=False)


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    def __init__(self):
        self.pending = 0
        self.mixed = False

    def step(self):
        if self.pending:
            self.pending -= 1
            if self.pending == 1 and not self.mixed:
                self.mixed = True
                _compile("_causal_conv1d_update_kernel", "mixed")
        return []

    def has_unfinished_requests(self):
        return self.pending > 0


class LLM:
    def __init__(self, **kw):
        event("init")
        LLM.kwargs = kw
        _compile("fused_moe_kernel", "init")  # a compile during init
        if os.environ.get("KWARM_REPORT") and os.environ.get("KWARM_ENABLE") == "1":
            with open(os.environ["KWARM_REPORT"], "w") as f:
                json.dump({"total_s": 4.5, "rank": 0, "families": [
                    {"name": "qwen_gdn", "status": "ran", "seconds": 4.0, "compiled": [{}],
                     "steps": [{"status": "ran"}]}]}, f)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["VLLM_CACHE_ROOT"], "tc", "triton_cache")
        from triton import knobs
        prev = knobs.runtime.jit_post_compile_hook  # vLLM's monitor chains what it finds

        def monitor(**k):
            MONITOR.append(k["fn"].name)
            return prev(**k) if prev else None

        knobs.runtime.jit_post_compile_hook = monitor
        self.llm_engine = _Engine()
        self.seen = set()

    def generate(self, prompts, sp, use_tqdm=True):
        event("generate")
        shape = (len(prompts), len(prompts[0]["prompt_token_ids"]))
        if shape not in self.seen:
            self.seen.add(shape)
            _compile("_compute_slot_mapping_kernel", shape)
            if shape == (4, 333):
                os.makedirs(os.path.join(os.environ["VLLM_CACHE_ROOT"], "deep_gemm", "cache",
                                         "kernel.mqa_logits.abc"))
        return []

    def enqueue(self, prompts, sp, use_tqdm=True):
        self.llm_engine.pending += 3
        return []
'''


def fake_engine_env(tmp_path) -> dict:
    """The environment of an engine_bench.py subprocess that imports a stand-in `vllm`
    (FAKE_VLLM; it appends "imported", "init", "generate" to $FAKE_EVENTS when set) and
    `torch`, with the real Triton knobs."""
    fake = tmp_path / "fake"
    (fake / "vllm" / "engine").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "engine" / "__init__.py").write_text("")
    (fake / "vllm" / "engine" / "arg_utils.py").write_text(
        "import dataclasses\nfrom vllm import event\nevent('imported')\n"
        "@dataclasses.dataclass\nclass EngineArgs:\n    model: str = ''\n")
    (fake / "torch").mkdir()
    (fake / "torch" / "__init__.py").write_text(
        "__version__ = '0.0.fake'\n"
        "class cuda:\n"
        "    get_device_name = staticmethod(lambda i: 'Fake GPU')\n"
        "    is_available = staticmethod(lambda: True)\n"
        "    device_allocs = [0]\n"
        "    @staticmethod\n"
        "    def memory_stats():  # two cudaMalloc calls between any two reads; no host_memory_stats\n"
        "        cuda.device_allocs[0] += 2\n"
        "        return {'num_device_alloc': cuda.device_allocs[0], 'active.all.current': 1}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KWARM_", "VLLM_", "TRITON_", "FAKE_"))}
    env.update(PYTHONPATH=f"{fake}:{REPO}", TMPDIR=str(tmp_path))
    return env


@pytest.mark.parametrize("kwarm", ["off", "on"])
def test_main_with_a_fake_engine(tmp_path, kwarm):
    """engine_bench.py end to end with a stand-in `vllm` and `torch` (real Triton knobs):
    hook chaining, per-request counts, DeepGEMM entries, the kwarm report, the JSON."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", kwarm,
                           "--out", str(out)], env=fake_engine_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["gpu"] == "Fake GPU" and res["versions"]["vllm"] == "0.0.fake"
    assert all(r["alloc"] == {"num_device_alloc": 2} for r in res["requests"])
    assert "jit_monitor_verbose" not in res["engine_kwargs"]  # this EngineArgs lacks it
    assert res["init_jit"] == 1 and res["init_kernels"] == [{"name": "fused_moe_kernel", "count": 1}]
    assert res["cache"]["label"] == "cold" and res["cache"]["triton_dir_after_init"].endswith("tc/triton_cache")
    jit = [r["jit"] for r in res["requests"]]
    assert jit == [1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0]  # new shapes compile; repeats and mixed repeat do not
    assert res["requests"][10]["kernels"] == [{"name": "_causal_conv1d_update_kernel", "key": "('_causal_conv1d_update_kernel', 'mixed')"}]
    assert res["requests"][10]["steps"] == 6  # 2 before the prefill is queued, 4 after
    assert [r["deepgemm_new"] for r in res["requests"]][5:7] == [1, 0]
    assert res["total_jit"] == 8 and [p["first"] for p in res["pairs"]] == [0, 5, 7, 10]
    if kwarm == "on":
        assert res["kwarm_active"] is True and "bench" in res["kwarm_doors"]
        assert res["kwarm_warmup_s"] == 4.5 and res["kwarm_report_summary"]["compiled"] == 1
    else:
        assert res["kwarm_warmup_s"] is None and res["kwarm_report"] is None
    assert "| 0.0.fake | %s | cold |" % kwarm in proc.stdout
    assert res["sync"] is None and not any("profile" in r or "profiled" in r for r in res["requests"])
    assert not list(tmp_path.glob("*.prof"))


def test_main_profiles_requests(tmp_path):
    out = tmp_path / "res" / "run.json"
    proc = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                           "--profile", "10,0", "--out", str(out)], env=fake_engine_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["complete"] is True and res["args"]["profile"] == [0, 10]
    assert [r["i"] for r in res["requests"] if r.get("profiled")] == [0, 10]
    assert all("profile" not in r for r in res["requests"] if r["i"] not in (0, 10))
    assert sorted(p.name for p in out.parent.glob("*.prof")) == ["run.req0.prof", "run.req10.prof"]
    for i, inner in ((0, "generate"), (10, "run_mixed")):
        prof = res["requests"][i]["profile"]
        assert prof["file"] == str(out.parent / f"run.req{i}.prof")
        raw = pstats.Stats(prof["file"]).stats  # the raw dump loads and holds the same calls
        assert len(prof["top_cumtime"]) == len(prof["top_tottime"]) == min(engine_bench.PROFILE_ROWS, len(raw))
        assert set(prof["top_cumtime"][0]) == {"func", "ncalls", "tottime", "cumtime"}
        funcs = [r["func"] for r in prof["top_cumtime"]]
        assert any(re.fullmatch(r"bench/engine_bench\.py:\d+\(run_request\)", f) for f in funcs), funcs
        assert any(f.endswith(f"({inner})") for f in funcs), funcs
        cum = [r["cumtime"] for r in prof["top_cumtime"]]
        assert cum == sorted(cum, reverse=True) and prof["total_s"] > 0
        assert any(name == "run_request" for (_, _, name) in raw)
    # the fake vllm package, shortened from its own folder on
    assert any(re.fullmatch(r"vllm/__init__\.py:\d+\(generate\)", r["func"])
               for r in res["requests"][0]["profile"]["top_cumtime"])
    after = proc.stdout.split("request 0 prefill 1x200:", 1)[1].split("request 1 ", 1)[0]
    assert "top 15 by cumtime" in after and "(run_request)" in after
    assert len([line for line in after.splitlines() if "(" in line and line.startswith("  ")]) >= 1
    bad = subprocess.run([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--profile", "12",
                          "--out", str(out)], env=fake_engine_env(tmp_path / "x"), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--profile [12]" in bad.stderr


def _wait_for(path: Path, line: str, proc, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and line in path.read_text().split():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no {line!r} in {path}")


def test_main_sync_lock_orders_init_and_requests(tmp_path):
    """A lock holder here: exclusive while the engine would initialize, then shared while it
    would measure. The engine's init and first request each come after the release."""
    lock, events, out = tmp_path / "engines.lock", tmp_path / "events", tmp_path / "run.json"
    env = dict(fake_engine_env(tmp_path), FAKE_EVENTS=str(events))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = subprocess.Popen([sys.executable, str(BENCH / "engine_bench.py"), "tiny-qwen3-next", "--kwarm", "off",
                                 "--scenario", "smoke", "--sync-lock", str(lock), "--out", str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(events, "imported", proc)  # just before LLM(): the engine now waits for us
        time.sleep(0.3)
        with events.open("a") as f:
            f.write("released-init\n")
        fcntl.flock(fd, fcntl.LOCK_SH)  # lets init through, holds the requests back
        _wait_for(events, "init", proc)
        time.sleep(0.3)
        with events.open("a") as f:
            f.write("released-requests\n")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout
    assert events.read_text().split() == ["imported", "released-init", "init", "released-requests"] + ["generate"] * 5
    res = json.loads(out.read_text())
    assert res["sync"]["lock"] == str(lock) and res["complete"] is True
    assert res["sync"]["init_wait_s"] > 0 and res["sync"]["requests_wait_s"] > 0
    # disjoint stretches of the run: init_s leaves out the wait for the lock
    sync = res["sync"]
    assert 0 <= res["init_s"] and res["init_s"] + sync["init_wait_s"] + sync["requests_wait_s"] <= res["wall_s"] + 0.06
    assert "for %s" % lock in stdout


def test_resplit_stage_recuts_the_payload_and_keeps_the_digest(tmp_path):
    import hashlib

    payload = bytes(range(256)) * 12_000  # about 3 MiB
    digest = hashlib.sha256(payload).hexdigest()
    receive = ('echo "vllm-0.24.0: $have of 2 chunks on this host"\n'
               f'if [ "$have" -eq 2 ]; then\n  python3 "$here/host_setup.py" "$dest" {digest}\nfi\n')
    staged = tmp_path / "staged"
    half = len(payload) // 2
    for i, part in enumerate((payload[:half], payload[half:])):
        folder = staged / f"chunk{i:02d}"
        folder.mkdir(parents=True)
        (folder / f"part.{i:02d}").write_bytes(part)
        (folder / "receive.sh").write_text(receive)
        (folder / "host_setup.py").write_text("# host setup\n")
    out = tmp_path / "small"
    script = REPO / "bench" / "resplit_stage.py"
    proc = subprocess.run([sys.executable, str(script), str(staged), str(out), "--mib", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    chunks = sorted(out.glob("chunk*"))
    assert len(chunks) == 3
    assert b"".join((c / f"part.{i:02d}").read_bytes() for i, c in enumerate(chunks)) == payload
    text = (chunks[2] / "receive.sh").read_text()
    assert "of 3 chunks" in text and '-eq 3 ]' in text and digest in text

    (staged / "chunk01" / "part.01").write_bytes(b"truncated")
    proc = subprocess.run([sys.executable, str(script), str(staged), str(out)], capture_output=True, text=True)
    assert proc.returncode != 0 and "do not match the digest" in proc.stderr
