"""The ``caching_allocator`` family: run after ``compile_or_warm_up_model``, not in kwarm's
warmup, through kwarm's real ``warmup.run`` / ``warmup.after_capture``.

torch's CUDA caching allocator cannot exist on this machine (no GPU driver): its statistics
(``torch.cuda.memory_stats``, ``torch.cuda.mem_get_info``) and the 1 MiB CUDA allocations of
``reserve`` are stood in for, and only those; ``reserve`` itself runs on the CPU allocator.
What the step saves on the GPU is measured by the engine benchmark (``alloc`` per request).
"""
from __future__ import annotations

import contextlib
import json
import types

import pytest

from kwarm_ext import warmup
from kwarm_ext.kernels import caching_allocator as ca
from test_faults import stand_in_worker

MIB = 1 << 20


def ca_family(part: dict) -> dict:
    """This family's part of an after-capture run (v2_warmup runs before it there)."""
    return next(f for f in part["families"] if f["name"] == "caching_allocator")


def test_small_pool_reads_segments_and_free_bytes():
    assert ca.small_pool({"segment.small_pool.current": 7, "reserved_bytes.small_pool.current": 14 * MIB,
                          "allocated_bytes.small_pool.current": 3 * MIB}) == (7, 11.0)
    assert ca.small_pool({}) == (0, 0.0)


def test_reserve_holds_all_blocks_at_once_then_frees_them():
    import weakref

    import torch

    held, alive, most_alive = [], weakref.WeakSet(), []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        held.append(tensor.nbytes)
        alive.add(tensor)
        most_alive.append(len(alive))
        return tensor

    torch.empty = empty
    try:
        ca.reserve("cpu", 3)
        ca.reserve("cpu", 2, ca.LARGE_BLOCK)
    finally:
        torch.empty = real_empty
    assert held == [MIB] * 3 + [9 * MIB] * 2
    assert most_alive == [1, 2, 3, 1, 2], "each block allocated while the others are held"
    assert len(alive) == 0, "all freed on return"
    assert 2 * ca.LARGE_BLOCK <= 20 * MIB and ca.LARGE_BLOCK < 10 * MIB, "two to a 20 MiB large-pool segment"


@pytest.fixture
def gpu_allocator(monkeypatch):
    """Stand-ins for the CUDA driver's side: the allocator's statistics and its allocations.
    The small pool holds 6 MiB allocated and 11 MiB free, in pieces; a reserve of n blocks
    adds n // 2 new segments (two 1 MiB blocks each)."""
    import torch

    state = types.SimpleNamespace(segments=8, large=3, free=11 * MIB, reserved=[], device_free=80 << 30,
                                  stream=None, large_bytes=60 * MIB, synchronized=[])

    def memory_stats(device):
        assert device == "cuda:0"
        return {"segment.small_pool.current": state.segments, "segment.large_pool.current": state.large,
                "reserved_bytes.small_pool.current": state.free + 6 * MIB,
                "allocated_bytes.small_pool.current": 6 * MIB, "reserved_bytes.large_pool.current": state.large_bytes}

    def reserve(device, blocks, size=MIB):
        state.reserved.append((device, state.stream, blocks, size // MIB))
        if size == MIB:
            state.segments += blocks // 2
            state.free += blocks // 2 * 2 * MIB
        else:
            state.large += blocks // 2

    @contextlib.contextmanager
    def on_stream(stream):
        state.stream = stream
        try:
            yield
        finally:
            state.stream = None

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state.device_free, 141 << 30))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state.synchronized.append(str(device)))
    monkeypatch.setattr(ca, "reserve", reserve)
    monkeypatch.setattr(ca, "on_stream", on_stream)
    return state


