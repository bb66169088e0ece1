"""The ``deep_gemm`` family: DeepGEMM's kernels compiled on every core ahead of vLLM's warmup.

DeepGEMM, its block-FP8 layers and CUDA IPC cannot exist on this machine; what runs here is
the family's own logic against the real vLLM: when it applies, how it cuts vLLM's token-count
lists among child processes, which weights it takes from a model (vLLM's own filters stood in
for, since they call into DeepGEMM), how the warmup runs it before vLLM's ``kernel_warmup`` and
how a failing child is reported. What it saves is measured on the GPU (BENCHMARKS.md, FP8).
"""
from __future__ import annotations


import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kwarm_ext import engine, warmup
from kwarm_ext.families import FAMILIES
from kwarm_ext.kernels import deep_gemm as dg
from test_faults import stand_in_worker


def test_chunks_cover_every_count_once_the_profile_runs_first_then_short_runs_spread_over_m():
    linear = [(m, None, None) for m in (1, 2, 3, 4, 8, 16, 63, 64, 200, 256, 1024, 4096, 8192)]
    grouped = [(m, 128, None) for m in (33536, 65536, 98048)]
    counts = [linear, grouped, [], list(reversed(linear[:4]))]
    work = dg.chunks(counts, size=4)
    for j, job in enumerate(counts):  # every count once
        assert sorted(c for k, run in work if k == j for c in run) == sorted(job, key=lambda c: c[0])
    assert [(j, [c[0] for c in run]) for j, run in work] == [
        (0, [8192]), (1, [98048]), (3, [4]),  # each weight's largest count alone: vLLM's profile run's
        (0, [1, 2, 3, 4]), (1, [33536, 65536]), (3, [1, 2, 3]),  # then each weight's first run,
        (0, [200, 256, 1024, 4096]),  # then each one's second: the middle of M, ...
        (0, [8, 16, 63, 64])]
    assert dg.chunks([[], []]) == []
    assert [len(run) for _, run in dg.chunks([[(m, None, None) for m in range(1, 20)]])] == [1, 8, 2, 8]


def test_spread_takes_the_middle_of_the_largest_gap_next():
    assert dg.spread(0) == [] and dg.spread(1) == [0] and dg.spread(2) == [0, 1]
    assert dg.spread(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert dg.spread(5) == [0, 4, 2, 1, 3]
    assert sorted(dg.spread(37)) == list(range(37))


def _claim_all(work, claims, out):
    for i, run in dg.claimed(work, claims):
        assert work[i] == run
        time.sleep(0.002)  # a call's worth of work, so that the processes interleave
        out.put(run)
    out.put(None)


def test_the_summary_names_the_runs_that_took_longest():
    # the children's timings of the runs that compiled, by index in the work list: the summary
    # names each by its weight (N x K) and its range of M, longest first
    jobs = [{"w": torch.empty(2624, 6144, device="meta")}, {"w": torch.empty(8, 16384, 6144, device="meta")}]
    work = [(0, [(1, None, None), (2, None, None)]), (1, [(128, 128, None), (384, 128, None)]),
            (0, [(1024, None, None), (3968, None, None)])]
    outcomes = [{"run_s": [[2, 21.4], [0, 3.3]]}, {"run_s": [[1, 9.9]]}, {"calls": 0}]
    assert dg.longest_runs(work, jobs, outcomes) == \
        "2624x6144 M 1024-3968 21 s, 16384x6144 M 128-384 10 s, 2624x6144 M 1-2 3 s"
    assert dg.longest_runs(work, jobs, outcomes, top=1) == "2624x6144 M 1024-3968 21 s"
    assert dg.longest_runs(work, jobs, [{"run_s": []}]) == "-"  # nothing compiled


def test_processes_walking_one_work_list_each_run_it_once(tmp_path):
    import multiprocessing

    work = [(j % 3, [(m, None, None)]) for j, m in enumerate(range(1, 61))]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(work, str(tmp_path), out)) for _ in range(4)]
    for proc in procs:
        proc.start()
    got, done = [], 0
    while done < len(procs):
        run = out.get(timeout=60)
        done += run is None
        got += [] if run is None else [run]
    for proc in procs:
        proc.join()
    assert sorted(got) == sorted(work), "every run once, none twice"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(map(str, range(60)))


def test_is_an_ahead_family_and_applies_only_where_vllm_runs_deepgemm(monkeypatch):
    assert FAMILIES["deep_gemm"].ahead and not FAMILIES["deep_gemm"].after_capture
    view = engine.EngineView(vllm_version="0.24.0", device="cpu", runner=object())
    assert dg.applies(view) == "runner device cpu is not CUDA"
    assert dg.applies(engine.EngineView(device="cuda:0")) == "no model runner"
    view.device = "cuda:0"
    # the real vLLM decides: no DeepGEMM package or Hopper GPU here
    assert dg.applies(view) == "DeepGEMM is not in use (VLLM_USE_DEEP_GEMM, GPU or package)"
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    assert dg.applies(view).startswith("VLLM_DEEP_GEMM_WARMUP=skip")


class _Linear(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n, k), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.empty(n // 128, k // 128), requires_grad=False)


class _Experts(torch.nn.Module):
    def __init__(self, e, n, k):
        super().__init__()
        self.w13 = torch.empty(e, 2 * n, k)
        self.w2 = torch.empty(e, k, n)


def test_jobs_are_vllms_weights_and_counts_one_per_distinct_shape(monkeypatch):
    # vLLM's filters and extractors call into DeepGEMM (absent here): stand-ins with their
    # signatures and meaning; the counts are vLLM's own full list (1..max_tokens).
    from vllm.model_executor.warmup import deep_gemm_warmup as w_mod

    model = torch.nn.Sequential(_Linear(256, 512), _Linear(256, 512), _Linear(384, 256), _Experts(4, 256, 512))
    monkeypatch.setattr(w_mod, "_fp8_linear_may_use_deep_gemm", lambda m: isinstance(m, _Linear))
    monkeypatch.setattr(w_mod, "_extract_data_from_linear_base_module",
                        lambda m: (m.weight, m.weight_scale_inv, [128, 128]))
    monkeypatch.setattr(w_mod, "_fused_moe_grouped_gemm_may_use_deep_gemm", lambda m: isinstance(m, _Experts))
    monkeypatch.setattr(w_mod, "_extract_data_from_fused_moe_module",
                        lambda m: (m.w13, "s13", m.w2, "s2", 2))
    monkeypatch.setattr(w_mod, "_get_grouped_gemm_params",
                        lambda w1, w2, top_k, max_tokens: (256, 128, [(128, 128, "ids"), (256, 128, "ids")]))
    monkeypatch.setattr(dg.selection, "grouped_layouts",
                        lambda module, w1, w2, top_k, max_tokens: [(256, 128, None), (384, 128, None)])
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "full")
    jobs = dg.gemm_jobs(model, 64)
    assert [(j["kind"], tuple(j["w"].shape)) for j in jobs] == [
        ("linear", (256, 512)), ("linear", (384, 256)), ("grouped", (4, 512, 512)), ("grouped", (4, 512, 256))]
    assert jobs[0]["counts"] == [(m, None, None) for m in range(1, 65)]
    assert jobs[2]["ws"] == "s13" and jobs[3]["ws"] == "s2"
    assert jobs[3]["counts"] == [(128, 128, None), (256, 128, None), (384, 128, None)], \
        "every layout vLLM's warmup runs and every one requests reach, once"
    # a weight vLLM's warmup already ran in this process is left out, as vLLM leaves it out
    monkeypatch.setattr(w_mod, "FP8_GEMM_NT_WARMUP_CACHE", {torch.Size([256, 512])})
    assert [tuple(j["w"].shape) for j in dg.gemm_jobs(model, 64)][:1] == [(384, 256)]


