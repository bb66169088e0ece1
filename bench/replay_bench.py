#!/usr/bin/env python3
"""Replay cost of a learned manifest: parallel vs one-after-another, empty vs warm Triton cache.

    python bench/replay_bench.py MANIFEST [--threads 1 16] [--out FILE]

Each measurement runs in a fresh process (Triton's in-memory caches must start empty) with
its own empty TRITON_CACHE_DIR; a last run with the largest thread count reuses the cache
of the one before it (the warm-cache case). Only kwarm's compile step is timed (preload of
every entry, what the `replay` family's `compile` step does at engine start); resolving
the kernels (importing vLLM's modules) is not. Needs a GPU: replay targets the current one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(path: str, threads: int) -> dict:
    from kwarm_ext import config, manifest_files
    from kwarm_ext.surfaces.triton import replay

    stamp = manifest_files.load(path).stamp  # the same host: validate against the recording's stamp
    state = replay.prepare(path, stamp, config.get().allowed_modules)
    state.threads = threads
    t0 = time.perf_counter()
    replay.compile_entries(state)
    seconds = time.perf_counter() - t0
    return {"threads": threads, "jobs": len(state.jobs), "compiled": len(state.compiled),
            "skipped": len(state.skipped), "seconds": round(seconds, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifest")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.manifest, args.threads[0])), flush=True)
        return 0
    runs, cache = [], None
    plan = [(t, "empty") for t in args.threads] + [(max(args.threads), "warm")]
    for threads, label in plan:
        if label == "empty":
            cache = tempfile.mkdtemp(prefix="kwarm-replay-triton-")
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        proc = subprocess.run([sys.executable, __file__, args.manifest, "--one", "--threads", str(threads)],
                              env=env, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"threads": threads, "error": proc.stderr[-1500:]}
        result["cache"] = label
        runs.append(result)
        print(json.dumps(result), flush=True)
    ok = {(r["threads"], r["cache"]): r.get("seconds") for r in runs}
    serial, parallel = ok.get((min(args.threads), "empty")), ok.get((max(args.threads), "empty"))
    summary = {"manifest": args.manifest, "runs": runs,
               "speedup": round(serial / parallel, 2) if serial and parallel else None}
    print("SUMMARY " + json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
