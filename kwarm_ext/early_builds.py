"""FlashInfer's nvcc builds started at launch, in a background process, instead of where vLLM
first calls them.

Why: the FlashInfer wheel ``pip install vllm`` installs (0.7.2.post1 with vLLM 0.33.0) ships no
compiled module; each is built with nvcc the first time it is called. vLLM's start-up sampler
check builds the sampling module after its profile run: 107 s of a 289.5 s cold start of
``vllm serve`` on an H100 (issue 60), serially, while the engine waits. The front end knows the
configuration long before: here the builds start as soon as ``EngineArgs.create_engine_config``
returns (``kwarm_ext/patches.py``), and run during the engine's imports, model load and
torch.compile.

What (:func:`predict`), from vLLM's own selection logic, per release:

- ``sampling``: where the engine samples (a generating model) and vLLM would use FlashInfer's
  top-k/top-p sampler: ``VLLM_USE_FLASHINFER_SAMPLER`` (vLLM's ``envs``), and on every visible GPU
  ``FlashInferBackend.supports_compute_capability`` and FlashInfer's own arch normalization, the
  parts of 0.33's ``flashinfer_sampler_supported`` that need no CUDA context (its >16-SM check
  does: every data-centre GPU passes it);
- ``concat_mla``: MLA layers with 128 heads per rank and 128/64 nope/rope dimensions (the
  condition of vLLM's ``_use_flashinfer_concat_mla_k``, 0.33: DeepSeek-V3/V3.2, GLM-5).

A wrong guess costs only background CPU.

How: one process (``python -m kwarm_ext.early_builds``), which also makes the prediction (its
imports would hold the API server back), started in its own session at low
priority (nice 10), with ``CUDA_VISIBLE_DEVICES`` empty so that it never creates a CUDA context
(its memory would count in vLLM's memory profiling) and ``FLASHINFER_CUDA_ARCH_LIST`` set to the
visible GPUs' capabilities, read through NVML (vLLM's platform, no CUDA context either): FlashInfer
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
    spec: str  # "module:function" returning FlashInfer's JitSpec
    why: str


SAMPLING = Build("sampling", "flashinfer.jit.sampling:gen_sampling_module",
                 "vLLM's FlashInfer top-k/top-p sampler (its start-up sampler check builds it)")
PREDICT_FLAG = "--predict"
CONCAT_MLA = Build("concat_mla", "flashinfer.jit.dsv3_optimizations:gen_concat_mla_module",
                   "MLA prefill's concat_mla_k (128 heads per rank, 128/64 nope/rope)")


def config_facts(vllm_config) -> dict:
    """What :func:`predict` reads of a ``VllmConfig``, as JSON for the background process."""
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    return {"runner_type": getattr(model, "runner_type", "generate"), "use_mla": bool(getattr(model, "use_mla", False)),
            "heads_per_rank": (getattr(hf, "num_attention_heads", 0) or 0) // tp,
            "nope_rope": [getattr(hf, "qk_nope_head_dim", None), getattr(hf, "qk_rope_head_dim", None)]}


def predict(vllm_config, capabilities: list) -> tuple[list, list]:
    """(builds, [why each other was not predicted]) for `vllm_config` (or its
    :func:`config_facts`) on GPUs of `capabilities` ([(major, minor), ...], every visible GPU)."""
    facts = vllm_config if isinstance(vllm_config, dict) else config_facts(vllm_config)
    builds, not_predicted = [], []
    if not capabilities:
        return [], ["no NVIDIA GPU visible"]
    reason = _sampler_reason(facts, capabilities)
    if reason is None:
        builds.append(SAMPLING)
    else:
        not_predicted.append(f"sampling: {reason}")
    reason = _concat_reason(facts)
    if reason is None:
        builds.append(CONCAT_MLA)
    else:
        not_predicted.append(f"concat_mla: {reason}")
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


def _concat_reason(facts) -> str | None:
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
    count = getattr(current_platform, "device_count", None)  # 0.33+: NVML's count of the visible GPUs
    if count is None:
        from vllm.utils import cuda_device_count_stateless as count  # before 0.33
    caps = []
    for i in range(count()):
        cap = current_platform.get_device_capability(i)
        if cap is not None:
            caps.append((int(cap.major), int(cap.minor)))
    return caps


def arch_list(capabilities) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` for `capabilities`: FlashInfer normalizes each as it would a
    detected device's."""
    return " ".join(f"{major}.{minor}" for major, minor in sorted(set(capabilities)))


def start(vllm_config) -> subprocess.Popen | None:
    """Start the background process that predicts the builds and runs them (once per process
    tree); None where no GPU is visible, FlashInfer is not installed or they started already.

    The prediction runs there, not here: it imports vLLM's sampler, its FlashInfer attention
    backend and FlashInfer itself (about 5 s on an H100 host, measured: the API server would start
    the engine's process that much later, cold or warm)."""
    if os.environ.get(STARTED_ENV):
        return None
    if importlib.util.find_spec("flashinfer") is None:
        return None
    capabilities = visible_capabilities()
    os.environ[STARTED_ENV] = "1"  # the engine's processes inherit it
    if not capabilities:
        logger.debug("kwarm: no FlashInfer build to start early: no NVIDIA GPU visible")
        return None
    # no CUDA device; kwarm off there: its imports of vLLM must not activate kwarm (deep_gemm's
    # compile processes would start a second time)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", KWARM_ENABLE="0")
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch_list(capabilities))
    payload = {"facts": config_facts(vllm_config), "capabilities": [list(c) for c in capabilities]}
    proc = subprocess.Popen([sys.executable, "-m", "kwarm_ext.early_builds", PREDICT_FLAG, json.dumps(payload)],
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: os.nice(10))
    logger.info("kwarm: starting the FlashInfer builds this configuration implies in the background from "
                "launch (pid %d, archs %s)", proc.pid, env["FLASHINFER_CUDA_ARCH_LIST"])
    return proc


def build(spec: str) -> str:
    """Build one FlashInfer module by its spec function, under the spec's file lock; its line."""
    import time

    module, _, function = spec.partition(":")
    t0 = time.perf_counter()
    jit_spec = getattr(importlib.import_module(module), function)()
    jit_spec.build(False, need_lock=True)
    return f"{jit_spec.name} ready in {time.perf_counter() - t0:.1f} s"


def say(message: str) -> None:
    """One line to stderr (the server's log) with vLLM's prefix, its time included: this process
    has no vLLM logger, and a line without a time cannot be placed in the start."""
    import time

    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [kwarm early_builds.py] {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """The background process: ``--predict FACTS`` (:func:`start`'s payload) predicts the builds,
    says which, and builds them; a JSON list of builds builds those. One line each."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == PREDICT_FLAG:
        payload = json.loads(argv[1])
        builds, not_predicted = predict(payload["facts"], [tuple(c) for c in payload["capabilities"]])
        note = f" (not: {'; '.join(not_predicted)})" if not_predicted else ""
        say(f"kwarm: early FlashInfer builds: {', '.join(b.name for b in builds) or 'none'}{note}")
        items = [dataclasses.asdict(b) for b in builds]
    else:
        items = json.loads(argv[0])
    failed = 0
    for item in items:
        try:
            line = build(item["spec"])
        except Exception as exc:  # noqa: BLE001  (one module's failure: vLLM builds it itself later)
            failed += 1
            line = f"{item['name']} failed, vLLM builds it when it needs it: {type(exc).__name__}: {exc}"
        say(f"kwarm: early FlashInfer build: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
