"""deep_gemm: DeepGEMM's block-FP8 GEMM kernels, compiled on every core before vLLM's own
DeepGEMM warmup runs.

Why: on a block-FP8 model (DeepSeek-V3.2, GLM-5 checkpoints), ``kernel_warmup`` runs vLLM's
DeepGEMM warmup (``VLLM_DEEP_GEMM_WARMUP``, ``vllm/model_executor/warmup/deep_gemm_warmup.py``):
``fp8_gemm_nt`` for each linear weight shape at the token counts where DeepGEMM's kernel
choice changes (``relax``, the default) or at every count up to ``max_num_batched_tokens``
(``full``), and ``m_grouped_fp8_gemm_nt_contiguous`` at its boundary counts for each MoE. Every new kernel configuration is compiled there by NVCC, one at a time, on one
core: about 3.3 s per kernel on the H200 host (BENCHMARKS.md, "DeepGEMM's JIT"). The compiles
are independent of each other, and DeepGEMM keeps each one in ``DG_JIT_CACHE_DIR``, which
processes share: a kernel another process compiled is loaded, not compiled again.

How: this family runs *ahead* (``ahead=True`` in the table): before vLLM's profile run, the
model's first forward, which on a cold cache compiles each weight's kernel for
``max_num_batched_tokens`` one by one too (kwarm_ext/patches.py,
``_wrap_determine_available_memory``). It derives what requests can run on DeepGEMM from vLLM's
own code, not from a list of its own:
- the weights (:func:`linear_data`): on 0.33+ those the DeepGEMM kernel stamped as its own,
  which vLLM's warmup runs; before, those vLLM's warmup filter takes and those whose layer vLLM
  runs on DeepGEMM although the filter leaves them out (:func:`runs_on_deep_gemm`: N a multiple
  of 64, not of 128, as MLA's fused q/kv down-projection; their kernels compiled in requests,
  4-5 in the FP8 scenario of BENCHMARKS.md);
- linear layers' token counts: vLLM's own list (``relax``: every block-M multiple and wave
  boundary). DeepGEMM 2.5-2.6 (vLLM 0.24-0.29) compile N and K into a kernel, not M, and no
  longer size the SM count per M, so the list reaches each kernel a count up to
  ``max_num_batched_tokens`` selects (checked on the H200 for every M of two weights);
- MoE layers: every grouped layout a batch can produce (:func:`grouped_layouts`), where vLLM's
  list samples half of them.
On a cache that holds no DeepGEMM GEMM it goes straight to the children; otherwise it probes one
call, and when that call compiled, cuts every weight's counts into short runs and lets child
processes, one per core of this rank, pull the runs across weights until none is left
(:func:`chunks`). The children call vLLM's ``fp8_gemm_nt`` / ``m_grouped_fp8_gemm_nt_contiguous`` on
the engine's own weights and one set of scratch buffers, shared through CUDA IPC (no copy;
their outputs are thrown away). vLLM's warmup then loads every kernel from the cache. On a
warm cache the probe is a load (milliseconds) and nothing is spawned. On a block-FP8 model whose
cache holds no DeepGEMM GEMM at all, the children start when vLLM starts loading the weights
(:func:`before_load`, from ``Worker.load_model``), so that their imports (torch and vLLM, seconds
each, slower fifteen at a time) overlap the load; once vLLM has built the model, before the
weights load (:func:`model_built`, from ``initialize_model``), they get the linear layers' work
by shape (a kernel depends on N, K and M, not on the values) and compile while the weights load,
on tensors of their own, as many processes as the GPU's free memory holds beside the weights.
The ahead run then waits for them and runs only what they did not cover (MoE layers, whose
experts are set up after the load).

Upstream: vLLM 0.20-0.33 compile these kernels serially (``deep_gemm_warmup``); vLLM issue
#49905 is about the entry points that warmup misses, not its speed. This family can go when
vLLM compiles DeepGEMM's kernels in parallel (or ships them prebuilt).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

from kwarm_ext import triton_compile
from kwarm_ext.families import Step

logger = logging.getLogger("kwarm")

KERNEL = "deep_gemm.fp8_gemm_nt"
TRITON_KERNELS = ()  # DeepGEMM is not Triton
WARMUP_MODULE = "vllm.model_executor.warmup.deep_gemm_warmup"
_WARMUP_NAMES = ("_get_fp8_gemm_nt_m_values", "_fused_moe_grouped_gemm_may_use_deep_gemm",
                 "_extract_data_from_fused_moe_module", "_get_grouped_gemm_params")
# which linear layers run on DeepGEMM: 0.33+ asks the layer (its DeepGEMM kernel stamps it),
# 0.20-0.32 a filter on the layer and its weights
_LINEAR_NAMES = (("_deep_gemm_linear_data",), ("_fp8_linear_may_use_deep_gemm", "_extract_data_from_linear_base_module"))
COLD_PROBE_S = 0.5  # a call slower than this compiled its kernel (a cache load takes milliseconds)
CHILD_TIMEOUT_S = 1800.0
MAX_CHILDREN = 16
CHILD_GPU_BYTES = 1 << 30  # a child's CUDA context and DeepGEMM's workspace, with room to spare
RUN_COUNTS = 8  # a run of the work list holds at most this many of one weight's token counts (chunks)


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if not (view.device or "").startswith("cuda"):
        return f"runner device {view.device or 'unknown'} is not CUDA"
    try:
        import vllm.envs as envs
        from vllm.utils import deep_gemm
    except ImportError as exc:
        return f"vLLM {view.vllm_version} has no DeepGEMM support ({exc})"
    if envs.VLLM_DEEP_GEMM_WARMUP == "skip":
        return "VLLM_DEEP_GEMM_WARMUP=skip: vLLM leaves DeepGEMM's compiles to the requests"
    if not deep_gemm.is_deep_gemm_supported():
        return "DeepGEMM is not in use (VLLM_USE_DEEP_GEMM, GPU or package)"
    try:
        warmup = __import__(WARMUP_MODULE, fromlist=["_"])
    except ImportError:
        return f"vLLM {view.vllm_version} has no DeepGEMM warmup to run ahead of"
    missing = warmup_gaps(warmup)
    if missing:
        return f"vLLM {view.vllm_version}'s DeepGEMM warmup lacks {', '.join(missing)}"
    return None


def warmup_gaps(w_mod) -> list:
    """The names this family reads from vLLM's DeepGEMM warmup module that `w_mod` lacks."""
    missing = [name for name in _WARMUP_NAMES if not hasattr(w_mod, name)]
    linear = [[name for name in names if not hasattr(w_mod, name)] for names in _LINEAR_NAMES]
    return missing + ([] if [] in linear else linear[-1])


