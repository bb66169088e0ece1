#!/usr/bin/env python3
"""Can FlashInfer's Hopper GDN prefill kernels skip CuTe DSL's compile on a restart? A GPU check.

Why: on ``vllm serve`` (vLLM 0.33.0, FlashInfer 0.7.2.post1, H100) FlashInfer's SM90 GDN prefill
compiles its CuTe DSL kernels on every start, warm restarts included (BENCHMARKS.md, "Not measured
yet"): it keeps them in a dict in memory only (``flashinfer.gdn_kernels.delta_rule_dsl.
custom_compile_cache._in_mem_compile_cache``), where FlashInfer's other CuTe DSL kernels go through
its disk cache (``flashinfer.jit.cute_dsl_core.JitSpecCuteDsl``: ``export_to_c`` after the compile,
``cute.runtime.load_module(..., enable_tvm_ffi=True)`` on the next start). The SM90 kernels are
compiled with ``EnableTVMFFI(True)``, the form that disk cache exports and loads.

What: ``compile DIR`` runs ``chunk_gated_delta_rule`` at Qwen3-Next's GDN shapes (16 key and 32 value
heads of 128, bf16, fp32 state) for a short and a long sequence, timing each call, then exports
every kernel of that dict to ``DIR`` (the key pickled beside it: this check's own files) with the
outputs. ``load DIR``, in a new process, loads the exported kernels into the dict first, runs the
same calls and says how long they took, how many kernels were compiled anyway and how far the
outputs are from the first process's. One JSON line each.

    python3 bench/cute_dsl_cache_check.py compile /tmp/cdc && python3 bench/cute_dsl_cache_check.py load /tmp/cdc

Needs a Hopper GPU, FlashInfer 0.7.2 and nvidia-cutlass-dsl (the staged vllm-0.33.0-flashinfer).
"""
from __future__ import annotations

import json
import pickle
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
    import torch
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

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
    return seconds, outputs


def main(argv) -> int:
    mode, folder = argv[0], Path(argv[1])
    import torch
    from flashinfer.gdn_kernels.delta_rule_dsl import custom_compile_cache as cache

    report = {"mode": mode, "gpu": torch.cuda.get_device_name(0)}
    if mode == "compile":
        folder.mkdir(parents=True, exist_ok=True)
        report["seconds"], outputs = run_calls()
        report["compiled"] = len(cache._in_mem_compile_cache)
        keys, failed = {}, []
        for i, (key, fn) in enumerate(list(cache._in_mem_compile_cache.items())):
            name = f"kwarm_cdc_{i}"
            try:
                t0 = time.perf_counter()
                fn.export_to_c(str(folder / f"{name}.o"), function_name=name)
                keys[name] = pickle.dumps(key)
                report.setdefault("export_s", []).append(round(time.perf_counter() - t0, 3))
            except Exception as exc:  # noqa: BLE001  (what cannot be exported is the finding)
                kernel = getattr(key[0][0][0], "__name__", "?")  # the kernel class: the key's MRO comes first
                failed.append(f"{kernel}: {type(exc).__name__}: {exc}"[:300])
        (folder / "keys.pickle").write_bytes(pickle.dumps(keys))
        torch.save(outputs, folder / "outputs.pt")
        report["exported"], report["export_failed"] = len(keys), failed
    else:
        import cutlass.cute as cute

        keys = pickle.loads((folder / "keys.pickle").read_bytes())
        t0 = time.perf_counter()
        loaded, failed = 0, []
        for name, raw in keys.items():
            try:
                module = cute.runtime.load_module(str(folder / f"{name}.o"), enable_tvm_ffi=True)
                cache._in_mem_compile_cache[pickle.loads(raw)] = getattr(module, name)
                loaded += 1
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        report["load_s"], report["loaded"], report["load_failed"] = round(time.perf_counter() - t0, 3), loaded, failed
        report["seconds"], outputs = run_calls()
        report["compiled_anyway"] = len(cache._in_mem_compile_cache) - loaded
        before = torch.load(folder / "outputs.pt")
        report["max_abs_diff"] = [float((a - b).abs().max()) for a, b in zip(outputs, before)]
        report["finite"] = all(bool(torch.isfinite(o).all()) for o in outputs)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
