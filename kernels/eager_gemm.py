"""Warmup family ``eager_gemm``: the cuBLAS GEMMs of the model's unquantized linear layers,
of its LM head and of MLA's absorbed attention, at the token counts that run outside CUDA
graphs, before the first request.

Why:
    A prefill longer than the largest CUDA-graph capture size runs the compiled model's
    general-shape code, whose linear layers call cuBLAS (``extern_kernels.mm`` /
    ``addmm``); the LM head's GEMM runs eagerly at every step, at the number of sampled
    rows. The first GEMM at a new token count pays cuBLAS's choice of a kernel for that
    shape, and, when the choice is a kernel not used before, the driver loading it (lazy
    module loading). Measured on the GPU host (``bench/gemm_first_call.py``): about 0.2 ms
    per GEMM shape at a new token count, 2-3.5 ms when it picks a kernel not loaded yet (every
    few dozen counts); a repeat costs 0.02 ms. In the engine benchmark (cProfile of request 0
    against its repeat, vLLM 0.24.0, no Triton compile), a 200-token prefill spent 18.6 ms in
    12 first ``torch.mm`` calls on the tiny DeepSeek-V3.2 and 7.9 ms on the tiny Qwen3-Next;
    19 dummy forwards at a ladder of sizes left it as slow. With the linear layers warmed, a
    first 1332-token prefill of the DeepSeek-V3.2 still spent 6.3 ms in 4 first ``torch.bmm``
    calls of MLA's absorbed attention, which runs eagerly at the step's real token count.

How:
    One target per GEMM shape (weight shape, dtype, stride; bias or not) among the model's
    ``LinearBase`` layers on ``UnquantizedLinearMethod``, called as the layer's ``forward`` does,
    ``quant_method.apply(layer, x, bias)``, on an input of M rows over the eager range (smallest
    eager size to ``max_num_batched_tokens``); the LM head (``ParallelLMHead``) at
    1..``max_num_seqs`` rows. Outputs are dropped: only the weights are read. Quantized layers
    are not warmed (their GEMMs are other libraries' kernels).

    The MoE router's ``GateLinear`` is called through its own ``forward``: it picks its GEMM by
    release, weight and token count (a CuTe DSL kernel for few tokens, a fp32-specialized one,
    or ``torch.mm(x, W.T, out_dtype=float32)``), a cuBLAS problem ``quant_method.apply`` never
    makes: 3.1 ms in request 0, 0.09 ms in its repeat (vLLM 0.29.0, block-FP8 GLM-5, cProfile).
    Its GEMMs run instead of being captured (a CuTe DSL kernel may compile and load on its first
    call, which a capture would refuse); they are small (M x hidden x experts).

    MLA (``MLAAttention``'s absorbed ``W_UK_T`` / ``W_UV``), one target per shape: the query's
    ``torch.bmm(q_nope (N, B, P), W_UK_T)`` into a head-major buffer and, without padded heads,
    a token-major one (0.33), and the layer's own ``_v_up_proj``, at B up to
    ``max_num_batched_tokens`` for sparse MLA (DSA) and ``max_num_seqs`` x the decode query
    length for dense MLA (the V1 runner's ``reorder_batch_threshold``, V2's ``decode_query_len``).
    Layers on ROCm's AITER BMMs are left to vLLM, which warms those.

    Three passes, most useful first; the first two always run, the last while ``KWARM_BUDGET``
    lasts (kwarm_ext/budget.py): the summary says what is left to the requests.

    1. ``exact``: every count up to 64 and the counts this deployment stepped at in earlier
       runs (learned with ``KWARM_LEARN``, kept in its manifest): their first call then costs
       what the second does (DeepSeek-V3.2 dimensions: about 0.4 s);
    2. ``grid``: a geometric ladder of counts 9% apart (``kernel_grid``), about 40 counts per
       shape, which loads most kernels cuBLAS picks (DeepSeek-V3.2 dimensions: about 1 s);
    3. ``fill``: every count up to 512, then every 8th, smallest first (:func:`fill_counts`).

    The budget counts from the start of kwarm's warmup; the families before this one spend it
    first, except their time on a start where they compiled (``budget.credit``). The grid always
    runs: left to the budget, a cold start lost it (vLLM 0.29.0, published-size DeepSeek-V3.2:
    the first 200-, 1332- and 616-token steps paid 54, 37 and 33 ms more than their repeats,
    7.5, 0.3 and 7.7 ms with the grid warmed). With an every-8th fill too (unlimited budget,
    cold), request 0 paid 3.5 ms more (cProfile): cuBLAS's choice at a count no pass warmed,
    5-7% of a short prefill's step, hence every count up to 512 first.

    On CUDA each pass is *captured* into CUDA graphs that are never replayed: cuBLAS makes its
    choice and the driver loads the kernel at capture, and the GPU computes nothing. Measured
    (``bench/gemm_coverage.py``, DeepSeek-V3.2's 12 linear shapes and MLA BMMs): a first call
    at a captured count cost what a repeat does; capturing the 28,032 problems of an every-8th
    grid took 9.3 s, against 34.6 s running them. The grid alone leaves about one kernel load
    (2-5 ms) per 14 first calls at counts off it; the fill, none for linear layers. A count not
    warmed still pays cuBLAS's choice, about 0.2-0.3 ms per shape: what learned counts remove.
    The capture runs on the calling thread and one side stream (cuBLAS workspace made before
    capture; thread-local capture mode), not on threads: each thread would keep a cuBLAS handle
    and workspace for the life of the process, memory taken after vLLM sized its KV cache
    (``gemm_capture``). Where capture fails, the GEMMs run.

Cost: about 0.21 ms of CPU per problem (cuBLAS's choice; vLLM 0.29.0, one thread), no GPU
time when captured: published-size DeepSeek-V3.2 exact + grid about 1 s, the full fill (28,487
problems) 6.1 s on one thread. ``KWARM_WARMUPS=-eager_gemm`` turns it off. Its first step
raises the capacity of cuBLASLt's heuristics cache (8192 entries; ``kernels/cublaslt.py``).

Upstream: no vLLM release warms cuBLAS GEMM shapes outside CUDA-graph capture (0.20-0.34; 0.34's
``kernel_warmup`` warms CuTe DSL GEMMs and ROCm's AITER ones). Of the router gate, vLLM warms the
GEMMs its ``forward`` picks for few tokens on SM90+ (:func:`gate_counts_warmed_upstream`): kwarm's
gate counts start above those.

Remove when:
    vLLM warms its eager GEMM shapes, or cuBLAS stops choosing and loading per shape.
"""
from __future__ import annotations