def linear_data(w_mod, module):
    """``(w, ws)`` of a linear layer whose GEMM runs on DeepGEMM, else None. vLLM 0.33+: the layers
    the DeepGEMM kernel stamped as its own (``_deep_gemm_linear_data``, what vLLM's warmup runs:
    every N that kernel takes). Before: vLLM's warmup filter, or vLLM's kernel choice where the
    filter leaves the layer out (:func:`runs_on_deep_gemm`)."""
    if hasattr(w_mod, "_deep_gemm_linear_data"):
        return w_mod._deep_gemm_linear_data(module)
    if w_mod._fp8_linear_may_use_deep_gemm(module) or runs_on_deep_gemm(module):
        w, ws, _ = w_mod._extract_data_from_linear_base_module(module)
        return w, ws
    return None


def plan(view, forced) -> list:
    jobs = gemm_jobs(view.worker.get_model(), view.max_num_batched_tokens)
    if not jobs:
        return [Step("block-FP8 GEMMs", KERNEL, skip="no layer runs on DeepGEMM")]
    calls = sum(len(job["counts"]) for job in jobs)
    return [Step(f"{len(jobs)} weights, {calls} token counts", KERNEL, summary=True,
                 run=lambda: compile_ahead(jobs, view.device, view.tp_size, _early.pop(id(view.worker), ()),
                                           _sent.pop(id(view.worker), None)))]


_early: dict = {}  # id(worker) -> the processes before_load started, until its ahead run takes them


