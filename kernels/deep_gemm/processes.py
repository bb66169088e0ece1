"""deep_gemm's work list and compile processes: how vLLM's token counts are cut into runs
(:func:`chunks`), the compile processes that pull the runs and call vLLM's DeepGEMM entries,
forked by one parent that imported what they need (:func:`start_forkserver`, :func:`run_children`,
:func:`forkserver`, :func:`child`), with the engine's tensors
through CUDA IPC or tensors of their own made from a job's shapes (:func:`made_tensors`), and
what the summary says of them (:func:`readiness`, :func:`longest_runs`). The family, and why
it exists, is the package's ``__init__``.
"""
from __future__ import annotations

import itertools
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from kwarm_ext.config import DEEP_GEMM_EARLY_ENV as EARLY_ENV  # noqa: F401  (the front end's mark)

CHILD_TIMEOUT_S = 1800.0
IDLE_S = 600.0  # a parent started early that nobody took in this long exits (its engine loaded no model here)
_IDLE_ENV = "KWARM_DEEP_GEMM_IDLE_S"  # how the parent learns it was started early
TAKEN = b"taken"  # the line take_early sends: a worker took this parent, its work comes
COMPILE_S = 0.5  # a DeepGEMM call this long compiled its kernel (NVCC: seconds; a cached one loads in ms)
RUN_COUNTS = 8  # a run of the work list holds at most this many of one weight's token counts (chunks)


def _stop(servers) -> None:
    """Kill what still runs of `servers` (:func:`start_forkserver`'s triples; None: none) and of
    what they forked (their process groups), and close their files."""
    for proc, out, err in filter(None, servers):
        _kill(proc)
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        out.close()
        err.close()


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def chunks(counts_per_job: list, size: int = RUN_COUNTS) -> list:
    """The work list the children pull from: ``[(job index, counts)]``, every count once: first
    each weight's largest count alone (``max_num_batched_tokens``, the count of vLLM's profile
    run, which may run beside the compiles: :func:`kwarm_ext.kernels.deep_gemm.compile_ahead`),
    then runs of at most `size` consecutive token counts of one weight (sorted by M), each
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
        largest, ordered = ordered[-1:], ordered[:-1]
        own = [ordered[i:i + size] for i in range(0, len(ordered), size)]
        runs.append([(j, largest)] * bool(largest) + [(j, own[i]) for i in spread(len(own))])
    return [run for level in itertools.zip_longest(*runs) for run in level if run is not None]


def spread(n: int) -> list:
    """``range(n)`` in van der Corput order (0, n/2, n/4, 3n/4, ...): each index lies in the
    middle of the largest gap the ones before it leave."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))


def _throughput(new: int, wall_s: float, outcomes: list) -> str:
    """Kernels per second of wall time, and where the processes' time went: their calls in all,
    the compiles among them (more compiles than new kernels: two processes built one kernel)."""
    busy = sum(o["seconds"] for o in outcomes)
    compiles = sum(o.get("compiles", 0) for o in outcomes)
    compile_s = sum(o.get("compile_s", 0.0) for o in outcomes)
    return (f"{new / max(wall_s, 1e-9):.2f} kernels/s; processes busy {busy:.0f} s in all, "
            f"{busy / max(new, 1):.1f} s a kernel, the slowest {max((o['seconds'] for o in outcomes), default=0):.0f} s; "
            f"{compiles} compiles for {new} kernels, {compile_s / max(compiles, 1):.1f} s each")


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


def run_counts(jobs: list, counts_per_job: list, buffers: dict, compiled: list | None = None) -> int:
    """Call vLLM's DeepGEMM entry for each (job, its counts); returns the number of calls.
    `compiled` (if given) gains the seconds of each call that took ``COMPILE_S`` or more: one that
    compiled (DeepGEMM builds a kernel on the CPU before it launches; a loaded one returns in
    milliseconds)."""
    from vllm.utils import deep_gemm

    calls = 0
    for job, counts in zip(jobs, counts_per_job):
        w, ws = job["w"], job["ws"]
        n, k = w.shape[-2], w.shape[-1]
        for m, align, expert_ids in counts:
            started = time.perf_counter()
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
            if compiled is not None and time.perf_counter() - started >= COMPILE_S:
                compiled.append(time.perf_counter() - started)
    return calls


