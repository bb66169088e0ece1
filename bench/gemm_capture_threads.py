"""What capture threads buy ``eager_gemm`` and what they keep: its grid and fill passes captured
into CUDA graphs (never replayed) on 1, 2, 4 and 8 threads, each count of threads in a fresh
process (cuBLAS loads its kernels anew in each), DeepSeek-V3.2-like bf16 weight shapes, at the
counts ``eager_gemm`` warms (its own ``kernel_grid`` and ``fill_counts``). Needs one CUDA GPU,
torch and kwarm installed (``bench/install_kwarm.sh``; no vLLM); prints JSON:

    python bench/gemm_capture_threads.py > gemm_capture_threads.json

Per thread count: each pass's wall time and problems, and what the process keeps after the threads
ended, outside torch's allocator (cuBLAS handles) and inside it (their workspaces). The capture is
``kernels/gemm_capture.py``'s: a side stream per thread whose cuBLAS workspace exists before
capture begins, thread-local capture mode, the graph dropped after.
"""
import json
import subprocess
import sys
import time

SHAPES = [(7168, 2048), (2048, 7168), (7168, 1536), (1536, 24576), (7168, 576), (512, 32768),
          (16384, 7168), (7168, 4096), (4096, 7168), (7168, 16160)]


def one(threads: int) -> dict:
    import threading

    import torch

    from kwarm_ext.kernels.eager_gemm import fill_counts, kernel_grid

    dev = torch.device("cuda", 0)
    weights = [torch.randn(k, n, dtype=torch.bfloat16, device=dev) for k, n in SHAPES]
    big = torch.empty(8192 * max(k for k, _ in SHAPES), dtype=torch.bfloat16, device=dev)
    torch.mm(big[:64 * 7168].view(64, 7168), weights[0])  # this thread's handle, as vLLM's profile run leaves it
    torch.cuda.synchronize()

    def nontorch():
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    base_nontorch, base_allocated = nontorch(), torch.cuda.memory_allocated()

    def capture(problems):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.stream(stream):
            a = torch.zeros((8, 8), dtype=torch.bfloat16, device=dev)
            torch.mm(a, a)
            stream.synchronize()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for i, m in problems:
                    w = weights[i]
                    torch.mm(big[:m * w.shape[0]].view(m, w.shape[0]), w)
            finally:
                graph.capture_end()
                del graph

    def run_pass(counts):
        problems = [(i, m) for m in sorted(counts, reverse=True) for i in range(len(SHAPES))]
        t0 = time.perf_counter()
        if threads == 1:
            capture(problems)
        else:
            errors = []

            def work(k):
                try:
                    torch.cuda.set_device(dev)
                    capture(problems[k::threads])
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{type(exc).__name__}: {exc}")

            workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors:
                return {"error": errors[0]}
        torch.cuda.synchronize()
        return {"s": round(time.perf_counter() - t0, 3), "problems": len(problems)}

    out = {"threads": threads, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "grid": run_pass(kernel_grid(513, 8192)), "fill": run_pass(fill_counts(1, 512))}
    torch.cuda.empty_cache()
    out["kept_outside_torch_mib"] = round((nontorch() - base_nontorch) / 2**20, 1)
    out["kept_allocated_mib"] = round((torch.cuda.memory_allocated() - base_allocated) / 2**20, 1)
    return out


def main() -> int:
    if len(sys.argv) > 1:
        print(json.dumps(one(int(sys.argv[1]))))
        return 0
    results = []
    for threads in (1, 2, 4, 8, 1):  # 1 again last: the first process's time includes the host's warm-up
        p = subprocess.run([sys.executable, __file__, str(threads)], capture_output=True, text=True, timeout=240)
        try:
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            results.append({"threads": threads, "error": (p.stderr or p.stdout)[-500:]})
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"shapes": SHAPES, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