def test_runs_after_capture_only(gpu_allocator, kwarm_env, kwarm_log, tmp_path):
    report_path = tmp_path / "report.json"
    kwarm_env(KWARM_WARMUPS="caching_allocator", KWARM_REPORT=str(report_path), KWARM_LOG_LEVEL="DEBUG")
    worker = stand_in_worker(device="cuda:0")
    report = warmup.run(worker)
    assert "caching_allocator" not in [f["name"] for f in report["families"]], "not in kwarm's warmup"
    assert gpu_allocator.reserved == []

    part = warmup.after_capture(worker)  # what patches' compile_or_warm_up_model wrapper calls
    assert gpu_allocator.reserved == [("cuda:0", None, ca.RESERVE_BLOCKS, 1), ("cuda:0", None, 4, 9)]
    family = ca_family(part)
    assert family["name"] == "caching_allocator" and family["status"] == "ran", family
    text = "model stream 32 x 1 MiB + 4 x 9 MiB: 16 small, 2 large segments new; small pool 11 -> 43 MiB cached free"
    assert family["steps"][0]["variants"] == [text] and family["details"] == {"summary": text}
    written = json.loads(report_path.read_text())
    assert ca_family(written["after_capture"])["steps"][0]["status"] == "ran"
    lines = [m for m in kwarm_log.messages(0) if m.startswith("kwarm: after CUDA-graph capture, ")]
    assert lines[0] == part["summary"] == written["after_capture"]["summary"], lines
    assert ": ran caching_allocator; " in lines[0] and "; 0 failed; 0 compiled; largest caching_allocator " in lines[0]
    assert lines[1] == f"kwarm: after CUDA-graph capture, detail on rank 0: {part['detail']}"
    assert "caching_allocator " in part["detail"] and f" s: {text}" in part["detail"]
    assert part["left_to_requests"] == []
    assert kwarm_log.messages() == [], "no warning"

    assert ca_family(warmup.after_capture(worker))["reason"] == "no engine view", \
        "one after-capture run per warmup run"


def v2_dummy_run(state, calls):
    """A stand-in for the V2 runner's ``_dummy_run`` (its signature in 0.29.0; the runner needs a
    GPU): each step's activations start two large-pool segments of 1.5 GiB in all."""
    import torch

    def _dummy_run(num_tokens, *args, skip_attn=False, uniform_decode=False, context_len=0, skip_eplb=False,
                   is_profile=False, **kwargs):
        calls.append({"num_tokens": num_tokens, "skip_eplb": skip_eplb, "skip_attn": skip_attn,
                      "is_profile": is_profile, "inference": torch.is_inference_mode_enabled()})
        state.large += 2
        state.large_bytes += 1536 * MIB

    return _dummy_run


def test_the_largest_eager_step_leaves_its_activations_cached(gpu_allocator, kwarm_env):
    # a long prefill's allocations above 9 MiB come from the large pool, which vLLM's
    # empty_cache left empty: the first 4x333-token prefill of Qwen3-Next-80B dimensions paid
    # 10.5 ms in new segments (vLLM 0.29.0, cProfile against its repeat)
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    calls = []
    worker = stand_in_worker(device="cuda:0", max_num_tokens=1024, _dummy_run=v2_dummy_run(gpu_allocator, calls))
    warmup.run(worker)
    family = ca_family(warmup.after_capture(worker))
    assert [s["name"] for s in family["steps"]] == ["small and large pools", "largest eager step"]
    assert calls == [{"num_tokens": 1024, "skip_eplb": True, "skip_attn": False, "is_profile": False,
                      "inference": True}], "vLLM's own eager step at the most tokens a step schedules, once"
    assert gpu_allocator.synchronized == ["cuda:0"]
    [text] = family["steps"][1]["variants"]
    assert text.startswith("one eager step of 1024 tokens (vLLM's _dummy_run) in ")
    assert text.endswith(" s: large pool +1536 MiB cached (2 segments new)"), text
    assert family["details"]["summary"].endswith(text)

    gpu_allocator.device_free = 512 * MIB
    warmup.run(worker)
    step = ca_family(warmup.after_capture(worker))["steps"][1]
    assert step["variants"] == ["no eager step: 512 MiB free on the device"] and len(calls) == 1
    # with torch.distributed peers every rank runs the step whatever its free memory: the
    # forward's collectives must pair up across ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ca, "one_process", lambda: False)
        warmup.run(worker)
        warmup.after_capture(worker)
    assert len(calls) == 2 and calls[-1]["num_tokens"] == 1024

    bare = stand_in_worker(device="cuda:0")
    warmup.run(bare)
    step = ca_family(warmup.after_capture(bare))["steps"][1]
    assert step["status"] == "skipped" and step["reason"] == "runner has no _dummy_run"