def test_linear_layers_vllm_runs_on_deep_gemm_count_though_its_warmup_filter_leaves_them_out(monkeypatch):
    # vLLM's real kernel classes (uninitialized: the family asks only which class vLLM chose)
    from types import SimpleNamespace

    from vllm.model_executor.kernels.linear.scaled_mm import cutlass, deep_gemm, flashinfer
    from vllm.model_executor.warmup import deep_gemm_warmup as w_mod

    def layer(n, k, kernel):
        module = _Linear(n, k)
        module.quant_method = SimpleNamespace(fp8_linear=object.__new__(kernel))
        return module

    on_dg = layer(2112, 7168, deep_gemm.DeepGemmFp8BlockScaledMMKernel)  # DeepSeek-V3.2's fused_qkv_a
    assert dg.runs_on_deep_gemm(on_dg)
    wrapped = layer(2624, 6144, flashinfer.FlashInferFp8DeepGEMMDynamicBlockScaledKernel)  # GLM-5's
    wrapped.quant_method.fp8_linear.fallback = object.__new__(deep_gemm.DeepGemmFp8BlockScaledMMKernel)
    assert dg.runs_on_deep_gemm(wrapped), "DeepGEMM as the dynamic kernel's fallback (M >= 32)"
    assert not dg.runs_on_deep_gemm(layer(2112, 7168, cutlass.CutlassFp8BlockScaledMMKernel))
    assert not dg.runs_on_deep_gemm(torch.nn.Linear(4, 4)) and not dg.runs_on_deep_gemm(_Linear(256, 512))
    # vLLM's warmup filter takes N % 128 == 0 only (stood in: it calls DeepGEMM); the family
    # takes the 2112-row weight as well, with the same count list
    monkeypatch.setattr(w_mod, "_fp8_linear_may_use_deep_gemm",
                        lambda m: isinstance(m, _Linear) and m.weight.shape[0] % 128 == 0)
    monkeypatch.setattr(w_mod, "_extract_data_from_linear_base_module",
                        lambda m: (m.weight, m.weight_scale_inv, [128, 128]))
    monkeypatch.setattr(w_mod, "_fused_moe_grouped_gemm_may_use_deep_gemm", lambda m: False)
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "full")
    jobs = dg.gemm_jobs(torch.nn.Sequential(_Linear(256, 512), on_dg, wrapped), 16)
    assert [tuple(j["w"].shape) for j in jobs] == [(256, 512), (2112, 7168), (2624, 6144)]
    assert all(j["counts"] == [(m, None, None) for m in range(1, 17)] for j in jobs)


def _moe_layer(experts):
    """A MoE layer where vLLM's warmup filter reads its experts (``_fused_moe_grouped_gemm_may_use_deep_gemm``:
    the MoERunner's ``_quant_method.moe_kernel.impl.fused_experts``)."""
    from types import SimpleNamespace

    return SimpleNamespace(_quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=experts))))


def _vllm_layouts(ms, top_k=8, experts=256):
    from vllm.model_executor.layers.fused_moe import deep_gemm_utils

    return sorted({deep_gemm_utils.compute_aligned_M_and_alignment(
        M=m, num_topk=top_k, local_num_experts=experts, alignment=128, expert_tokens_meta=None) for m in ms})


def test_grouped_layouts_are_every_m_sum_a_batch_reaches_including_those_vllms_list_misses(monkeypatch, tmp_path):
    # DeepSeek-V3.2's MoE (256 experts, top-8, hidden 7168, intermediate 2048) on vLLM's own
    # layout code; the experts are vLLM's real TritonOrDeepGemmExperts (uninitialized: only its
    # class decides), whose Triton fallback takes batches below DeepGEMM's alignment.
    from types import SimpleNamespace

    # vLLM's DeepGEMM set-up points DG_JIT_CACHE_DIR for the process: here, undone after the test
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))

    from vllm.model_executor.layers.fused_moe.experts.triton_deep_gemm_moe import TritonOrDeepGemmExperts
    from vllm.model_executor.warmup import deep_gemm_warmup as w_mod

    monkeypatch.setattr(w_mod, "get_dp_group", lambda: SimpleNamespace(world_size=1))  # no process group here
    w13, w2 = torch.empty(256, 4096, 7168, device="meta"), torch.empty(256, 7168, 2048, device="meta")
    layer = _moe_layer(object.__new__(TritonOrDeepGemmExperts))
    layouts = dg.grouped_layouts(layer, w13, w2, 8, 8192)
    assert [(m, a) for m, a, _ in layouts] == _vllm_layouts(range(128, 8193))
    assert len(layouts) == 505 and all(m % 128 == 0 and a == 128 for m, a, _ in layouts)
    # vLLM's relax list (an H200's 132 SMs) runs 241 layouts, 228 of them reachable: the
    # scenario's 1x2500-token prefill (BENCHMARKS.md) has a layout it misses
    monkeypatch.setattr(w_mod, "num_compute_units", lambda index: 132)
    _, _, relax = w_mod._get_grouped_gemm_params(w13, w2, 8, 8192)
    relax = {(m, a) for m, a, _ in relax}
    assert len(relax) == 241 and len(relax & {(m, a) for m, a, _ in layouts}) == 228
    assert _vllm_layouts([2500]) == [(52608, 128)] and (52608, 128) not in relax
    # experts without a Triton fallback take every batch on DeepGEMM: from one token up
    assert [(m, a) for m, a, _ in dg.grouped_layouts(_moe_layer(None), w13, w2, 8, 8192)] == \
        _vllm_layouts(range(1, 8193))
    # DP ranks' tokens meet in one MoE call, as vLLM's warmup assumes
    monkeypatch.setattr(w_mod, "get_dp_group", lambda: SimpleNamespace(world_size=2))
    assert dg.grouped_layouts(layer, w13, w2, 8, 4096) == layouts