def start_forkserver(idle_s: float | None = None) -> tuple:
    """The compile processes' parent, started: one process that imports torch and vLLM's DeepGEMM
    wrapper, then waits for its work on stdin and forks the compile processes that do it
    (:func:`forkserver`). Returns ``(Popen, stdout file, stderr file)``: stdout and stderr go to
    files, so that vLLM's log lines never fill a pipe nobody reads yet.

    Why one parent that forks: fifteen processes each importing torch and vLLM took 17-18 s beside
    vLLM's weight loading before their first call (DeepSeek-V3.2 FP8 dimensions, vLLM 0.29.0,
    BENCHMARKS.md); forked from one that imported once, they start with the imports done. The
    parent never touches CUDA (it would make CUDA unusable in what it forks). With `idle_s`, it
    exits if no worker takes it (:func:`take_early`) in that long."""
    # not an engine (DG_JIT_CACHE_DIR as vLLM set it); torch asks NVML, not the CUDA driver,
    # whether CUDA is there (a driver initialized before fork is unusable in what it forks)
    env = dict(os.environ, KWARM_ENABLE="0", PYTORCH_NVML_BASED_CUDA_CHECK="1")
    env.pop(_IDLE_ENV, None)
    if idle_s:
        env[_IDLE_ENV] = str(idle_s)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", "from kwarm_ext.kernels.deep_gemm.processes import forkserver; "
                             "forkserver()"], stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                            start_new_session=True)  # its own process group: _stop ends what it forked
    return proc, out, err


_early_server = None  # the parent start_early started, until take_early takes it
_metadata_parent = None  # the parent start_metadata_parent started, until take_metadata_parent takes it
METADATA_IDLE_S = 1800.0  # load, profile run, KV cache and capture of a large DSA model come first


def _running_or_new(server, idle_s: float) -> tuple:
    """`server` while it still waits, else a new parent (one that exited, nobody having taken it in
    time, is stopped: its files go)."""
    if server is not None and server[0].poll() is not None:
        _stop([server])
        server = None
    return server or start_forkserver(idle_s)


def _taken(server):
    """`server`, told on its stdin that it is taken (it waits for its work without its idle time),
    or None where there is none or it exited (idle, or failed)."""
    if server is None:
        return None
    try:
        server[0].stdin.write(TAKEN + b"\n")
        server[0].stdin.flush()
    except (BrokenPipeError, ValueError):  # it exited: none to take
        pass
    if server[0].poll() is not None:
        _stop([server])
        return None
    return server


def start_metadata_parent() -> None:
    """Start, as the worker starts loading a DSA-indexer model (DeepSeek-V3.2, GLM-5), the parent
    of the processes that will build the indexer's DeepGEMM schedule metadata
    (``dsa_indexer``'s ``warm_metadata``, after the KV cache is bound): its imports of torch and
    vLLM overlap the load instead of delaying the warmup (19 s on an H100 beside the engine,
    BENCHMARKS.md). It exits by itself after ``METADATA_IDLE_S`` if nothing takes it."""
    global _metadata_parent
    _metadata_parent = _running_or_new(_metadata_parent, METADATA_IDLE_S)


def take_metadata_parent():
    """The parent :func:`start_metadata_parent` started, still waiting, or None; the caller's now."""
    global _metadata_parent
    server, _metadata_parent = _metadata_parent, None
    return _taken(server)


def start_early() -> None:
    """Start the compile processes' parent now, before this process builds a model (kwarm's
    activation, where :data:`EARLY_ENV` is set; the front end, for an engine in its own
    process), so that its imports overlap vLLM's own start; :func:`take_early` hands it to the
    worker's ``before_load``. One that gets no work exits after ``IDLE_S``."""
    global _early_server
    _early_server = _running_or_new(_early_server, IDLE_S)


def take_early():
    """The parent :func:`start_early` started, still running, or None; it is the caller's now,
    and it waits for its work without ``IDLE_S`` (told so on its stdin)."""
    global _early_server
    server, _early_server = _early_server, None
    return _taken(server)


