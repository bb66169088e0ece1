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
The ahead run sends what they did not cover (MoE layers, whose experts are set up after the
load) to a second parent started then; where vLLM's profile run starts with ``torch.compile``,
it does not wait: the processes compile beside Dynamo's trace and Inductor's compiles, and
:func:`finish` waits for them once the profile run has returned (:func:`compile_beside`; in eager
mode the ahead run waits for them before it). The selection lives in ``selection``, the
processes in ``processes``.

Upstream: vLLM 0.20-0.33 compile these kernels serially (``deep_gemm_warmup``); vLLM issue
#49905 is about the entry points that warmup misses, not its speed. This family can go when
vLLM compiles DeepGEMM's kernels in parallel (or ships them prebuilt).
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import time

from kwarm_ext import config
from kwarm_ext.log import fail_open
from kwarm_ext.surfaces.triton import compile as triton_compile
from kwarm_ext.families import Step
from kwarm_ext.kernels.deep_gemm.processes import (  # noqa: F401  (the family's names, re-exported)
    CHILD_TIMEOUT_S, RUN_COUNTS, _buffers, _collect, _scale_cols, _send, _shape, _stop, _throughput, chunks, child, claimed,
    EARLY_ENV, finish_children, forkserver, longest_runs, made_tensors, readiness, run_children, run_counts, spread,
    cancel_children, start_calls, start_children, start_early, start_forkserver, start_metadata_parent, take_early,
    take_metadata_parent)
from kwarm_ext.kernels.deep_gemm.selection import (  # noqa: F401  (the family's names, re-exported)
    WARMUP_MODULE, _deep_gemm_takes, _takes_linear, fused_experts, gemm_jobs, grouped_layouts, job_key, linear_data,
    runs_on_deep_gemm, shape_jobs)

logger = logging.getLogger("kwarm")

KERNEL = "deep_gemm.fp8_gemm_nt"
TRITON_KERNELS = ()  # DeepGEMM is not Triton
_WARMUP_NAMES = ("_get_fp8_gemm_nt_m_values", "_fused_moe_grouped_gemm_may_use_deep_gemm",
                 "_extract_data_from_fused_moe_module", "_get_grouped_gemm_params")
# which linear layers run on DeepGEMM: 0.33+ asks the layer (its DeepGEMM kernel stamps it),
# 0.20-0.32 a filter on the layer and its weights
_LINEAR_NAMES = (("_deep_gemm_linear_data",), ("_fp8_linear_may_use_deep_gemm", "_extract_data_from_linear_base_module"))
COLD_PROBE_S = 0.5  # a call slower than this compiled its kernel (a cache load takes milliseconds)
# auto's cap (KWARM_COMPILE_PROCESSES raises it): the data-parallel engines of one host each take
# their share of its cores, and each compile process holds a CUDA context
MAX_CHILDREN = 16


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


def plan(view, forced) -> list:
    jobs = gemm_jobs(view.worker.get_model(), view.max_num_batched_tokens)
    if not jobs:
        return [Step("block-FP8 GEMMs", KERNEL, skip="no layer runs on DeepGEMM")]
    calls = sum(len(job["counts"]) for job in jobs)
    key = id(view.worker)
    beside = key if view.before_profile_run and profile_run_compiles(view.worker.vllm_config) else None
    return [Step(f"{len(jobs)} weights, {calls} token counts", KERNEL, summary=True,
                 run=lambda: compile_ahead(jobs, view.device, view.tp_size, _early.pop(key, None), _sent.pop(key, None),
                                           beside=beside))]


def profile_run_compiles(vllm_config) -> bool:
    """Whether vLLM's profile run starts with ``torch.compile`` (Dynamo's trace and Inductor's
    compiles, tens of seconds on a cold cache, before the forward's first DeepGEMM call): not
    ``enforce_eager``, and a compilation mode (0.24+ ``mode``, before it ``level``) other than
    none."""
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return False
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "mode", None)
    mode = getattr(compilation, "level", None) if mode is None else mode
    return bool(int(mode or 0))


