#!/usr/bin/env python3
"""How few GEMMs must run at start so that the first request pays no cuBLAS first call?
(GPU host, torch alone; not part of kwarm)

    python bench/gemm_coverage.py [--model deepseek-v32|qwen3-next] [--out FILE.json]

The weight shapes are those of the unquantized linear layers, the LM head and (DeepSeek-V3.2)
MLA's absorbed BMMs of the published-dimension bench models (``bench/models/``). Each variant
runs in a fresh process, because cuBLAS's choices and the driver's loaded kernels live for the
process:

- ``none``: nothing warmed;
- ``exec-grid``: each GEMM run once at every token count of the geometric grid
  (``kernels/eager_gemm.kernel_grid``);
- ``capture-grid``: the same problems captured into a CUDA graph that is never replayed:
  cuBLAS chooses and the driver loads each kernel, the GPU computes nothing;
- ``capture-dense``: captured at every token count of the old dense grid (every one up to 64,
  then every 8th).

Then, in the same process, a probe times the first call of every shape (CPU ms, GPU idle
before it) at token counts of three kinds: on the grid, off the grid (random), and the engine
scenario's eager counts. A first call over 1 ms is counted as a kernel load. What a variant
leaves to the requests is the probe's excess over the same calls repeated.
"""
import argparse
import json
import random
import subprocess
import sys
import time

# (K, N) of each weight: y = x @ W.t(), W of shape (N, K)
LINEAR = {
    "deepseek-v32": [(7168, 2112), (1536, 24576), (512, 32768), (16384, 7168), (7168, 36864),
                     (18432, 7168), (7168, 4096), (2048, 7168), (7168, 256), (1536, 8192),
                     (7168, 128), (7168, 64)],
    "qwen3-next": [(2048, 12288), (2048, 64), (4096, 2048), (2048, 9216), (2048, 1024),
                   (512, 2048), (2048, 512), (2048, 1)],
}
LM_HEAD = {"deepseek-v32": (7168, 129280), "qwen3-next": (2048, 151936)}
MLA = {"deepseek-v32": (128, 128, 512, 128)}  # heads, nope, kv_lora, v_head
EAGER_FIRST, LAST, MAX_SEQS = 513, 16384, 16
SCENARIO_M = [1332, 604, 602, 200, 37, 16, 1]  # engine scenario: prefills and mixed steps


def grid(first, last):
    from kwarm_ext.kernels.eager_gemm import kernel_grid  # the family's own grid

    return kernel_grid(first, last)


def dense(first, last):
    sizes = list(range(first, min(last, 64) + 1))
    sizes += range(sizes[-1] + 8 if sizes else first, last + 1, 8)
    return sizes


def problems(model, torch, sizes_linear, sizes_bmm):
    """[(label, fn)] for every GEMM problem of the variant, largest M first."""
    import torch.nn.functional as F

    dt, dev = torch.bfloat16, "cuda"
    out = []
    ws = [torch.randn(n, k, device=dev, dtype=dt) for k, n in LINEAR[model]]
    x = torch.zeros(LAST, max(k for k, _ in LINEAR[model]), device=dev, dtype=dt)
    for w in ws:
        k = w.shape[1]
        for m in sorted(sizes_linear, reverse=True):
            out.append((("linear", tuple(w.shape), m), lambda w=w, m=m, k=k: F.linear(x[:m, :k], w)))
    k, n = LM_HEAD[model]
    head = torch.randn(n, k, device=dev, dtype=dt)
    for m in range(MAX_SEQS, 0, -1):
        out.append((("lm_head", (n, k), m), lambda m=m: F.linear(x[:m, :k], head)))
    if model in MLA:
        heads, nope, lora, vh = MLA[model]
        uk = torch.randn(heads, nope, lora, device=dev, dtype=dt)
        uv = torch.randn(heads, lora, vh, device=dev, dtype=dt)
        q = torch.zeros(LAST, heads, nope + 64, device=dev, dtype=dt)
        q_nope = q[..., :nope].transpose(0, 1)
        lat = torch.zeros(heads, LAST, lora, device=dev, dtype=dt)
        for m in sorted(sizes_bmm, reverse=True):
            out.append((("bmm_uk", heads, m), lambda m=m: torch.bmm(q_nope[:, :m], uk)))
            out.append((("bmm_uv", heads, m), lambda m=m: torch.bmm(lat[:, :m], uv)))
    return out


def ms(torch, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    return (t1 - t0) * 1e3


def child(model, variant, probe_ms):
    import torch

    torch.cuda.init()
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    if variant == "none":
        warm = []
    elif variant.endswith("-grid"):
        warm = problems(model, torch, grid(EAGER_FIRST, LAST), grid(1, LAST))
    else:
        warm = problems(model, torch, dense(EAGER_FIRST, LAST), dense(1, LAST))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if variant.startswith("exec"):
        with torch.inference_mode():
            for _, fn in warm:
                fn()
        torch.cuda.synchronize()
    elif variant.startswith("capture"):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # cuBLAS's workspace for this stream, outside capture
            (a @ a).sum()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
            for _, fn in warm:
                fn()
        del graph
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    on_grid = set(grid(EAGER_FIRST, LAST))
    rng = random.Random(7)
    off = sorted(rng.sample([m for m in range(EAGER_FIRST, LAST) if m not in on_grid], 24))
    kinds = {"grid": sorted(rng.sample(sorted(on_grid), 12)), "off": off, "scenario": SCENARIO_M}
    result = {"model": model, "variant": variant, "warm_s": round(warm_s, 3), "warm_problems": len(warm)}
    with torch.inference_mode():
        for kind, ms_list in kinds.items():
            lin = [m for m in ms_list if m >= EAGER_FIRST]
            probe = problems(model, torch, lin, ms_list)
            probe = [p for p in probe if p[0][0] != "lm_head"]
            first = [ms(torch, fn) for _, fn in probe]
            again = [ms(torch, fn) for _, fn in probe]
            for op in sorted({p[0][0] for p in probe}):
                idx = [i for i, p in enumerate(probe) if p[0][0] == op]
                result[f"{kind}:{op}"] = {
                    "calls": len(idx), "first_ms": round(sum(first[i] for i in idx), 2),
                    "repeat_ms": round(sum(again[i] for i in idx), 2),
                    "loads_over_1ms": sum(first[i] > 1.0 for i in idx),
                    "worst": sorted(((round(first[i], 2), str(probe[i][0])) for i in idx), reverse=True)[:3]}
    print("RESULT " + json.dumps(result), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", choices=sorted(LINEAR), help="default: both")
    p.add_argument("--variants", default="none,exec-grid,capture-grid,capture-dense")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child, None)
    rows = []
    for model in args.model or sorted(LINEAR):
        for variant in args.variants.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", model, variant],
                                  capture_output=True, text=True, timeout=600)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(model, variant, "FAILED", proc.stderr[-2000:], flush=True)
                continue
            rows.append(json.loads(line[-1][7:]))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