def run_children(work: list, children: int, jobs: list, buffers: dict, device: str, server=None) -> list:
    """`children` processes at once, forked by `server` (:func:`start_forkserver`; a new one if
    None), pulling the runs of `work` in order: each claims the next unclaimed run (an
    exclusive-create file per run in a scratch folder, so no run is done twice) until none is
    left. Each gets the jobs' tensors and the buffers through CUDA IPC (torch's multiprocessing
    pickler). Returns each process's ``{"calls", "runs", "seconds", "run_s", "ready", "done"}``;
    raises one line naming the first failure."""
    return finish_children(start_children(work, children, jobs, buffers, device, server=server))


def start_children(work: list, children: int, jobs: list, buffers: dict | None, device: str, server=None) -> dict:
    """:func:`run_children` without the wait: the work is out; :func:`finish_children` waits for
    it. With `buffers` None each process makes its own scratch for each run (none of it in this
    process's memory, which vLLM's profile run measures while they run)."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    index = torch.device(device).index or 0
    claims = tempfile.TemporaryDirectory(prefix="kwarm-deep-gemm-")
    shared = {j: {"kind": jobs[j]["kind"], "w": jobs[j]["w"], "ws": jobs[j]["ws"]} for j, _ in work}
    server = server or start_forkserver()
    try:
        payload = {"device": index, "jobs": shared, "work": work, "claims": claims.name, "sent": time.time()}
        if buffers is not None:
            payload["buffers"] = buffers
        _send(server, max(1, children), payload, lambda payload: bytes(ForkingPickler.dumps(payload)))
    except BaseException:
        _stop([server])
        claims.cleanup()
        raise
    # `jobs` and `buffers` stay alive with the handle until every process is done with them
    return {"server": server, "children": max(1, children), "claims": claims, "jobs": jobs, "buffers": buffers}


def cancel_children(started: dict) -> None:
    """End what :func:`start_children` or :func:`start_calls` started without waiting for it."""
    _stop([started["server"]])
    started["claims"].cleanup()


def finish_children(started: dict) -> list:
    """Wait for what :func:`start_children` started; each process's outcome (see :func:`run_children`)."""
    try:
        return _collect(started["server"], started["children"])
    finally:
        cancel_children(started)


def _send(server: tuple, children: int, payload: dict, dumps) -> None:
    """Write the payload to a file in its claims folder, and the number of processes to fork
    with the file's path to `server`'s stdin: a pipe holds 64 KiB, and a server still importing
    would block a larger write (and the weight loading behind it) until it reads."""
    path = os.path.join(payload["claims"], "payload")
    with open(path, "wb") as f:
        f.write(dumps(payload))
    proc = server[0]
    try:
        proc.stdin.write(f"{children} {path}".encode())
        proc.stdin.close()
    except BrokenPipeError:  # it died at start: its stderr says why, in _collect
        pass