_early: dict = {}  # id(worker) -> (server, processes) before_load started, until model_built or the ahead run takes it


def before_load(worker) -> None:
    """As vLLM starts loading `worker`'s weights: on a block-FP8 model that will run DeepGEMM on a
    cache holding no DeepGEMM GEMM, take the compile processes' parent the front end or kwarm's
    activation started (:func:`take_early`), or start one now (:func:`start_forkserver`), so that
    its imports overlap the load; :func:`model_built` or :func:`compile_ahead` takes it,
    :func:`release` ends it if neither did. Elsewhere one started early ends, and nothing starts
    (the ahead run probes and starts one as before)."""
    with fail_open("deep_gemm: the DSA indexer metadata processes' parent did not start with the load; "
                   "dsa_indexer starts it when it runs"):
        if dsa_metadata_ahead(worker):
            start_metadata_parent()  # dsa_indexer's schedule metadata takes it after the KV cache is bound
    started = take_early()  # the parent activation or the front end started, if any
    if early_start_gap(worker) is not None:
        _stop([started])
        return
    tp_size = getattr(worker.vllm_config.parallel_config, "tensor_parallel_size", 1)
    n = compile_processes(tp_size)
    _early[id(worker)] = (started or start_forkserver(), n)
    logger.info("kwarm: deep_gemm: the parent of %d compile processes %s (DeepGEMM's cache %s holds no GEMM "
                "kernel)", n, "started early (front end or engine start)" if started else "started beside weight loading",
                _cache_dir())


def dsa_metadata_ahead(worker) -> bool:
    """Whether `worker` loads a DSA-indexer model (``index_topk`` in its config: DeepSeek-V3.2,
    GLM-5) on a CUDA device where DeepGEMM runs: its indexer's schedule metadata will be built
    by compile processes (``dsa_indexer``), whose parent can start now."""
    if getattr(getattr(worker, "device", None), "type", None) != "cuda":
        return False
    hf_config = getattr(getattr(worker.vllm_config, "model_config", None), "hf_config", None)
    if not getattr(hf_config, "index_topk", None):
        return False
    from vllm.utils import deep_gemm

    return bool(deep_gemm.is_deep_gemm_supported())


def compile_processes(tp_size) -> int:
    """How many compile processes this worker starts: KWARM_COMPILE_PROCESSES, or MAX_CHILDREN
    (auto), never more than its share of the cores but one, which stays with the engine."""
    wanted = config.get().compile_processes or MAX_CHILDREN
    return max(1, min(wanted, triton_compile.compile_threads(tp_size) - 1))


def early_start_gap(worker) -> str | None:
    """Why :func:`before_load` starts no process for `worker` (None: it does). It reads the
    config only: the model is not built yet."""
    if getattr(getattr(worker, "device", None), "type", None) != "cuda":
        return "not a CUDA worker"
    gap = config_gap(worker.vllm_config)
    if gap is not None:
        return gap
    if cached_kernels(_cache_dir(), "gemm"):
        return "DeepGEMM's cache holds GEMM kernels: the ahead run probes it first"
    return None


def config_gap(vllm_config) -> str | None:
    """Why a model of `vllm_config` compiles no DeepGEMM GEMM at start (None: it does): not
    block-FP8, or DeepGEMM not in use (NVML's device capability: no CUDA is initialized)."""
    if not getattr(getattr(vllm_config, "quant_config", None), "weight_block_size", None):
        return "not a block-FP8 model"
    return _deep_gemm_gap()


def _deep_gemm_gap() -> str | None:
    import vllm.envs as envs
    from vllm.utils import deep_gemm

    if envs.VLLM_DEEP_GEMM_WARMUP == "skip" or not deep_gemm.is_deep_gemm_supported():
        return "DeepGEMM not in use or its warmup skipped"
    return None


