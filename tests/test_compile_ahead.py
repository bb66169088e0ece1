"""Compile ahead (``fused_moe`` step 3): launches of one kernel become compiles on Triton's
AsyncCompileMode pool while vLLM's own code computes their arguments.

On CPU, Triton's ``@triton.jit`` is its interpreter, which has no compile to defer, so the
kernel is stood in for by a subclass of Triton's real ``KernelInterface`` (whose
``kernel[grid](...)`` is what vLLM calls) with a recording ``run``; Triton's real
``AsyncCompileMode`` and kwarm's real ``parallel_compiles`` run. What it saves on a GPU is in
BENCHMARKS.md (the family's seconds on empty caches)."""
from __future__ import annotations

import pytest
from triton.runtime.jit import KernelInterface

from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.kernels import fused_moe


class Kernel(KernelInterface):
    def __init__(self):
        self.calls = []

    def run(self, *args, grid, warmup, **kwargs):
        from triton.runtime import _async_compile

        self.calls.append((args, grid, warmup, _async_compile.active_mode.get() is not None))
        return "compiled" if warmup else "launched"


def test_launches_compile_only_turns_launches_into_compiles_for_one_kernel():
    kernel, other = Kernel(), Kernel()
    with triton_compile.launches_compile_only(kernel):
        assert kernel[(4,)](1, 2) == "compiled"
        assert other[(4,)](1, 2) == "launched", "other kernels launch as usual"
    assert kernel[(4,)](3) == "launched", "restored on leaving"
    assert kernel.calls == [((1, 2), (4,), True, False), ((3,), (4,), False, False)]
    assert "run" not in vars(kernel)


def test_launches_compile_only_restores_after_an_exception():
    kernel = Kernel()
    with pytest.raises(RuntimeError):
        with triton_compile.launches_compile_only(kernel):
            raise RuntimeError("dummy run failed")
    assert kernel[(1,)]() == "launched"


@pytest.fixture
def moe_kernel(monkeypatch):
    kernel = Kernel()
    resolved = triton_compat.ResolvedKernel(fused_moe._KERNEL_MODULE, fused_moe.KERNEL, kernel, kernel)
    monkeypatch.setattr(triton_compat, "resolve", lambda module, qualname: resolved)
    return kernel


def test_compile_ahead_runs_every_size_on_the_pool_without_launching(moe_kernel):
    seen = []

    def dummy_run(m):  # what vLLM's fused-MoE layer does with the token count
        seen.append(m)
        moe_kernel[(m,)](m)

    text = fused_moe.compile_ahead(dummy_run, [40, 48, 513], threads=4)
    assert text.startswith("compiled ahead on 4 threads in ")
    assert seen == [40, 48, 513]
    assert moe_kernel.calls == [((m,), (m,), True, True) for m in (40, 48, 513)], \
        "compile-only launches, inside AsyncCompileMode"


def test_compile_ahead_without_a_pool_or_kernel_says_why(moe_kernel, monkeypatch):
    assert fused_moe.compile_ahead(lambda m: None, [40], threads=1).startswith("no compile ahead (one thread")
    assert fused_moe.compile_ahead(lambda m: None, [], threads=4) == "nothing to compile ahead"

    def unresolvable(module, qualname):
        raise triton_compat.Unresolvable("interpreted")

    monkeypatch.setattr(triton_compat, "resolve", unresolvable)
    assert fused_moe.compile_ahead(lambda m: None, [40], threads=4) == "no compile ahead (interpreted)"
    assert moe_kernel.calls == []


def test_a_failing_compile_ahead_is_one_warning_then_strict_raises(moe_kernel, kwarm_env, kwarm_log):
    def dummy_run(m):
        raise ValueError("shape")

    kwarm_env()
    assert fused_moe.compile_ahead(dummy_run, [40], threads=4) == "compile ahead failed (ValueError)"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and warnings[0].startswith("kwarm: fused_moe: compile ahead failed"), warnings
    assert "run" not in vars(moe_kernel)

    kwarm_env(KWARM_STRICT="1")
    with pytest.raises(ValueError):
        fused_moe.compile_ahead(dummy_run, [40], threads=4)


