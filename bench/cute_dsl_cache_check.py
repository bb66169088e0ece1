#!/usr/bin/env python3
"""Can FlashInfer's Hopper GDN prefill kernels and vLLM's router GEMM skip CuTe DSL's compile on a
restart? A GPU check.

Why: on ``vllm serve`` (vLLM 0.33.0, FlashInfer 0.7.2.post1, H100) FlashInfer's SM90 GDN prefill
compiles its CuTe DSL kernels on every start, warm restarts included (BENCHMARKS.md, "Not measured
yet"): it keeps them in a dict in memory only (``flashinfer.gdn_kernels.delta_rule_dsl.
custom_compile_cache._in_mem_compile_cache``), where FlashInfer's other CuTe DSL kernels go through
its disk cache (``flashinfer.jit.cute_dsl_core.JitSpecCuteDsl``: ``export_to_c`` after the compile,
``cute.runtime.load_module(..., enable_tvm_ffi=True)`` on the next start). The SM90 kernels are
compiled with ``EnableTVMFFI(True)``, the form that disk cache exports and loads.

What: kwarm's own ``cute_dsl`` family functions (kernels/cute_dsl.py), outside vLLM's engine.
``compile DIR`` runs ``chunk_gated_delta_rule`` at Qwen3-Next's GDN shapes (16 key and 32 value heads
of 128, bf16, fp32 state) for a short and a long sequence, and vLLM's router GEMM at 1-4 rows (the
family's second source), timing each, then saves every kernel of their dicts into ``DIR`` with
``cute_dsl.save`` (and the outputs beside it). ``load DIR``, in a new process,
loads them first with ``cute_dsl.load``, runs the same calls and says how long they took, how many
kernels were compiled anyway and how far the outputs are from the first process's. One JSON line
each.

    source bench/install_kwarm.sh && OUT=/tmp WORK=/tmp install_kwarm
    python3 bench/cute_dsl_cache_check.py compile /tmp/cdc && python3 bench/cute_dsl_cache_check.py load /tmp/cdc

Needs a Hopper GPU, FlashInfer 0.7.2 and nvidia-cutlass-dsl (the staged vllm-0.33.0-flashinfer).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def calls():
    """The two calls, on fixed inputs: (name, kwargs)."""
    import torch

    out = []
    for name, tokens in (("short", 300), ("long", 8192)):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        q = torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        k = torch.nn.functional.normalize(torch.randn(tokens, 16, 128, device="cuda", generator=g), dim=-1).bfloat16()
        v = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        gate = torch.rand(tokens, 32, device="cuda", generator=g) * 0.1 + 0.9
        beta = torch.rand(tokens, 32, device="cuda", generator=g)
        state = torch.zeros(1, 32, 128, 128, device="cuda", dtype=torch.float32)
        cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int64)
        out.append((name, dict(q=q, k=k, v=v, g=gate, beta=beta, initial_state=state, output_final_state=True,
                               output_state=torch.empty_like(state), cu_seqlens=cu)))
    return out


def run_calls() -> tuple[dict, list]:
    """FlashInfer's GDN prefill on both sequences, then vLLM's router GEMM (``ll_bf16_gemm``) at
    1-4 rows of tiny Qwen3-Next's hidden size and experts (512, 8)."""
    import torch
    from flashinfer.gdn_prefill import chunk_gated_delta_rule
    from vllm.model_executor.kernels.linear.cute_dsl.ll_bf16 import ll_bf16_gemm

    seconds, outputs = {}, []
    for name, kwargs in calls():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = chunk_gated_delta_rule(**kwargs)
        torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - t0, 3)
        out = result[0] if isinstance(result, tuple) else result
        outputs.append(out.float().cpu())
        outputs.append(kwargs["output_state"].float().cpu())
    g = torch.Generator(device="cuda").manual_seed(7)
    weight = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        outputs.append(ll_bf16_gemm(x, weight).float().cpu())
    torch.cuda.synchronize()
    seconds["router_gemm"] = round(time.perf_counter() - t0, 3)
    return seconds, outputs


def main(argv) -> int:
    mode, folder = argv[0], Path(argv[1])
    import importlib

    import torch

    from kwarm_ext.kernels import cute_dsl

    report = {"mode": mode, "gpu": torch.cuda.get_device_name(0)}
    for source in cute_dsl.SOURCES:
        importlib.import_module(source.module)

    def caches():
        return {s.name: cute_dsl.imported_caches(s) for s in cute_dsl.SOURCES}

    def kernels():
        return {name: sum(len(d) for d in dicts.values()) for name, dicts in caches().items()}

    def where(source):
        return cute_dsl.subfolder(str(folder / source.name), cute_dsl.stack(source))

    if mode == "compile":
        folder.mkdir(parents=True, exist_ok=True)
        report["seconds"], outputs = run_calls()
        report["compiled"] = kernels()
        print(json.dumps({"mode": mode, "calls_s": report["seconds"], "compiled": report["compiled"]}), flush=True)
        report["save"] = {s.name: cute_dsl.save(where(s), caches()[s.name], cute_dsl.stack(s)) for s in cute_dsl.SOURCES}
        torch.save(outputs, folder / "outputs.pt")
    else:
        report["load"] = {s.name: cute_dsl.load(where(s), caches()[s.name]) for s in cute_dsl.SOURCES}
        loaded = kernels()
        report["seconds"], outputs = run_calls()
        report["compiled_anyway"] = {name: n - loaded[name] for name, n in kernels().items()}
        before = torch.load(folder / "outputs.pt")
        report["max_abs_diff"] = [float((a - b).abs().max()) for a, b in zip(outputs, before)]
        report["finite"] = all(bool(torch.isfinite(o).all()) for o in outputs)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