import dataclasses

from kwarm_ext import budget
from kwarm_ext.kernels import cublaslt, gemm_capture
from kwarm_ext.families import Plan, Step
from kwarm_ext.kernels.attention_groups import model_dtype
from kwarm_ext.kernels.model_runner import eager_range, runner_models
from kwarm_ext.vllm_compat import Missing, resolve, resolve_or_none

NAME = "eager_gemm"
KERNEL = "cuBLAS GEMMs"
_LINEAR = ("vllm.model_executor.layers.linear:LinearBase",)
_UNQUANTIZED = ("vllm.model_executor.layers.linear:UnquantizedLinearMethod",)
_GATE = ("vllm.model_executor.layers.fused_moe.router.gate_linear:GateLinear",)
_LM_HEAD = ("vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",)
_LM_HEAD_UNQUANTIZED = ("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod",)
_MLA = ("vllm.model_executor.layers.attention.mla_attention:MLAAttention",)
_OTHER_BMMS = ("is_aiter_triton_fp8_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled", "is_amx_bmm_enabled")
EXACT_UP_TO = 64  # every token count up to this one is warmed exactly (decode-sized steps)
DENSE_UP_TO = 512  # the fill pass: every token count up to this one,
FILL_STRIDE = 8  # then every 8th
GRID_STEPS_PER_DOUBLING = 8  # the kernel grid: counts about 9% apart


@dataclasses.dataclass
class Target:
    """One GEMM shape to warm: `warm(m)` makes its call(s) at m rows; `first..last` its counts."""

    kind: str  # linear | lm_head | mla_bmm
    label: str
    first: int
    last: int
    calls: int  # GEMM problems per token count
    prepare: object  # (buffers) -> warm(m): its inputs (outside any capture)
    inputs: tuple | None = None  # (elements, dtype, device) it views from the pass's shared buffer
    captured: bool = True  # False: its GEMMs run even on CUDA (the router gate's own forward)
    out_bytes: int = 0  # what one call at `last` allocates (its outputs)