def test_low_device_memory_reserves_nothing(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    gpu_allocator.device_free = 512 * MIB
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    step = ca_family(warmup.after_capture(worker))["steps"][0]
    assert step["variants"] == ["nothing reserved: 512 MiB free on the device"]
    assert gpu_allocator.reserved == []


def test_not_on_cuda_is_a_skip_and_disabled_is_disabled(gpu_allocator, kwarm_env):
    kwarm_env(KWARM_WARMUPS="caching_allocator")
    worker = stand_in_worker(device="cpu")
    warmup.run(worker)
    assert ca_family(warmup.after_capture(worker))["reason"] == "runner device cpu is not CUDA"

    kwarm_env(KWARM_WARMUPS="-caching_allocator")
    warmup.run(worker)
    assert ca_family(warmup.after_capture(worker))["reason"] == "disabled by KWARM_WARMUPS"
    assert gpu_allocator.reserved == []


def test_vllms_aux_stream_gets_its_own_reserve_once_created(gpu_allocator, kwarm_env, monkeypatch):
    # the shared experts run on vLLM's aux stream, whose blocks the allocator keeps apart:
    # request 0 started a small and a large segment there (BENCHMARKS.md, --alloc-stacks 0)
    import vllm.utils.torch_utils as torch_utils

    kwarm_env(KWARM_WARMUPS="caching_allocator")
    monkeypatch.setattr(torch_utils, "_aux_stream", None)
    assert torch_utils.aux_stream() is None, "vLLM creates none without CUDA"
    assert [label for label, *_ in ca.streams()] == ["model stream"], "none created: the model's stream only"

    aux = object()  # the torch.cuda.Stream vLLM's aux_stream() created
    monkeypatch.setattr(torch_utils, "_aux_stream", aux)
    assert torch_utils.aux_stream() is aux, "what kwarm reads is what vLLM's aux_stream() hands out"
    worker = stand_in_worker(device="cuda:0")
    warmup.run(worker)
    step = ca_family(warmup.after_capture(worker))["steps"][0]
    assert gpu_allocator.reserved == [("cuda:0", None, 32, 1), ("cuda:0", None, 4, 9),
                                      ("cuda:0", aux, 4, 1), ("cuda:0", aux, 2, 9)]
    assert step["variants"] == ["model stream 32 x 1 MiB + 4 x 9 MiB: 16 small, 2 large segments new; "
                                "aux stream 4 x 1 MiB + 2 x 9 MiB: 2 small, 1 large segments new; "
                                "small pool 11 -> 47 MiB cached free"]


# -- FLASH_ATTN_MLA_SPARSE's sparse MQA scratch ----------------------------------------------

SPARSE_MQA = """
import json, sys, types
import torch

# FlashAttention 3 cannot exist on this machine: vllm.vllm_flash_attn needs its CUDA extension.
# A recorder takes its place, and only its place; the rest is vLLM's own code.
calls = []
def flash_attn_varlen_func(**kwargs):
    calls.append({k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    calls[-1]["pages"] = sorted(set(kwargs["block_table"].flatten().tolist()))
    calls[-1]["used"] = sorted(set(kwargs["seqused_k"].tolist()))
    return torch.zeros(kwargs["q"].shape[0], kwargs["q"].shape[1], kwargs["q_v"].shape[-1])
fa = types.ModuleType("vllm.vllm_flash_attn")
fa.flash_attn_varlen_func = flash_attn_varlen_func
fa.get_scheduler_metadata = lambda *a, **k: None
fa.flash_attn_supports_fp8 = fa.is_fa_version_supported = lambda *a, **k: True
fa.fa_version_unsupported_reason = lambda *a, **k: None
fa.flash_attn_interface = fa
sys.modules["vllm.vllm_flash_attn"] = sys.modules["vllm.vllm_flash_attn.flash_attn_interface"] = fa

import vllm.v1.attention.backends.mla.flashattn_mla_sparse as backend
from kwarm_ext.kernels import caching_allocator as ca

NS = types.SimpleNamespace
H, RANK, ROPE, TOPK, BLOCK = 128, 512, 64, 128, 64
impl = object.__new__(backend.FlashAttnMLASparseImpl)
buffer = torch.full((12, TOPK), 7, dtype=torch.int32)  # rows: max_num_batched_tokens; 7: stale indices
impl.__dict__.update(num_heads=H, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, head_size=RANK + ROPE,
                     scale=(RANK + ROPE) ** -0.5, dcp_world_size=1, index_group=None,
                     cu_seqlens_q_buffer=torch.arange(13, dtype=torch.int32))
impl.topk_indices_buffer = buffer  # 0.33: a property of SharedTopkIndicesBuffer
kv = torch.randn(4, BLOCK, RANK + ROPE, dtype=torch.bfloat16)
kv_before = kv.clone()
layer = NS(impl=impl, kv_cache=kv, layer_name="model.layers.0.self_attn.attn")
builder = NS(reorder_batch_threshold=json.loads(sys.argv[1]), metadata_cls=backend.FlashAttnMLASparseMetadata,
             kv_cache_spec=NS(block_size=BLOCK))
group = NS(backend=backend.FlashAttnMLASparseBackend, layer_names=[layer.layer_name], kv_cache_group_id=0,
           metadata_builders=[builder])
rows = torch.arange(32, dtype=torch.int32).reshape(2, 16)
runner = NS(attn_groups=[[group]], block_tables=NS(input_block_tables=[rows]))
view = NS(runner=runner, forward_context={layer.layer_name: layer}, device="cpu",
          worker=NS(vllm_config=NS(model_config=NS(dtype=torch.bfloat16))))

tokens = ca.sparse_mqa_tokens(view, group)
ca.sparse_mqa(view, group, tokens)
out = {"tokens": tokens, "calls": calls, "kv_untouched": bool(torch.equal(kv, kv_before)),
       "buffer": sorted(set(buffer[:max(tokens)].flatten().tolist())),
       "steps": [s.name for s in ca.plan(view, False).steps]}

# The step itself, with the CUDA allocator's statistics stood in for (no GPU driver here):
# FlashAttention 3's scratch added one 1792 MiB large-pool segment; then with 512 MiB free.
calls.clear()
stats = iter([{"reserved_bytes.large_pool.current": 100 << 20, "segment.large_pool.current": 3},
              {"reserved_bytes.large_pool.current": 1892 << 20, "segment.large_pool.current": 4}])
free = [80 << 30]
torch.cuda.memory_stats = lambda device: next(stats)
torch.cuda.mem_get_info = lambda device: (free[0], 141 << 30)
torch.cuda.synchronize = lambda device=None: None
details = {}
out["ran"] = ca._sparse_mqa_scratch(view, group, details)
out["ran_calls"] = len(calls)
free[0] = 512 << 20
out["low"] = ca._sparse_mqa_scratch(view, group, details)
details["pools"] = "pools text"
out["summary"] = ca.summary(details)
print(json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.28.0", "0.33.0"])
@pytest.mark.parametrize("threshold", [8, 256])
def test_sparse_mqa_runs_forward_mqa_as_a_request_of_each_decode_size(release, threshold):
    """vLLM's own FlashAttnMLASparseImpl.forward_mqa (the 0.28 and 0.33 call shapes) takes the
    batch the step builds, converts its -1 top-k indices with vLLM's Triton kernel (interpreted)
    and calls FlashAttention 3 as a one-request batch of T new tokens does: T one-token queries
    over the top-k width, every page -1 (no KV entry read), for each T a decode can have, largest
    first (the allocator keeps the largest scratch), capped by the top-k buffer's rows."""
    from conftest import cpu_triton_env, run_py

    proc = run_py(SPARSE_MQA.replace("json.loads(sys.argv[1])", str(threshold)), env=cpu_triton_env(),
                  release=release, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = list(range(min(threshold, 12), 0, -1))
    assert out["tokens"] == expected
    assert [call["q"] for call in out["calls"]] == [[t, 128, 64] for t in expected]
    assert [call["q_v"] for call in out["calls"]] == [[t, 128, 512] for t in expected]
    assert [call["cu_seqlens_q"] for call in out["calls"]] == [[t + 1] for t in expected]
    for t, call in zip(expected, out["calls"]):
        assert call["max_seqlen_q"] == 1 and call["max_seqlen_k"] == 128 and call["causal"] is True
        assert call["block_table"] == [t, 128] and call["pages"] == [-1] and call["used"] == [0], call
        assert call["fa_version"] == 3
    assert out["buffer"] == [-1], "the batch's top-k rows hold -1, not stale indices"
    assert out["kv_untouched"]
    assert out["steps"] == ["sparse MQA scratch, KV-cache group 0", "small and large pools", "largest eager step"]
    assert out["ran_calls"] == len(expected)
    [ran] = out["ran"]
    assert ran.startswith(f"KV-cache group 0: {len(expected)} batches of {expected[0]}..1 tokens through forward_mqa in ")
    assert ran.endswith(" s: large pool +1792 MiB (1 segments new)"), ran
    assert out["low"] == ["KV-cache group 0: nothing run: 512 MiB free on the device"]
    assert out["summary"] == {"summary": "; ".join([ran, *out["low"], "pools text"])}
