"""FlashInfer's nvcc builds started at launch, in a background process, instead of where vLLM
first calls them.

Why: the FlashInfer wheel ``pip install vllm`` installs (0.7.2.post1 with vLLM 0.33.0) ships no
compiled module; each is built with nvcc the first time it is called. vLLM's start-up sampler
check builds the sampling module after its profile run: 107 s of a 289.5 s cold start of
``vllm serve`` on an H100 (issue 60), serially, while the engine waits. Here the builds start
before vLLM needs them, and run during the engine's imports, model load and torch.compile:

- the sampling build, which every generating model needs, as ``vllm serve`` starts (kwarm's
  activation in its first process, :func:`start_at_launch`): started once the engine config was
  made instead (66-72 s after launch, cold, H100), the engine still waited for it;
- the builds a model's layers imply once ``EngineArgs.create_engine_config`` returns
  (``kwarm_ext/patches.py``, :func:`start`), where the configuration is known.

What (:func:`predict`), from vLLM's own selection logic, per release:

- ``sampling``: where the engine samples (a generating model) and vLLM would use FlashInfer's
  top-k/top-p sampler: ``VLLM_USE_FLASHINFER_SAMPLER`` (vLLM's ``envs``), and on every visible GPU
  ``FlashInferBackend.supports_compute_capability`` and FlashInfer's own arch normalization, the
  parts of 0.33's ``flashinfer_sampler_supported`` that need no CUDA context (its >16-SM check
  does: every data-centre GPU passes it);
- ``concat_mla``: MLA layers with 128 heads per rank and 128/64 nope/rope dimensions (the
  condition of vLLM's ``_use_flashinfer_concat_mla_k``, 0.33: DeepSeek-V3/V3.2, GLM-5);
- ``gdn_prefill``: not an nvcc build but CuTe DSL kernels compiled on the CPU, FlashInfer's SM90 GDN
  prefill where vLLM's GDN layers pick FlashInfer (``kwarm_ext/early_gdn.py``); the engine's
  ``cute_dsl`` family waits for them and loads them before its profile run.

A wrong guess costs only background CPU.

How: one process (``python -m kwarm_ext.early_builds``), which also makes the prediction (its
imports would hold the API server back), started in its own session at low
priority (nice 10), with ``CUDA_VISIBLE_DEVICES`` empty so that it never creates a CUDA context
(its memory would count in vLLM's memory profiling) and ``FLASHINFER_CUDA_ARCH_LIST`` set to the
visible GPUs' capabilities, read through NVML (no CUDA context either; vLLM's platform where the
host's GPUs differ, :func:`capabilities_of`): FlashInfer
then derives the same target architectures, workspace folder and nvcc flags as the engine's
processes, which detect them from the devices. Each module is built through FlashInfer's own
``JitSpec.build`` under the spec's file lock (``need_lock=True``): vLLM's own call finds the
module built, or waits on that lock for the one build in flight, then loads it; nothing is built
twice. The process writes one line per module to its stderr, the server's (vLLM's log).
``KWARM_EARLY_BUILDS`` in the environment marks that they started, so the engine's processes
that inherit it do not start them again.

Versions: FlashInfer 0.6-0.7 (``JitSpec.build(verbose, need_lock)``), vLLM 0.33-0.34 (the
start-up sampler check); elsewhere the prediction is empty or the build a logged failure in the
background process. It can go when the FlashInfer ``pip install vllm`` installs ships its modules
compiled (``flashinfer-jit-cache``), or vLLM starts these builds itself.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys

from kwarm_ext.config import EARLY_BUILDS_ENV as STARTED_ENV

logger = logging.getLogger("kwarm")


@dataclasses.dataclass(frozen=True)
class Build:
    name: str
    spec: str  # "module:function" returning FlashInfer's JitSpec (a FlashInfer JIT module), or "" (GDN_PREFILL)
    why: str


SAMPLING = Build("sampling", "flashinfer.jit.sampling:gen_sampling_module",
                 "vLLM's FlashInfer top-k/top-p sampler (its start-up sampler check builds it)")
PREDICT_FLAG = "--predict"
CONCAT_MLA = Build("concat_mla", "flashinfer.jit.dsv3_optimizations:gen_concat_mla_module",
                   "MLA prefill's concat_mla_k (128 heads per rank, 128/64 nope/rope)")
GDN_PREFILL = Build("gdn_prefill", "", "FlashInfer's SM90 GDN prefill, CuTe DSL kernels compiled on the CPU "
                    "(kwarm_ext/early_gdn.py), which vLLM's GDN layers compile in its profile run")


def config_facts(vllm_config) -> dict:
    """What :func:`predict` reads of a ``VllmConfig``, as JSON for the background process."""
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    from kwarm_ext import early_gdn

    return {"runner_type": getattr(model, "runner_type", "generate"), "use_mla": bool(getattr(model, "use_mla", False)),
            "heads_per_rank": (getattr(hf, "num_attention_heads", 0) or 0) // tp,
            "nope_rope": [getattr(hf, "qk_nope_head_dim", None), getattr(hf, "qk_rope_head_dim", None)],
            "gdn": early_gdn.config_facts(vllm_config)}


def predict(vllm_config, capabilities: list, started: tuple = ()) -> tuple[list, list]:
    """(builds, [why each other was not predicted]) for `vllm_config` (or its
    :func:`config_facts`) on GPUs of `capabilities` ([(major, minor), ...], every visible GPU).
    A build named in `started` (the sampling build, started at launch) is not predicted again:
    its selection logic (vLLM's sampler, its FlashInfer backend, FlashInfer: seconds of imports)
    is not even asked."""
    facts = vllm_config if isinstance(vllm_config, dict) else config_facts(vllm_config)
    builds, not_predicted = [], []
    if not capabilities:
        return [], ["no NVIDIA GPU visible"]
    for build, reason_of in ((GDN_PREFILL, lambda: _gdn_reason(facts, capabilities)),
                             (SAMPLING, lambda: _sampler_reason(facts, capabilities)),
                             (CONCAT_MLA, lambda: _concat_reason(facts))):
        if build is GDN_PREFILL and facts.get("gdn") is None:
            continue  # no GDN layers (or not known yet): not worth a word
        reason = "started at launch" if build.name in started else reason_of()
        if reason is None:
            builds.append(build)
        else:
            not_predicted.append(f"{build.name}: {reason}")
    return builds, not_predicted


def _sampler_reason(facts, capabilities) -> str | None:
    if facts["runner_type"] != "generate":
        return "the model does not generate (no sampler)"
    try:
        import vllm.envs as envs
        from vllm.v1.sample.ops import topk_topp_sampler
    except Exception as exc:  # noqa: BLE001
        return f"vLLM's sampler not importable ({type(exc).__name__})"
    if not hasattr(topk_topp_sampler, "flashinfer_sampler_supported"):
        return "this vLLM has no FlashInfer sampler check (flashinfer_sampler_supported)"
    if not envs.VLLM_USE_FLASHINFER_SAMPLER:  # vLLM's own reading of the variable
        return "VLLM_USE_FLASHINFER_SAMPLER=0"
    try:
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    except Exception:  # noqa: BLE001  (a FlashInfer this vLLM does not match: FlashInfer's own check alone)
        FlashInferBackend = None
    for major, minor in capabilities:
        if FlashInferBackend is not None and not FlashInferBackend.supports_compute_capability(
                DeviceCapability(major, minor)):
            return f"compute capability {major}.{minor} unsupported"
        try:
            from flashinfer.compilation_context import CompilationContext

            CompilationContext._normalize_cuda_arch(major, minor)
        except ImportError:
            return "FlashInfer not installed"
        except Exception as exc:  # noqa: BLE001  (FlashInfer cannot target this GPU with this CUDA)
            return f"FlashInfer cannot build for {major}.{minor}: {exc}"
    return None


def _gdn_reason(facts, capabilities) -> str | None:
    from kwarm_ext import early_gdn

    return early_gdn.reason(facts["gdn"], capabilities)


def _concat_reason(facts) -> str | None:
    if "use_mla" not in facts:  # the launch's facts: the engine config, made later, says
        return "the model's layers are not known at launch (the engine config starts it)"
    if not facts["use_mla"]:
        return "no MLA attention"
    heads, dims = facts["heads_per_rank"], tuple(facts["nope_rope"])
    if heads != 128 or dims != (128, 64):
        return f"{heads} heads per rank, nope/rope {dims[0]}/{dims[1]} (vLLM calls it at 128, 128/64)"
    return None


def visible_capabilities() -> list:
    """[(major, minor)] of every GPU this process sees, through vLLM's platform (NVML on NVIDIA:
    no CUDA context is created)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return []
    caps = []
    for i in range(current_platform.device_count()):  # NVML's count of the visible GPUs (0.20-0.34)
        cap = current_platform.get_device_capability(i)
        if cap is not None:
            caps.append((int(cap.major), int(cap.minor)))
    return caps


