"""deep_gemm's work list and compile processes: how vLLM's token counts are cut into runs
(:func:`chunks`), the child processes that pull the runs and call vLLM's DeepGEMM entries
(:func:`start_children`, :func:`run_children`, :func:`child`), with the engine's tensors
through CUDA IPC or tensors of their own made from a job's shapes (:func:`made_tensors`), and
what the summary says of them (:func:`readiness`, :func:`longest_runs`). The family, and why
it exists, is the package's ``__init__``.
"""
from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

CHILD_TIMEOUT_S = 1800.0
RUN_COUNTS = 8  # a run of the work list holds at most this many of one weight's token counts (chunks)


def _stop(procs) -> None:
    """Kill what is still running of `procs` (``start_children``'s triples) and close their files."""
    for proc, out, err in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        out.close()
        err.close()


def chunks(counts_per_job: list, size: int = RUN_COUNTS) -> list:
    """The work list the children pull from: ``[(job index, counts)]``, each a run of at most
    `size` consecutive token counts of one weight (sorted by M), every count once; each
    weight's runs in :func:`spread` order, interleaved across weights (each weight's first run,
    then each one's second, ...).

    DeepGEMM compiles N and K into a kernel and picks its block sizes and multicast from the
    waves a count makes, so a weight's kernels cluster where vLLM's list is dense (its wave
    boundaries, a few hundred tokens on 132 SMs) and a run of a few counts compiles at most a
    kernel or two: no run keeps one process busy while the others are done. Runs of one weight
    taken at the same time lie far apart in M, so two processes seldom compile one kernel
    twice; the runs left for last lie between runs already done, whose kernels they mostly
    load. Measured on the H200 (BENCHMARKS.md, FP8 on vLLM 0.29.0): runs of two doublings of M
    built 126 kernels in 56 s on 15 processes, the last 26 s spent on the three runs of M
    256-1024 (about 8 kernels each)."""
    runs = []
    for j, counts in enumerate(counts_per_job):
        ordered = sorted(counts, key=lambda c: c[0])
        own = [ordered[i:i + size] for i in range(0, len(ordered), size)]
        runs.append([(j, own[i]) for i in spread(len(own))])
    return [run for level in itertools.zip_longest(*runs) for run in level if run is not None]