def before_load(worker) -> None:
    """As vLLM starts loading `worker`'s weights: on a block-FP8 model that will run DeepGEMM on a
    cache holding no DeepGEMM GEMM, start the compile processes now (:func:`start_children`), so
    that their imports overlap the load; :func:`compile_ahead` takes them, :func:`release` ends
    those it did not take. Elsewhere nothing starts (the ahead run probes and spawns as before)."""
    if early_start_gap(worker) is not None:
        return
    tp_size = getattr(worker.vllm_config.parallel_config, "tensor_parallel_size", 1)
    n = max(1, min(MAX_CHILDREN, triton_compile.compile_threads(tp_size) - 1))
    _early[id(worker)] = start_children(n)
    logger.info("kwarm: deep_gemm: %d compile processes started beside weight loading (DeepGEMM's cache "
                "%s holds no GEMM kernel)", n, _cache_dir())


def early_start_gap(worker) -> str | None:
    """Why :func:`before_load` starts no process for `worker` (None: it does). It reads the
    config only: the model is not built yet."""
    if getattr(getattr(worker, "device", None), "type", None) != "cuda":
        return "not a CUDA worker"
    if not getattr(getattr(worker.vllm_config, "quant_config", None), "weight_block_size", None):
        return "not a block-FP8 model"
    import vllm.envs as envs
    from vllm.utils import deep_gemm

    if envs.VLLM_DEEP_GEMM_WARMUP == "skip" or not deep_gemm.is_deep_gemm_supported():
        return "DeepGEMM not in use or its warmup skipped"
    if cached_kernels(_cache_dir(), "gemm"):
        return "DeepGEMM's cache holds GEMM kernels: the ahead run probes it first"
    return None


def release(worker) -> None:
    """End the processes :func:`before_load` started for `worker` that no ahead run took (the
    family skipped, or found no DeepGEMM layer), those :func:`model_built` sent work included."""
    _stop(_early.pop(id(worker), ()))
    sent = _sent.pop(id(worker), None)
    if sent is not None:
        _stop(sent["procs"])
        sent["claims"].cleanup()


_sent: dict = {}  # id(worker) -> the work model_built sent, until its ahead run waits for it


def model_built(worker, model) -> None:
    """As vLLM has built `worker`'s model, before it loads the weights (``initialize_model``
    returned, kwarm_ext/patches.py): send the processes :func:`before_load` started the linear
    layers' work, each weight by its shape (:func:`shape_jobs`; a process makes its own tensors
    of that shape, DeepGEMM's kernel depends on the shapes, not the values), so that the
    compiles run while the weights load. As many processes as the GPU's free memory holds
    (:func:`fitting`); :func:`compile_ahead` waits for them and runs what they did not cover."""
    procs = _early.get(id(worker))
    if not procs:
        return
    import torch

    jobs = shape_jobs(model, worker.vllm_config.scheduler_config.max_num_batched_tokens)
    if not jobs:
        return
    device = torch.device(worker.device)
    work = chunks([job["counts"] for job in jobs])
    n = min(len(procs), len(work), fitting(jobs, *torch.cuda.mem_get_info(device)))
    if n < 1:
        logger.info("kwarm: deep_gemm: the GPU's free memory holds no compile process beside the weights; "
                    "the compiles wait for the load")
        return
    claims = tempfile.TemporaryDirectory(prefix="kwarm-deep-gemm-")
    shapes = {j: {key: job[key] for key in ("kind", "shape", "ws_shape")} for j, job in enumerate(jobs)}
    t0 = time.perf_counter()
    _send(procs[:n], {"device": device.index or 0, "jobs": shapes, "work": work, "claims": claims.name,
                      "sent": time.time()}, pickle.dumps)
    _early[id(worker)] = procs[n:]
    _sent[id(worker)] = {"procs": procs[:n], "keys": {job_key(job) for job in jobs}, "claims": claims, "t0": t0,
                         "before": cached_kernels(_cache_dir()), "work": work, "jobs": jobs,
                         "weights": len(jobs), "calls": sum(len(job["counts"]) for job in jobs)}
    logger.info("kwarm: deep_gemm: %d weights, %d token counts sent to %d compile processes as the model was "
                "built, before its weights load", len(jobs), _sent[id(worker)]["calls"], n)