def arch_list(capabilities) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` for `capabilities`: FlashInfer normalizes each as it would a
    detected device's."""
    return " ".join(f"{major}.{minor}" for major, minor in sorted(set(capabilities)))


LAUNCH = "launch"  # STARTED_ENV's value once the sampling build started at launch (config builds still to come)


def launch_argv(argv=None, orig_argv=None) -> list:
    """`argv` (``sys.argv``) as a program path and its arguments. Under ``python -m MODULE``,
    while the module is being located (when kwarm activates: the first import of ``vllm``),
    ``sys.argv[0]`` is ``-m``; the interpreter's own command line (``sys.orig_argv``) then
    names the module, read as its file's path (``vllm/entrypoints/cli/main.py``)."""
    argv = list(sys.argv if argv is None else argv)
    if argv[:1] != ["-m"]:
        return argv
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if "-m" not in orig[:-1]:
        return argv
    i = orig.index("-m")
    return [orig[i + 1].replace(".", "/") + ".py", *orig[i + 2:]]


def serve_launch(argv) -> bool:
    """Whether `argv` (``sys.argv``) is vLLM's OpenAI server starting: ``vllm serve ...`` (the
    console script, or ``python -m vllm.entrypoints.cli.main serve``) or ``python -m
    vllm.entrypoints.openai.api_server ...``, not asked for its help. ``activation`` looks at
    ``config.SERVE_PROGRAMS`` before it imports this module."""
    if not argv or any(a in ("-h", "--help") or a.startswith("--help=") for a in argv[1:]):
        return False
    program, path = os.path.basename(argv[0]), argv[0].replace(os.sep, "/")
    if program == "vllm" or (program == "main.py" and "vllm/entrypoints/cli" in path):
        return len(argv) > 1 and argv[1] == "serve"
    return program == "api_server.py" and "vllm/entrypoints" in path


def launch_runner(argv) -> str:
    """The runner type `argv` asks for, as far as the command line says it (``--runner``, or a
    pooling ``--convert``): ``generate`` unless it says otherwise."""
    def value(flag):
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    runner, convert = value("--runner"), value("--convert")
    if runner == "pooling" or (convert not in (None, "none", "auto")):
        return "pooling"
    return "generate"


def start_at_launch(argv=None) -> subprocess.Popen | None:
    """Start the sampling build the moment ``vllm serve`` starts (kwarm's activation in its first
    process), before vLLM's imports and its engine config: None where it is not a serve launch,
    FlashInfer is not installed or builds started already.

    Why this early: with the build started once the engine config was made (66-72 s after launch on
    an H100 host, cold, vLLM 0.33.0), the engine still waited for it: its sampler check came 11-40 s
    later and the build takes about 80 s (BENCHMARKS.md, the start's milestones). The sampler is the
    one build every generating model needs; the ones a model's layers imply wait for its config
    (:func:`start`). The background process finds the GPUs' capabilities itself (NVML), so this
    process imports nothing; it starts the build at once and checks it against vLLM's selection
    logic while it runs (:func:`launch_main`). Not started where the command line asks for a
    pooling runner or ``VLLM_USE_FLASHINFER_SAMPLER=0``: then the engine config's prediction decides."""
    argv = launch_argv(argv)
    if os.environ.get(STARTED_ENV) or not serve_launch(argv):
        return None
    if launch_runner(argv) != "generate" or os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "").strip().lower() in (
            "0", "false"):
        return None  # no sampler, or not FlashInfer's: the engine config's prediction decides
    if importlib.util.find_spec("flashinfer") is None:
        return None
    os.environ[STARTED_ENV] = LAUNCH  # the engine's processes inherit it; start() adds the config's builds
    payload = {"facts": {"runner_type": "generate"}, "capabilities": None,
               "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    proc = _spawn(payload, dict(os.environ))
    logger.info("kwarm: starting FlashInfer's sampling build in the background at launch (pid %d)", proc.pid)
    return proc


def start(vllm_config) -> subprocess.Popen | None:
    """Start the background process that predicts the builds and runs them (once per process
    tree); None where no GPU is visible, FlashInfer is not installed or they started already.
    Where :func:`start_at_launch` started the sampling build, only the builds the config's layers
    imply are left (``concat_mla``), and a process starts only where one is predicted; it does
    not import the sampler's selection logic again (:func:`predict`'s `started`).

    The prediction runs there, not here: it imports vLLM's sampler, its FlashInfer attention
    backend and FlashInfer itself (about 5 s on an H100 host, measured: the API server would start
    the engine's process that much later, cold or warm)."""
    started = os.environ.get(STARTED_ENV)
    if started and started != LAUNCH:
        return None
    if importlib.util.find_spec("flashinfer") is None:
        return None
    from kwarm_ext import config as kwarm_config, early_gdn

    facts = config_facts(vllm_config)
    if started == LAUNCH and _concat_reason(facts) is not None and facts["gdn"] is None:
        os.environ[STARTED_ENV] = "1"
        return None  # the sampling build is running; the config implies no other
    capabilities = visible_capabilities()
    os.environ[STARTED_ENV] = "1"  # the engine's processes inherit it
    if not capabilities:
        logger.debug("kwarm: no FlashInfer build to start early: no NVIDIA GPU visible")
        return None
    env = dict(os.environ)
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch_list(capabilities))
    payload = {"facts": facts, "capabilities": [list(c) for c in capabilities]}
    if started == LAUNCH:
        payload["started"] = [SAMPLING.name]
    if (facts["gdn"] is not None and early_gdn.reason(facts["gdn"], capabilities, ask_vllm=False) is None
            and kwarm_config.get().warmups.wants("cute_dsl")):  # the family that loads them
        payload["early"] = early_gdn.handoff()  # where the engine finds the kernels, and when they are done
    proc = _spawn(payload, env)
    if "early" in payload:
        os.environ[early_gdn.EARLY_ENV] = json.dumps(dict(payload["early"], pid=proc.pid))  # the engine inherits it
    logger.info("kwarm: starting the FlashInfer builds this configuration implies in the background from "
                "launch (pid %d, archs %s)", proc.pid, env["FLASHINFER_CUDA_ARCH_LIST"])
    return proc


def _spawn(payload: dict, env: dict) -> subprocess.Popen:
    """The background process: its own session, nice 10, no CUDA device (a CUDA context's memory
    would count in vLLM's memory profiling) and kwarm off there (its imports of vLLM must not
    activate kwarm: deep_gemm's compile processes would start a second time)."""
    env = dict(env, CUDA_VISIBLE_DEVICES="", KWARM_ENABLE="0")
    return subprocess.Popen([sys.executable, "-m", "kwarm_ext.early_builds", PREDICT_FLAG, json.dumps(payload)],
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: os.nice(10))


def host_capabilities() -> list | None:
    """[(major, minor)] of every NVIDIA GPU of this host, through NVML (``pynvml``, nvidia-ml-py,
    a dependency of vLLM): milliseconds, no torch, no vLLM, no CUDA context; None where NVML
    cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [tuple(int(x) for x in pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)))
                    for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no NVML, no driver, the unofficial wrapper's differences)
        return None


def capabilities_of(visible: str | None) -> list:
    """:func:`visible_capabilities` as a process with ``CUDA_VISIBLE_DEVICES`` = `visible` (None:
    unset) sees them, read in this process (whose own variable is empty): NVML, no CUDA context.

    Where every GPU of the host has one capability (:func:`host_capabilities`) and `visible` is
    unset or names some, that capability is the answer, without importing vLLM: its platform
    (which maps the variable's entries to GPUs the way the engine will) pulls in torch and vLLM,
    4 s on a quiet host before the sampling build could start, and more at a cold start beside
    the server's own imports. A host of mixed GPUs, or an empty variable, asks vLLM's platform."""
    host = host_capabilities()
    if host and len(set(host)) == 1 and (visible is None or visible.strip()):
        return [host[0]]
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        return visible_capabilities()
    finally:
        if own is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = own


def jit_spec(spec: str):
    """FlashInfer's ``JitSpec`` of `spec` ("module:function")."""
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)()


def already_built(spec: str) -> bool:
    """Whether FlashInfer's cache (or its AOT folder) holds `spec`'s module (``JitSpec.is_compiled``:
    the library's path exists), as on any start after the first; False where it cannot say."""
    try:
        return bool(jit_spec(spec).is_compiled)
    except Exception:  # noqa: BLE001  (a FlashInfer without the property: build, as before)
        return False


def build(spec: str) -> str:
    """Build one FlashInfer module by its spec function, under the spec's file lock; its line."""
    import time

    t0 = time.perf_counter()
    module = jit_spec(spec)
    module.build(False, need_lock=True)
    return f"{module.name} ready in {time.perf_counter() - t0:.1f} s"


def say(message: str) -> None:
    """One line to stderr (the server's log) with vLLM's prefix, its time included: this process
    has no vLLM logger, and a line without a time cannot be placed in the start."""
    import time

    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [kwarm early_builds.py] {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """The background process: ``--predict FACTS`` (:func:`start`'s payload) predicts the builds,
    says which, and builds them; a JSON list of builds builds those. One line each. Started at
    launch (no capabilities in the payload): :func:`launch_main`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == PREDICT_FLAG:
        payload = json.loads(argv[1])
        if payload.get("capabilities") is None:
            return launch_main(payload)
        builds, not_predicted = predict(payload["facts"], [tuple(c) for c in payload["capabilities"]],
                                        started=tuple(payload.get("started") or ()))
        note = f" (not: {'; '.join(not_predicted)})" if not_predicted else ""
        say(f"kwarm: early FlashInfer builds: {', '.join(b.name for b in builds) or 'none'}{note}")
        items = [dataclasses.asdict(b) for b in builds]
        if payload.get("early") and not any(b.name == GDN_PREFILL.name for b in builds):
            from kwarm_ext import early_gdn

            early_gdn.finish(payload["early"], {"compiled": 0, "not": next(
                (w for w in not_predicted if w.startswith(GDN_PREFILL.name)), "")})  # the engine stops waiting
    else:
        payload, items = {}, json.loads(argv[0])
    failed = 0
    for item in items:  # each line as its build ends: the start's milestones read their times
        line, ok = gdn_line(payload) if item["name"] == GDN_PREFILL.name else build_line(item)
        failed += not ok
        say(f"kwarm: early FlashInfer build: {line}")
    return 1 if failed else 0


def gdn_line(payload: dict) -> tuple[str, bool]:
    """Compile the GDN prefill kernels (``kwarm_ext.early_gdn``) where the payload says, and tell
    the engine they are done (also when they failed); (its line, whether it compiled)."""
    from kwarm_ext import early_gdn

    summary: dict = {"compiled": 0}
    try:
        capability = tuple(payload["capabilities"][0])
        summary = early_gdn.run(payload["facts"]["gdn"], capability, payload["early"]["folder"],
                                lambda line: say(f"kwarm: early GDN prefill: {line}"))
        if summary.get("skipped") == "compiled before":
            return f"{GDN_PREFILL.name}: compiled at an earlier start", True
        return f"{GDN_PREFILL.name}: {summary['saved']} CuTe DSL kernels ready in {summary['seconds']:.1f} s", True
    except Exception as exc:  # noqa: BLE001  (vLLM compiles them in its profile run, as before)
        summary = {"compiled": 0, "failed": f"{type(exc).__name__}: {exc}"[:300]}
        return f"{GDN_PREFILL.name} failed, vLLM compiles its kernels in its profile run: {summary['failed']}", False
    finally:
        if payload.get("early"):
            early_gdn.finish(payload["early"], summary)


def build_line(item: dict) -> tuple[str, bool]:
    """:func:`build` of one ``{"name", "spec"}``: (its line, whether it built); a failure is its
    line, never raised."""
    try:
        return build(item["spec"]), True
    except Exception as exc:  # noqa: BLE001  (one module's failure: vLLM builds it itself later)
        return f"{item['name']} failed, vLLM builds it when it needs it: {type(exc).__name__}: {exc}", False


def launch_main(payload: dict) -> int:
    """Started at launch: read the server's GPUs (NVML), start the sampling build at once, and
    check it against vLLM's own selection logic (:func:`predict`) while it builds.

    Why in that order: vLLM's sampler and FlashInfer attention backend, which the check imports,
    took most of the 22 s between this process's start and its build's (DeepSeek-V3.2 dimensions,
    H100, cold), and the engine asked for the module 10 s after that. Where the check says vLLM
    will not call it (a GPU FlashInfer's sampler does not support, a vLLM without the check) the
    line says so: the build then cost background CPU only. Where FlashInfer's cache holds the module
    already (every start after the first), the process ends at once: the check's imports of vLLM
    (seconds of CPU) would run beside the server's own, for a module vLLM just loads."""
    import threading

    capabilities = capabilities_of(payload.get("visible"))
    if not capabilities:
        say("kwarm: early FlashInfer builds: none (not: sampling: no NVIDIA GPU visible)")
        return 0
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch_list(capabilities))
    if already_built(SAMPLING.spec):  # a restart: nothing to build, and vLLM's imports would only take CPU
        say("kwarm: early FlashInfer builds: none, sampling is built already (FlashInfer's cache)")
        return 0
    done: list = []
    builder = threading.Thread(target=lambda: done.append(build_line(dataclasses.asdict(SAMPLING))),
                               name="kwarm-early-sampling")
    builder.start()
    builds, not_predicted = predict(payload["facts"], capabilities)
    if any(b.name == SAMPLING.name for b in builds):
        say("kwarm: early FlashInfer builds: sampling, started at launch; vLLM's sampler check calls it here")
    else:
        why = next((w.split(": ", 1)[1] for w in not_predicted if w.startswith(f"{SAMPLING.name}: ")), "?")
        say(f"kwarm: early FlashInfer builds: sampling, started at launch, though vLLM will not call it here "
            f"({why}): background CPU only")
    builder.join()
    line, ok = done[0] if done else ("sampling: no result", False)
    say(f"kwarm: early FlashInfer build: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