def _collect(server: tuple, children: int) -> list:
    """Wait for `server` (at most ``CHILD_TIMEOUT_S``) and read its processes' JSON lines; raises
    one line naming the first failure (the server exits with the number that failed)."""
    proc, out, err = server
    try:
        proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
    out.seek(0)
    err.seek(0)
    outcomes = [json.loads(line) for line in out.read().decode(errors="replace").splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not outcomes:
        lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
        failed = children - len(outcomes) if proc.returncode and proc.returncode > 0 else children
        raise RuntimeError(f"{failed} of {children} DeepGEMM compile processes failed (exit {proc.returncode}); "
                           f"first: {lines[-1] if lines else 'no output'}")
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


def forkserver() -> None:
    """The compile processes' parent (:func:`start_forkserver`): import what the calls need, read
    ``"<processes> <payload path>"`` from stdin (nothing: exit; started early and not
    :data:`TAKEN` by a worker within its idle time: exit), fork
    that many processes that each do :func:`child`, wait for them; exit with the number that
    failed (each prints its traceback to stderr)."""
    import torch
    from vllm.utils import deep_gemm  # noqa: F401  (imported before the work comes)

    if not select.select([sys.stdin], [], [], float(os.environ.get(_IDLE_ENV) or 0) or None)[0]:
        return  # nobody took it: started early for an engine that did not load its model here
    lines = [line for line in sys.stdin.buffer.read().decode().splitlines() if line.strip() != TAKEN.decode()]
    request = lines[-1].split(maxsplit=1) if lines else []
    if not request:
        return
    children, path = int(request[0]), request[1]
    if torch.cuda.is_initialized():  # what it forked could not use CUDA
        raise RuntimeError("CUDA was initialized by the imports of the compile processes' parent; cannot fork")
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for _ in range(children):
        pid = os.fork()
        if pid == 0:  # a compile process
            code = 1
            try:
                child(path)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    sys.exit(min(failed, 100))


def start_calls(calls: list, children: int, device: str, server=None) -> dict:
    """:func:`start_children` for a work list of DeepGEMM calls described by value, each
    ``{"fn": "module:qualname", "args": [...], "kwargs": {...}}`` where an argument
    ``{"tensor": [shape], "dtype": "int32", "fill": 1}`` is made on the process's device
    (:func:`described`): a call whose kernel depends only on shapes and scalars (the DSA
    indexer's schedule metadata), compiled by `children` processes at once. :func:`finish_children`
    waits for them."""
    import torch

    device = torch.device(device)
    index = None if device.type == "cpu" else (device.index or 0)  # CPU: the tests' calls
    claims = tempfile.TemporaryDirectory(prefix="kwarm-deep-gemm-")
    server = server or start_forkserver()
    try:
        payload = {"device": index, "calls": calls, "claims": claims.name, "sent": time.time()}
        _send(server, max(1, children), payload, pickle.dumps)
    except BaseException:
        _stop([server])
        claims.cleanup()
        raise
    return {"server": server, "children": max(1, children), "claims": claims}


def described(arg, device):
    """An argument of :func:`start_calls`: a described tensor made on `device`, else the value."""
    if isinstance(arg, dict) and "tensor" in arg:
        import torch

        return torch.full(arg["tensor"], arg.get("fill", 0), dtype=getattr(torch, arg["dtype"]), device=device)
    return arg


def _run_calls(payload, device) -> dict:
    """A compile process's share of a :func:`start_calls` work list."""
    from kwarm_ext.vllm_compat import resolve

    calls, compiled, t0 = 0, [], time.perf_counter()
    for _, call in claimed(payload["calls"], payload["claims"]):
        started = time.perf_counter()
        resolve(call["fn"])(*(described(a, device) for a in call["args"]),
                            **{k: described(v, device) for k, v in call.get("kwargs", {}).items()})
        calls += 1
        if time.perf_counter() - started >= COMPILE_S:
            compiled.append(time.perf_counter() - started)
    return {"calls": calls, "runs": calls, "seconds": round(time.perf_counter() - t0, 3),
            "compiles": len(compiled), "compile_s": round(sum(compiled), 2), "run_s": []}


def child(path: str) -> None:
    """A compile process: read the pickled payload at `path`, run every run of the work list it
    claims first, print one JSON line. The weights and buffers are the engine's, mapped through
    CUDA IPC, or, for jobs sent by shape, its own (:func:`made_tensors`); the scratch buffers
    the engine's, or (none sent) its own for each run. A payload of described calls
    (:func:`start_calls`) runs those instead."""
    import torch

    with open(path, "rb") as f:
        payload = pickle.load(f)  # maps the IPC handles (if any) on their device
    on_gpu = payload["device"] is not None  # None: described calls on the CPU (tests)
    if on_gpu:
        torch.cuda.set_device(payload["device"])
        torch.cuda.synchronize()  # this thread's context current before DeepGEMM's driver calls
    ready = time.time() - payload["sent"]
    if "calls" in payload:
        done = _run_calls(payload, torch.device("cuda", payload["device"]) if on_gpu else torch.device("cpu"))
        if on_gpu:
            torch.cuda.synchronize()
        print(json.dumps(dict(done, ready=round(ready, 2), done=round(time.time() - payload["sent"], 2))), flush=True)
        return
    calls = runs = 0
    compiled = []  # seconds of each call that compiled
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
        if buffers is None:  # sent by shape, or beside the profile run: scratch of its own, this run's size
            buffers = _buffers([dict(job, counts=counts)], job["w"].device)
        calls += run_counts([job], [counts], buffers, compiled)
        runs += 1
        if time.perf_counter() - started >= 1.0:
            run_s.append([i, round(time.perf_counter() - started, 2)])
    torch.cuda.synchronize()
    print(json.dumps({"calls": calls, "runs": runs, "seconds": round(time.perf_counter() - t0, 3),
                      "compiles": len(compiled), "compile_s": round(sum(compiled), 2),
                      "run_s": run_s, "ready": round(ready, 2), "done": round(time.time() - payload["sent"], 2)}),
          flush=True)