def shape_jobs(model, max_tokens: int) -> list:
    """The linear layers' jobs of a model built but not loaded, by shape: ``{"kind": "linear",
    "shape": (N, K), "ws_shape", "counts"}``, one per distinct weight shape, for the layers
    vLLM's warmup filter takes (0.20-0.32) or whose kernel vLLM chose is DeepGEMM's
    (:func:`runs_on_deep_gemm`; vLLM chooses it as it creates the weights), with vLLM's own
    counts. MoE layers set their experts up as their weights are processed: the ahead run
    takes them (:func:`gemm_jobs`)."""
    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    may_use = getattr(w_mod, "_fp8_linear_may_use_deep_gemm", None)
    jobs, seen = [], set()
    for module in model.modules():
        if not (runs_on_deep_gemm(module) or (may_use is not None and may_use(module))):
            continue
        w = getattr(module, "weight", None)
        ws = getattr(module, "weight_scale_inv", None)
        ws = getattr(module, "weight_scale", None) if ws is None else ws
        if w is None or ws is None or w.ndim != 2 or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        counts = [(m, None, None) for m in w_mod._get_fp8_gemm_nt_m_values(w, max_tokens)]
        jobs.append({"kind": "linear", "shape": tuple(w.shape), "ws_shape": tuple(ws.shape), "counts": counts})
    return jobs


def job_key(job: dict) -> tuple:
    """What decides a job's kernels: its kind, N and K, and its counts (a job read from the
    loaded model and one from its shapes alone match when these do)."""
    return job["kind"], _shape(job)[-2:], tuple(job["counts"])


CONTEXT_BYTES = 1 << 30  # a process's CUDA context and DeepGEMM's workspace, with room to spare
RESERVE_FRACTION = 0.1  # of the GPU's memory, left to vLLM's weight processing while the processes run