def test_the_family_reads_a_moe_layers_experts_where_vllms_own_filter_does(monkeypatch):
    # vLLM's real MoERunner (its _quant_method is the routed experts' quant method) and real
    # TritonOrDeepGemmExperts; vLLM's real warmup filter takes the layer, and the family finds the
    # same experts object, hence vLLM's real test of which batches go to DeepGEMM
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts.triton_deep_gemm_moe import TritonOrDeepGemmExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.warmup import deep_gemm_warmup as w_mod

    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setenv("VLLM_MOE_USE_DEEP_GEMM", "1")
    experts = object.__new__(TritonOrDeepGemmExperts)
    config = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    method = SimpleNamespace(get_fused_moe_quant_config=lambda layer: config,
                             moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=experts)))
    runner = object.__new__(MoERunner)
    torch.nn.Module.__init__(runner)
    runner.routed_experts = SimpleNamespace(quant_method=method)
    monkeypatch.setattr(w_mod, "get_mk_alignment_for_contiguous_layout", lambda: [128, 128])
    assert w_mod._fused_moe_grouped_gemm_may_use_deep_gemm(runner)
    assert dg.fused_experts(runner) is experts
    takes = dg._deep_gemm_takes(runner)
    assert takes is not None and takes.__name__ == "_valid_deep_gemm_shape"
    assert dg.fused_experts(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("release", ["0.28.0", "0.33.0", "0.34.0"])
def test_the_linear_layers_come_from_each_releases_own_warmup_module(release):
    # 0.33 replaced the warmup's filter on the layer (_fp8_linear_may_use_deep_gemm) with the
    # DeepGEMM kernel's own stamp (_deep_gemm_linear_data): the family reads whichever the release has
    from conftest import cpu_triton_env, run_py

    code = """
import json, torch, types
from vllm.model_executor.kernels.linear.scaled_mm import deep_gemm
from vllm.model_executor.warmup import deep_gemm_warmup as w_mod
from kwarm_ext.kernels import deep_gemm as dg

# a model as vLLM builds it, before the weights load: the release's own DeepGEMM kernel class
layer = torch.nn.Linear(7168, 2112, bias=False)
layer.weight_scale_inv = torch.nn.Parameter(torch.empty(17, 56), requires_grad=False)
layer.quant_method = types.SimpleNamespace(fp8_linear=object.__new__(deep_gemm.DeepGemmFp8BlockScaledMMKernel))
jobs = dg.shape_jobs(torch.nn.Sequential(layer, torch.nn.Linear(4, 4)), 8)
print(json.dumps({"gaps": dg.warmup_gaps(w_mod), "stamped": hasattr(w_mod, "_deep_gemm_linear_data"),
                  "plain_linear": dg.linear_data(w_mod, torch.nn.Linear(4, 4)),
                  "without": dg.warmup_gaps(type("M", (), {})()),
                  "by_shape": [[j["shape"], j["ws_shape"], [c[0] for c in j["counts"]]] for j in jobs]}))
"""
    proc = run_py(code, env=dict(cpu_triton_env(), VLLM_DEEP_GEMM_WARMUP="full"), release=release)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["gaps"] == [] and out["stamped"] is (release != "0.28.0")
    assert out["plain_linear"] is None  # a bf16 nn.Linear runs on no DeepGEMM kernel
    # before the load, the layer vLLM put on DeepGEMM is found by its kernel, with vLLM's own counts
    assert out["by_shape"] == [[[2112, 7168], [17, 56], list(range(1, 9))]]
    assert out["without"] == ["_get_fp8_gemm_nt_m_values", "_fused_moe_grouped_gemm_may_use_deep_gemm",
                              "_extract_data_from_fused_moe_module", "_get_grouped_gemm_params",
                              "_fp8_linear_may_use_deep_gemm", "_extract_data_from_linear_base_module"]


def test_a_failing_child_is_one_line_naming_its_error(tmp_path):
    # a real child process, fed the real payload; here it cannot map CUDA (no driver), which
    # is what any child failure looks like to the parent
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # CPU tensors through a pipe (CUDA uses IPC handles)
    try:
        jobs = [{"kind": "linear", "w": torch.zeros(4, 4), "ws": torch.ones(1, 1), "counts": [(1, None, None)]}]
        buffers = {"a": torch.zeros(16), "scale": torch.zeros(4), "out": torch.zeros(16)}
        with pytest.raises(RuntimeError) as err:  # two processes forked by one parent
            dg.run_children([(0, [(1, None, None)]), (0, [(2, None, None)])], 2, jobs, buffers, "cuda:0",
                            server=dg.start_forkserver())
    finally:
        tmp.set_sharing_strategy(old)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("2 of 2 DeepGEMM compile processes failed (exit 2); first: ")
    assert "Error" in message.split("first: ", 1)[1]


def test_described_calls_go_out_once_each_over_the_processes(tmp_path):
    """start_calls: a work list of calls by name with tensors by description (the DSA indexer's
    schedule metadata); two real processes forked by one real parent make every call exactly once
    (a second torch.save of a path would still pass, a second os.mkdir would fail the process)."""
    calls = []
    for i in range(6):
        calls.append({"fn": "os:mkdir", "args": [str(tmp_path / f"d{i}")]})
        calls.append({"fn": "torch:save", "args": [{"tensor": [i + 1, 2], "dtype": "int32", "fill": 1},
                                                   str(tmp_path / f"d{i}.pt")]})
    started = dg.start_calls(calls, 2, "cpu")
    outcomes = dg.finish_children(started)
    assert sorted(o["calls"] for o in outcomes) and sum(o["calls"] for o in outcomes) == 12 and len(outcomes) == 2
    for i in range(6):
        assert (tmp_path / f"d{i}").is_dir()
        saved = torch.load(tmp_path / f"d{i}.pt")
        assert saved.dtype == torch.int32 and saved.shape == (i + 1, 2) and bool((saved == 1).all())
    again = dg.start_calls(calls[:1], 1, "cpu")  # the directory exists now: one line naming the error
    with pytest.raises(RuntimeError, match=r"^1 of 1 DeepGEMM compile processes failed .*FileExistsError"):
        dg.finish_children(again)


def test_a_parent_started_ahead_exits_quietly_when_no_work_comes(tmp_path):
    # the probe found the kernels cached: the engine closes the parent's stdin unwritten
    proc, out, err = dg.start_forkserver()
    proc.stdin.close()
    assert proc.wait(timeout=300) == 0
    out.seek(0)
    err.seek(0)
    assert out.read() == b"" and b"Traceback" not in err.read()


def test_the_gemm_kernels_in_deepgemms_cache_are_counted_apart_from_its_transforms(tmp_path):
    for name in ("kernel.sm90_fp8_gemm_1d2d.1a", "kernel.transpose_fp32.2b", "kernel.sm90_fp8_gemm_1d2d.3c", "tmp"):
        (tmp_path / "cache" / name).mkdir(parents=True)
    assert dg.cached_kernels(str(tmp_path)) == 3
    assert dg.cached_kernels(str(tmp_path), "gemm") == 2
    assert dg.cached_kernels(str(tmp_path / "missing"), "gemm") == 0


def test_deepjit_caches_are_counted_committed_entries_only(tmp_path):
    # the DeepJIT-based DeepGEMM vLLM 0.34 vendors: cache/<name>.<digest>/ with a .committed
    # marker; a build in progress is tmp/<uuid>/, a published entry without the marker is not one
    for name, committed in (("sm90_fp8_gemm_1d2d.0a1b", True), ("sm90_m_grouped_fp8_gemm_contiguous_1d2d.2c", True),
                            ("smxx_transpose_fp32.3d", True), ("sm90_fp8_mqa_logits.4e", True),
                            ("sm90_fp8_gemm_1d2d.5f", False)):
        (tmp_path / "cache" / name).mkdir(parents=True)
        (tmp_path / "cache" / name / "kernel.cubin").write_bytes(b"")
        if committed:
            (tmp_path / "cache" / name / ".committed").write_bytes(b"")
    (tmp_path / "tmp" / "8b1d5c0e-uuid").mkdir(parents=True)
    assert dg.cached_kernels(str(tmp_path)) == 4
    assert dg.cached_kernels(str(tmp_path), "gemm") == 2


def test_the_cache_is_the_first_writable_folder_deepjit_reads(monkeypatch, tmp_path):
    # DG_JIT_CACHE_DIR (vLLM sets it where unset), a ':'-list for DeepJIT; DJ_JIT_CACHE_DIR below it
    monkeypatch.setenv("DG_JIT_CACHE_DIR", f"{tmp_path}/rw:{tmp_path}/ro")
    monkeypatch.setenv("DJ_JIT_CACHE_DIR", f"{tmp_path}/dj")
    assert dg._cache_dir() == f"{tmp_path}/rw"
    monkeypatch.delenv("DG_JIT_CACHE_DIR")
    assert dg._cache_dir() == f"{tmp_path}/dj"  # venv's vLLM 0.24: no DeepGEMM, so _lazy_init sets none


def test_on_034_the_cache_is_where_vllm_points_its_vendored_deepgemm(tmp_path):
    """vLLM 0.34's own _lazy_init (DeepGEMM standing in: its vendored package's compiled extension
    cannot load here) points DG_JIT_CACHE_DIR at VLLM_CACHE_ROOT/deep_gemm before importing
    vllm.third_party.deep_gemm; kwarm reads that folder and counts its DeepJIT entries."""
    from conftest import clean_env, result_of, run_py

    got = result_of(run_py(r"""
import json, os, types
from vllm.utils import deep_gemm as vllm_dg
from kwarm_ext.kernels import deep_gemm as dg
imported = []
vllm_dg.has_deep_gemm = lambda: True  # STAND-IN: the extension is absent, has_deep_gemm() says False
vllm_dg._import_deep_gemm = lambda: imported.append(os.environ.get("DG_JIT_CACHE_DIR")) or types.SimpleNamespace()
cache = dg._cache_dir()
os.makedirs(os.path.join(cache, "cache", "sm90_fp8_gemm_1d2d.0a1b"))
open(os.path.join(cache, "cache", "sm90_fp8_gemm_1d2d.0a1b", ".committed"), "w").close()
print("RESULT " + json.dumps({"cache": cache, "seen_by_import": imported, "gemm": dg.cached_kernels(cache, "gemm")}))
""", env=clean_env(VLLM_CACHE_ROOT=str(tmp_path), CUDA_VISIBLE_DEVICES=""), release="0.34.0"))
    assert got == {"cache": f"{tmp_path}/deep_gemm", "seen_by_import": [f"{tmp_path}/deep_gemm"], "gemm": 1}


def test_ahead_results_join_the_workers_summary_and_report(monkeypatch, kwarm_env, kwarm_log, tmp_path):
    kwarm_env(KWARM_WARMUPS="deep_gemm,runner", KWARM_LOG_LEVEL="DEBUG")  # the detail line is DEBUG's
    worker = stand_in_worker()
    results = warmup.ahead(worker)
    assert [(r.name, r.status, r.reason) for r in results if r.reason != "disabled by KWARM_WARMUPS"] == [
        ("deep_gemm", "skipped", "runner device cpu is not CUDA")]
    report = warmup.run(worker)
    names = [f["name"] for f in report["families"]]
    assert names[0] == "deep_gemm" and names.count("deep_gemm") == 1, "run() does not plan it again"
    done = [r.getMessage() for r in kwarm_log.records if "warmup done" in r.getMessage()]
    assert len(done) == 1 and "): ran runner; " in done[0]
    detail = [r.getMessage() for r in kwarm_log.records if "warmup detail" in r.getMessage()]
    assert len(detail) == 1 and "deep_gemm (runner device cpu is not CUDA)" in detail[0]
    # without an ahead phase for this worker, run() neither plans nor lists it
    assert "deep_gemm" not in [f["name"] for f in warmup.run(stand_in_worker())["families"]]


@pytest.mark.parametrize("model, fused_qkv_a", [("deepseek-v32-2l-fp8", 2112), ("glm5-2l-fp8", 2624)])
def test_bench_fp8_models_load_as_block_fp8_mla_whose_fused_down_projection_vllms_warmup_skips(model, fused_qkv_a):
    # the bench's published-dimension FP8 models, read by transformers' own config classes
    # and vLLM's registry: the q/kv down-projection's N runs on DeepGEMM (a multiple of 64) and
    # is skipped by vLLM's warmup filter (not a multiple of 128)
    from pathlib import Path

    from transformers import AutoConfig
    from vllm.model_executor.models.registry import ModelRegistry

    cfg = AutoConfig.from_pretrained(Path(__file__).parent.parent / "bench" / "models" / model)
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    assert cfg.architectures[0] in ModelRegistry.get_supported_archs()
    n = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert n == fused_qkv_a and n % 64 == 0 and n % 128 != 0


def test_processes_start_beside_weight_loading_only_on_a_cold_block_fp8_deepgemm_worker(monkeypatch, tmp_path):
    # the reasons come from the worker's config and vLLM's own DeepGEMM checks, read before the
    # model exists; on this machine the last two cannot be true (no GPU, no DeepGEMM)
    import types

    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    def worker(device, quant):
        return types.SimpleNamespace(device=torch.device(device), vllm_config=types.SimpleNamespace(
            quant_config=quant, parallel_config=types.SimpleNamespace(tensor_parallel_size=1)))

    block = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    assert dg.early_start_gap(worker("cpu", block)) == "not a CUDA worker"
    assert dg.early_start_gap(worker("cuda", None)) == "not a block-FP8 model"
    assert dg.early_start_gap(worker("cuda", Fp8Config(is_checkpoint_fp8_serialized=True))) == "not a block-FP8 model"
    assert dg.early_start_gap(worker("cuda", block)) == "DeepGEMM not in use or its warmup skipped"
    from vllm.utils import deep_gemm as vllm_dg

    monkeypatch.setattr(vllm_dg, "is_deep_gemm_supported", lambda: True)  # an H200 with DeepGEMM
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "cache" / "kernel.transpose_fp32.1a").mkdir(parents=True)  # weight loading's, not a GEMM
    assert dg.early_start_gap(worker("cuda", block)) is None
    (tmp_path / "cache" / "kernel.sm90_fp8_gemm_1d2d.2b").mkdir()
    assert dg.early_start_gap(worker("cuda", block)).startswith("DeepGEMM's cache holds GEMM kernels")


