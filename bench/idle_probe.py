"""Is a workload slower right after the GPU and CPU sat idle? Each workload first, then twice
again, after 0, 5 and 20 s of idle (bench/README.md, "idle_probe.py"). torch only.

First, the first replay of a freshly captured CUDA graph against its second (a graph vLLM
captured at start is first replayed by a request), and the same for a graph uploaded
(``cudaGraphUpload``, through cuda-python) right after its capture: whether uploading what
vLLM captured would take anything off a first request."""
import json
import os
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


def fresh_graph():           # 3000 tiny kernels captured, like a decode step's graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_bound()
    torch.cuda.synchronize()
    return graph


def upload(graph) -> str | None:
    """cudaGraphUpload of `graph`'s executable on the current stream; None, or why not."""
    try:
        from cuda.bindings import runtime as cudart

        exec_ = cudart.cudaGraphExec_t(init_value=graph.raw_cuda_graph_exec())
        stream = cudart.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream)
        err, = cudart.cudaGraphUpload(exec_, stream)
        torch.cuda.synchronize()
        return None if int(err) == 0 else f"cudaGraphUpload: {err}"
    except Exception as exc:  # no cuda-python, or a torch without raw_cuda_graph_exec
        return f"{type(exc).__name__}: {exc}"


def first_replays() -> dict:
    plain, uploaded = fresh_graph(), fresh_graph()
    why = upload(uploaded)
    once = lambda graph: timed(graph.replay)  # noqa: E731
    return {"graph first replay (ms: first, second, third)": [once(plain), once(plain), once(plain)],
            "graph first replay after cudaGraphUpload": [once(uploaded), once(uploaded), once(uploaded)],
            "upload": why or "done"}

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

out = first_replays()
print(json.dumps(out), flush=True)
for name, fn in work.items():
    for _ in range(5):
        timed(fn)
out["busy_clocks"] = clocks()
for idle in [0, 5, 20]:
    for name, fn in work.items():
        time.sleep(idle)
        first, second, third = timed(fn), timed(fn), timed(fn)
        out[f"{name} idle {idle}s"] = [first, second, third]
        print(name, idle, first, second, third, flush=True)
time.sleep(5)
out["idle_clocks"] = clocks()
print(json.dumps(out, indent=1))
if os.environ.get("OUT"):  # the device tool's folder: the result comes back as a file, whole
    with open(os.path.join(os.environ["OUT"], "idle_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
