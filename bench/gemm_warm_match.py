#!/usr/bin/env python3
"""When does a GEMM warmed at an exact token count still pay a first-call cost? (GPU host)

    python bench/gemm_warm_match.py

In the engine benchmark (vLLM 0.24.0, request 0 under cProfile) request 0's 12 ``torch.mm`` calls at M = 200
cost 0.13 ms more than in its repeat although ``eager_gemm`` had run every weight shape at
M = 200 through the layers' own ``F.linear``. Each case below warms fresh token counts one way
and then times the first and second call made another way (CPU ms summed over the weight
shapes): same way (control), another thread, another CUDA stream, a padded row stride, an
input not 256-byte aligned, after ``torch.cuda.empty_cache()`` (vLLM empties the cache after
CUDA-graph capture, after kwarm's warmup), and after capturing a CUDA graph (vLLM captures
its graphs between kwarm's warmup and the first request; this case came after the run in
``bench/results/gemm-warm-match-h200``). It also times fresh allocations after
``empty_cache`` (and after refilling the small pool), the first replay of a CUDA graph, and a
warmed problem after 9,000 others, with cuBLASLt's heuristics cache at its default capacity
and raised by kwarm's ``eager_gemm`` (needs kwarm installed). Not part of kwarm.
"""
import json
import threading

import torch
import torch.nn.functional as F

from gemm_first_call import SHAPES, timed  # (K, N) weight shapes; (CPU ms, wall ms) of one call

DT = torch.bfloat16


def cpu_ms(fn):
    return timed(fn)[0]


def weights():
    return [torch.randn(n, k, device="cuda", dtype=DT) for k, n in SHAPES]


def warm(ws, m):
    with torch.inference_mode():
        for w in ws:
            F.linear(torch.zeros(m, w.shape[1], device="cuda", dtype=DT), w)


def probe(ws, m, make_input, stream=None):
    """First and second call, summed over shapes, of mm(input, w.t(), out=...)."""
    calls = []
    for w in ws:
        a = make_input(m, w.shape[1])
        out = torch.empty(m, w.shape[0], device="cuda", dtype=DT)
        ctx = torch.cuda.stream(stream) if stream is not None else torch.inference_mode()
        with ctx:
            calls.append((cpu_ms(lambda: torch.mm(a, w.t(), out=out)), cpu_ms(lambda: torch.mm(a, w.t(), out=out))))
    return round(sum(c[0] for c in calls), 3), round(sum(c[1] for c in calls), 3)


def contiguous(m, k):
    return torch.randn(m, k, device="cuda", dtype=DT)


def padded(m, k):
    return torch.randn(m, k + 64, device="cuda", dtype=DT)[:, :k]


