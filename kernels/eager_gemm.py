"""Warmup family ``eager_gemm``: the cuBLAS GEMMs of the model's unquantized linear layers,
of its LM head and of MLA's absorbed attention, at the token counts that run outside CUDA
graphs, before the first request.

Why:
    A prefill longer than the largest CUDA-graph capture size runs the compiled model's
    general-shape code, whose linear layers call cuBLAS (``extern_kernels.mm`` /
    ``addmm``); the LM head's GEMM runs eagerly at every step, at the number of sampled
    rows. The first GEMM at a new token count pays cuBLAS's choice of a kernel for that
    shape, and, when the choice is a kernel not used before, the driver loading it (lazy
    module loading). Measured on the GPU host (H200, torch 2.11, ``bench/gemm_first_call.py``):
    about 0.2 ms per GEMM shape at a new token count, and 2-3.5 ms when it picks a kernel
    not loaded yet, which happens every few dozen token counts; a repeat costs 0.02 ms. A
    neighbour (M+1) of a token count already run paid only the 0.2 ms. In the engine
    benchmark (cProfile of request 0 against its repeat, vLLM 0.24.0, no Triton compile),
    a 200-token prefill spent 18.6 ms in 12 first ``torch.mm`` calls on the tiny
    DeepSeek-V3.2 (0.2 ms in the repeat) and 7.9 ms on the tiny Qwen3-Next: the largest
    part of what still separated request 0 from request 1. Dummy forwards do not help
    enough: 19 of them at a ladder of sizes left request 0 as slow (measured). With the
    linear layers warmed, a first 1332-token prefill of the DeepSeek-V3.2 still spent 6.3 ms
    in 4 first ``torch.bmm`` calls of MLA's absorbed attention, which no CUDA graph holds:
    the attention runs eagerly at the step's real token count.

How:
    One layer per GEMM shape (weight shape, dtype, stride; bias or not) among the model's
    ``LinearBase`` layers whose ``quant_method`` is ``UnquantizedLinearMethod``, called the way
    the layer's ``forward`` calls it, ``quant_method.apply(layer, x, bias)`` (vLLM's
    ``dispatch_unquantized_gemm``: ``F.linear`` on CUDA), on a zero input of M rows, for M
    = every token count up to 64 and then every 8th, over the eager range (smallest eager
    size to ``max_num_batched_tokens``). The LM head (``ParallelLMHead`` with
    ``UnquantizedEmbeddingMethod``) the same way at 1..``max_num_seqs`` rows. Inputs are
    fresh buffers and outputs are dropped: no state of the engine is read or written
    besides the weights, which are only read. Quantized layers are not warmed (their GEMMs
    are other libraries' kernels).

    MLA (``MLAAttention`` layers with their ``W_UK_T`` / ``W_UV`` absorbed weights), one
    layer per shape: the query's up-projection ``torch.bmm(q_nope (N, B, P), W_UK_T)`` into
    a head-major buffer and, where the layer pads no heads, also into a token-major one
    (0.33 writes there), and the layer's own ``_v_up_proj`` for the output, at B = every
    token count (as above) up to ``max_num_batched_tokens`` for sparse MLA (DSA: every token
    goes this way) and up to ``max_num_seqs x reorder_batch_threshold`` decode tokens for
    dense MLA. Layers on ROCm's AITER BMMs are left to vLLM, which warms those itself.

Cost: one GEMM per (shape, token count), on every start (cuBLAS keeps nothing across
processes), mostly cuBLAS's per-shape choice on the CPU: for the tiny DeepSeek-V3.2, 5.2-7.8 s
for 11 linear shapes x 2072 token counts and 2.0-2.7 s for MLA (1 shape x 2104 counts x 3
BMMs; the token-major BMM only serves 0.33+, where vLLM writes there); the GPU time of the large
token counts grows with the layers' sizes. ``KWARM_WARMUPS=-eager_gemm`` turns it off.

cuBLASLt's heuristics cache: cuBLAS remembers its choice per exact problem in one cache per
process, 8192 entries by default (least recently used out first), and this family makes far
more (tiny DeepSeek-V3.2: about 29,000). Warmed in ascending order, the small token counts
were out of the cache again by the first request, which paid the choice once more: 0.13-0.15 ms
per ``torch.mm`` at M = 200 in request 0 of the engine benchmark (calls 12 and 14), a count
this family had run. Before warming on CUDA, the family raises the cache's capacity
(``cublasLtHeuristicsCacheSetCapacity``, on the cuBLASLt library torch loaded) to what it
warms plus the default 8192 for everything else, about 360 bytes of host memory per entry
(tiny DeepSeek-V3.2: 37,312 entries, about 13 MB); a capacity already larger
(``CUBLASLT_HEURISTICS_CACHE_CAPACITY``) is kept. Each step also warms its token counts from
the largest down, so that where the capacity cannot be raised the smallest, most frequent
counts are the ones left in the cache. Measured on the GPU host (``bench/gemm_warm_match.py``):
a problem warmed before 9,000 others cost 0.82 ms on its next call (5 shapes), 0.18 ms with
the capacity raised (0.15 ms when nothing came in between); in the engine benchmark (call 16)
request 0's GEMMs then cost what their repeat did. Ruled out on the way: the input's layout,
the thread, the stream, the pointer alignment, ``empty_cache`` and CUDA-graph capture.

Upstream: no vLLM release warms GEMM shapes outside CUDA-graph capture (0.20-0.33).

Remove when:
    vLLM warms its eager GEMM shapes, or cuBLAS stops choosing and loading per shape.
"""
from __future__ import annotations