def _capture_room(torch, device_type):
    """Bytes the capture's CUDA graph may hold: what kwarm's memory bound leaves
    (``kwarm_ext.memory``), else half the device's free memory; None off CUDA."""
    if device_type != "cuda":
        return None
    from kwarm_ext import memory

    left = memory.room()
    return torch.cuda.mem_get_info()[0] // 2 if left is None else left


def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if model_of(view.runner) is None:
        return "runner has no model"
    return None


def plan(view, forced) -> list | Plan:
    """Steps: the heuristics cache, then three passes over every GEMM target, most useful
    first: ``exact`` (small and learned token counts), ``grid`` (the kernel grid) and ``fill``
    (every count to 512, then every 8th), the last within KWARM_BUDGET. Details: what each pass
    warmed and left (:func:`describe`)."""
    model = model_of(view.runner)
    device_type = _device_type(view)
    targets, skips = gemm_targets(model, view, device_type)
    if not targets:
        return skips
    learned = learned_token_counts(view)
    passes = [("exact", lambda t: exact_counts(t.first, t.last, learned), False),
              ("grid", lambda t: kernel_grid(t.first, t.last), False),
              ("fill", lambda t: fill_counts(t.first, t.last), True)]
    done = {id(t): set() for t in targets}
    steps, problems, details = list(skips), 0, {"learned": len(learned)}
    for name, counts_of, budgeted in passes:
        work = []
        for target in targets:
            counts = [m for m in counts_of(target) if m not in done[id(target)]]
            done[id(target)].update(counts)
            if counts:
                work.append((target, counts))
        if not work:
            steps.append(Step(name, KERNEL, skip="no token counts left to warm"))
            continue
        problems += sum(t.calls * len(c) for t, c in work)
        steps.append(Step(name, KERNEL, run=_pass(name, work, device_type, budgeted, details)))
    steps.insert(0, cublaslt.cache_step(problems, device_type, details))
    return Plan(steps, lambda: describe(details))


def gemm_targets(model, view, device_type: str | None) -> tuple[list, list]:
    """(targets, skip steps): one target per GEMM shape of the linear layers, LM head and MLA."""
    first, last = eager_range(view)
    targets, skips = [], []
    for kind, classes, method, lo, hi in (
            ("linear", _LINEAR, _UNQUANTIZED, first, last),
            ("lm_head", _LM_HEAD, _LM_HEAD_UNQUANTIZED, 1, view.max_num_reqs or 0)):
        try:
            layers = gemm_layers(model, resolve(*classes), resolve(*method), device_type)
        except Missing as exc:
            skips.append(Step(kind, KERNEL, skip=str(exc)))
            continue
        if not layers:
            where = f" on {device_type}" if device_type else ""
            skips.append(Step(kind, KERNEL, skip=f"no unquantized {kind} layers{where}"))
        elif hi < max(lo, 1):
            skips.append(Step(kind, KERNEL, skip="no token counts to warm"))
        else:
            gate = resolve_or_none(*_GATE) if kind == "linear" else None
            for name, layer, bias in layers:
                weight = layer.weight
                own = gate is not None and isinstance(layer, gate)
                # the gate gets the hidden states in the model's dtype, whatever its weight's (fp32 on some models)
                dtype = (model_dtype(view) or weight.dtype) if own else weight.dtype
                start = max(lo, 1, gate_counts_warmed_upstream(layer, dtype, view) + 1 if own else 1)
                if start > hi:
                    continue
                targets.append(Target(kind, f"{name} {tuple(weight.shape)}{' +bias' if bias is not None else ''}"
                                      + (" router gate (its forward)" if own else ""),
                                      start, hi, 1, _gate(layer, dtype) if own else _linear(layer, bias),
                                      (hi * weight.shape[1], dtype, weight.device), captured=not own,
                                      out_bytes=hi * weight.shape[0] * weight.element_size()))
    try:
        layers = mla_layers(model, resolve(*_MLA), device_type)
    except Missing as exc:
        return targets, skips + [Step("mla_bmm", KERNEL, skip=str(exc))]
    if not layers:
        return targets, skips + [Step("mla_bmm", KERNEL, skip="no MLA layers with absorbed cuBLAS weights")]
    decode_rows = (view.max_num_reqs or 0) * decode_query_len(view.runner)
    for name, layer in layers:
        hi = last if _sparse(layer) else min(last, decode_rows)
        if hi >= 1:
            label = (f"{name} W_UK_T {tuple(layer.W_UK_T.shape)} W_UV {tuple(layer.W_UV.shape)}"
                     f"{' sparse' if _sparse(layer) else ''}")
            uk = layer.W_UK_T
            targets.append(Target("mla_bmm", label, 1, hi, 2 if _pads_heads(layer) else 3, _mla(layer, hi),
                                  out_bytes=2 * layer.num_heads * hi * uk.shape[2] * uk.element_size()))
    if not any(t.kind == "mla_bmm" for t in targets):
        skips.append(Step("mla_bmm", KERNEL, skip="no token counts to warm"))
    return targets, skips