def before_engine_config(engine_args) -> None:
    """As the front end starts making the engine's config (``EngineArgs.create_engine_config``,
    which resolves the model for seconds to tens of seconds): where the checkpoint's own
    ``config.json`` says block-FP8 (:func:`checkpoint_block_fp8`) and DeepGEMM is in use, start
    the compile processes' parent now (:func:`_start_for_engine`); :func:`engine_config_made`
    confirms it from the config, or ends it."""
    if checkpoint_block_fp8(engine_args) and _deep_gemm_gap() is None:
        _start_for_engine()


def engine_config_made(vllm_config) -> None:
    """As the front end has made the engine's config: for a block-FP8 model on DeepGEMM, the
    parent as :func:`_start_for_engine` starts it (once); for any other model, end what
    :func:`before_engine_config` started and take the mark back. The worker's :func:`before_load`
    takes the parent, or ends it where DeepGEMM's cache turns out warm."""
    if config_gap(vllm_config) is None:
        _start_for_engine()
    elif os.environ.pop(EARLY_ENV, None) is not None:
        _stop([take_early()])


def _start_for_engine() -> None:
    """Mark :data:`EARLY_ENV` in the environment the engine's processes inherit (kwarm's
    activation there starts the parent at once), and start the parent in this process when the
    engine runs here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import vllm.envs as envs

    here = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
    if os.environ.get(EARLY_ENV) != "1":
        logger.info("kwarm: deep_gemm: block-FP8 model on DeepGEMM: the compile processes' parent starts %s",
                    "now, in this process" if here else "with the engine's processes")
    os.environ[EARLY_ENV] = "1"
    if here:
        start_early()


def checkpoint_block_fp8(engine_args) -> bool:
    """Whether the checkpoint's own ``config.json`` (a local folder, or Hugging Face's cache: never
    the network) has a ``quantization_config`` with ``weight_block_size``, and no
    ``--quantization`` other than ``fp8`` overrides it."""
    if getattr(engine_args, "quantization", None) not in (None, "fp8"):
        return False
    model = getattr(engine_args, "model", None)
    if not isinstance(model, str):
        return False
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model, "config.json", revision=getattr(engine_args, "revision", None))
        except Exception:  # not a repository id, or no hub client: the config decides later
            return False
    if not isinstance(path, str) or not os.path.isfile(path):
        return False
    with open(path) as f:
        hf = json.load(f)
    quant = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or {}
    return bool(quant.get("weight_block_size"))


def release(worker) -> None:
    """End the processes :func:`before_load` started for `worker` that no ahead run took (the
    family skipped, or found no DeepGEMM layer), those :func:`model_built` sent work included.
    What runs beside the profile run is the ahead run's: :func:`finish` waits for it."""
    early = _early.pop(id(worker), None)
    _stop([early[0]] if early else [])
    sent = _sent.pop(id(worker), None)
    if sent is not None:
        _stop([sent["server"], sent.get("spare")])
        sent["claims"].cleanup()


_sent: dict = {}  # id(worker) -> the work model_built sent, until its ahead run waits for it