def test_a_worker_without_peers_is_alone():
    """Without torch.distributed peers the probe's time may decide; the GPU runs cover the
    rule itself (BENCHMARKS.md: the probe took 1.59 s on empty caches, 0.07 s warm)."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    assert fused_moe.one_process() is True


def test_triton_attn_compile_ahead_failing_is_one_warning_naming_the_group(monkeypatch, kwarm_env, kwarm_log):
    import types

    from kwarm_ext.kernels import triton_attn

    kernel = Kernel()
    monkeypatch.setattr(triton_compat, "resolve",
                        lambda module, qualname: triton_compat.ResolvedKernel(module, qualname, kernel, kernel))

    def run_batch(target, batch):
        raise RuntimeError("builder")

    monkeypatch.setattr(triton_attn, "run_batch", run_batch)
    target = types.SimpleNamespace(label="group 3")
    kwarm_env()
    text = triton_attn.compile_ahead(target, {"kernel_unified_attention": kernel}, [triton_attn.Batch(1, 1)], 4)
    assert text == "compile ahead failed (RuntimeError)"
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and warnings[0].startswith("kwarm: triton_attn: group 3: compile ahead failed"), warnings
    assert "run" not in vars(kernel)


@pytest.mark.parametrize("probe_extra_s, compiles_ahead", [(1.6, True), (0.0, False)])
def test_the_probe_against_its_rerun_decides_the_compile_ahead_pass(monkeypatch, probe_extra_s, compiles_ahead):
    """Alone, where Triton's cache cannot be counted (a cache manager of the user's own), the
    pass runs when the probe took ``COLD_PROBE_S`` longer than its rerun (it compiled), not
    when it was slow only because the forward is (a warm restart beside other engines): the
    dummy runs call vLLM's real ``try_get_optimal_moe_config`` by its module."""
    import time

    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    # a wider margin than production's 0.3 s: under pytest -n 6 on a loaded host the probe's own
    # first calls once took 0.3 s more than its rerun with nothing compiled
    monkeypatch.setattr(fused_moe, "COLD_PROBE_S", 1.0)
    assert triton_compile.disk_cache_entries() is None
    config_fn = fm.try_get_optimal_moe_config

    def probe(runs):
        time.sleep(0.1 + (probe_extra_s if len(runs) == 1 else 0.0))  # a slow forward, and the probe's compiles

    runs, passes, details = _warm_eager_sizes(monkeypatch, probe)
    assert runs[:2] == [33, 33], "the probe, then its rerun"
    assert bool(passes) is compiles_ahead, details["summary"]
    assert "its rerun" in details["summary"]
    assert fm.try_get_optimal_moe_config is config_fn


def _warm_eager_sizes(monkeypatch, forward) -> tuple:
    """``warm_eager_sizes`` alone over M 33..64, with dummy runs that call `forward` (given the
    counts run so far) and vLLM's real ``try_get_optimal_moe_config`` by its module, and the
    compile-ahead pass recorded instead of run: (the counts run, the passes, the details)."""
    import vllm.platforms
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    # the only part of the GPU vLLM's config lookup asks for (its tuned tables are per device)
    monkeypatch.setattr(vllm.platforms.current_platform, "get_device_name", lambda device_id=0: "NVIDIA H200")
    runs, passes, details = [], [], {}

    def dummy_run(m):
        runs.append(m)
        forward(runs)
        fm.try_get_optimal_moe_config((8, 512, 1024), (8, 1024, 256), 2, None, m, None)

    monkeypatch.setattr(fused_moe, "compile_ahead", lambda run, sizes, threads: passes.append(sizes) or "compiled ahead")
    # the lookup's own first call (its tuned table read from disk: 0.47 s on a loaded 2-core CI machine)
    # is not what the probe measures: made before, as vLLM's profile run has made it in an engine
    fm.try_get_optimal_moe_config((8, 512, 1024), (8, 1024, 256), 2, None, 1, None)
    fused_moe.warm_eager_sizes(fm.try_get_optimal_moe_config, dummy_run, 33, 64, threads=4, alone=True,
                               details=details)
    return runs, passes, details