def learned_token_counts(view) -> list:
    """Token counts this deployment's earlier runs stepped at (learn-and-replay's manifest)."""
    from kwarm_ext.surfaces.triton import learn

    try:
        return learn.learned_token_counts(view)
    except RuntimeError:  # no Triton target (no driver): no deployment manifest to read
        return []


def exact_counts(first: int, last: int, learned=()) -> list:
    """Every count from `first` up to EXACT_UP_TO, and the learned counts in range."""
    if last < first or last < 1:
        return []
    first = max(first, 1)
    return sorted(set(range(first, min(last, EXACT_UP_TO) + 1)) | {m for m in learned if first <= m <= last})


def kernel_grid(first: int, last: int, steps_per_doubling: int = GRID_STEPS_PER_DOUBLING) -> list:
    """A geometric ladder from `first` to `last`, `steps_per_doubling` counts per doubling
    (about 9% apart), and `last`: cheap, and it reaches most kernels cuBLAS picks between."""
    if last < first or last < 1:
        return []
    first = max(first, 1)
    sizes, i = {first, last}, 0
    while (m := round(first * 2 ** (i / steps_per_doubling))) < last:
        sizes.add(m)
        i += 1
    return sorted(sizes)


def fill_counts(first: int, last: int) -> list:
    """Above EXACT_UP_TO, every count up to DENSE_UP_TO, then every FILL_STRIDE-th, smallest
    first: a first call costs about the same at any count (cuBLAS's choice, a kernel load), a
    small fraction of a long step, so a budget cut leaves the requests the largest counts."""
    if last < first or last < 1:
        return []
    start = max(first, EXACT_UP_TO + 1)
    dense = list(range(start, min(last, DENSE_UP_TO) + 1))
    return dense + list(range(max(start, DENSE_UP_TO + FILL_STRIDE), last + 1, FILL_STRIDE))


def describe(details: dict) -> dict:
    """What ran, for the summary line: per pass, the problems warmed and any left to the requests."""
    if not any(details.get(name) for name in ("exact", "grid", "fill", "heuristics_cache")):
        return {}
    parts = []
    for name in ("exact", "grid", "fill"):
        d = details.get(name)
        if d:
            text = f"{name} {d['warmed']} problems"
            if d["left"]:
                text += f" ({d['left']} left to the requests: KWARM_BUDGET)"
            parts.append(text)
    first = next((d for d in (details.get(n) for n in ("exact", "grid", "fill")) if d), None)
    if first:
        parts.append(f"{first['targets']} GEMM shapes, {first['mode']}")
    if details.get("learned"):
        parts.append(f"{details['learned']} learned token counts")
    cache = details.get("heuristics_cache")
    if cache:
        parts.append(f"cuBLASLt heuristics cache {cache['before']} -> {cache['after']} entries"
                     if cache["after"] is not None else f"cuBLASLt heuristics cache: {cache['reason']}")
    left = [{"step": name, "count": details[name]["left"], "what": "GEMM problems", "why": "KWARM_BUDGET"}
            for name in ("exact", "grid", "fill") if (details.get(name) or {}).get("left")]
    return {"summary": ", ".join(parts), **details} | ({"left_to_requests": left} if left else {})