def model_built(worker, model) -> None:
    """As vLLM has built `worker`'s model, before it loads the weights (``initialize_model``
    returned, kwarm_ext/patches.py): send the processes :func:`before_load` started the linear
    layers' work, each weight by its shape (:func:`shape_jobs`; a process makes its own tensors
    of that shape, DeepGEMM's kernel depends on the shapes, not the values), so that the
    compiles run while the weights load. As many processes as the GPU's free memory holds
    (:func:`fitting`); :func:`compile_ahead` waits for them and runs what they did not cover."""
    early = _early.get(id(worker))
    if not early:
        return
    import torch

    jobs = shape_jobs(model, worker.vllm_config.scheduler_config.max_num_batched_tokens)
    if not jobs:
        return
    device = torch.device(worker.device)
    work = chunks([job["counts"] for job in jobs])
    n = min(early[1], len(work), fitting(jobs, *torch.cuda.mem_get_info(device)))
    if n < 1:
        logger.info("kwarm: deep_gemm: the GPU's free memory holds no compile process beside the weights; "
                    "the compiles wait for the load")
        return
    claims = tempfile.TemporaryDirectory(prefix="kwarm-deep-gemm-")
    shapes = {j: {key: job[key] for key in ("kind", "shape", "ws_shape")} for j, job in enumerate(jobs)}
    t0 = time.perf_counter()
    _send(early[0], n, {"device": device.index or 0, "jobs": shapes, "work": work, "claims": claims.name,
                        "sent": time.time()}, pickle.dumps)
    del _early[id(worker)]
    # a second parent imports now for what the ahead run finds after the load (MoE layers)
    _sent[id(worker)] = {"server": early[0], "processes": n, "jobs": jobs, "work": work, "claims": claims, "t0": t0,
                         "before": cached_kernels(_cache_dir()), "calls": sum(len(job["counts"]) for job in jobs),
                         "spare": start_forkserver()}
    logger.info("kwarm: deep_gemm: %d weights, %d token counts sent to %d compile processes as the model was "
                "built, before its weights load", len(jobs), _sent[id(worker)]["calls"], n)


CONTEXT_BYTES = 1 << 30  # a process's CUDA context and DeepGEMM's workspace, with room to spare
RESERVE_FRACTION = 0.1  # of the GPU's memory, left to vLLM's weight processing while the processes run


