"""``eager_gemm``'s capture (``kernels/gemm_capture.py``): a pass on the calling thread, each
problem once in the pass's order, a budget cut, a refused capture leaving the GEMMs to run, and
one side stream for every capture of the process. On CPU the GEMMs run rather than being
captured, so each target's warm(m) here records what it got (the GEMMs themselves:
tests/test_family_eager_gemm.py; the memory threads would keep: bench/cublas_threads_memory.py)."""
from __future__ import annotations

import threading
import types

import pytest


def _calls(log):
    """Two targets whose warm(m) records (target, m, thread, inference mode): the shape of a
    pass's ``calls``."""
    import torch

    from kwarm_ext.kernels import eager_gemm

    def warm_of(i):
        def warm(m):
            log.append((i, m, threading.current_thread().name, torch.is_inference_mode_enabled()))
        return warm

    return [(eager_gemm.Target("linear", f"t{i}", 65, 400, 1, None), warm_of(i)) for i in range(2)]


def test_a_pass_runs_on_the_calling_thread_each_problem_once_in_its_order():
    import torch

    from kwarm_ext import budget
    from kwarm_ext.kernels import eager_gemm, gemm_capture

    log = []
    calls = _calls(log)
    order = eager_gemm._order([eager_gemm.fill_counts(65, 400)] * 2, interleave=True)
    with torch.inference_mode():
        warmed, left, mode = gemm_capture.capture(calls, order, True, torch, "cpu")
    assert (warmed, left, mode) == (len(order), 0, "run")
    assert [(i, m) for i, m, _, _ in log] == order, "every problem once, in the pass's order"
    assert {name for _, _, name, _ in log} == {threading.current_thread().name}, "no thread of its own"
    assert all(inference for *_, inference in log)

    log.clear()
    try:
        budget.begin(("seconds", 0.0))
        assert gemm_capture.capture(calls, order, True, torch, "cpu")[:2] == (0, len(order))
        assert log == [], "a spent budget: the whole pass left to the requests"
    finally:
        budget.reset()


class _CaptureRefused(RuntimeError):
    pass


def _fake_cuda_torch(made: list, refuse: bool = False, device: list | None = None):
    """torch with a CUDA device that this CPU host cannot have: its streams are counted in
    `made`; with `refuse`, making one fails as a capture refused inside vLLM would."""
    import torch

    device = device if device is not None else [0]

    def stream():
        if refuse:
            raise _CaptureRefused("operation not permitted when stream is capturing")
        made.append(types.SimpleNamespace(device=torch.device("cuda", device[0])))
        return made[-1]

    cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: device[0], Stream=stream)
    return types.SimpleNamespace(cuda=cuda, device=torch.device)


def test_a_refused_capture_runs_the_gemms_and_says_why(kwarm_env):
    from kwarm_ext.kernels import eager_gemm, gemm_capture

    kwarm_env()
    log = []
    calls = _calls(log)
    order = eager_gemm._order([[65, 73, 81]] * 2, interleave=False)
    fake = _fake_cuda_torch([], refuse=True)
    gemm_capture._capture_stream = None
    warmed, left, mode = gemm_capture.capture(calls, order, False, fake, "cuda")
    assert (warmed, left) == (len(order), 0)
    assert mode == "run (capture failed: _CaptureRefused: operation not permitted when stream is capturing)"
    assert [(i, m) for i, m, _, _ in log] == order
    kwarm_env(KWARM_STRICT="1")
    with pytest.raises(_CaptureRefused):
        gemm_capture.capture(calls, order, False, fake, "cuda")


def test_every_capture_of_the_process_shares_one_side_stream_per_device():
    """One (handle, stream) pair: one cuBLAS workspace for all of kwarm's passes, where a stream
    per pass left one workspace (32 MiB on Hopper) per pass for the life of the process."""
    from kwarm_ext.kernels import gemm_capture

    made, device = [], [0]
    fake = _fake_cuda_torch(made, device=device)
    gemm_capture._capture_stream = None
    try:
        first = gemm_capture.capture_stream(fake)
        assert gemm_capture.capture_stream(fake) is first and len(made) == 1
        device[0] = 1  # another device (a worker that moved): a stream there
        assert gemm_capture.capture_stream(fake) is not first and len(made) == 2
    finally:
        gemm_capture._capture_stream = None
