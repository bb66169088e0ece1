"""``eager_gemm``'s capture threads: a pass dealt to threads, each problem once in the pass's
order, a budget cut on every thread, a failed thread leaving the pass to one thread, and the
thread count. On CPU the GEMMs run rather than being captured, so each target's warm(m) here
records what it got (the GEMMs themselves: tests/test_family_eager_gemm.py; what threads save on
the GPU: the engine benchmark)."""
from __future__ import annotations

import pytest


def _threaded_calls(log, fail_off_main=False):
    """Two targets whose warm(m) records (target, m, thread, inference mode): the shape of a
    pass's ``calls`` (the GEMMs themselves: tests/test_family_eager_gemm.py)."""
    import threading

    import torch

    from kwarm_ext.kernels import eager_gemm

    def warm_of(i):
        def warm(m):
            if fail_off_main and threading.current_thread() is not threading.main_thread():
                raise RuntimeError("operation not permitted when stream is capturing")
            log.append((i, m, threading.current_thread().name, torch.is_inference_mode_enabled()))
        return warm

    return [(eager_gemm.Target("linear", f"t{i}", 65, 400, 1, None), warm_of(i)) for i in range(2)]


def test_a_pass_is_dealt_to_threads_each_problem_once_in_its_order():
    import torch

    from kwarm_ext import budget
    from kwarm_ext.kernels import eager_gemm, gemm_capture

    log = []
    calls = _threaded_calls(log)
    order = eager_gemm._order([eager_gemm.fill_counts(65, 400)] * 2, interleave=True)
    warmed, left, mode = gemm_capture.capture(calls, order, True, torch, "cpu", threads=3)
    assert (warmed, left) == (len(order), 0) and mode == "run on 3 threads"
    assert sorted((i, m) for i, m, _, _ in log) == sorted(order), "every problem once"
    threads = {name for _, _, name, _ in log}
    assert len(threads) == 3 and all(name.startswith("kwarm-eager-gemm") for name in threads)
    for name in threads:  # each thread's share keeps the pass's (spread, round-robin) order
        assert [(i, m) for i, m, n, _ in log if n == name] in [order[k::3] for k in range(3)]
    assert all(inference for *_, inference in log), "inference mode on every thread"

    log.clear()
    try:
        budget.begin(("seconds", 0.0))
        assert gemm_capture.capture(calls, order, True, torch, "cpu", threads=3)[:2] == (0, len(order))
        assert log == [], "a spent budget: every thread's share left to the requests"
    finally:
        budget.reset()


def test_a_thread_that_fails_leaves_the_pass_to_one_thread_with_a_note(kwarm_env):
    import torch

    from kwarm_ext.kernels import eager_gemm, gemm_capture

    kwarm_env()
    log = []
    calls = _threaded_calls(log, fail_off_main=True)
    order = eager_gemm._order([[65, 73, 81]] * 2, interleave=False)
    warmed, left, mode = gemm_capture.capture(calls, order, False, torch, "cpu", threads=2)
    assert (warmed, left) == (len(order), 0)
    assert mode == "run (on 2 threads failed: RuntimeError: operation not permitted when stream is capturing)"
    assert [(i, m) for i, m, _, _ in log] == order, "all of it again, in order, on this thread"
    kwarm_env(KWARM_STRICT="1")
    with pytest.raises(RuntimeError):
        gemm_capture.capture(calls, order, False, torch, "cpu", threads=2)


def test_capture_threads_share_the_ranks_cores_and_the_free_memory_on_cuda_only(monkeypatch):
    from kwarm_ext.surfaces.triton import compile as triton_compile
    from kwarm_ext.kernels import gemm_capture

    threads = gemm_capture.capture_threads
    monkeypatch.setattr(triton_compile.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert threads("cuda", 28487) == gemm_capture.CAPTURE_THREADS == 8
    assert threads("cuda", 28487, tp_size=4) == 4, "four ranks on 16 cores"
    assert threads("cuda", 200) == 3, "at least 64 problems a thread"
    assert threads("cuda", 10) == 1
    # each thread's graph keeps its own pool, about twice the largest output, within what kwarm's bound leaves
    gib = 1 << 30
    assert threads("cuda", 28487, free_bytes=20 * gib, out_bytes=gib) == 8
    assert threads("cuda", 28487, free_bytes=5 * gib, out_bytes=gib) == 2
    assert threads("cuda", 28487, free_bytes=gib, out_bytes=gib) == 1
    assert threads("cpu", 28487) == threads(None, 28487) == 1