def fitting(jobs: list, free: int, total: int, shared_weights: bool = False) -> int:
    """How many processes making their own tensors for `jobs` (the largest weight at its
    largest count: weight, scales, activations, output and expert ids; with `shared_weights`,
    the engine's weights through CUDA IPC, only the rest) fit in `free` bytes of the GPU, a
    tenth of its `total` left to vLLM."""
    def need(job):
        (n, k), m = _shape(job)[-2:], max(c[0] for c in job["counts"])
        weights = 0 if shared_weights else n * k + 4 * n * _scale_cols(k)
        return weights + m * (k + 4 * _scale_cols(k) + 2 * n + 4)

    per = CONTEXT_BYTES + max(need(job) for job in jobs)
    return max(0, int(free - RESERVE_FRACTION * total) // per)


def compile_ahead(jobs: list, device: str, tp_size, early=None, sent=None, beside=None) -> list:
    """Every count of every job on compile processes: first waits for the work :func:`model_built`
    `sent` (if any) and leaves out the jobs it covered; the rest on processes forked by `early`
    (:func:`before_load`'s ``(server, processes)``), the spare parent :func:`model_built` started,
    or a new server, unless a probe of the first job's first count finds the cache warm; a cache
    holding no DeepGEMM GEMM (or one found so before the load) is cold without a probe. With
    `beside` (the worker's id: vLLM's profile run comes next and starts with ``torch.compile``)
    and work sent, nothing waits here: :func:`compile_beside`. Returns the step's labels (what
    ran, where, what it left in the cache)."""
    import torch

    cache = _cache_dir()
    labels = []
    spare = None
    if sent is not None:
        spare = sent.pop("spare", None)
        covered = {job_key(job) for job in sent["jobs"]}
        jobs = [job for job in jobs if job_key(job) not in covered]
        if beside is not None and (label := compile_beside(beside, sent, jobs, device, tp_size, spare, cache)):
            _stop([early[0]] if early else [])
            return label
        try:
            labels.append(_finish(sent, cache))
        except BaseException:
            _stop([early[0] if early else None, spare])
            raise
        if not jobs:
            _stop([early[0] if early else None, spare])
            return labels
    before = cached_kernels(cache)
    children = max(1, min(compile_processes(tp_size), torch.cuda.mem_get_info(device)[0] // CONTEXT_BYTES))
    work = chunks([job["counts"] for job in jobs])
    children = min(children, len(work))
    cold = bool(early) or sent is not None or cached_kernels(cache, "gemm") == 0
    if early:
        children = min(children, early[1])
    if early and early[0][0].poll() is not None:  # it exited (its stderr is lost with it): a new one
        _stop([early[0]])
        early = (start_forkserver(), early[1])
    server = early[0] if early else (_alive(spare) if cold else None)  # imports while the probe runs
    try:
        if cold:
            how = ("no GEMM in the cache, no probe; their parent started beside weight loading"
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
        outcomes = run_children(work, children, jobs, buffers, device, server=server)
    finally:
        _stop([server])  # unused (warm probe) or failed: none outlives the step
    return labels + [_ran(how, jobs, work, outcomes, cached_kernels(cache) - before, time.perf_counter() - t0, cache)]


def _alive(server):
    """`server` (a parent started earlier) if it still runs, else a new one."""
    if server is not None and server[0].poll() is None:
        return server
    _stop([server])
    return start_forkserver()


def _ran(how: str, jobs: list, work: list, outcomes: list, new: int, wall_s: float, cache: str) -> str:
    """The label of one set of compile processes' work: how, what, by how many, what it left."""
    return (f"{how}; {len(jobs)} weights, {sum(len(j['counts']) for j in jobs)} calls in {len(work)} runs "
            f"pulled by {len(outcomes)} processes; {new} kernels new in {cache}, {wall_s:.0f} s "
            f"({_throughput(new, wall_s, outcomes)}; {readiness(outcomes)}; "
            f"longest runs {longest_runs(work, jobs, outcomes)})")


_pending: dict = {}  # id(worker) -> what compiles beside vLLM's profile run, until finish waits for it


def compile_beside(key, sent: dict, jobs: list, device: str, tp_size, spare, cache: str) -> list | None:
    """Leave the work :func:`model_built` `sent` compiling, send `jobs` (what the loaded model
    adds: MoE layers, whose experts are set up as their weights load) to the spare parent's
    processes, and return without waiting: :func:`finish` waits for both once vLLM's profile run
    has returned (kwarm_ext/warmup.py, ``beside_profile_run``).

    Why: the ahead run waits for every kernel, 35-40 s after the load for GLM-5's FP8
    dimensions (vLLM 0.29.0, BENCHMARKS.md). Where the profile run that follows starts with
    ``torch.compile`` (0.20-0.28; 0.29+ unless vLLM turns it off, as it does for DeepSeek-V3.2
    and GLM-5 with its breakable CUDA graphs, seen in 0.29.0's and 0.33.0's logs), its first
    tens of seconds (Dynamo's trace, Inductor's compiles) call no DeepGEMM kernel. Beside them,
    the processes finish what they have; the profile run's own kernels (each weight at
    ``max_num_batched_tokens``) come first in their work list (:func:`chunks`), and one the
    forward reaches before a process built it is compiled by the forward itself, as without
    kwarm. The processes make their scratch buffers themselves, so
    none of it is in the engine's memory, which the profile run measures; they have exited
    before vLLM reads the GPU's free memory after it. Returns None, having started nothing,
    where not one such process fits in the GPU's free memory beside a tenth of it left to the
    profile run (:func:`fitting`): the ahead run then waits, as in eager mode."""
    import torch

    pending = {"sent": sent, "rest": None, "cache": cache}
    work = chunks([job["counts"] for job in jobs])
    children = min(compile_processes(tp_size), len(work),
                   fitting(jobs, *torch.cuda.mem_get_info(device), shared_weights=True)) if jobs else 0
    if jobs and children < 1:
        return None
    try:
        if jobs:
            spare = _alive(spare)
            pending["rest"] = {"jobs": jobs, "work": work, "before": cached_kernels(cache), "t0": time.perf_counter(),
                               "started": start_children(work, children, jobs, None, device, spare)}
        else:
            _stop([spare])
    except BaseException:
        _stop([sent["server"], spare])
        sent["claims"].cleanup()
        raise
    _pending[key] = pending
    rest = pending["rest"]
    more = (f", {len(jobs)} found after the load ({sum(len(j['counts']) for j in jobs)} calls) on "
            f"{rest['started']['children']} more" if rest else "")
    return [f"{len(sent['jobs'])} weights sent to {sent['processes']} processes as the model was built{more}: "
            f"compiling beside vLLM's profile run (its torch.compile first)"]


def finish(worker) -> list:
    """Wait for what :func:`compile_beside` left compiling for `worker`; the labels of what it
    did ([]: nothing was left). Every process has exited when it returns, failed or not."""
    pending = _pending.pop(id(worker), None)
    if pending is None:
        return []
    rest, waited = pending["rest"], time.perf_counter()
    try:
        labels = [_finish(pending["sent"], pending["cache"], after="vLLM's profile run")]
    except BaseException:  # the rest is not waited for: it ends with the step
        if rest is not None:
            _stop([rest["started"]["server"]])
            rest["started"]["claims"].cleanup()
        raise
    if rest is not None:
        outcomes = finish_children(rest["started"])  # ends them, failed or not
        labels.append(_ran("found after the load, beside vLLM's profile run", rest["jobs"], rest["work"], outcomes,
                           cached_kernels(pending["cache"]) - rest["before"], time.perf_counter() - rest["t0"],
                           pending["cache"]))
    return labels + [f"waited {time.perf_counter() - waited:.1f} s after vLLM's profile run"]


def _finish(sent: dict, cache: str, after: str = "the load") -> str:
    """Wait for the processes :func:`model_built` sent work; the label of what they did (how long
    the wait took, `after` what)."""
    waited = time.perf_counter()
    try:
        outcomes = _collect(sent["server"], sent["processes"])
    finally:
        _stop([sent["server"]])
        sent["claims"].cleanup()
    end = time.perf_counter()
    wall_s, new = end - sent["t0"], cached_kernels(cache) - sent["before"]
    return (f"{len(sent['jobs'])} weights, {sent['calls']} calls in {len(sent['work'])} runs sent to {len(outcomes)} "
            f"processes as the model was built, before its weights loaded; {new} kernels new in {cache}, "
            f"{wall_s:.0f} s from then, {end - waited:.1f} s of it after {after} "
            f"({_throughput(new, wall_s, outcomes)}; {readiness(outcomes)}; "
            f"longest runs {longest_runs(sent['work'], sent['jobs'], outcomes)})")


def _cache_dir() -> str:
    """Where vLLM points DeepGEMM (``DG_JIT_CACHE_DIR``, set by vLLM's first DeepGEMM use). The
    DeepJIT-based DeepGEMM vLLM 0.34 vendors (``vllm.third_party.deep_gemm``) reads it as a
    ``:``-separated list whose first folder it writes, then ``DJ_JIT_CACHE_DIR``, then ``~/.dj``."""
    from vllm.utils import deep_gemm

    init = getattr(deep_gemm, "_lazy_init", None)
    if init is not None:
        init()
    if os.environ.get("DG_JIT_CACHE_DIR"):
        return os.environ["DG_JIT_CACHE_DIR"].split(":")[0]
    if os.environ.get("DJ_JIT_CACHE_DIR"):
        return os.environ["DJ_JIT_CACHE_DIR"].split(":")[0]
    return os.path.join(os.path.expanduser("~"), ".deep_gemm")


def cached_kernels(cache: str, part: str = "") -> int:
    """The kernels in DeepGEMM's cache, those whose name holds `part` (``"gemm"``: the GEMMs, not
    the layout transforms that vLLM's weight loading may have built). DeepGEMM 2.x before DeepJIT
    keeps each in ``cache/kernel.<name>.<hash>/``; the DeepJIT-based build vLLM 0.34 vendors in
    ``cache/<name>.<digest>/`` with a ``.committed`` marker (builds go through ``tmp/<uuid>/``)."""
    count = 0
    for root, dirs, _ in os.walk(cache):
        count += sum(part in d and (d.startswith("kernel.") or os.path.exists(os.path.join(root, d, ".committed")))
                     for d in dirs)
    return count