def test_processes_started_before_the_load_end_with_the_ahead_run_that_did_not_take_them(
        monkeypatch, kwarm_env, kwarm_log):
    # vLLM's Worker.load_model through kwarm's patch: the processes start first, the load runs;
    # the ahead run skips deep_gemm here (CPU runner), so they are ended, not left waiting
    import types

    from kwarm_ext import patches

    kwarm_env(KWARM_WARMUPS="deep_gemm")
    monkeypatch.setattr(dg, "early_start_gap", lambda worker: None)  # a cold H200 with DeepGEMM
    monkeypatch.setattr(dg, "_cache_dir", lambda: "/tmp/dg-cache")
    monkeypatch.setattr(dg.triton_compile, "compile_threads", lambda tp_size: 3)  # a core stays with the engine
    seen = []
    module = types.ModuleType("stand_in_gpu_worker")
    module.Worker = type("Worker", (), {"load_model": lambda self, **kw: seen.append(dict(dg._early)) or kw})
    assert patches.BEFORE_LOAD.apply(module) is True
    worker = module.Worker()
    vars(worker).update(vars(stand_in_worker()))
    assert worker.load_model(load_dummy_weights=False) == {"load_dummy_weights": False}
    (proc, _, _), processes = seen[0][id(worker)]
    assert processes == 2 and proc.poll() is None, "started before the load, running"
    assert any("the parent of 2 compile processes started beside weight loading" in m
               for m in kwarm_log.messages(logging.INFO))
    results = warmup.ahead(worker)
    assert [(r.name, r.status) for r in results if r.name == "deep_gemm"] == [("deep_gemm", "skipped")]
    assert id(worker) not in dg._early and proc.wait(timeout=60) is not None


