"""The engine view: a small read-only snapshot of a vLLM worker, taken at warmup time.

Every read is defensive: an attribute that this vLLM release lacks (or a property that
raises) is recorded in ``missing`` with the reason, never raised. Families decide from
the view whether they apply; they reach the live objects through ``view.worker`` and
``view.runner``, which are not part of the snapshot's JSON.
"""
from __future__ import annotations

import dataclasses
from typing import Any

_ABSENT = object()
# Reads without which no family can decide anything; their absence is worth a warning.
REQUIRED = ("model_runner", "vllm_config", "model_config", "static_forward_context")


@dataclasses.dataclass
class EngineView:
    vllm_version: str | None = None
    runner_kind: str | None = None  # "V1" (gpu_model_runner) or "V2" (v1/worker/gpu)
    model_type: str | None = None
    architectures: list = dataclasses.field(default_factory=list)
    backends: list = dataclasses.field(default_factory=list)  # per KV-cache group: [names]
    layers: dict = dataclasses.field(default_factory=dict)  # forward-context prefix -> class name
    device: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_reqs: int | None = None
    enforce_eager: bool | None = None
    cudagraph_mode: str | None = None
    is_pooling_model: bool | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    before_profile_run: bool = False  # built by the ahead run with vLLM's profile run next
    after_capture: bool = False  # planned by the after-capture run (a family that runs ahead and after capture)
    missing: dict = dataclasses.field(default_factory=dict)  # read -> reason
    worker: Any = dataclasses.field(default=None, repr=False, compare=False)
    runner: Any = dataclasses.field(default=None, repr=False, compare=False)
    forward_context: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def as_dict(self) -> dict:
        skip = {"worker", "runner", "forward_context"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    def has_backend(self, name: str) -> bool:
        return any(name in group for group in self.backends)

    def layers_of(self, *class_names: str) -> dict:
        """Live forward-context layers whose class (or a base class) has one of these names."""
        out = {}
        for prefix, layer in self.forward_context.items():
            if any(c.__name__ in class_names for c in type(layer).__mro__):
                out[prefix] = layer
        return out

    def summary(self) -> str:
        groups = ";".join("+".join(g) for g in self.backends) or "-"
        kinds = sorted(set(self.layers.values()))
        return (f"vllm={self.vllm_version} runner={self.runner_kind} model_type={self.model_type} "
                f"backends={groups} layers={len(self.layers)} ({', '.join(kinds) or '-'}) "
                f"device={self.device} max_num_batched_tokens={self.max_num_batched_tokens} "
                f"tp={self.tp_rank}/{self.tp_size}")


def read(obj, path: str, missing: dict, name: str | None = None, default=None):
    """``obj.a.b.c`` or `default`; an absent attribute or a raising read goes into `missing`."""
    cur = obj
    for part in path.split("."):
        try:
            cur = getattr(cur, part, _ABSENT)
        except Exception as exc:  # a property that raises
            missing[name or path] = f"{type(exc).__name__}: {exc}"
            return default
        if cur is _ABSENT:
            missing[name or path] = f"no attribute {part!r}"
            return default
    return cur


def call(fn, missing: dict, name: str, default=None):
    try:
        return fn()
    except Exception as exc:
        missing[name] = f"{type(exc).__name__}: {exc}"
        return default


def build(worker) -> EngineView:
    """Take the snapshot of `worker` (a ``vllm.v1.worker.gpu_worker.Worker``)."""
    missing: dict = {}
    view = EngineView(worker=worker, missing=missing)
    runner = read(worker, "model_runner", missing)
    view.runner = runner
    vllm_config = read(worker, "vllm_config", missing)
    if vllm_config is None and runner is not None:
        missing.pop("vllm_config", None)
        vllm_config = read(runner, "vllm_config", missing)
    view.vllm_version = call(_vllm_version, missing, "vllm.__version__")
    if runner is not None:
        view.runner_kind = "V2" if type(runner).__module__.startswith("vllm.v1.worker.gpu.") else "V1"

    model_config = read(vllm_config, "model_config", missing)
    hf_text = read(model_config, "hf_text_config", {}, default=None)
    model_type = getattr(hf_text, "model_type", None) or read(model_config, "hf_config.model_type", {})
    view.model_type = model_type
    if model_type is None and model_config is not None:
        missing["model_type"] = "neither hf_text_config nor hf_config has model_type"
    view.architectures = list(read(model_config, "hf_config.architectures", {}, default=None) or [])

    view.backends = call(lambda: _backends(runner), missing, "attn_groups", default=[]) if runner is not None else []
    compilation = read(runner, "compilation_config", {}) if runner is not None else None
    if compilation is None:
        compilation = read(vllm_config, "compilation_config", missing)
    ctx = read(compilation, "static_forward_context", missing, name="static_forward_context", default=None)
    view.forward_context = dict(ctx) if isinstance(ctx, dict) else {}
    view.layers = {k: type(v).__name__ for k, v in view.forward_context.items()}

    view.device = str(d) if (d := read(runner, "device", missing)) is not None else None
    view.max_num_batched_tokens = read(vllm_config, "scheduler_config.max_num_batched_tokens", missing)
    view.max_num_reqs = read(runner, "max_num_reqs", missing) if runner is not None else None
    view.enforce_eager = read(model_config, "enforce_eager", missing)
    mode = read(compilation, "cudagraph_mode", missing)
    view.cudagraph_mode = getattr(mode, "name", None) or (str(mode) if mode is not None else None)
    view.is_pooling_model = read(runner, "is_pooling_model", missing) if runner is not None else None
    view.tp_size = read(vllm_config, "parallel_config.tensor_parallel_size", missing)
    view.tp_rank = call(_tp_rank, missing, "tp_rank", default=None)
    if view.tp_rank is None and view.tp_size == 1:
        view.tp_rank = 0
    return view


def missing_required(view: EngineView) -> list:
    return [name for name in REQUIRED if name in view.missing]


def _vllm_version():
    import vllm

    return vllm.__version__


def _backends(runner) -> list:
    groups = getattr(runner, "attn_groups", None)
    if groups is None:
        raise AttributeError("runner has no attn_groups")
    out = []
    for per_group in groups:
        names = []
        for group in per_group:
            try:
                names.append(group.backend.get_name())
            except Exception as exc:  # get_name may raise NotImplementedError
                names.append(f"?{type(exc).__name__}")
        out.append(names)
    return out


def _tp_rank():
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().rank_in_group