def misaligned(m, k):
    return torch.randn(m * k + 8, device="cuda", dtype=DT)[8:].view(m, k)


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")
    ws = weights()
    warm(ws, 100)
    m = 200

    def case(name, make_input=contiguous, warm_fn=warm, before_probe=None, stream=None):
        nonlocal m
        m += 11  # a token count no case ran before
        cold = probe(ws, m + 5, make_input, stream)  # a count never warmed: what warming saves
        warm_fn(ws, m)
        if before_probe:
            before_probe()
        first, second = probe(ws, m, make_input, stream)
        print(json.dumps({"case": name, "M": m, "first_ms": first, "second_ms": second,
                          "never_warmed_first_ms": cold[0]}), flush=True)

    case("control: warmed by F.linear, called by mm(out=)")
    case("input with a padded row stride", padded)
    case("input not 256-byte aligned", misaligned)
    case("called on another CUDA stream", stream=torch.cuda.Stream())
    case("after torch.cuda.empty_cache()", before_probe=torch.cuda.empty_cache)

    def warm_in_thread(ws_, m_):
        t = threading.Thread(target=warm, args=(ws_, m_))
        t.start()
        t.join()

    case("warmed in another thread", warm_fn=warm_in_thread)

    side = torch.cuda.Stream()
    graphs = []  # kept alive, as vLLM keeps its graphs

    def capture_a_graph(empty=True, gemm_after=False):
        """What vLLM's capture_model does in between, in small: GEMMs on a side stream, then
        one captured into a CUDA graph (torch's recipe: warm on the side stream first),
        ``empty_cache``; with `gemm_after`, one GEMM at another M on the main stream, as
        vLLM's own post-capture dummy run (at max_num_reqs tokens) does."""
        def go():
            a = torch.randn(16, SHAPES[0][0], device="cuda", dtype=DT)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for w in ws:
                    torch.mm(torch.randn(16, w.shape[1], device="cuda", dtype=DT), w.t())
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.mm(a, ws[0].t())
            graph.replay()
            graphs.append(graph)
            if empty:
                torch.cuda.empty_cache()
            if gemm_after:
                with torch.inference_mode():
                    for w in ws:
                        F.linear(torch.zeros(7, w.shape[1], device="cuda", dtype=DT), w)
        return go

    for label, kw in (("after a CUDA-graph capture and empty_cache", {}),
                      ("after a CUDA-graph capture, no empty_cache", {"empty": False}),
                      ("after a CUDA-graph capture, empty_cache, GEMMs at M=7", {"gemm_after": True})):
        try:
            case(label, before_probe=capture_a_graph(**kw))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(json.dumps({"case": label, "error": repr(exc)}), flush=True)

    def rewarm_after_capture(ws_, m_):
        """Warm before the capture, capture, then warm again at the same M after it."""
        warm(ws_, m_)
        capture_a_graph()()
        warm(ws_, m_)

    case("warmed, captured, warmed again after the capture", warm_fn=rewarm_after_capture)

    # the caching allocator after empty_cache: 15 fresh 0.8 MB tensors, then the same again;
    # then after re-filling the cache with one large block, and with small (<= 1 MB) blocks
    shape = (200, 16, 128)

    def fifteen():
        return [torch.empty(shape, device="cuda", dtype=DT) for _ in range(15)]

    def refill_large():
        del_me = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
        del del_me

    def refill_small():
        blocks = [torch.empty(1 << 20, device="cuda", dtype=torch.uint8) for _ in range(64)]
        del blocks

    for label, refill in (("", None), (", cache refilled with one 256 MB block", refill_large),
                          (", cache refilled with 64 x 1 MB blocks", refill_small)):
        torch.cuda.empty_cache()
        if refill:
            refill()
        first = cpu_ms(fifteen)
        second = cpu_ms(fifteen)
        print(json.dumps({"case": "15 x torch.empty 0.8 MB after empty_cache" + label,
                          "first_ms": first, "second_ms": second}), flush=True)

    # cuBLASLt's heuristics cache (8192 entries by default, least recently used out first):
    # warm M for the 5 shapes, then 9,000 other problems, then the first call at M again;
    # then the same after kwarm's eager_gemm raised the capacity (kwarm installed)
    def evicted(label, m, others_from):
        warm(ws, m)
        with torch.inference_mode():
            for w in ws:
                rows = torch.zeros(others_from + 1800, w.shape[1], device="cuda", dtype=DT)
                for o in range(others_from, others_from + 1800):
                    F.linear(rows[:o], w)
        first, second = probe(ws, m, contiguous)
        print(json.dumps({"case": label, "M": m, "first_ms": first, "second_ms": second}), flush=True)

    evicted("warmed, then 9000 other GEMM problems (default heuristics cache)", 400, 2000)
    try:
        from kwarm_ext.kernels.cublaslt import reserve_heuristics_cache
    except ImportError as exc:
        print(json.dumps({"case": "heuristics cache raised", "error": repr(exc)}), flush=True)
    else:
        print(json.dumps({"case": "reserve_heuristics_cache(40000)",
                          "before_after_reason": reserve_heuristics_cache(40000)}), flush=True)
        evicted("warmed, then 9000 other GEMM problems (heuristics cache raised to 40000)", 410, 4000)

    # first replay of a freshly captured graph of 200 small kernels against its second
    x = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for _ in range(200):
            x.add_(1)
    print(json.dumps({"case": "first replay of a 200-kernel graph", "first_ms": cpu_ms(g.replay),
                      "second_ms": cpu_ms(g.replay)}), flush=True)


if __name__ == "__main__":
    main()