@pytest.mark.parametrize("setting, cores, expect", [
    (None, 17, 16), (None, 33, 16),  # auto: a core for the engine, at most MAX_CHILDREN
    (None, 4, 3), (None, 1, 1),
    ("31", 33, 31), ("31", 16, 15),  # KWARM_COMPILE_PROCESSES: above the cap, never past the cores
    ("2", 33, 2),
])
def test_compile_processes_per_worker(monkeypatch, kwarm_env, setting, cores, expect):
    kwarm_env(**({} if setting is None else {"KWARM_COMPILE_PROCESSES": setting}))
    monkeypatch.setattr(dg.triton_compile, "compile_threads", lambda tp_size: cores)
    assert dg.compile_processes(1) == expect


def test_the_summary_says_when_the_processes_were_ready_and_done():
    outcomes = [{"ready": 0.4, "done": 30.2}, {"ready": 0.6, "done": 41.7}, {"ready": 2.5, "done": 39.0}]
    assert dg.readiness(outcomes) == "ready 0.6-2.5 s after the work list, all done at 42 s"


def _dg_layer(n, k, kernel_class):
    """A linear layer as vLLM builds it, before its weights load: FP8 weight, FP32 block scales,
    the kernel vLLM chose in ``create_weights`` (a real class, uninitialized)."""
    from types import SimpleNamespace

    module = _Linear(n, k)
    module.quant_method = SimpleNamespace(fp8_linear=object.__new__(kernel_class))
    return module


def test_jobs_by_shape_of_a_model_not_loaded_are_those_the_ahead_run_reads_from_the_loaded_one(monkeypatch):
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass, deep_gemm
    from vllm.model_executor.warmup import deep_gemm_warmup as w_mod

    monkeypatch.setattr(w_mod, "_fp8_linear_may_use_deep_gemm",  # vLLM's filter: N % 128 (it calls DeepGEMM)
                        lambda m: isinstance(m, _Linear) and m.weight.shape[0] % 128 == 0
                        and not isinstance(m.quant_method.fp8_linear, cutlass.CutlassFp8BlockScaledMMKernel))
    monkeypatch.setattr(w_mod, "_extract_data_from_linear_base_module",
                        lambda m: (m.weight, m.weight_scale_inv, [128, 128]))
    monkeypatch.setattr(w_mod, "_fused_moe_grouped_gemm_may_use_deep_gemm", lambda m: False)
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "full")
    on_dg = deep_gemm.DeepGemmFp8BlockScaledMMKernel
    model = torch.nn.Sequential(_dg_layer(256, 512, on_dg), _dg_layer(256, 512, on_dg),
                                _dg_layer(2112, 7168, on_dg),  # N % 64: vLLM's filter leaves it out, its kernel not
                                _dg_layer(384, 256, cutlass.CutlassFp8BlockScaledMMKernel), torch.nn.Linear(4, 4))
    jobs = dg.shape_jobs(model, 16)
    assert [(j["kind"], j["shape"], j["ws_shape"]) for j in jobs] == [
        ("linear", (256, 512), (2, 4)), ("linear", (2112, 7168), (16, 56))]
    assert all(j["counts"] == [(m, None, None) for m in range(1, 17)] for j in jobs)
    # the ahead run reads the loaded model: the same kernels' jobs, so it leaves them out
    assert [dg.job_key(j) for j in dg.gemm_jobs(model, 16)] == [dg.job_key(j) for j in jobs]
    made = dg.made_tensors(jobs[1], torch.device("cpu"))  # what a process builds of a job sent by shape
    assert (made["w"].shape, made["w"].dtype) == ((2112, 7168), torch.float8_e4m3fn)
    assert (made["ws"].shape, made["ws"].dtype, made["ws"].abs().sum().item()) == ((16, 56), torch.float32, 0)