from kwarm_ext.families import Step
from kwarm_ext.kernels.runner import eager_range, runner_models
from kwarm_ext.vllm_compat import Missing, resolve

NAME = "eager_gemm"
KERNEL = "cuBLAS GEMMs"
_LINEAR = ("vllm.model_executor.layers.linear:LinearBase",)
_UNQUANTIZED = ("vllm.model_executor.layers.linear:UnquantizedLinearMethod",)
_LM_HEAD = ("vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",)
_LM_HEAD_UNQUANTIZED = ("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod",)
_MLA = ("vllm.model_executor.layers.attention.mla_attention:MLAAttention",)
_OTHER_BMMS = ("is_aiter_triton_fp8_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled", "is_amx_bmm_enabled")
EVERY_UP_TO = 64  # every token count up to this one, then every STRIDE-th
STRIDE = 8
_details: dict = {}


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if model_of(view.runner) is None:
        return "runner has no model"
    return None


def plan(view, forced) -> list:
    _details.clear()
    model = model_of(view.runner)
    first, last = eager_range(view)
    device_type = _device_type(view)
    steps = []
    problems = []  # GEMM problems each step will run, for the heuristics cache
    for name, classes, method, sizes in (
            ("linear", _LINEAR, _UNQUANTIZED, token_counts(first, last)),
            ("lm_head", _LM_HEAD, _LM_HEAD_UNQUANTIZED, token_counts(1, view.max_num_reqs or 0))):
        try:
            layers = gemm_layers(model, resolve(*classes), resolve(*method), device_type)
        except Missing as exc:
            steps.append(Step(name, KERNEL, skip=str(exc)))
            continue
        if not layers:
            where = f" on {device_type}" if device_type else ""
            steps.append(Step(name, KERNEL, skip=f"no unquantized {name} layers{where}"))
        elif not sizes:
            steps.append(Step(name, KERNEL, skip="no token counts to warm"))
        else:
            steps.append(Step(name, KERNEL, run=_warm(name, layers, sizes)))
            problems.append(len(layers) * len(sizes))
    mla, mla_problems = _mla_step(model, view, last, device_type)
    steps.append(mla)
    problems.append(mla_problems)
    if sum(problems):
        steps.insert(0, _cache_step(sum(problems), device_type))
    return steps


def _mla_step(model, view, last: int, device_type: str | None) -> tuple:
    """(the ``mla_bmm`` step, the number of BMM problems it runs)."""
    try:
        layers = mla_layers(model, resolve(*_MLA), device_type)
    except Missing as exc:
        return Step("mla_bmm", KERNEL, skip=str(exc)), 0
    if not layers:
        return Step("mla_bmm", KERNEL, skip="no MLA layers with absorbed cuBLAS weights"), 0
    decode_rows = (view.max_num_reqs or 0) * _int(getattr(view.runner, "reorder_batch_threshold", None), 1)
    sized = [(name, layer, token_counts(1, last if _sparse(layer) else min(last, decode_rows)))
             for name, layer in layers]
    sized = [entry for entry in sized if entry[2]]
    if not sized:
        return Step("mla_bmm", KERNEL, skip="no token counts to warm"), 0
    problems = sum((2 if _pads_heads(layer) else 3) * len(sizes) for _, layer, sizes in sized)
    return Step("mla_bmm", KERNEL, run=_warm_mla(sized)), problems


