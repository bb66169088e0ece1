#!/usr/bin/env python3
"""Do FlashInfer's Hopper GDN prefill kernels compiled on the CPU at launch (kwarm_ext/early_gdn.py)
do on the GPU what the GPU's own compile does? A GPU check, outside the engine.

``cpu MODEL DIR``, in a process with no CUDA device (as kwarm's background process runs): compiles
the kernels vLLM's GDN warmup asks for at MODEL's dimensions (``tiny``: 2 key and 4 value heads of
128, Qwen3-Next-shaped; ``80b``: Qwen3-Next-80B's 16 and 32 per rank at TP 1; bf16, prefix caching
on, so checkpoints too) and saves them into DIR, timing it. ``gpu MODEL DIR compile`` then runs
vLLM's ``fi_chunk_gated_delta_rule`` on the GPU on fixed inputs: every variant of vLLM's warmup
(``use_cp`` "auto" and False, with and without checkpoints) at 64 tokens, then a 300-token and a
2x1024-token prefill with checkpoints, compiling as vLLM does, and keeps the outputs; ``gpu MODEL DIR load``, in a
new process, first loads DIR's kernels with the ``cute_dsl`` family's own load, runs the same calls
and says how many kernels were compiled anyway and how far the outputs are from the GPU-compiled
ones. One JSON line each.

    source /tmp/kwarm-gpu/vllm-0.33.0-flashinfer/env.sh && export CUDA_HOME=/usr/local/cuda
    source bench/install_kwarm.sh && WORK=/tmp/ge install_kwarm
    CUDA_VISIBLE_DEVICES= python3 bench/gdn_early_check.py cpu tiny /tmp/ge/tiny
    python3 bench/gdn_early_check.py gpu tiny /tmp/ge/tiny compile && python3 bench/gdn_early_check.py gpu tiny /tmp/ge/tiny load

Needs a Hopper GPU, vLLM 0.33, FlashInfer 0.7.2 and nvidia-cutlass-dsl (the staged vllm-0.33.0-flashinfer).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MODELS = {"tiny": (2, 4), "80b": (16, 32)}  # GDN key and value heads per rank


def facts(model: str) -> dict:
    hk, hv = MODELS[model]
    return {"head_k_dim": 128, "head_v_dim": 128, "num_k_heads": hk, "num_v_heads": hv, "dtype": "bfloat16",
            "mamba_cache_mode": "align", "additional_config": {}}


def calls(model: str):
    """(name, kwargs of vLLM's fi_chunk_gated_delta_rule) on fixed inputs."""
    import torch

    hk, hv = MODELS[model]
    out = []
    variants = [(f"warmup {cp} {'ckpt' if ck else 'plain'}", 64, cp, ck) for cp in ("auto", False) for ck in (False, True)]
    variants += [("prefill 300", 300, "auto", False), ("prefill 2x1024 ckpt", 2048, "auto", True)]
    for name, tokens, use_cp, ckpt in variants:
        g = torch.Generator(device="cuda").manual_seed(tokens + len(out))
        q = torch.nn.functional.normalize(torch.randn(1, tokens, hk, 128, device="cuda", generator=g), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(torch.randn(1, tokens, hk, 128, device="cuda", generator=g), dim=-1).bfloat16()
        v = (torch.randn(1, tokens, hv, 128, device="cuda", generator=g) * 0.1).bfloat16()
        gate = -torch.rand(1, tokens, hv, device="cuda", generator=g) * 0.1
        beta = torch.rand(1, tokens, hv, device="cuda", generator=g)
        seqs = 2 if tokens == 2048 else 1
        cu = torch.tensor([0, 1024, 2048] if seqs == 2 else [0, tokens], device="cuda", dtype=torch.int32)
        state = (torch.randn(seqs, hv, 128, 128, device="cuda", generator=g) * 0.01).bfloat16()
        kwargs = dict(q=q, k=k, v=v, g=gate, beta=beta, initial_state=state, output_final_state=True,
                      cu_seqlens=cu, use_qk_l2norm_in_kernel=False, use_cp=use_cp)
        if ckpt:
            per_seq = tokens // seqs // 64
            kwargs.update(state_checkpoints=torch.zeros(seqs * per_seq, hv, 128, 128, device="cuda"),
                          checkpoint_cu_starts=torch.tensor([i * per_seq for i in range(seqs + 1)], device="cuda"),
                          checkpoint_every_n_tokens=64)
        out.append((name, kwargs))
    return out


def run_calls(model: str) -> tuple[dict, list]:
    import torch
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import fi_chunk_gated_delta_rule

    seconds, outputs = {}, []
    for name, kwargs in calls(model):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fi_chunk_gated_delta_rule(**kwargs)
        torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - t0, 3)
        for part in (result if isinstance(result, tuple) else (result,)):
            outputs.append(part.float().cpu())
        if "state_checkpoints" in kwargs:
            outputs.append(kwargs["state_checkpoints"].float().cpu())
    return seconds, outputs


def main(argv) -> int:
    mode, model, folder = argv[0], argv[1], Path(argv[2])
    from kwarm_ext import early_gdn
    from kwarm_ext.kernels import cute_dsl

    source = cute_dsl.source_named("flashinfer_gdn")
    if mode == "cpu":
        t0 = time.perf_counter()
        lines: list = []
        summary = early_gdn.run(facts(model), (9, 0), str(folder), lines.append)
        print(json.dumps({"mode": mode, "model": model, "wall_s": round(time.perf_counter() - t0, 2),
                          "summary": summary, "lines": lines,
                          "cpus": len(os.sched_getaffinity(0))}), flush=True)
        return 0 if summary.get("saved") else 1
    import importlib

    import torch

    cache = importlib.import_module(source.module)._in_mem_compile_cache
    report = {"mode": f"gpu {argv[3]}", "model": model, "gpu": torch.cuda.get_device_name(0)}
    if argv[3] == "load":
        where = cute_dsl.subfolder(str(folder / source.name), cute_dsl.stack(source))
        report["load"] = cute_dsl.load(where, source.caches(importlib.import_module(source.module)))
    before = len(cache)
    report["seconds"], outputs = run_calls(model)
    report["compiled"] = len(cache) - before
    report["finite"] = all(bool(torch.isfinite(o).all()) for o in outputs)
    if argv[3] == "compile":
        torch.save(outputs, folder / "gpu_outputs.pt")
    else:
        reference = torch.load(folder / "gpu_outputs.pt")
        report["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(outputs, reference))
        report["outputs"] = len(outputs)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