def test_processes_fit_the_gpus_free_memory_beside_the_weights():
    # the largest weight at its largest count: weight, scales, activations, output; plus a
    # context each; a tenth of the GPU left to vLLM
    jobs = [{"shape": (36864, 7168), "counts": [(1, None, None), (8192, None, None)]},
            {"shape": (2112, 7168), "counts": [(8192, None, None)]}]
    per = dg.CONTEXT_BYTES + 36864 * 7168 + 4 * 36864 * 56 + 8192 * (7168 + 4 * 56 + 2 * 36864 + 4)
    gib = 1 << 30
    assert dg.fitting(jobs, 100 * gib, 140 * gib) == int(100 * gib - 14 * gib) // per == 45
    assert dg.fitting(jobs, 14 * gib, 140 * gib) == 0, "nothing beside a GPU the weights fill"
    # beside the profile run, on the engine's weights through CUDA IPC: each process's scratch only
    # (a grouped weight: experts x N x K, its largest layout of M_sum rows)
    grouped = [{"w": torch.empty(256, 4096, 7168, device="meta"), "counts": [(128, 128, None), (67584, 128, None)]}]
    assert dg.fitting(grouped, 20 * gib, 140 * gib, shared_weights=True) == int(
        6 * gib) // (dg.CONTEXT_BYTES + 67584 * (7168 + 4 * 56 + 2 * 4096 + 4)) == 3


def test_the_ahead_run_waits_for_the_work_sent_as_the_model_was_built_and_runs_only_the_rest(monkeypatch, tmp_path):
    # work sent as the model was built whose processes are done (none here: their reading is
    # tested with real processes below): jobs it covered are not run again, nothing is spawned
    import tempfile as tf

    monkeypatch.setattr(dg, "_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(dg, "start_forkserver", lambda: pytest.fail("nothing left to compile"))
    job = {"kind": "linear", "shape": (256, 512), "ws_shape": (2, 4), "counts": [(1, None, None)]}
    loaded = [{"kind": "linear", "w": torch.empty(256, 512, device="meta"), "ws": None, "counts": [(1, None, None)]}]
    out, err = tf.TemporaryFile(), tf.TemporaryFile()
    line = json.dumps({"calls": 1, "runs": 1, "seconds": 0.5})
    proc = subprocess.Popen([sys.executable, "-c", f"print({line!r})"], stdin=subprocess.PIPE, stdout=out, stderr=err)
    server = (proc, out, err)  # a parent whose one process did the work and exited
    sent = {"server": server, "processes": 1, "claims": tf.TemporaryDirectory(), "t0": time.perf_counter(),
            "before": 0, "work": dg.chunks([job["counts"]]), "jobs": [job], "calls": 1}
    labels = dg.compile_ahead(loaded, "cuda:0", 1, early=None, sent=sent)
    assert len(labels) == 1 and labels[0].startswith(
        "1 weights, 1 calls in 1 runs sent to 1 processes as the model was built, before its weights loaded; 0 kernels new")


def _done_server(line: dict):
    """A parent whose one process did its work and exited: the JSON line it printed."""
    import tempfile as tf

    out, err = tf.TemporaryFile(), tf.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", f"print({json.dumps(line)!r})"], stdin=subprocess.PIPE,
                            stdout=out, stderr=err)
    return proc, out, err


def test_the_profile_run_compiles_unless_eager_or_without_a_compilation_mode():
    from types import SimpleNamespace as NS

    from vllm.config import CompilationConfig

    def config(eager=False, **compilation):
        return NS(model_config=NS(enforce_eager=eager), compilation_config=NS(**compilation))

    assert dg.profile_run_compiles(config(mode=3)) and dg.profile_run_compiles(config(level=3))  # 0.24+, before
    assert not dg.profile_run_compiles(config(eager=True, mode=3))
    assert not dg.profile_run_compiles(config(mode=0)) and not dg.profile_run_compiles(config(mode=None))
    real = CompilationConfig(mode=3) if "mode" in CompilationConfig.__dataclass_fields__ else CompilationConfig(level=3)
    assert dg.profile_run_compiles(NS(model_config=NS(enforce_eager=False), compilation_config=real))


def test_beside_the_profile_run_the_ahead_run_returns_at_once_and_finish_waits(monkeypatch, tmp_path):
    # the work sent as the model was built covers every job: nothing more goes out, the spare
    # parent ends; finish waits for the sent processes once, then has nothing left
    import tempfile as tf

    monkeypatch.setattr(dg, "_cache_dir", lambda: str(tmp_path))
    job = {"kind": "linear", "shape": (256, 512), "ws_shape": (2, 4), "counts": [(1, None, None)]}
    loaded = [{"kind": "linear", "w": torch.empty(256, 512, device="meta"), "ws": None, "counts": [(1, None, None)]}]
    spare = dg.start_forkserver()
    sent = {"server": _done_server({"calls": 1, "runs": 1, "seconds": 0.5}), "processes": 1, "spare": spare,
            "claims": tf.TemporaryDirectory(), "t0": time.perf_counter(), "before": 0,
            "work": dg.chunks([job["counts"]]), "jobs": [job], "calls": 1}
    worker = object()
    labels = dg.compile_ahead(loaded, "cuda:0", 1, early=None, sent=sent, beside=id(worker))
    assert labels == ["1 weights sent to 1 processes as the model was built: compiling beside vLLM's profile run "
                      "(its torch.compile first)"]
    assert spare[0].wait(timeout=60) is not None, "nothing left for the spare parent: it ends"
    done = dg.finish(worker)
    assert done[0].startswith("1 weights, 1 calls in 1 runs sent to 1 processes as the model was built")
    assert "s of it after vLLM's profile run" in done[0] and done[1].startswith("waited ")
    assert dg.finish(worker) == [], "once"