def fitting(jobs: list, free: int, total: int) -> int:
    """How many processes making their own tensors for `jobs` (the largest weight at its
    largest count: weight, scales, activations and output) fit in `free` bytes of the GPU, a
    tenth of its `total` left to vLLM."""
    def need(job):
        (n, k), m = job["shape"], max(c[0] for c in job["counts"])
        return n * k + 4 * n * _scale_cols(k) + m * (k + 4 * _scale_cols(k) + 2 * n)

    per = CONTEXT_BYTES + max(need(job) for job in jobs)
    return max(0, int(free - RESERVE_FRACTION * total) // per)


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


def gemm_jobs(model, max_tokens: int) -> list:
    """What the requests can run on DeepGEMM, from vLLM's own filters, kernel choice and lists:
    one job per distinct weight, ``{"kind": "linear"|"grouped", "w", "ws", "counts": [(m, align,
    expert_ids)]}`` (``align`` is None for linear layers; ``expert_ids`` is None: grouped calls
    take theirs from the shared buffers, :func:`_buffers`). Weights vLLM's warmup already ran
    in this process are left out, as it leaves them out."""
    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    jobs, seen = [], set(getattr(w_mod, "FP8_GEMM_NT_WARMUP_CACHE", ()))
    seen_grouped = set(getattr(w_mod, "GROUPED_FP8_GEMM_NT_CONTIGUOUS_WARMUP_CACHE", ()))
    for module in model.modules():
        if (data := linear_data(w_mod, module)) is not None:
            w, ws = data
            if w.size() in seen:
                continue
            seen.add(w.size())
            counts = [(m, None, None) for m in w_mod._get_fp8_gemm_nt_m_values(w, max_tokens)]
            jobs.append({"kind": "linear", "w": w, "ws": ws, "counts": counts})
        elif w_mod._fused_moe_grouped_gemm_may_use_deep_gemm(module):
            w13, w13_s, w2, w2_s, top_k = w_mod._extract_data_from_fused_moe_module(module)
            if w13.size() in seen_grouped and w2.size() in seen_grouped:
                continue
            # what requests reach, and what vLLM's warmup will run after this family (its list
            # has layouts of batches that go to the Triton fallback): all of it compiled here
            _, _, cases = w_mod._get_grouped_gemm_params(w13, w2, top_k, max_tokens)
            layouts = sorted({(m, align, None) for m, align, _ in cases}
                             | set(grouped_layouts(module, w13, w2, top_k, max_tokens)))
            for w, ws in ((w13, w13_s), (w2, w2_s)):
                if layouts and w.size() not in seen_grouped:
                    seen_grouped.add(w.size())
                    jobs.append({"kind": "grouped", "w": w, "ws": ws, "counts": layouts})
    return jobs


def runs_on_deep_gemm(module) -> bool:
    """Whether vLLM chose DeepGEMM for this linear layer (its ``fp8_linear`` kernel, or that
    kernel's fallback for larger batches, is ``DeepGemmFp8BlockScaledMMKernel``), which vLLM's
    warmup filter does not ask: it takes only weights whose N is a multiple of 128, while the
    kernel runs every N that is a multiple of 64 (``should_use_deepgemm_for_fp8_linear``), so
    MLA's fused q/kv down-projection (N = 2112 on DeepSeek-V3.2, 2624 on GLM-5) compiled its
    kernels in requests (vLLM 0.24-0.33)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return any(getattr(k, "__name__", "") == "DeepGemmFp8BlockScaledMMKernel"
               for k in (*type(kernel).__mro__, *type(getattr(kernel, "fallback", None)).__mro__))


def grouped_layouts(module, w13, w2, top_k: int, max_tokens: int) -> list:
    """Every ``(M_sum, alignment, None)`` a MoE layer's grouped GEMM can be called with, from
    vLLM's own code: a batch of M tokens is permuted into ``M_sum`` rows, each expert's rows
    padded to the alignment (``compute_aligned_M_and_alignment``, with no per-expert counts on
    the CPU, as the non-EP path calls it), for every M that takes DeepGEMM's path: M up to the
    tokens of one MoE call (DP ranks x ``max_num_batched_tokens``, as vLLM's warmup assumes),
    from the alignment up where the experts fall back to Triton below it
    (``TritonOrDeepGemmExperts``, vLLM's own ``_valid_deep_gemm_shape``).
    DeepGEMM picks the kernel (block N, multicast, stages) from ``M_sum``'s waves, so each
    layout is a call: those sharing a kernel load it from the cache."""
    from vllm.model_executor.layers.fused_moe import deep_gemm_utils
    from vllm.utils.deep_gemm import get_mk_alignment_for_contiguous_layout

    w_mod = __import__(WARMUP_MODULE, fromlist=["_"])
    tokens = max_tokens * w_mod.get_dp_group().world_size
    block_m = get_mk_alignment_for_contiguous_layout()[0]
    takes = _deep_gemm_takes(module)
    _, k, n = w2.size()
    layouts = {}
    for m in range(1, tokens + 1):
        if takes is not None and not takes(m, n, k):
            continue
        m_sum, align = deep_gemm_utils.compute_aligned_M_and_alignment(
            M=m, num_topk=top_k, local_num_experts=w13.size(0), alignment=block_m, expert_tokens_meta=None)
        layouts[(m_sum, align)] = None
    return [(m_sum, align, None) for m_sum, align in sorted(layouts)]


def fused_experts(module):
    """A MoE layer's experts implementation, where vLLM's own warmup filter reads it:
    ``moe_kernel.impl.fused_experts`` of the layer's quant method (the ``MoERunner``'s
    ``_quant_method`` on 0.24-0.33, the ``FusedMoE`` layer's ``quant_method`` on 0.20-0.23);
    None where the layer has no modular kernel."""
    method = getattr(module, "_quant_method", None) or getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    return getattr(getattr(kernel, "impl", None), "fused_experts", None)


def _deep_gemm_takes(module):
    """vLLM's test of whether M tokens go to DeepGEMM rather than the Triton fallback, where the
    layer's experts have one (``TritonOrDeepGemmExperts`` calls ``_valid_deep_gemm_shape(M, N,
    K)``; on GPUs with E8M0 scales everything goes to DeepGEMM); None: every M does."""
    experts = fused_experts(module)
    if experts is None or type(experts).__name__ != "TritonOrDeepGemmExperts":
        return None
    owner = sys.modules[type(experts).__module__]
    if getattr(owner, "is_deep_gemm_e8m0_used", lambda: False)():
        return None
    return getattr(owner, "_valid_deep_gemm_shape", None)


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


def compile_ahead(jobs: list, device: str, tp_size, early=(), sent=None) -> list:
    """Every count of every job on child processes: first waits for the work :func:`model_built`
    `sent` (if any) and leaves out the jobs it covered; the rest on the processes `early`
    (:func:`before_load`'s) or new ones, unless a probe of the first job's first count finds the
    cache warm; a cache holding no DeepGEMM GEMM (or one the early processes found so) is cold
    without a probe. Returns the step's labels (what ran, where, what it left in the cache)."""
    import torch

    cache = _cache_dir()
    labels = []
    if sent is not None:
        try:
            labels.append(_finish(sent, cache))
        except BaseException:
            _stop(early)
            raise
        jobs = [job for job in jobs if job_key(job) not in sent["keys"]]
        if not jobs:
            _stop(early)
            return labels
    before = cached_kernels(cache)
    children = max(1, min(MAX_CHILDREN, triton_compile.compile_threads(tp_size) - 1,  # a core stays with the engine
                          torch.cuda.mem_get_info(device)[0] // CHILD_GPU_BYTES))
    work = chunks([job["counts"] for job in jobs])
    children = min(children, len(work))
    cold = bool(early) or sent is not None or cached_kernels(cache, "gemm") == 0
    started = list(early) or (start_children(children) if cold else [])
    try:
        if cold:
            how = (f"no GEMM in the cache, no probe; {len(started)} processes started beside weight loading"
                   if early else "no GEMM in the cache, no probe")
        else:
            probe = [dict(jobs[0], counts=jobs[0]["counts"][:1])]  # one call, scratch for it alone
            t0 = time.perf_counter()
            run_counts(probe, [probe[0]["counts"]], _buffers(probe, device))
            torch.cuda.synchronize(device)
            probe_s = time.perf_counter() - t0
            if probe_s < COLD_PROBE_S:
                return labels + [f"probe {probe_s * 1000:.0f} ms: kernels cached, nothing compiled ahead"]
            how = f"probe {probe_s:.1f} s (compiled)"
        buffers = _buffers(jobs, device)  # the full scratch only on a cold cache
        t0 = time.perf_counter()
        outcomes = run_children(work, children, jobs, buffers, device, started=started)
    finally:
        _stop(started)  # unused (warm probe, more than needed) or failed: none outlives the step
    wall_s, new = time.perf_counter() - t0, cached_kernels(cache) - before
    return labels + [f"{how}; {len(jobs)} weights, {sum(len(j['counts']) for j in jobs)} calls in {len(work)} runs "
                     f"pulled by {len(outcomes)} processes; {new} kernels new in {cache}, {wall_s:.0f} s "
                     f"({_throughput(new, wall_s, outcomes)}; {readiness(outcomes)}; "
                     f"longest runs {longest_runs(work, jobs, outcomes)})"]


def _finish(sent: dict, cache: str) -> str:
    """Wait for the processes :func:`model_built` sent work; the label of what they did."""
    waited = time.perf_counter()
    try:
        outcomes = _collect(sent["procs"])
    finally:
        sent["claims"].cleanup()
    end = time.perf_counter()
    wall_s, new = end - sent["t0"], cached_kernels(cache) - sent["before"]
    return (f"{sent['weights']} weights, {sent['calls']} calls in {len(sent['work'])} runs sent to {len(outcomes)} "
            f"processes as the model was built, before its weights loaded; {new} kernels new in {cache}, "
            f"{wall_s:.0f} s from then, {end - waited:.1f} s of it after the load "
            f"({_throughput(new, wall_s, outcomes)}; {readiness(outcomes)}; "
            f"longest runs {longest_runs(sent['work'], sent['jobs'], outcomes)})")


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


def _cache_dir() -> str:
    """Where vLLM points DeepGEMM (``DG_JIT_CACHE_DIR``, set by vLLM's first DeepGEMM use)."""
    from vllm.utils import deep_gemm

    init = getattr(deep_gemm, "_lazy_init", None)
    if init is not None:
        init()
    return os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")


def cached_kernels(cache: str, part: str = "") -> int:
    """The kernel directories (``kernel.<name>.<hash>``) under DeepGEMM's cache, those whose
    name holds `part` (``"gemm"``: the GEMMs, not the layout transforms that vLLM's weight
    loading may have built)."""
    count = 0
    for _, dirs, _ in os.walk(cache):
        count += sum(d.startswith("kernel.") and part in d for d in dirs)
    return count


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
        proc = subprocess.Popen([sys.executable, "-c", "from kwarm_ext.kernels.deep_gemm import child; child()"],
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
