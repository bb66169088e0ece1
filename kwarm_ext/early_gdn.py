"""FlashInfer's Hopper GDN prefill kernels (CuTe DSL) compiled at launch, on the CPU, for the
engine to load before its profile run.

Why: vLLM 0.33's GDN layers compile every FlashInfer SM90 prefill kernel a batch can dispatch to
in their first forward, inside the profile run (``_warmup_prefill_kernels`` and
``_warmup_flashinfer_prefill_variants``): 7 CuTe DSL kernels, about 36 s of a cold ``vllm serve``
start of a tiny Qwen3-Next on an H100, after the model load, while the engine waits. kwarm's
``cute_dsl`` family saves them for the next start (a warm restart loads them in 0.24 s), but the
first start of a deployment paid in full. CuTe DSL compiles to native code on the host: no GPU,
no CUDA driver. So the kernels are compiled in a background process from the moment the engine
config is known (``kwarm_ext/early_builds.py`` starts it), beside the engine's imports, model load
and torch.compile, and written in the ``cute_dsl`` family's format; the family loads them into
FlashInfer's in-memory cache before the profile run, where FlashInfer looks before it compiles.

What (:func:`reason`, :func:`variants`): vLLM's own backend choice (``_resolve_gdn_prefill_backend``, asked for
the capability of the GPUs NVML reports, :func:`planned_platform`), and the argument sets of vLLM's
warmup: ``use_cp`` in {CP, not CP} (vLLM passes ``"auto"``, whose choice depends on the device's SM
count: forcing CP compiles the superset), each with and without state checkpoints where prefix
caching's ``mamba_cache_mode`` is ``"align"`` (as vLLM's layers decide); shapes, dtypes and heads
per rank from the model's config, through vLLM's own ``fi_chunk_gated_delta_rule``. A wrong guess
costs background CPU only: a kernel vLLM then asks for with another key compiles as before.

How (:func:`cpu_compile`): the call runs on CPU tensors, in a process with no CUDA device. Where
FlashInfer and the CuTe DSL ask the device something on the way, the answer is the planned GPU's
(capability, SM count, the stream, 128-byte aligned scratch buffers, the shared memory per SM the
DSL writes into the kernel's attributes); each kernel is compiled, not launched; and the tensors
are presented to the DSL as ``cuda:0`` tensors (DLPack), so that its TVM FFI wrapper checks for
CUDA tensors as the engine's own compile does. The compile keys are FlashInfer's own.

Versions: vLLM 0.33-0.34, FlashInfer 0.7.2 (``gdn_kernels.delta_rule_dsl``), nvidia-cutlass-dsl
4.8, SM 9.0; elsewhere nothing is predicted, and a failure is one line of the background process.
It can go when FlashInfer's SM90 GDN prefill goes through its CuTe DSL disk cache and ships its
kernels compiled, or vLLM compiles them before its profile run.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import time
import types

from kwarm_ext.config import EARLY_CUTE_DSL_ENV as EARLY_ENV  # the engine's processes read it (kernels/cute_dsl.py)

FLASHINFER_SM90 = "flashinfer.gdn_kernels.delta_rule_dsl.delta_rule_sm90"
FLASHINFER_CP_SM90 = "flashinfer.gdn_kernels.delta_rule_dsl.delta_rule_cp_sm90"
FLASHINFER_CACHE = "flashinfer.gdn_kernels.delta_rule_dsl.custom_compile_cache"
VLLM_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
# Shared memory per SM that the CuTe DSL asks the driver for while it compiles a kernel launched
# with several blocks per SM (FlashInfer's CP T-precompute and fixup), per compute capability:
# CUDA's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR (H100, H200, H800, H20).
MAX_SMEM_PER_SM = {(9, 0): 233472}
SM_COUNT = 132  # what FlashInfer sizes its scratch buffers by; no key depends on it
CHUNK = 64  # vLLM's FLA_CHUNK_SIZE: its warmup's token count, and the checkpoint interval


# ---------------------------------------------------------------------------- what


def config_facts(vllm_config) -> dict | None:
    """What :func:`reason` and :func:`compile_kernels` read of a ``VllmConfig`` (JSON); None for a model without GDN layers
    (no ``linear_key_head_dim`` in its text config)."""
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    if getattr(hf, "linear_key_head_dim", None) is None:
        return None
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    additional = getattr(vllm_config, "additional_config", None)
    return {"head_k_dim": hf.linear_key_head_dim, "head_v_dim": getattr(hf, "linear_value_head_dim", None),
            "num_k_heads": getattr(hf, "linear_num_key_heads", 0) // tp,
            "num_v_heads": getattr(hf, "linear_num_value_heads", 0) // tp,
            "dtype": str(getattr(model, "dtype", "torch.bfloat16")).removeprefix("torch."),
            "mamba_cache_mode": getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", None),
            "additional_config": additional if isinstance(additional, dict) else {}}


def planned_platform(capability):
    """vLLM's CUDA platform as it would be on a GPU of `capability` ((major, minor)): this process
    sees none, and vLLM's choices ask the platform."""
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    major, minor = capability

    class Planned(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major, minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"planned sm_{major}{minor}"

    return Planned()


def backend(facts: dict, capability) -> str:
    """The GDN prefill backend vLLM picks for `facts` on a GPU of `capability`: its own
    ``_resolve_gdn_prefill_backend``, asked with :func:`planned_platform`."""
    gdn = importlib.import_module(VLLM_GDN)
    config = types.SimpleNamespace(
        additional_config=facts["additional_config"],
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(
            linear_key_head_dim=facts["head_k_dim"], linear_value_head_dim=facts["head_v_dim"])))
    real = gdn.current_platform
    gdn.current_platform = planned_platform(capability)
    try:
        return gdn._resolve_gdn_prefill_backend(config)[1]
    finally:
        gdn.current_platform = real