def test_beside_the_profile_run_the_weights_found_after_the_load_go_out_and_a_failure_is_one_line(
        monkeypatch, tmp_path):
    # the loaded model adds a MoE weight: it goes to the spare parent's real processes (here they
    # cannot map CUDA, which is how any failure looks); finish raises one line, and no process outlives it
    import tempfile as tf

    import torch.multiprocessing as tmp

    monkeypatch.setattr(dg, "_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(dg.triton_compile, "compile_threads", lambda tp_size: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 140 << 30))
    job = {"kind": "linear", "shape": (256, 512), "ws_shape": (2, 4), "counts": [(1, None, None)]}
    grouped = {"kind": "grouped", "w": torch.zeros(2, 4, 4), "ws": torch.ones(2, 1, 1),
               "counts": [(128, 128, None), (256, 128, None)]}
    sent = {"server": _done_server({"calls": 1, "runs": 1, "seconds": 0.5}), "processes": 1,
            "spare": dg.start_forkserver(), "claims": tf.TemporaryDirectory(), "t0": time.perf_counter(), "before": 0,
            "work": dg.chunks([job["counts"]]), "jobs": [job], "calls": 1}
    worker = object()
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # CPU tensors through a pipe (CUDA uses IPC handles)
    try:
        labels = dg.compile_ahead([dict(job, w=torch.empty(256, 512, device="meta"), ws=None), grouped],
                                  "cuda:0", 1, early=None, sent=sent, beside=id(worker))
        assert labels == ["1 weights sent to 1 processes as the model was built, 1 found after the load (2 calls) on "
                          "2 more: compiling beside vLLM's profile run (its torch.compile first)"]
        rest = dg._pending[id(worker)]["rest"]
        assert rest["started"]["buffers"] is None, "their scratch is their own"
        with pytest.raises(RuntimeError) as err:
            dg.finish(worker)
    finally:
        tmp.set_sharing_strategy(old)
    message = str(err.value)
    assert "\n" not in message and message.startswith("2 of 2 DeepGEMM compile processes failed (exit 2); first: ")
    assert rest["started"]["server"][0].poll() is not None and id(worker) not in dg._pending


def test_beside_the_profile_run_nothing_starts_where_no_process_fits_beside_it(monkeypatch, tmp_path):
    # a GPU the weights fill: no scratch of a process's own fits beside a tenth left to the
    # profile run, so the ahead run does not go beside it (it waits, as in eager mode)
    monkeypatch.setattr(dg.triton_compile, "compile_threads", lambda tp_size: 17)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (14 << 30, 140 << 30))
    grouped = {"kind": "grouped", "w": torch.empty(256, 4096, 7168, device="meta"), "ws": None,
               "counts": [(67584, 128, None)]}
    worker = object()
    assert dg.compile_beside(id(worker), {"jobs": []}, [grouped], "cuda:0", 1, None, str(tmp_path)) is None
    assert id(worker) not in dg._pending


def test_work_goes_out_as_vllm_builds_the_model_and_a_failing_process_is_one_line(monkeypatch, kwarm_env, kwarm_log,
                                                                                    tmp_path):
    # vLLM's Worker.load_model and initialize_model through kwarm's patches, on stand-in modules:
    # the processes start before the load, get the work by shape once the model is built (real
    # child processes: here they cannot make CUDA tensors, which is how any failure looks)
    import types

    from kwarm_ext import patches
    from vllm.model_executor.kernels.linear.scaled_mm import deep_gemm

    kwarm_env(KWARM_WARMUPS="deep_gemm")
    monkeypatch.setattr(dg, "early_start_gap", lambda worker: None)  # a cold H200 with DeepGEMM
    monkeypatch.setattr(dg, "_cache_dir", lambda: "/tmp/dg-cache")
    monkeypatch.setattr(dg.triton_compile, "compile_threads", lambda tp_size: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 140 << 30))
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "full")
    # vLLM's real warmup filter runs here, and its DeepGEMM set-up points DG_JIT_CACHE_DIR for the
    # process: at this test's folder, undone after it
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    model = torch.nn.Sequential(_dg_layer(2112, 7168, deep_gemm.DeepGemmFp8BlockScaledMMKernel))
    loader = types.ModuleType("stand_in_base_loader")
    loader.initialize_model = lambda **kw: model
    gpu_worker = types.ModuleType("stand_in_gpu_worker")
    gpu_worker.Worker = type("Worker", (), {"load_model": lambda self: loader.initialize_model(vllm_config=None)})
    assert patches.BEFORE_LOAD.apply(gpu_worker) is True and patches.MODEL_BUILT.apply(loader) is True
    assert loader.initialize_model() is model, "a model built outside a worker's load: nothing sent"
    worker = gpu_worker.Worker()
    worker.device = torch.device("cuda", 0)
    worker.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8),
                                               parallel_config=types.SimpleNamespace(tensor_parallel_size=1))
    worker.load_model()
    sent = dg._sent.pop(id(worker))
    # two runs of work (the profile run's count alone, then the other seven): two processes
    assert sent["processes"] == 2 and id(worker) not in dg._early, "two runs, two processes, the parent taken"
    assert sent["calls"] == 8 and [j["shape"] for j in sent["jobs"]] == [(2112, 7168)]
    assert any("1 weights, 8 token counts sent to 2 compile processes as the model was built" in m
               for m in kwarm_log.messages(logging.INFO))
    spare = sent["spare"]  # a second parent, importing for what the loaded model adds
    loaded = [{"kind": "linear", "w": torch.empty(2112, 7168, device="meta"), "ws": None,
               "counts": [(m, None, None) for m in range(1, 9)]}]
    with pytest.raises(RuntimeError) as err:
        dg.compile_ahead(loaded, "cuda:0", 1, early=None, sent=sent)
    message = str(err.value)
    assert "\n" not in message and message.startswith("2 of 2 DeepGEMM compile processes failed (exit 2); first: ")
    assert sent["server"][0].poll() is not None, "the parent does not outlive the step"
    assert spare[0].poll() is not None, "nor does the spare one"


def test_the_summary_counts_compiles_apart_from_kernels_so_duplicates_show():
    # two processes that each compiled the same kernel: 2 compiles, 1 kernel new in the cache
    outcomes = [{"seconds": 4.0, "compiles": 1, "compile_s": 3.5}, {"seconds": 5.0, "compiles": 1, "compile_s": 4.5}]
    assert dg._throughput(1, 5.0, outcomes) == ("0.20 kernels/s; processes busy 9 s in all, 9.0 s a kernel, "
                                                "the slowest 5 s; 2 compiles for 1 kernels, 4.0 s each")


