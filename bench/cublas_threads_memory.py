"""Device memory that cuBLAS keeps, outside and inside torch's allocator, as ``eager_gemm``'s
passes meet it: lazily loaded kernels over a grid of token counts, and the handle and workspace of
every thread that calls cuBLAS (DeepSeek-V3.2-like bf16 weight shapes). Needs one CUDA GPU and
torch; prints JSON. Behind ``kernels/gemm_capture.py``'s one capture thread:

    python bench/cublas_threads_memory.py > cublas_threads_memory.json

- ``steps_m_nontorch_growth_reserved``: (token count, device memory outside torch's allocator
  grown since the weights, torch's reserved bytes) as the grid goes;
- ``16_side_threads_*``: after 16 threads, each on its own stream, ran two GEMMs and ended:
  torch's allocated growth (their workspaces) and the growth outside torch (their handles).
"""
import json, time
import torch

torch.cuda.init()
dev = torch.device("cuda", 0)
torch.zeros(1, device=dev)
def used():
    free, total = torch.cuda.mem_get_info()
    return total - free
def nontorch():
    return used() - torch.cuda.memory_reserved()
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "start_used": used(), "start_nontorch": nontorch()}
from gemm_capture_threads import SHAPES  # noqa: E402  (bench/, this script's folder)

ws = [torch.randn(k, n, dtype=torch.bfloat16, device=dev) for k, n in SHAPES]
torch.cuda.synchronize()
out["after_weights_nontorch"] = nontorch()
steps = []
ms = sorted(set([1, 2, 3, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
                + list(range(1, 513, 7)) + list(range(520, 8193, 97))))
t0 = time.time()
for i, m in enumerate(ms):
    for w in ws:
        a = torch.randn(m, w.shape[0], dtype=torch.bfloat16, device=dev)
        torch.mm(a, w)
    if i % 20 == 0 or i == len(ms) - 1:
        torch.cuda.synchronize()
        steps.append((m, nontorch() - out["after_weights_nontorch"], torch.cuda.memory_reserved()))
out["grid_s"] = round(time.time() - t0, 2)
out["ms"] = len(ms)
out["steps_m_nontorch_growth_reserved"] = steps
torch.cuda.empty_cache()
out["end_nontorch_growth"] = nontorch() - out["after_weights_nontorch"]
# threads with side streams: the per-(handle, stream) cuBLAS workspaces
import threading
before = torch.cuda.memory_allocated()
def side():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.randn(64, 7168, dtype=torch.bfloat16, device=dev)
        torch.mm(a, ws[0]); torch.addmm(a[:, :2048], a, ws[0])
        s.synchronize()
th = [threading.Thread(target=side) for _ in range(16)]
[t.start() for t in th]; [t.join() for t in th]
torch.cuda.synchronize()
out["16_side_threads_allocated_growth"] = torch.cuda.memory_allocated() - before
out["16_side_threads_nontorch_growth"] = nontorch() - out["after_weights_nontorch"]
torch._C._cuda_clearCublasWorkspaces()
out["after_clear_allocated_growth"] = torch.cuda.memory_allocated() - before
print(json.dumps(out, indent=1))
