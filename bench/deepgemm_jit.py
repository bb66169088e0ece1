"""How fast DeepGEMM's JIT compiles the kernels of vLLM's DeepGEMM warmup, one by one and in
parallel (issue 15, FP8). GPU host only; vLLM's bundled DeepGEMM.

    python bench/deepgemm_jit.py --shape 7168x2048 --m-values relax --workers 1,8 --out dg.json

For each mode, an empty ``DG_JIT_CACHE_DIR`` and the same list of token counts (M) for
``fp8_gemm_nt`` on a block-FP8 weight of shape N x K (vLLM's own list: ``relax`` = the config
boundaries of ``VLLM_DEEP_GEMM_WARMUP=relax``, ``full`` = 1..max_tokens, or ``first:N``):

- ``threads:W``  W Python threads in this process (tells whether DeepGEMM's binding releases
  the GIL while its compiler runs);
- ``procs:W``    W processes (spawned; each its own CUDA context and tensors) over slices of M;
- ``seq``        one by one, as vLLM's warmup runs them.

Reports seconds and the kernels written to the cache per mode, then ``seq`` again on the
cache that ``procs`` left (what vLLM's warmup costs once the kernels are on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _tensors(n: int, k: int, max_m: int):
    """The block-FP8 weight and its scales, and scratch for up to `max_m` tokens laid out as
    kwarm's deep_gemm family passes it to :func:`run_counts` (flat activations, scales, outputs)."""
    import torch
    w = torch.randn((n, k), device="cuda").to(torch.float8_e4m3fn)
    ws = torch.ones(((n + 127) // 128, (k + 127) // 128), device="cuda", dtype=torch.float32)
    buffers = {"a": torch.randn(max_m * k, device="cuda").to(torch.float8_e4m3fn),
               "scale": torch.ones(max_m * ((k + 127) // 128), device="cuda", dtype=torch.float32),
               "out": torch.empty(max_m * n, device="cuda", dtype=torch.bfloat16)}
    return w, ws, buffers


def _run(n: int, k: int, ms: list[int], threads: int = 1) -> float:
    """Seconds for vLLM's ``fp8_gemm_nt`` at each token count in `ms`, called as kwarm's
    deep_gemm family calls it (``run_counts``), one by one or from `threads` threads."""
    import torch
    from kwarm_ext.kernels.deep_gemm import run_counts
    w, ws, buffers = _tensors(n, k, max(ms))
    job = {"kind": "linear", "w": w, "ws": ws}
    torch.cuda.synchronize()

    def one(m: int) -> None:
        run_counts([job], [[(m, None, None)]], buffers)

    t0 = time.perf_counter()
    if threads <= 1:
        for m in ms:
            one(m)
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, ms))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _worker(args: tuple) -> float:  # one spawned process: its slice of M
    cache, n, k, ms = args
    os.environ["DG_JIT_CACHE_DIR"] = cache
    return _run(n, k, ms)


def _kernels(cache: str) -> int:
    from kwarm_ext.kernels.deep_gemm import cached_kernels
    return cached_kernels(cache)


def m_values(spec: str, n: int, max_tokens: int) -> list[int]:
    if spec.startswith("first:"):
        return list(range(1, int(spec.split(":")[1]) + 1))
    if spec == "full":
        return list(range(1, max_tokens + 1))
    import torch
    from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values
    return _generate_optimal_warmup_m_values(max_tokens, n, torch.device("cuda:0"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="7168x2048", help="N x K of the FP8 weight")
    p.add_argument("--m-values", default="relax", help="relax | full | first:N")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--limit", type=int, default=0, help="at most this many token counts, evenly spaced")
    p.add_argument("--modes", default="threads:8,procs:8,seq", help="comma list: seq, threads:W, procs:W")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n, k = (int(x) for x in args.shape.lower().split("x"))
    root = tempfile.mkdtemp(prefix="kwarm-dg-")
    os.environ["DG_JIT_CACHE_DIR"] = os.path.join(root, "main")
    ms = m_values(args.m_values, n, args.max_tokens)
    if args.limit and len(ms) > args.limit:
        ms = [ms[i * len(ms) // args.limit] for i in range(args.limit)]
    print(f"deepgemm_jit: fp8_gemm_nt N={n} K={k}, {len(ms)} token counts ({args.m_values})", flush=True)
    rows = []
    procs_cache = None
    for mode in args.modes.split(","):
        kind, _, w = mode.partition(":")
        workers = int(w or 1)
        cache = os.path.join(root, mode.replace(":", "-"))
        if kind == "procs":
            import multiprocessing as mp
            slices = [ms[i::workers] for i in range(workers)]
            t0 = time.perf_counter()
            with mp.get_context("spawn").Pool(workers) as pool:
                pool.map(_worker, [(cache, n, k, s) for s in slices])
            s = time.perf_counter() - t0
            procs_cache = cache
        else:
            # DeepGEMM reads DG_JIT_CACHE_DIR once per process: separate modes need their own process
            import subprocess
            code = (f"import os, sys; os.environ['DG_JIT_CACHE_DIR'] = {cache!r}; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import deepgemm_jit as d; print(d._run({n}, {k}, {ms!r}, {workers}))")
            t0 = time.perf_counter()
            # not in the repository root, where `-c` would import the source kwarm_ext (no kernels)
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
            s = time.perf_counter() - t0
            if res.returncode:
                print(res.stderr[-2000:])
        row = {"mode": mode, "wall_s": round(s, 2), "kernels": _kernels(cache)}
        rows.append(row)
        print(f"  {mode:12} {s:7.2f} s wall (incl. start-up), {row['kernels']} kernels compiled", flush=True)
    if procs_cache:
        import subprocess
        code = (f"import os, sys; os.environ['DG_JIT_CACHE_DIR'] = {procs_cache!r}; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import deepgemm_jit as d; print(d._run({n}, {k}, {ms!r}, 1))")
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
        s = time.perf_counter() - t0
        rows.append({"mode": "seq-on-procs-cache", "wall_s": round(s, 2), "inner_s": res.stdout.strip()[-20:],
                     "kernels": _kernels(procs_cache)})
        print(f"  seq on the procs cache: {s:.2f} s wall, loop {res.stdout.strip()[-20:]} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"n": n, "k": k, "m_values": len(ms), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