def _fp8_config():
    from types import SimpleNamespace

    return SimpleNamespace(quant_config=SimpleNamespace(weight_block_size=[128, 128]))


@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_the_front_end_marks_a_block_fp8_model_and_an_engine_in_its_process_starts_the_parent(
        monkeypatch, kwarm_log, multiprocessing):
    # vLLM's real config gate (envs) with DeepGEMM's support stood in (NVML's capability: no GPU
    # here); the engine runs in this process (0) or in processes that inherit the mark (1)
    from types import SimpleNamespace

    from vllm.utils import deep_gemm

    monkeypatch.setattr(deep_gemm, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    monkeypatch.delenv(dg.EARLY_ENV, raising=False)
    dg.engine_config_made(SimpleNamespace(quant_config=None))
    assert dg.EARLY_ENV not in os.environ and dg.processes._early_server is None, "bf16: nothing"
    dg.engine_config_made(_fp8_config())
    assert os.environ[dg.EARLY_ENV] == "1"
    server = dg.take_early()
    try:
        assert (server is not None) is (multiprocessing == "0")
        if server is not None:
            assert server[0].poll() is None, "running, importing torch and vLLM"
            server[0].stdin.close()  # taken, then no work: it exits quietly
            assert server[0].wait(timeout=300) == 0
            server[2].seek(0)
            assert b"Traceback" not in server[2].read()
    finally:
        dg._stop([server])
    assert dg.take_early() is None


def test_activation_starts_the_parent_where_the_front_end_marked_the_model():
    # a fresh engine process that inherited the mark: kwarm's activation starts the parent, and
    # imports neither torch nor vLLM itself
    from conftest import clean_env, run_py

    proc = run_py("""
import json, sys
import kwarm_ext
assert kwarm_ext.activate("api")
from kwarm_ext.kernels.deep_gemm import processes
server = processes.take_early()
print(json.dumps([server is not None and server[0].poll() is None, "torch" in sys.modules, "vllm" in sys.modules]))
processes._stop([server])
""", env=clean_env(KWARM_ENABLE="1", KWARM_DEEP_GEMM_EARLY="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, False, False]


def test_a_parent_started_early_that_no_worker_takes_exits(monkeypatch):
    monkeypatch.setattr(dg.processes, "IDLE_S", 1.0)
    dg.start_early()
    server = dg.processes._early_server
    try:
        assert server[0].wait(timeout=300) == 0, "no worker took it: it exits after its idle time"
        server[2].seek(0)
        assert b"Traceback" not in server[2].read()
        assert dg.take_early() is None, "an exited parent is not handed out"
    finally:
        dg._stop([server])


def test_the_checkpoints_own_config_says_block_fp8_before_vllm_makes_its_config(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from conftest import REPO

    models = REPO / "bench" / "models"
    args = lambda model, **kw: SimpleNamespace(model=str(model), quantization=None, revision=None, **kw)  # noqa: E731
    assert dg.checkpoint_block_fp8(args(models / "deepseek-v32-2l-fp8")) is True
    assert dg.checkpoint_block_fp8(args(models / "glm5-2l-fp8")) is True
    assert dg.checkpoint_block_fp8(args(models / "deepseek-v32-2l")) is False, "bf16"
    overridden = args(models / "deepseek-v32-2l-fp8")
    overridden.quantization = "bitsandbytes"
    assert dg.checkpoint_block_fp8(overridden) is False, "another --quantization decides"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty hub cache: no file, no network
    assert dg.checkpoint_block_fp8(args("deepseek-ai/DeepSeek-V3.2")) is False


def test_a_parent_started_from_the_checkpoint_ends_when_the_config_says_otherwise(monkeypatch):
    # the checkpoint said block-FP8, the config vLLM made does not (a quantization the peek
    # missed): the parent ends and the mark goes, so no engine process starts one
    from types import SimpleNamespace

    from conftest import REPO
    from vllm.utils import deep_gemm

    monkeypatch.setattr(deep_gemm, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv(dg.EARLY_ENV, raising=False)
    dg.before_engine_config(SimpleNamespace(model=str(REPO / "bench" / "models" / "deepseek-v32-2l-fp8"),
                                            quantization=None, revision=None))
    server = dg.processes._early_server
    assert server is not None and server[0].poll() is None and os.environ[dg.EARLY_ENV] == "1"
    dg.engine_config_made(SimpleNamespace(quant_config=None))
    assert dg.EARLY_ENV not in os.environ and dg.processes._early_server is None
    assert server[0].poll() is not None, "ended"


def test_the_dsa_metadata_parent_starts_with_the_load_of_a_dsa_model_on_deepgemm(monkeypatch, tmp_path):
    """deep_gemm's before_load starts the parent of the DSA indexer's metadata processes for a model
    whose config has ``index_topk`` (DeepSeek-V3.2, GLM-5) on a CUDA device where DeepGEMM runs, and
    for no other; dsa_indexer takes it later and its processes make the calls sent to them."""
    import types

    from transformers import AutoConfig
    from vllm.utils import deep_gemm as vllm_dg

    def worker(device, model):
        hf = AutoConfig.from_pretrained(Path(__file__).parent.parent / "bench" / "models" / model)
        return types.SimpleNamespace(device=torch.device(device), vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_config=hf), quant_config=None,
            parallel_config=types.SimpleNamespace(tensor_parallel_size=1)))

    assert not dg.dsa_metadata_ahead(worker("cuda", "tiny-deepseek-v32"))  # no DeepGEMM on this machine
    monkeypatch.setattr(vllm_dg, "is_deep_gemm_supported", lambda: True)  # an H100 with DeepGEMM
    assert not dg.dsa_metadata_ahead(worker("cpu", "tiny-deepseek-v32"))
    assert not dg.dsa_metadata_ahead(worker("cuda", "tiny-qwen3-next"))
    assert dg.dsa_metadata_ahead(worker("cuda", "glm5-2l-fp8"))
    assert dg.take_metadata_parent() is None
    dg.before_load(worker("cuda", "tiny-deepseek-v32"))  # not block-FP8: no GEMM parent, the DSA one
    parent = dg.take_metadata_parent()
    assert parent is not None and parent[0].poll() is None and dg.take_metadata_parent() is None
    started = dg.start_calls([{"fn": "os:mkdir", "args": [str(tmp_path / "made")]}], 1, "cpu", server=parent)
    assert [o["calls"] for o in dg.finish_children(started)] == [1] and (tmp_path / "made").is_dir()
    dg.before_load(worker("cuda", "tiny-qwen3-next"))
    assert dg.take_metadata_parent() is None