def details() -> dict:
    """What ran, for the summary line: shapes and token counts per step."""
    if not _details:
        return {}
    parts = [f"{d['shapes']} {name} GEMM shapes x {d['counts']} token counts (M {d['M'][0]}..{d['M'][1]})"
             for name, d in _details.items() if name != "heuristics_cache"]
    cache = _details.get("heuristics_cache")
    if cache:
        parts.append(f"cuBLASLt heuristics cache {cache['before']} -> {cache['after']} entries"
                     if cache["after"] is not None else f"cuBLASLt heuristics cache: {cache['reason']}")
    return {"summary": ", ".join(parts), **_details}


def model_of(runner):
    """The runner's own model (``get_model()``, else ``runner.model``), or None."""
    models = runner_models(runner)
    return models[0] if models else None


def _device_type(view) -> str | None:
    """The runner's device type ("cuda" of the engine view's "cuda:0"), or None."""
    return view.device.split(":")[0] if view.device else None


def token_counts(first: int, last: int) -> list:
    """Every count from `first` up to EVERY_UP_TO, then every STRIDE-th, and `last`."""
    if last < first or last < 1:
        return []
    first = max(first, 1)
    sizes = list(range(first, min(last, EVERY_UP_TO) + 1))
    sizes += range(sizes[-1] + STRIDE if sizes else first, last + 1, STRIDE)
    return sizes if sizes[-1] == last else sizes + [last]


def kernel_grid(first: int, last: int, steps_per_doubling: int = 8) -> list:
    """Token counts from `first` to `last` that reach every kernel cuBLAS picks between them:
    every count up to 16, then a geometric ladder of `steps_per_doubling` counts per doubling
    (about 9% apart), and `last`."""
    if last < first or last < 1:
        return []
    first = max(first, 1)
    sizes = set(range(first, min(last, 16) + 1))
    base, i = max(first, 16), 0
    while (m := round(base * 2 ** (i / steps_per_doubling))) < last:
        sizes.add(m)
        i += 1
    sizes.add(last)
    return sorted(sizes)


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def mla_layers(model, mla_cls, device_type: str | None = None) -> list:
    """One (name, layer) per absorbed-weight shape among `model`'s ``MLAAttention`` layers
    that run their BMMs through ``torch.bmm`` (not AITER's or AMX's), on `device_type`."""
    seen = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, mla_cls) or any(getattr(layer, flag, False) for flag in _OTHER_BMMS):
            continue
        uk, uv = getattr(layer, "W_UK_T", None), getattr(layer, "W_UV", None)
        if _dims(uk) != 3 or _dims(uv) != 3:
            continue  # not loaded yet, or another layout
        if device_type is not None and uk.device.type != device_type:
            continue
        key = tuple((tuple(w.shape), tuple(w.stride()), str(w.dtype), str(w.device)) for w in (uk, uv))
        seen.setdefault(key + (_pads_heads(layer), _sparse(layer)), (name, layer))
    return list(seen.values())


def _dims(tensor) -> int:
    """Its number of dimensions; 0 for None or anything not a tensor."""
    return getattr(tensor, "dim", lambda: 0)()


def _sparse(layer) -> bool:
    return bool(getattr(layer, "use_sparse", False))


def _pads_heads(layer) -> bool:
    return getattr(layer, "q_pad_num_heads", None) is not None


def gemm_layers(model, layer_cls, method_cls, device_type: str | None = None) -> list:
    """One (name, layer, bias) per GEMM shape among `model`'s layers of `layer_cls` whose
    quant method is `method_cls` (and whose weight is on `device_type`, when given: not a
    weight offloaded to the CPU)."""
    seen = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, layer_cls) or not isinstance(getattr(layer, "quant_method", None), method_cls):
            continue
        weight = getattr(layer, "weight", None)
        if _dims(weight) != 2:
            continue
        if device_type is not None and weight.device.type != device_type:
            continue
        bias = None if getattr(layer, "skip_bias_add", False) else getattr(layer, "bias", None)
        key = (tuple(weight.shape), tuple(weight.stride()), str(weight.dtype), str(weight.device), bias is not None)
        seen.setdefault(key, (name, layer, bias))
    return list(seen.values())


def _warm(name: str, layers: list, sizes: list):
    def step():
        import torch

        with torch.inference_mode():
            for _, layer, bias in layers:
                weight = layer.weight
                rows = torch.zeros((sizes[-1], weight.shape[1]), dtype=weight.dtype, device=weight.device)
                for m in reversed(sizes):  # the smallest last: the ones a full cache keeps
                    layer.quant_method.apply(layer, rows[:m], bias)
        _details[name] = {"shapes": len(layers), "counts": len(sizes), "M": [sizes[0], sizes[-1]]}
        return [f"{layer_name} {tuple(layer.weight.shape)}{' +bias' if bias is not None else ''}"
                for layer_name, layer, bias in layers] + [f"M {sizes[0]}..{sizes[-1]} ({len(sizes)} counts)"]

    return step


