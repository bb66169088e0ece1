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

``--compilers nvcc,nvrtc`` runs every mode once per DeepGEMM JIT compiler (``DG_JIT_USE_NVRTC``
0 or 1, each on its own caches), and ``--time-kernels R`` then times each token count's kernel
R times (CUDA events, median) on each compiler's ``seq`` cache: whether NVRTC's faster compile
costs kernel speed ("may be slower" in DeepGEMM's own words).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


def _kernel_us(n: int, k: int, ms: list[int], repeats: int) -> dict:
    """{M: median microseconds of one ``fp8_gemm_nt`` launch} on this process's DeepGEMM cache
    (each M called once first, so a kernel missing from the cache compiles outside the timing)."""
    import statistics
    import torch
    from kwarm_ext.kernels.deep_gemm import run_counts
    w, ws, buffers = _tensors(n, k, max(ms))
    job = {"kind": "linear", "w": w, "ws": ws}
    out = {}
    for m in ms:
        run_counts([job], [[(m, None, None)]], buffers)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_counts([job], [[(m, None, None)]], buffers)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        out[m] = round(statistics.median(times), 2)
    return out


def _in_process(cache: str, nvrtc: bool, call: str) -> subprocess.CompletedProcess:
    """Run ``deepgemm_jit.<call>`` in a new Python with `cache` as DG_JIT_CACHE_DIR and the chosen
    compiler (DeepGEMM reads both once per process, so each mode needs its own process). Not in
    the repository root, where ``-c`` would import the source kwarm_ext (no kernels)."""
    env = dict(os.environ, DG_JIT_CACHE_DIR=cache, DG_JIT_USE_NVRTC="1" if nvrtc else "0")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import deepgemm_jit as d; print(repr({call}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(cache), env=env)


def _worker(args: tuple) -> float:  # one spawned process: its slice of M
    cache, nvrtc, n, k, ms = args
    os.environ["DG_JIT_CACHE_DIR"] = cache
    os.environ["DG_JIT_USE_NVRTC"] = "1" if nvrtc else "0"
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
    p.add_argument("--compilers", default="nvcc", help="comma list: nvcc, nvrtc (DG_JIT_USE_NVRTC=1)")
    p.add_argument("--time-kernels", type=int, default=0, metavar="R",
                   help="time each kernel R times on each compiler's seq cache (0: no timing)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n, k = (int(x) for x in args.shape.lower().split("x"))
    compilers = args.compilers.split(",")
    bad = [c for c in compilers if c not in ("nvcc", "nvrtc")]
    if bad:
        p.error(f"--compilers: {bad[0]!r} is neither nvcc nor nvrtc")
    root = tempfile.mkdtemp(prefix="kwarm-dg-")
    os.environ["DG_JIT_CACHE_DIR"] = os.path.join(root, "main")
    ms = m_values(args.m_values, n, args.max_tokens)
    if args.limit and len(ms) > args.limit:
        ms = [ms[i * len(ms) // args.limit] for i in range(args.limit)]
    print(f"deepgemm_jit: fp8_gemm_nt N={n} K={k}, {len(ms)} token counts ({args.m_values})", flush=True)
    rows = []
    timings = {}
    for compiler in compilers:
        nvrtc = compiler == "nvrtc"
        procs_cache = seq_cache = None
        for mode in args.modes.split(","):
            kind, _, w = mode.partition(":")
            workers = int(w or 1)
            cache = os.path.join(root, compiler, mode.replace(":", "-"))
            os.makedirs(cache, exist_ok=True)
            error = ""
            t0 = time.perf_counter()
            if kind == "procs":
                import multiprocessing as mp
                slices = [ms[i::workers] for i in range(workers)]
                with mp.get_context("spawn").Pool(workers) as pool:
                    pool.map(_worker, [(cache, nvrtc, n, k, s) for s in slices])
                procs_cache = cache
            else:
                res = _in_process(cache, nvrtc, f"d._run({n}, {k}, {ms!r}, {workers})")
                if res.returncode:
                    error = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
                    print(res.stderr[-2000:])
                elif kind == "seq":
                    seq_cache = cache
            s = time.perf_counter() - t0
            row = {"compiler": compiler, "mode": mode, "wall_s": round(s, 2), "kernels": _kernels(cache)}
            if error:
                row["error"] = error
            rows.append(row)
            print(f"  {compiler:5} {mode:12} {s:7.2f} s wall (incl. start-up), {row['kernels']} kernels compiled"
                  + (f", failed: {error}" if error else ""), flush=True)
        if procs_cache:
            t0 = time.perf_counter()
            res = _in_process(procs_cache, nvrtc, f"d._run({n}, {k}, {ms!r}, 1)")
            s = time.perf_counter() - t0
            rows.append({"compiler": compiler, "mode": "seq-on-procs-cache", "wall_s": round(s, 2),
                         "inner_s": res.stdout.strip()[-20:], "kernels": _kernels(procs_cache)})
            print(f"  {compiler:5} seq on the procs cache: {s:.2f} s wall, loop {res.stdout.strip()[-20:]} s", flush=True)
        if args.time_kernels and seq_cache:
            res = _in_process(seq_cache, nvrtc, f"d._kernel_us({n}, {k}, {ms!r}, {args.time_kernels})")
            if res.returncode:
                print(f"  {compiler:5} kernel timing failed: {res.stderr.strip()[-300:]}", flush=True)
            else:
                import ast
                timings[compiler] = ast.literal_eval(res.stdout.strip().splitlines()[-1])
                print(f"  {compiler:5} kernel us: {timings[compiler]}", flush=True)
    result = {"n": n, "k": k, "m_values": len(ms), "rows": rows}
    if timings:
        result["kernel_us"] = {c: {str(m): us for m, us in t.items()} for c, t in timings.items()}
    if "nvcc" in timings and "nvrtc" in timings:
        import math
        ratios = [timings["nvrtc"][m] / timings["nvcc"][m] for m in ms if timings["nvcc"].get(m)]
        if ratios:
            result["nvrtc_over_nvcc"] = {"geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                                         "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
            print(f"  kernel time nvrtc/nvcc: {result['nvrtc_over_nvcc']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
