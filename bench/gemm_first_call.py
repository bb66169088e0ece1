#!/usr/bin/env python3
"""First-call cost of cuBLAS GEMMs per exact shape (GPU host): is it per shape class or per M?

    python bench/gemm_first_call.py

Prints, per (backend, layout, M, K, N), the CPU time of the mm call and its wall time with a
synchronize, for M values seen before (by a warm-up at other M) and not. Explains the residual
in request 0 of the engine benchmark (BENCHMARKS.md); not part of kwarm.
"""
import json
import os
import time

import torch

SHAPES = [(1024, 2048), (2048, 1024), (1024, 576), (512, 1024), (7168, 1536)]


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) * 1e3, 3), round((time.perf_counter() - t0) * 1e3, 3)


def run(label, ms, transposed, quiet=False):
    weights = {}
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        weights[(k, n)] = w.t() if transposed else w.t().contiguous()
    rows = []
    for m in ms:
        cpu = []
        for (k, n), w in weights.items():
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cpu.append(timed(lambda: torch.mm(a, w))[0])
        rows.append({"run": label, "M": m, "cpu_ms_per_shape": cpu, "sum_ms": round(sum(cpu), 2)})
        if not quiet:
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    print("CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING"), torch.__version__,
          torch.cuda.get_device_name(), flush=True)
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")
    seq = [64, 64, 200, 200, 201, 37, 333, 1332, 1332, 1333, 4096, 4100, 200, 8192, 8200, 16384, 16000]
    run("default transposed-weight (Inductor's mm)", seq, True)
    run("default contiguous", [64, 200, 300, 300, 301, 1332, 1400], False)
    ladder = list(range(33, 1200, 7))
    t0 = time.perf_counter()
    rows = run("ladder", ladder, True, quiet=True)
    print("ladder 33..1200 step 7:", round(time.perf_counter() - t0, 2), "s; first-call ms per M:",
          [r["sum_ms"] for r in rows[:12]], flush=True)
    run("after ladder (neighbours of ladder points)", [250, 251, 600, 601, 1100, 1101], True)
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        run("cublaslt transposed-weight", [64, 210, 210, 211, 1500, 1501], True)
    except Exception as exc:  # older torch
        print("cublaslt:", exc)

if __name__ == "__main__":
    main()