def _warm_mla(sized: list):
    def step():
        import torch

        with torch.inference_mode():
            for _, layer, sizes in sized:
                heads, rows = layer.num_heads, sizes[-1]
                uk, uv = layer.W_UK_T, layer.W_UV
                nope, lora = uk.shape[1], uk.shape[2]
                # the query as the attention gets it, (B, N, nope + rope), its nope part (N, B, P)
                q = torch.zeros((rows, heads, nope + layer.qk_rope_head_dim), dtype=uk.dtype, device=uk.device)
                q_nope = q[..., :nope].transpose(0, 1)
                latent = torch.zeros((rows, heads * lora), dtype=uv.dtype, device=uv.device)
                out = torch.empty((rows, heads * uv.shape[2]), dtype=uv.dtype, device=uv.device)
                token_major = not _pads_heads(layer)
                for m in reversed(sizes):
                    torch.bmm(q_nope[:, :m], uk, out=q_nope.new_empty((heads, m, lora)))
                    if token_major:
                        torch.bmm(q_nope[:, :m], uk, out=q_nope.new_empty((m, heads, lora)).transpose(0, 1))
                    layer._v_up_proj(latent[:m], out[:m])
        _details["mla_bmm"] = {"shapes": len(sized), "counts": max(len(sizes) for _, _, sizes in sized),
                               "M": [min(s[0] for _, _, s in sized), max(s[-1] for _, _, s in sized)]}
        return [f"{name} W_UK_T {tuple(layer.W_UK_T.shape)} W_UV {tuple(layer.W_UV.shape)}"
                f"{' sparse' if _sparse(layer) else ''}: B {sizes[0]}..{sizes[-1]} ({len(sizes)} counts)"
                for name, layer, sizes in sized]

    return step


# ---------------------------------------------------------------------------- cuBLASLt heuristics cache

DEFAULT_HEURISTICS_CACHE = 8192  # cuBLASLt's default capacity: room kept for everything else


def _cache_step(problems: int, device_type: str | None) -> Step:
    """First step: room in cuBLASLt's heuristics cache for the `problems` the others warm."""
    if device_type != "cuda":
        return Step("heuristics_cache", "cuBLASLt heuristics cache",
                    skip=f"runner device {device_type or 'unknown'} is not CUDA ({problems} GEMM problems)")
    return Step("heuristics_cache", "cuBLASLt heuristics cache", run=_reserve_step(problems))


def _reserve_step(problems: int):
    def step():
        before, after, reason = reserve_heuristics_cache(problems + DEFAULT_HEURISTICS_CACHE)
        _details["heuristics_cache"] = {"problems": problems, "before": before, "after": after, "reason": reason}
        return [f"capacity {before} -> {after} ({problems} problems to warm)" if after is not None
                else f"capacity not raised: {reason}"]

    return step


def reserve_heuristics_cache(entries: int, libraries=None) -> tuple:
    """Raise the capacity of cuBLASLt's heuristics cache to at least `entries`, in every
    cuBLASLt library loaded in this process (torch's). Returns (before, after, reason):
    the capacities, or (before or None, None, why not). Never lowers a capacity."""
    import ctypes

    libs = _cublaslt_libraries() if libraries is None else libraries
    if not libs:
        return None, None, "no cuBLASLt library loaded"
    befores, afters = [], []
    for lib in libs:
        capacity = ctypes.c_size_t()
        if lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(capacity)) != 0:
            return None, None, "cublasLtHeuristicsCacheGetCapacity failed"
        befores.append(capacity.value)
        if capacity.value < entries:
            status = lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(entries))
            if status != 0:
                return capacity.value, None, f"cublasLtHeuristicsCacheSetCapacity returned status {status}"
            lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(capacity))
        afters.append(capacity.value)
    return min(befores), min(afters), None


def _cublaslt_libraries() -> list:
    """The cuBLASLt libraries this process has loaded (from /proc/self/maps), opened again
    by path (the same loaded copy), that have the heuristics-cache functions."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcublasLt.so" in line})
    except OSError:
        return []
    libs = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "cublasLtHeuristicsCacheSetCapacity") and hasattr(lib, "cublasLtHeuristicsCacheGetCapacity"):
            libs.append(lib)
    return libs
