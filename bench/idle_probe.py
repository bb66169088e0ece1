"""Is a workload slower right after the GPU and CPU sat idle? Each workload first, then twice
again, after 0, 5 and 20 s of idle (bench/README.md, "idle_probe.py"). torch only."""
import json
import subprocess
import time

import torch

dev = "cuda"
small = torch.randn(4096, device=dev)
big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

def launch_bound():          # ~3000 tiny kernels, like a model step outside CUDA graphs
    y = small
    for _ in range(3000):
        y = y * 1.0001 + 0.0001
    return y

def gpu_bound():             # large GEMMs
    for _ in range(30):
        big @ big

def cpu_bound():             # pure Python
    s = 0
    for i in range(600000):
        s += i * i
    return s

def graph_replay(g):
    for _ in range(20):
        g.replay()

g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    launch_bound()
torch.cuda.synchronize()
with torch.cuda.graph(g):
    y = small
    for _ in range(300):
        y = y * 1.0001 + 0.0001

work = {"launch": launch_bound, "gemm": gpu_bound, "cpu": cpu_bound, "graph": lambda: graph_replay(g)}

def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1000, 2)

def clocks():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:
        return str(exc)

for name, fn in work.items():
    for _ in range(5):
        timed(fn)
out = {"busy_clocks": clocks()}
for idle in [0, 5, 20]:
    for name, fn in work.items():
        time.sleep(idle)
        first, second, third = timed(fn), timed(fn), timed(fn)
        out[f"{name} idle {idle}s"] = [first, second, third]
        print(name, idle, first, second, third, flush=True)
time.sleep(5)
out["idle_clocks"] = clocks()
print(json.dumps(out, indent=1))