@pytest.mark.parametrize("probe_compiles", [True, False])
def test_what_the_probe_added_to_tritons_cache_decides_the_compile_ahead_pass(monkeypatch, tmp_path, probe_compiles):
    """Where Triton's on-disk cache can be counted, the kernels the probe added to it decide,
    not its time: a warm probe slower than its rerun (loads, first calls) skips the pass, and
    no rerun runs. The probe's compile is Triton's real ``FileCacheManager`` writing a kernel
    under ``TRITON_CACHE_DIR`` (the interpreter compiles nothing, so the test stands in for
    it as a GPU's Triton: ``interpreted`` False)."""
    import time

    from triton.runtime.cache import get_cache_manager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    monkeypatch.setattr(triton_compat, "interpreted", lambda: False)
    assert triton_compile.disk_cache_entries() == 0, "a cache directory not made yet holds nothing"
    get_cache_manager("a" * 64).put(b"cubin", "earlier.cubin")  # a kernel from an earlier start
    assert triton_compile.disk_cache_entries() == 1

    def probe(runs):
        if len(runs) == 1:
            time.sleep(0.8)  # slow either way: a compile, or a warm probe's loads and first calls
            if probe_compiles:
                get_cache_manager("b" * 64).put(b"cubin", "fused_moe_kernel.cubin")

    runs, passes, details = _warm_eager_sizes(monkeypatch, probe)
    assert runs.count(33) == 1, "no rerun: the cache was counted"
    assert bool(passes) is probe_compiles, details["summary"]
    assert f"{int(probe_compiles)} kernels new in Triton's cache" in details["summary"]


def test_a_cache_manager_of_the_users_own_is_not_counted(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_compat, "interpreted", lambda: False)
    assert triton_compile.disk_cache_entries() == 0
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton.runtime.cache:FileCacheManager")
    # a wider margin than production's 0.3 s: under pytest -n 6 on a loaded host the probe's own
    # first calls once took 0.3 s more than its rerun with nothing compiled
    monkeypatch.setattr(fused_moe, "COLD_PROBE_S", 1.0)
    assert triton_compile.disk_cache_entries() is None
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    monkeypatch.setattr(triton_compat, "interpreted", lambda: True)
    assert triton_compile.disk_cache_entries() is None, "the interpreter writes no kernel"


def test_token_counts_over_the_memory_bound_are_left_to_the_requests_not_the_whole_step(monkeypatch):
    """At vLLM's default memory utilization the largest eager token counts may not fit kwarm's
    bound: the first that runs out of memory (torch's real OutOfMemoryError) ends the pass there,
    the smaller ones stay warmed, and the report's left-to-requests item says which counts."""
    import torch

    def forward(runs):
        if len(runs) > 1 and runs[-1] >= 37:  # past the probe (M 33): the larger counts
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 514.00 MiB")

    runs, passes, details = _warm_eager_sizes(monkeypatch, forward)
    sizes = details["token_counts"]
    big = [m for m in sizes if m >= 37]
    assert len(big) >= 2 and runs[-1] == big[0], "no larger count after the first that did not fit"
    assert [m for m in runs if m != 33][:-1] == [m for m in sizes if 33 < m < 37], "the smaller ones ran"
    assert details["left_to_requests"] == [{"count": len(big), "what": "fused-MoE token counts",
                                            "why": f"M {big[0]}..{big[-1]}: out of memory within kwarm's bound"}]
    assert f"M {big[0]}..{big[-1]} over kwarm's memory bound" in details["summary"]