def spread(n: int) -> list:
    """``range(n)`` in van der Corput order (0, n/2, n/4, 3n/4, ...): each index lies in the
    middle of the largest gap the ones before it leave."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))


def _throughput(new: int, wall_s: float, outcomes: list) -> str:
    busy = sum(o["seconds"] for o in outcomes)
    return (f"{new / max(wall_s, 1e-9):.2f} kernels/s; processes busy {busy:.0f} s in all, "
            f"{busy / max(new, 1):.1f} s a kernel, the slowest {max((o['seconds'] for o in outcomes), default=0):.0f} s")


def readiness(outcomes: list) -> str:
    """When the children could start calling and when they were done, in seconds after the work
    list went out (their ``ready`` and ``done``): imports, CUDA contexts and IPC mapping on one
    side, the last runs on the other."""
    ready = sorted(o.get("ready", 0.0) for o in outcomes) or [0.0]
    done = max((o.get("done", 0.0) for o in outcomes), default=0.0)
    return f"ready {ready[len(ready) // 2]:.1f}-{ready[-1]:.1f} s after the work list, all done at {done:.0f} s"


def longest_runs(work: list, jobs: list, outcomes: list, top: int = 3) -> str:
    """The `top` runs that took longest, from the children's ``run_s``: what keeps the last
    process busy after the others ran out of work (``2624x6144 M 1024-3968 21 s``)."""
    timed = sorted(((s, i) for o in outcomes for i, s in o.get("run_s", ())), reverse=True)[:top]
    return ", ".join(f"{'x'.join(map(str, _shape(jobs[work[i][0]])[-2:]))} M {work[i][1][0][0]}-"
                     f"{work[i][1][-1][0]} {s:.0f} s" for s, i in timed) or "-"


def _shape(job: dict) -> tuple:
    return tuple(job["shape"]) if "shape" in job else tuple(job["w"].shape)


def _buffers(jobs: list, device: str) -> dict:
    """One scratch set for every job: activations (FP8), their scales and outputs (bf16),
    flat, as large as the largest job needs (vLLM's warmup allocates the same per weight)."""
    import torch

    def need(job, per_row):
        return max(m for m, _, _ in job["counts"]) * per_row(job["w"])

    a = max(need(j, lambda w: w.shape[-1]) for j in jobs)
    scale = max(need(j, lambda w: _scale_cols(w.shape[-1])) for j in jobs)
    out = max(need(j, lambda w: w.shape[-2]) for j in jobs)
    buffers = {"a": torch.empty(a, device=device, dtype=torch.float8_e4m3fn),
               # zeros, as vLLM's warmup: where DeepGEMM packs FP32 scales into UE8M0 (SM100),
               # it asserts that their sign and mantissa bits are zero (vLLM 0.33's note)
               "scale": torch.zeros(scale, device=device, dtype=torch.float32),
               "out": torch.empty(out, device=device, dtype=torch.bfloat16)}
    # grouped GEMMs: one expert per block of `align` rows, as vLLM's permutation lays them out
    # (which expert does not change the kernel); a prefix of the longest serves every M_sum
    rows = {}  # align -> (most rows, fewest experts)
    for job in jobs:
        for m, align, _ in job["counts"] if job["kind"] == "grouped" else ():
            most, fewest = rows.get(align, (0, job["w"].shape[0]))
            rows[align] = (max(most, m), min(fewest, job["w"].shape[0]))
    for align, (m, experts) in rows.items():
        ids = torch.arange(-(-m // align), device=device, dtype=torch.int32) % experts
        buffers[_ids_key(align)] = ids.repeat_interleave(align)
    return buffers


def _ids_key(align: int) -> str:
    return f"expert_ids/{align}"


def _scale_cols(k: int) -> int:
    """Columns of an activation's block-FP8 scales: one per 128 of K."""
    return -(-k // 128)


def run_counts(jobs: list, counts_per_job: list, buffers: dict) -> int:
    """Call vLLM's DeepGEMM entry for each (job, its counts); returns the number of calls."""
    from vllm.utils import deep_gemm

    calls = 0
    for job, counts in zip(jobs, counts_per_job):
        w, ws = job["w"], job["ws"]
        n, k = w.shape[-2], w.shape[-1]
        for m, align, expert_ids in counts:
            a = buffers["a"][:m * k].view(m, k)
            a_s = buffers["scale"][:m * _scale_cols(k)].view(m, _scale_cols(k))
            out = buffers["out"][:m * n].view(m, n)
            if job["kind"] == "linear":
                deep_gemm.fp8_gemm_nt((a, a_s), (w, ws), out)
            else:
                if expert_ids is None:
                    expert_ids = buffers[_ids_key(align)][:m]
                with deep_gemm.mk_alignment_scope(align):
                    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_s), (w, ws), out, expert_ids)
            calls += 1
    return calls


def start_children(n: int) -> list:
    """`n` compile processes, started: each imports torch and vLLM's DeepGEMM wrapper, then
    waits for its payload on stdin (:func:`child`). Returns ``[(Popen, stdout file, stderr
    file)]``: stdout and stderr go to files, so that a child's vLLM log lines never fill a pipe
    nobody reads yet."""
    env = dict(os.environ, KWARM_ENABLE="0")  # a child is not an engine (DG_JIT_CACHE_DIR as vLLM set it)
    procs = []
    for _ in range(max(1, n)):
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-c", "from kwarm_ext.kernels.deep_gemm.processes import child; child()"],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
        procs.append((proc, out, err))
    return procs


def run_children(work: list, children: int, jobs: list, buffers: dict, device: str, started=()) -> list:
    """`children` processes at once (those `started` already, then new ones), pulling the runs
    of `work` in order: each claims the next unclaimed run (an exclusive-create file per run in
    a scratch folder, so no run is done twice) until none is left. Each gets the jobs' tensors
    and the buffers through CUDA IPC (torch's multiprocessing pickler) on its stdin. Returns
    each child's ``{"calls", "runs", "seconds", "run_s", "ready", "done"}``; a child that fails
    raises with its last error line."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    index = torch.device(device).index or 0
    claims = tempfile.TemporaryDirectory(prefix="kwarm-deep-gemm-")
    shared = {j: {"kind": jobs[j]["kind"], "w": jobs[j]["w"], "ws": jobs[j]["ws"]} for j, _ in work}
    procs = list(started)[:max(1, children)]
    procs += start_children(max(1, children) - len(procs))
    _send(procs, {"device": index, "jobs": shared, "work": work, "claims": claims.name, "buffers": buffers,
                  "sent": time.time()}, lambda payload: bytes(ForkingPickler.dumps(payload)))
    try:
        return _collect(procs)  # `jobs` and `buffers` stay alive here until every child is done
    finally:
        claims.cleanup()


def _send(procs: list, payload: dict, dumps) -> None:
    """Write the payload to a file in its claims folder and its path to each process's stdin:
    a pipe holds 64 KiB, and a process still importing would block a larger write (and the
    weight loading behind it) until it reads."""
    path = os.path.join(payload["claims"], "payload")
    with open(path, "wb") as f:
        f.write(dumps(payload))
    for proc, _, _ in procs:
        try:
            proc.stdin.write(path.encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died at start: its stderr says why, in _collect
            pass


def _collect(procs: list) -> list:
    """Wait for `procs` (at most ``CHILD_TIMEOUT_S`` in all) and read each one's JSON line;
    raises one line naming the first failure."""
    outcomes, failures = [], []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for proc, out, err in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        last = [line for line in out.read().decode(errors="replace").splitlines() if line.startswith("{")]
        if proc.returncode == 0 and last:
            outcomes.append(json.loads(last[-1]))
        else:
            lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
            failures.append(f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}")
        out.close()
        err.close()
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(procs)} DeepGEMM compile processes failed; first: {failures[0]}")
    return outcomes


def claimed(work: list, claims: str):
    """The runs of `work` this process claims, in order, as ``(index, run)``: a run is this
    process's when it creates the run's file in `claims` first (``O_EXCL``), so processes
    walking the same list share it out as they go, each run to exactly one of them."""
    for i, run in enumerate(work):
        try:
            os.close(os.open(os.path.join(claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another process took it
        yield i, run


def made_tensors(job: dict, device) -> dict:
    """A job sent by shape (:func:`shape_jobs`) with tensors of its own on `device`: the FP8
    weight (uninitialized) and its FP32 block scales (zeros), in the layout vLLM reads from the
    checkpoint; DeepGEMM lays the scales out for its kernel as it does for the loaded weight."""
    import torch

    return {"kind": job["kind"], "w": torch.empty(job["shape"], device=device, dtype=torch.float8_e4m3fn),
            "ws": torch.zeros(job["ws_shape"], device=device, dtype=torch.float32)}


def child() -> None:
    """A compile process: import what the calls need, read the pickled payload from the file
    stdin names (none: the parent needs no compile, exit), run every run of the work list it claims first,
    print one JSON line. The weights and buffers are the engine's, mapped through CUDA IPC, or,
    for jobs sent by shape, its own (:func:`made_tensors`)."""
    import torch
    from vllm.utils import deep_gemm  # noqa: F401  (imported before the payload comes)

    path = sys.stdin.buffer.read().decode()
    if not path:
        return
    with open(path, "rb") as f:
        payload = pickle.load(f)  # maps the IPC handles (if any) on their device
    torch.cuda.set_device(payload["device"])
    torch.cuda.synchronize()  # this thread's context current before DeepGEMM's driver calls
    ready = time.time() - payload["sent"]
    calls = runs = 0
    run_s = []  # [index in the work list, seconds] of the runs that compiled (took a second or more)
    made = {}  # a job sent by shape: the tensors of the one run last (one weight at a time)
    t0 = time.perf_counter()
    for i, (j, counts) in claimed(payload["work"], payload["claims"]):
        started = time.perf_counter()
        job, buffers = payload["jobs"][j], payload.get("buffers")
        if "w" not in job:
            if j not in made:
                made.clear()
                made[j] = made_tensors(job, torch.device("cuda", payload["device"]))
            job = made[j]
            buffers = _buffers([dict(job, counts=counts)], job["w"].device)
        calls += run_counts([job], [counts], buffers)
        runs += 1
        if time.perf_counter() - started >= 1.0:
            run_s.append([i, round(time.perf_counter() - started, 2)])
    torch.cuda.synchronize()
    print(json.dumps({"calls": calls, "runs": runs, "seconds": round(time.perf_counter() - t0, 3),
                      "run_s": run_s, "ready": round(ready, 2), "done": round(time.time() - payload["sent"], 2)}),
          flush=True)