def variants(facts: dict) -> list:
    """(use_cp, checkpoints) of each call, as vLLM 0.33's ``_warmup_flashinfer_prefill_variants``
    makes them: CP and not, each also with checkpoints where the layers export them
    (``mamba_cache_mode == "align"`` with FlashInfer's backend)."""
    checkpoints = (False, True) if facts.get("mamba_cache_mode") == "align" else (False,)
    return [(use_cp, ckpt) for use_cp in (True, False) for ckpt in checkpoints]


def reason(facts: dict | None, capabilities: list, ask_vllm: bool = True) -> str | None:
    """Why the GDN prefill kernels are not compiled early here (None: they are). Without
    `ask_vllm`, only what the config and the GPUs say (the API server: importing FlashInfer and
    vLLM's GDN layer takes seconds; the background process asks)."""
    if facts is None:
        return "no GDN layers"
    if not capabilities or any(tuple(c) not in MAX_SMEM_PER_SM for c in capabilities):
        return f"FlashInfer's SM90 GDN prefill only (GPUs {sorted({tuple(c) for c in capabilities})})"
    if facts["head_k_dim"] != facts["head_v_dim"] or not facts["num_k_heads"] or not facts["num_v_heads"]:
        return "head dimensions FlashInfer's GDN prefill does not take"
    if not ask_vllm:
        return None
    try:
        chosen = backend(facts, tuple(capabilities[0]))
    except Exception as exc:  # noqa: BLE001  (another vLLM: nothing predicted)
        return f"vLLM's GDN backend choice unavailable ({type(exc).__name__}: {exc})"
    if chosen != "flashinfer":
        return f"vLLM picks the {chosen} GDN prefill backend"
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer not installed"
    try:  # a parent package missing raises
        if importlib.util.find_spec(FLASHINFER_SM90) is None or importlib.util.find_spec(FLASHINFER_CP_SM90) is None:
            raise ImportError
    except ImportError:
        return "this FlashInfer has no SM90 GDN prefill in CuTe DSL"
    except Exception as exc:  # noqa: BLE001  (FlashInfer's import failed: vLLM's would too)
        return f"FlashInfer not importable ({type(exc).__name__}: {exc})"
    return None


# ---------------------------------------------------------------------------- compile on the CPU


def _as_cuda(tensor):
    """`tensor` (CPU) as a DLPack producer that says it lives on ``cuda:0``: the DSL reads its
    shape, strides, dtype and device, never its data, while it compiles."""
    from torch.utils.dlpack import to_dlpack

    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

    class AsCuda:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

        def __dlpack__(self, *args, **kwargs):
            capsule = to_dlpack(tensor)
            dl_tensor = get_pointer(capsule, b"dltensor")  # DLManagedTensor starts with its DLTensor
            ctypes.c_int32.from_address(dl_tensor + 8).value = 2  # DLTensor.device.device_type
            ctypes.c_int32.from_address(dl_tensor + 12).value = 0  # DLTensor.device.device_id
            return capsule

    return AsCuda()