def _pass(name: str, work: list, device_type: str | None, budgeted: bool, details: dict):
    """One pass: each target at its counts, largest first; on CUDA captured into CUDA graphs
    that are never replayed (cuBLAS chooses and the driver loads each kernel; the GPU computes
    nothing) on this thread (``gemm_capture``), elsewhere run. A budgeted pass stops when
    KWARM_BUDGET is spent."""
    def step():
        import torch

        with torch.inference_mode():
            buffers = _shared_inputs(torch, [target for target, _ in work])
            captured = [(t, c) for t, c in work if t.captured]
            ran = [(t, c) for t, c in work if not t.captured]
            warmed = left = 0
            modes = []
            if captured:
                calls = [(target, target.prepare(buffers)) for target, _ in captured]
                order = _order([counts for _, counts in captured], interleave=budgeted)
                if budgeted and budget.left() <= 0:  # nothing to capture: an empty CUDA graph makes torch warn in vLLM's log
                    warmed, left, mode = gemm_capture.warm(calls, order, budgeted) + ("warmed",)
                else:
                    free = _capture_room(torch, device_type)
                    out_bytes = max(t.out_bytes for t, _ in captured)
                    how, note = device_type, ""
                    if free is not None and free < 2 * out_bytes:  # not even one graph's pool: run them, one output at a time
                        how, note = None, f" (kwarm's memory bound leaves {free >> 20} MiB, one CUDA graph needs {2 * out_bytes >> 20})"
                    warmed, left, mode = gemm_capture.capture(calls, order, budgeted, torch, how)
                    mode += note
                modes.append(mode)
            if ran:
                calls = [(target, target.prepare(buffers)) for target, _ in ran]
                done, rest = gemm_capture.warm(calls, _order([counts for _, counts in ran], interleave=budgeted), budgeted)
                warmed, left = warmed + done, left + rest
                if done or not modes:
                    modes.append(f"{len(ran)} router gate{'s' if len(ran) > 1 else ''} run" if done else "warmed")
        mode = "; ".join(modes)
        details[name] = {"warmed": warmed, "left": left, "targets": len(work), "mode": mode,
                          "counts": max(len(c) for _, c in work)}
        return [f"{target.label}: {len(counts)} counts (M {min(counts)}..{max(counts)})" for target, counts in work] \
            + [f"{warmed} GEMM problems {mode}" + (f", {left} left to the requests (KWARM_BUDGET)" if left else "")]

    return step


def _shared_inputs(torch, targets: list) -> dict:
    """One flat input buffer per dtype and device, as large as the largest input of the
    pass's targets, which view it: zeros where the GEMMs run on the CPU, uninitialized on
    CUDA (the values never matter: outputs are dropped)."""
    need: dict = {}
    for target in targets:
        if target.inputs:
            elements, dtype, device = target.inputs
            need[(dtype, device)] = max(need.get((dtype, device), 0), elements)
    return {(dtype, device): (torch.empty if device.type == "cuda" else torch.zeros)(n, dtype=dtype, device=device)
            for (dtype, device), n in need.items()}


def _order(counts: list, interleave: bool) -> list:
    """(target index, m) in warming order: target by target, largest count first; or, for a
    budgeted pass, round-robin over the targets in each list's own order, so that a
    budget cut leaves every shape equally covered."""
    if not interleave:
        return [(i, m) for i, ms in enumerate(counts) for m in sorted(ms, reverse=True)]
    return [(i, ms[k]) for k in range(max(map(len, counts), default=0)) for i, ms in enumerate(counts) if k < len(ms)]


def _linear(layer, bias):
    """prepare(buffers): the input at every count, contiguous like the layer's real input,
    viewed from the pass's shared buffer of its dtype and device (:func:`_shared_inputs`);
    warm(m) calls the layer's own ``quant_method.apply``."""
    def prepare(buffers):
        weight = layer.weight
        flat = buffers[(weight.dtype, weight.device)]

        def warm(m):
            layer.quant_method.apply(layer, flat[:m * weight.shape[1]].view(m, weight.shape[1]), bias)

        return warm

    return prepare


def _gate(layer, dtype):
    """prepare(buffers) as :func:`_linear`, the input in `dtype` (the hidden states'); warm(m)
    calls the router gate's own ``forward``, whose GEMM (tier) vLLM picks by release, weight
    and token count."""
    def prepare(buffers):
        weight = layer.weight
        flat = buffers[(dtype, weight.device)]

        def warm(m):
            layer(flat[:m * weight.shape[1]].view(m, weight.shape[1]))

        return warm

    return prepare


