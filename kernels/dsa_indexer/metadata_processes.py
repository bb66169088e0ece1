"""dsa_indexer, the schedule metadata's row classes on deep_gemm's compile processes (see
:func:`warm_metadata`); the calls themselves are ``mqa_logits``'s, which hands them over."""
from __future__ import annotations

from kwarm_ext.kernels.dsa_indexer.common import _device, _synchronize


def warm_metadata(view, calls: list, described: list, warm) -> list:
    """The schedule metadata of every row class. Each class is a DeepGEMM kernel of its own, built
    with NVCC while DeepGEMM's binding holds the GIL (2-4 s each, one after another: 30 s of tiny
    DeepSeek-V3.2's start on the H200 at 256 sequences): all but the first go to deep_gemm's
    compile processes (forked by one parent that imports torch and vLLM once; ``deep_gemm``'s
    ``before_load`` starts it as the model loads, else it starts now), while this process
    calls the first. If that call was quick, DeepGEMM's cache already held the kernels (a
    restart): the processes are stopped and the rest load here. Then every class is called here,
    so that this process has them loaded. `calls`: one call per class, made here (``warm(view,
    calls)``); `described`: the same for all but the first, as the processes make them."""
    import time

    import torch

    from kwarm_ext import memory
    from kwarm_ext.log import fail_open

    device = _device(view)
    note = []
    if device.type == "cuda" and described and all(described):
        from kwarm_ext.kernels.deep_gemm import compile_processes
        from kwarm_ext.kernels.deep_gemm import processes

        children, short = memory.processes_that_fit(min(len(described), compile_processes(view.tp_size)))
        if children < 1:
            return warm(view, calls) + [f"compiled here, one at a time: {short}"]
        with fail_open("dsa_indexer: the metadata compile processes failed; compiling here, one at a time") as outcome:
            t0 = time.perf_counter()
            parent = processes.take_metadata_parent()  # started as the model loaded (deep_gemm.before_load)
            started = processes.start_calls(described, children, str(device), server=parent)
            try:
                with torch.inference_mode():
                    calls[0](device)
                _synchronize(device)
            except BaseException:
                processes.cancel_children(started)
                raise
            probe_s = time.perf_counter() - t0
            if probe_s < processes.COMPILE_S:
                processes.cancel_children(started)
                note = [f"first class loaded in {probe_s:.2f} s: DeepGEMM's cache holds them, no compile processes"]
            else:
                outcomes = processes.finish_children(started)
                note = [f"{len(described)} classes on {children} compile processes{' (' + short + ')' if short else ''} "
                        f"({'parent started with the model load' if parent else 'parent started now'}): "
                        f"{sum(o['compiles'] for o in outcomes)} compiled, ready in "
                        f"{max(o['ready'] for o in outcomes):.1f} s, done in {time.perf_counter() - t0:.1f} s"]
        if outcome.error is not None:
            note = [f"compile processes failed ({type(outcome.error).__name__})"]
    return warm(view, calls) + note