@contextlib.contextmanager
def cpu_compile(capability):
    """FlashInfer's SM90 GDN prefill compiling on CPU tensors in this process: what it and the CuTe
    DSL ask the device is answered for a GPU of `capability`, kernels are compiled and stored in
    FlashInfer's cache but not launched, and tensors reach the DSL as ``cuda:0`` tensors. Only for
    a process that runs no kernel (the background process); everything is put back on exit."""
    import torch

    import cutlass.cute as cute
    from cutlass.base_dsl.runtime import cuda as dsl_cuda

    import flashinfer.gdn_prefill as gdn_prefill
    import flashinfer.utils as fi_utils

    sm90, cp_sm90 = importlib.import_module(FLASHINFER_SM90), importlib.import_module(FLASHINFER_CP_SM90)
    cache = importlib.import_module(FLASHINFER_CACHE)
    props = types.SimpleNamespace(name=f"planned sm_{capability[0]}{capability[1]}", major=capability[0],
                                  minor=capability[1], multi_processor_count=SM_COUNT)
    smem_attr = dsl_cuda.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    real_attribute = dsl_cuda.get_device_attribute
    buffers: dict = {}

    def aligned_buffer(name, num_bytes, device, zero_init=False):
        # CPU allocations are 64-byte aligned; FlashInfer passes these as 128-byte aligned
        buf = buffers.get(name)
        if buf is None or buf.numel() < num_bytes:
            raw = torch.zeros(num_bytes + 256, dtype=torch.uint8, device=device)
            buf = buffers[name] = raw[(-raw.data_ptr()) % 256:][:num_bytes]
        return buf

    class NotLaunched:
        def __call__(self, *args, **kwargs):
            return None

    def compile_only(kernel, *args, **kwargs):
        cache.cached_compile(kernel, *args, **kwargs)
        return NotLaunched()

    def cached_only(kernel, compile_options=None):
        return NotLaunched() if cache.get_cached_compile(kernel, compile_options) is not None else None

    def from_dlpack(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            tensor = _as_cuda(tensor)
        return real_from_dlpack(tensor, *args, **kwargs)

    real_from_dlpack = cute.runtime.from_dlpack
    replaced = [(fi_utils, "get_device_properties", lambda device: props),
                (dsl_cuda, "get_device_attribute",
                 lambda attribute, device_id=0: MAX_SMEM_PER_SM[tuple(capability)] if attribute == smem_attr
                 else real_attribute(attribute, device_id)),
                (torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)),
                (cute.runtime, "from_dlpack", from_dlpack)]
    for module in (gdn_prefill, cp_sm90):
        if hasattr(module, "get_compute_capability"):
            replaced.append((module, "get_compute_capability", lambda device: tuple(capability)))
    for module in (sm90, cp_sm90):
        replaced += [(module, "_get_cache_buf", aligned_buffer), (module, "cached_compile", compile_only)]
        if hasattr(module, "get_cached_compile"):
            replaced.append((module, "get_cached_compile", cached_only))
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in replaced]
    try:
        for module, attr, value in replaced:
            setattr(module, attr, value)
        yield cache
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def compile_kernels(facts: dict, capability, say=lambda line: None) -> dict:
    """Compile the kernels :func:`variants` implies, through vLLM's ``fi_chunk_gated_delta_rule``
    with the warmup's shapes (one sequence of 64 tokens) on CPU tensors; FlashInfer's cache dict.
    A variant that fails is one line; the others still compile."""
    import torch

    fi_chunk = importlib.import_module(VLLM_GDN).fi_chunk_gated_delta_rule
    dtype = getattr(torch, facts["dtype"])
    hk, hv, dk, dv = facts["num_k_heads"], facts["num_v_heads"], facts["head_k_dim"], facts["head_v_dim"]
    with cpu_compile(capability) as cache:
        compiled = cache._in_mem_compile_cache
        for use_cp, ckpt in variants(facts):
            t0, before = time.perf_counter(), len(compiled)
            inputs = dict(q=torch.zeros(1, CHUNK, hk, dk, dtype=dtype), k=torch.zeros(1, CHUNK, hk, dk, dtype=dtype),
                          v=torch.zeros(1, CHUNK, hv, dv, dtype=dtype), g=torch.zeros(1, CHUNK, hv),
                          beta=torch.zeros(1, CHUNK, hv), initial_state=torch.zeros(1, hv, dv, dk, dtype=dtype),
                          output_final_state=True, cu_seqlens=torch.tensor([0, CHUNK], dtype=torch.int32),
                          use_qk_l2norm_in_kernel=False, use_cp=use_cp)
            if ckpt:
                inputs.update(state_checkpoints=torch.zeros(1, hv, dv, dk), checkpoint_cu_starts=torch.tensor([0, 1]),
                              checkpoint_every_n_tokens=CHUNK)
            label = f"{'CP' if use_cp else 'fused'}{', checkpoints' if ckpt else ''}"
            try:
                fi_chunk(**inputs)
                say(f"{label}: {len(compiled) - before} kernels in {time.perf_counter() - t0:.1f} s")
            except Exception as exc:  # noqa: BLE001  (this variant compiles in vLLM's warmup, as before)
                say(f"{label} failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
        return compiled


# ---------------------------------------------------------------------------- where


def early_folder() -> str:
    """Where early kernels go: beside ``KWARM_MANIFEST``, else in kwarm's cache folder; one
    subfolder per compiler stack (``cute_dsl``'s), shared by every deployment of that stack."""
    from kwarm_ext import config, manifest_files

    manifest = config.get().manifest
    base = os.path.dirname(os.path.abspath(manifest)) if manifest else manifest_files.cache_dir()
    return os.path.join(base, "cute_dsl_early")


def fingerprint(facts: dict, capability) -> str:
    """What the compiled set depends on, without importing FlashInfer: the facts, the GPU and the
    versions of vLLM, FlashInfer and the CuTe DSL."""
    import importlib.metadata as md

    from kwarm_ext.kernels import cute_dsl

    versions = {}
    for dist in ("vllm", "flashinfer-python"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    text = json.dumps([facts, list(capability), versions, cute_dsl.cute_dsl_stack()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run(facts: dict, capability, folder: str, say) -> dict:
    """The background process's work: compile and save, unless a start before already did for the
    same fingerprint. Returns the summary the engine reads (``done``)."""
    from kwarm_ext import manifest_files
    from kwarm_ext.kernels import cute_dsl

    t0 = time.perf_counter()
    marker = os.path.join(folder, f"compiled-{fingerprint(facts, capability)}.json")
    if compiled_before(marker):
        return {"compiled": 0, "saved": 0, "seconds": round(time.perf_counter() - t0, 3), "skipped": "compiled before"}
    compiled = compile_kernels(facts, capability, say)
    source = cute_dsl.source_named("flashinfer_gdn")
    meta = cute_dsl.stack(source, capability)
    where = cute_dsl.subfolder(os.path.join(folder, source.name), meta)
    result = cute_dsl.save(where, {source.dicts[0]: compiled}, meta)
    if result["saved"] and not result["skipped"]:
        keys = sorted(cute_dsl.symbol(cute_dsl.encode(key), source.dicts[0]) + ".json" for key in compiled)
        manifest_files.write_atomic(marker, json.dumps({"facts": facts, "folder": where, "keys": keys}) + "\n")
    return {"compiled": len(compiled), "saved": result["saved"], "skipped": result["skipped"][:3],
            "seconds": round(time.perf_counter() - t0, 3)}


def compiled_before(marker: str) -> bool:
    """Whether a start before compiled this set and its files are still there (another stack's
    save replaces them)."""
    try:
        with open(marker, encoding="utf-8") as f:
            saved = json.load(f)
        return all(os.path.exists(os.path.join(saved["folder"], key)) for key in saved["keys"]) and bool(saved["keys"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ---------------------------------------------------------------------------- handing over


def handoff() -> dict:
    """Where the background process writes the kernels and, once it is done with them, its summary
    (``done``): what the engine's processes read from :data:`EARLY_ENV`."""
    folder = early_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for name in os.listdir(folder):  # summaries of earlier starts (read within seconds of being written)
        path = os.path.join(folder, name)
        if name.startswith(".done-") and time.time() - os.path.getmtime(path) > 3600:
            os.unlink(path)
    return {"folder": folder, "done": os.path.join(folder, f".done-{os.getpid()}-{time.time_ns()}.json")}


def finish(early: dict, summary: dict) -> None:
    """Tell the engine the early kernels are done (the background process)."""
    from kwarm_ext import manifest_files

    manifest_files.write_atomic(early["done"], json.dumps(summary) + "\n")