def _mla(layer, rows: int):
    """prepare(buffers): the query as the attention gets it, (B, N, nope + rope), and the latent
    output; warm(m): the up-projection BMM into a head-major buffer and, where the layer pads
    no heads, a token-major one (0.33 writes there), and the layer's own ``_v_up_proj``."""
    def prepare(buffers):
        import torch

        heads, uk, uv = layer.num_heads, layer.W_UK_T, layer.W_UV
        nope, lora = uk.shape[1], uk.shape[2]
        q = torch.zeros((rows, heads, nope + layer.qk_rope_head_dim), dtype=uk.dtype, device=uk.device)
        q_nope = q[..., :nope].transpose(0, 1)
        latent = torch.zeros((rows, heads * lora), dtype=uv.dtype, device=uv.device)
        out = torch.empty((rows, heads * uv.shape[2]), dtype=uv.dtype, device=uv.device)
        token_major = not _pads_heads(layer)

        def warm(m):
            torch.bmm(q_nope[:, :m], uk, out=q_nope.new_empty((heads, m, lora)))
            if token_major:
                torch.bmm(q_nope[:, :m], uk, out=q_nope.new_empty((m, heads, lora)).transpose(0, 1))
            layer._v_up_proj(latent[:m], out[:m])

        return warm

    return prepare


def model_of(runner):
    """The runner's own model (``get_model()``, else ``runner.model``), or None."""
    models = runner_models(runner)
    return models[0] if models else None


def _device_type(view) -> str | None:
    """The runner's device type ("cuda" of the engine view's "cuda:0"), or None."""
    return view.device.split(":")[0] if view.device else None


def gate_counts_warmed_upstream(gate, dtype, view) -> int:
    """Up to which token count vLLM warms the router gate's own GEMM (0: none), which its
    ``forward`` picks for few tokens on SM90+ (the gate's ``allow_*`` flags, set at build):
    ``kernel_warmup``'s ll_bf16 router GEMM at 1..``LL_BF16_MAX_TOKENS`` for bf16 weights and
    hidden states (0.28-0.34, every engine), and the JIT warmup registry's ll_fp32w GEMM at
    1..``FP32_MAX_TOKENS`` for fp32 weights (0.33-0.34, with ``enable_jit_warmup``)."""
    import torch

    from kwarm_ext import upstream
    from kwarm_ext.kernels.attention_groups import vllm_config

    if getattr(gate, "allow_ll_bf16_gemm", False) is True and dtype == torch.bfloat16 and \
            gate.weight.shape[1] % 8 == 0 and upstream.kernel_warmup_calls("_warmup_ll_bf16_router_gemm"):
        warmed = getattr(resolve_or_none("vllm.model_executor.warmup.kernel_warmup:_LL_BF16_WARMUP_M_RANGE"),
                         "stop", 1) - 1  # range(1, 17) in 0.28-0.34
        return min(int(getattr(gate, "LL_BF16_MAX_TOKENS", 0)), warmed)
    jit = getattr(getattr(vllm_config(view), "kernel_config", None), "enable_jit_warmup", False)
    if getattr(gate, "allow_ll_fp32w_gemm", False) is True and not getattr(gate, "allow_fp32_router_gemm", False) \
            and callable(getattr(gate, "_register_ll_fp32w_warmup", None)) and jit is True:
        return int(getattr(gate, "FP32_MAX_TOKENS", 0))
    return 0


def decode_query_len(runner) -> int:
    """The most query tokens of one request that dense MLA runs as a decode: the V1 runner's
    ``reorder_batch_threshold`` (0.20-0.33), Model Runner V2's ``decode_query_len`` (1 + the
    speculative tokens; V2 has no ``reorder_batch_threshold``, and is the only runner from 0.34)."""
    for attr in ("reorder_batch_threshold", "decode_query_len"):
        value = getattr(runner, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


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
        key = (tuple(weight.shape), tuple(weight.stride()), str(weight.dtype), str(weight.device), bias is not None,
               type(layer).forward)  # a layer with its own forward (the router gate) makes other GEMMs
        seen.setdefault(key, (name, layer, bias))
    return list(seen.values())
