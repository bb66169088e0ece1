"""Learn, then replay in a fresh process: the same launches then compile nothing.

Each run is a fresh interpreter. tests/replay_kernels.FakeDriver stands in for the GPU
driver that cannot exist on this machine: Triton compiles for an sm90 target without a GPU,
but nothing can be loaded or launched, so "launch" here is Triton's compile-only path
(``warmup`` / ``run(..., warmup=True)``), which computes the same in-memory cache key as a
real launch. ``_init_handles`` and the tiny launch are checked to be skipped under the stub,
and (with the GPU check and both calls replaced by recorders) to be called when a GPU is
there; that they *work* is for the GPU benchmark to show.

The worker is a stand-in carrying what kwarm's engine view reads (a real vLLM Worker needs
a GPU); the warmup is kwarm's real ``warmup.run``, as the kernel_warmup hook calls it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import clean_env, require, run_py

require("triton")
require("vllm")
TESTS = Path(__file__).resolve().parent

PRELUDE = """
import json, os, sys, types
import replay_kernels as rk
rk.install_fake_driver()
from kwarm_ext import warmup
from kwarm_ext.surfaces.triton import hook
from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.surfaces.triton import preload as triton_preload

def stand_in_worker():
    ns = types.SimpleNamespace
    runner = ns(attn_groups=[], device="cpu", max_num_reqs=16, is_pooling_model=False,
                compilation_config=ns(static_forward_context={}, cudagraph_mode=None))
    model_config = ns(model="tiny/test-model", enforce_eager=False,
                      hf_text_config=ns(model_type="llama"), hf_config=ns(architectures=["LlamaForCausalLM"]))
    return ns(model_runner=runner, vllm_config=ns(model_config=model_config,
              scheduler_config=ns(max_num_batched_tokens=2048), parallel_config=ns(tensor_parallel_size=1)))

def replay_family(report):
    return next(f for f in report["families"] if f["name"] == "replay")
"""

LEARN = PRELUDE + """
report = warmup.run(stand_in_worker())       # no manifest yet: replay does not apply
with hook.capture() as compiled:
    rk.choose_autotune_configs()             # stands in for the benchmark a GPU would run
    rk.launch_all()                          # production launches after warmup: learned
print(json.dumps({"replay": replay_family(report), "learn": report.get("learn"),
                  "compiled": len(compiled)}))
"""  # the manifest is written at exit

REPLAY = PRELUDE + """
if os.environ.get("PRETEND_GPU"):
    # The GPU-only calls, replaced by recorders: does replay make them where a GPU exists?
    from triton.compiler.compiler import CompiledKernel
    loaded, launched = [], []
    triton_compat.has_gpu_driver = lambda: True
    CompiledKernel._init_handles = lambda self: loaded.append(self.name)
    triton_preload.tiny_launch = lambda: launched.append(1)
before = [m for m in ("triton.tools.tensor_descriptor",) if m in sys.modules]
report = warmup.run(stand_in_worker())
binder = [m for m in ("triton.tools.tensor_descriptor", "triton.experimental.gluon.nvidia.hopper")
          if m in sys.modules]
def key_caches():
    kernels = {"copy": rk.copy_kernel, "heuristic": rk.heuristic_kernel.fn, "tuned": rk.tuned_kernel.fn,
               "apply": rk.apply_kernel, "cast": rk.cast_kernel}
    return {name: len(jit.device_caches[triton_compat.current_device()][1]) for name, jit in kernels.items()}
keys_before = key_caches()
with hook.capture() as compiled:
    rk.launch_all()                          # the same launches, after replay
keys_after = key_caches()
out = {"replay": replay_family(report), "compiled_after": [(c.name, c.key) for c in compiled],
       "key_cache_added": {k: keys_after[k] - keys_before[k] for k in keys_after},
       "binder_before": before, "binder_after": binder,
       "tuned_cache": {str(k): rk.TUNE_CONFIGS.index(v) for k, v in rk.tuned_kernel.cache.items()}}
if os.environ.get("PRETEND_GPU"):
    out["loaded"], out["launched"] = sorted(loaded), len(launched)
print(json.dumps(out))
"""


def env_for(tmp_path, **extra) -> dict:
    settings = dict(KWARM_MANIFEST=str(tmp_path / "manifest.json"), KWARM_ALLOW_MODULES="replay_kernels",
                    KWARM_WARMUPS="replay", KWARM_LEARN_INTERVAL="0")
    env = clean_env(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
                    **{**settings, **extra})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def last_json(proc):
    """The last JSON line of stdout (log lines, e.g. the save at exit, may follow it)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """One learning run: (its output, its stdout, the manifest path, the tmp dir)."""
    tmp = tmp_path_factory.mktemp("learn")
    proc = run_py(LEARN, env=env_for(tmp, KWARM_LEARN="1"))
    return last_json(proc), proc.stdout, tmp / "manifest.json", tmp


def test_learning_run_records_and_saves_at_exit(learned):
    out, stdout, manifest_path, _ = learned
    assert out["replay"]["status"] == "skipped" and "no manifest" in out["replay"]["reason"]
    assert out["learn"] == {"manifest": str(manifest_path), "newly_learned": 0}
    assert out["compiled"] == 11  # what the first requests would have compiled
    data = json.loads(manifest_path.read_text())
    assert data["format"] == "kwarm-manifest" and data["version"] == 1
    assert data["stamp"]["triton"] and data["stamp"]["arch"] == "cuda:90" and data["stamp"]["tp_size"] == 1
    assert data["stamp"]["model"] == "tiny/test-model" and data["stamp"]["vllm"] == "0.24.0"
    assert len(data["entries"]) == 11 and len(data["autotune"]) == 2
    assert f"; learning into {manifest_path}" in [line for line in stdout.splitlines() if "warmup done" in line][0]
    assert "kwarm: learned 13 new (13 in the manifest, exit save)" in stdout
    assert oct(manifest_path.stat().st_mode & 0o777) == oct(0o644)


def test_replay_in_a_fresh_process_leaves_nothing_to_compile(learned, tmp_path):
    _, _, _, tmp = learned
    proc = run_py(REPLAY, env=env_for(tmp, KWARM_LOG_LEVEL="DEBUG"))  # the detail line is DEBUG's
    out = last_json(proc)
    fam = out["replay"]
    assert fam["status"] == "ran"
    assert out["compiled_after"] == []  # plain, heuristics, autotuned, function- and enum-constexpr kernels
    details = fam["details"]
    assert (details["replayed"], details["not_chosen"], details["autotune_seeded"]) == (10, 1, 2)
    assert details["skipped"] == [] and details["refused"] is None
    # The seeded choices are the kernel's own Config objects; the launch found them (a
    # benchmark would have failed: the stub driver has no benchmarker).
    assert out["tuned_cache"] == {"(64, 'torch.float16', 'torch.float16')": 0,
                                  "(4096, 'torch.float16', 'torch.float16')": 2}
    steps = {s["name"]: s for s in fam["steps"]}
    assert steps["compile"]["status"] == "ran" and len(steps["compile"]["variants"]) == 10
    assert steps["autotune"]["status"] == "ran"
    for gpu_only in ("load", "launch"):
        assert steps[gpu_only]["status"] == "skipped" and "no GPU driver" in steps[gpu_only]["reason"]
    # the binder's one-time imports were paid during replay, not by the first launch
    assert out["binder_before"] == [] and len(out["binder_after"]) == 2
    assert details["binder"] == "primed by warmup"
    # the launches found their in-memory keys already mapped from their specialization (the
    # IntEnum and dtype constexprs included), except the kernel whose specialization holds a
    # jitted function (its key text is the hash)
    assert details["key_cache_seeded"] == 9
    assert out["key_cache_added"] == {"copy": 0, "heuristic": 0, "tuned": 0, "apply": 1, "cast": 0}
    summary = [line for line in proc.stdout.splitlines() if "warmup done" in line]
    assert len(summary) == 1 and "): ran replay; " in summary[0]
    assert f"; 0 failed; {len(fam['compiled'])} compiled; largest replay " in summary[0]
    assert details["left_to_requests"] == [] and "left to requests" not in summary[0]
    detail = [line for line in proc.stdout.splitlines() if "kwarm: warmup detail on rank 0: " in line]
    assert len(detail) == 1
    assert "replay" in detail[0] and "10 replayed, 1 unchosen autotune configs left out, 2 autotune choices seeded" \
        in detail[0]


def test_replay_loads_and_launches_where_a_gpu_exists(learned):
    _, _, _, tmp = learned
    out = last_json(run_py(REPLAY, env=env_for(tmp, PRETEND_GPU="1")))
    steps = {s["name"]: s for s in out["replay"]["steps"]}
    assert steps["load"]["status"] == "ran" and len(steps["load"]["variants"]) == 10
    assert steps["launch"]["status"] == "ran" and out["launched"] == 1
    assert sorted(out["loaded"]) == sorted(["apply_kernel", "cast_kernel"] + ["copy_kernel"] * 4 + ["heuristic_kernel"] * 2
                                           + ["tuned_kernel"] * 2)


def test_periodic_save_while_serving(tmp_path):
    code = PRELUDE + """
import time
warmup.run(stand_in_worker())
import torch
rk.copy_kernel.warmup(torch.float16, torch.float16, 64, BLOCK=64, grid=(1,))
path = os.environ["KWARM_MANIFEST"]
deadline = time.time() + 20
while not os.path.exists(path) and time.time() < deadline:
    time.sleep(0.1)
print(json.dumps({"saved": os.path.exists(path)}))
os._exit(0)  # no atexit: only the periodic save can have written it
"""
    out = last_json(run_py(code, env=env_for(tmp_path, KWARM_LEARN="1", KWARM_LEARN_INTERVAL="0.2")))
    assert out == {"saved": True}
    assert len(json.loads((tmp_path / "manifest.json").read_text())["entries"]) == 1


def test_learn_all_records_during_warmup_but_not_replays_own_compiles(learned):
    _, _, manifest_path, tmp = learned
    before = manifest_path.read_text()
    proc = run_py(REPLAY, env=env_for(tmp, KWARM_LEARN="all", KWARM_LOG_LEVEL="DEBUG"))
    out = last_json(proc)
    assert out["replay"]["details"]["replayed"] == 10 and out["compiled_after"] == []
    assert "learning: 0 newly learned so far" in proc.stdout  # the detail line's  # replay's compiles are not "learned"
    assert manifest_path.read_text() == before  # nothing new: not rewritten


def test_a_second_learning_run_adds_only_what_is_new(learned, tmp_path):
    _, _, manifest_path, tmp = learned
    copy = tmp_path / "manifest.json"
    copy.write_text(manifest_path.read_text())
    code = REPLAY.replace("print(json.dumps(out))", """
import torch
rk.copy_kernel.warmup(torch.float16, torch.float16, 1024, BLOCK=32, grid=(1,))  # new in this run
print(json.dumps(out))""")
    env = env_for(tmp, KWARM_LEARN="1", KWARM_MANIFEST=str(copy))
    proc = run_py(code, env=env)
    assert last_json(proc)["compiled_after"] == []
    assert "kwarm: learned 1 new (14 in the manifest, exit save)" in proc.stdout
    assert len(json.loads(copy.read_text())["entries"]) == 12


VLLM_KERNELS = """
import json, os, sys
import torch
from vllm.v1.worker.block_table import _compute_slot_mapping_kernel as slot_mapping
from vllm.model_executor.layers.fla.ops.fused_gdn_prefill_post_conv import _fused_post_conv_kernel as post_conv
import replay_kernels as rk
rk.install_fake_driver()  # after the imports: vLLM's fla utils probe the device at import
from kwarm_ext import manifest_files
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.surfaces.triton import hook
from kwarm_ext.surfaces.triton import replay

def launch():
    i32, i64, bf, f32 = torch.int32, torch.int64, torch.bfloat16, torch.float32
    for num_tokens in (1, 5):
        slot_mapping.warmup(num_tokens, 2048, i32, i64, i32, 64, 16, i64, TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                            CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024, grid=(3,))
    for L in (1, 16):
        post_conv.warmup(bf, bf, bf, f32, f32, bf, bf, bf, f32, f32, 2048, 8, 8, 512, 512, 1024, L,
                         H=4, HV=8, K=128, V=128, APPLY_L2NORM=True, L2NORM_EPS=1e-6, OUTPUT_G_EXP=False,
                         SOFTPLUS_THRESHOLD=20.0, BLOCK_T=16, BK=128, BV=128, num_warps=4, num_stages=2,
                         grid=(1, 12))

path = sys.argv[1]
stamp = manifest_files.current_stamp(model="tiny", tp_size=1)
if not os.path.exists(path):
    recorder = learn.Recorder(("vllm.", "kwarm_ext."))
    hook.listen(recorder.on_compile)
    launch()
    manifest_files.save(path, stamp, recorder.take_unsaved())
    print(json.dumps({"recorded": recorder.recorded}))
else:
    state = replay.prepare(path, stamp, ("vllm.", "kwarm_ext."))
    state.threads = 4
    replay.compile_entries(state)
    with hook.capture() as compiled:
        launch()
    print(json.dumps({"replayed": len(state.compiled), "skipped": len(state.skipped), "compiled": len(compiled)}))
"""


def test_vllm_kernels_replay(tmp_path):
    env = env_for(tmp_path)
    code = VLLM_KERNELS.replace("sys.argv[1]", repr(str(tmp_path / "vllm.json")))
    # slot mapping: num_tokens is not specialized (one key); post-conv: L=1 is a constant (two)
    assert last_json(run_py(code, env=env)) == {"recorded": 3}
    assert last_json(run_py(code, env=env)) == {"replayed": 3, "skipped": 0, "compiled": 0}


class _Kernel:
    """Stands in for a CompiledKernel, whose ``_init_handles`` needs a GPU: records the
    thread that loaded it, and raises when told to."""

    def __init__(self, name, fail=False):
        self.name, self.fail, self.thread = name, fail, None

    def _init_handles(self):
        import threading

        self.thread = threading.current_thread().name
        if self.fail:
            raise RuntimeError(f"{self.name}: out of resources")


def test_load_step_runs_on_threads_and_reports_each_failure():
    from kwarm_ext.surfaces.triton import preload as triton_preload

    kernels = [_Kernel(f"k{i}", fail=(i == 2)) for i in range(6)]
    errors = triton_preload.init_handles_each(kernels, threads=4)
    assert [type(e).__name__ if e else None for e in errors] == [None, None, "RuntimeError", None, None, None]
    assert all(k.thread.startswith("kwarm-load") for k in kernels)


def test_load_step_falls_back_to_one_thread_when_a_thread_cannot_take_the_device(monkeypatch):
    """Pool threads take the caller's CUDA device first; where that fails (here for real:
    torch.cuda.set_device without a driver) every kernel loads in the caller's thread."""
    import threading

    from kwarm_ext.surfaces.triton import preload as triton_preload

    monkeypatch.setattr(triton_preload, "_current_cuda_device", lambda: 0)
    kernels = [_Kernel(f"k{i}") for i in range(3)]
    assert triton_preload.init_handles_each(kernels, threads=4) == [None, None, None]
    assert {k.thread for k in kernels} == {threading.current_thread().name}


def test_key_cache_seeding_reads_back_only_keys_that_print_the_same(monkeypatch):
    """``seed_key_cache`` on a stand-in JITFunction's ``device_caches`` (the current device
    comes from the GPU driver, stood in for)."""
    from kwarm_ext.surfaces.triton import compat as triton_compat
    from kwarm_ext.surfaces.triton import preload as triton_preload

    monkeypatch.setattr(triton_compat, "current_device", lambda: 0)
    jit = type("Jit", (), {})()
    jit.device_caches = {0: ({}, {}, "target", "backend", "binder")}
    plain = "[('*fp16', 'D'), ('i32', ''), ('constexpr', 64)]{'debug': False, 'num_warps': 4}"
    assert triton_preload.seed_key_cache(jit, plain) is True
    spec = (("*fp16", "D"), ("i32", ""), ("constexpr", 64))
    assert jit.device_caches[0][1] == {(spec, "{'debug': False, 'num_warps': 4}"): plain}
    function = "[('constexpr', '" + "a" * 64 + "')]{'debug': False}"
    for key in (function, "[('x', <object>)]{'debug': False}", "no options at all", "[('constexpr', 1.0e3)]{}"):
        assert triton_preload.seed_key_cache(jit, key) is False, key
    assert len(jit.device_caches[0][1]) == 1


def test_key_cache_seeding_reads_int_enum_and_dtype_constexprs(monkeypatch):
    """The two constexpr kinds vLLM's kernels pass that print as code: an IntEnum member
    (unified attention's KVQuantMode) and a triton.language dtype (fused MoE's compute_type).
    The launch's own specialization, with the real objects, finds the key."""
    import enum

    import triton.language as tl
    from kwarm_ext.surfaces.triton import compat as triton_compat
    from kwarm_ext.surfaces.triton import preload as triton_preload

    class Mode(enum.IntEnum):
        NONE = 0
        FP8 = 2

    monkeypatch.setattr(triton_compat, "current_device", lambda: 0)
    jit = type("Jit", (), {})()
    jit.device_caches = {0: ({}, {}, "target", "backend", "binder")}
    options = "{'debug': False, 'num_warps': 4}"
    launch = [("*bf16", "D"), ("constexpr", Mode.FP8), ("constexpr", tl.bfloat16), ("constexpr", -1.5)]
    key = str(launch) + options
    assert "<Mode.FP8: 2>" in key and "triton.language.bfloat16" in key
    assert triton_preload.seed_key_cache(jit, key) is True
    assert jit.device_caches[0][1][(tuple(launch), options)] == key
    other = [("*bf16", "D"), ("constexpr", Mode.NONE), ("constexpr", tl.bfloat16), ("constexpr", -1.5)]
    assert (tuple(other), options) not in jit.device_caches[0][1]
    for text in ("[('constexpr', triton.language.not_a_dtype)]", "[('constexpr', os.path.sep)]",
                 "[('constexpr', <Mode.FP8: x>)]", "[('constexpr', triton.language.bfloat16())]"):
        assert triton_preload.seed_key_cache(jit, text + options) is False, text
    assert len(jit.device_caches[0][1]) == 1


def test_a_failed_key_cache_seed_or_binder_priming_is_quiet_but_strict_raises(monkeypatch, kwarm_env):
    """Both are optimizations (the launch builds its key, the first launch primes the binder):
    the engine starts without them, but KWARM_STRICT (CI) must see a Triton layout change."""
    import types

    from kwarm_ext.surfaces.triton import replay
    from kwarm_ext.surfaces.triton import preload as triton_preload

    def broken(*args):
        raise AttributeError("JITFunction has no device_caches")

    monkeypatch.setattr(triton_preload, "settle", lambda job, result: ("kernel", None))
    monkeypatch.setattr(triton_preload, "seed_key_cache", broken)
    job = types.SimpleNamespace(label="vllm.k:kern", jit=None, key="key")
    kwarm_env()
    state = replay.ReplayState(path="m.json")
    replay._settle(state, job, "compiled")
    assert state.compiled == [("vllm.k:kern", "kernel")] and state.key_cache_seeded == 0
    assert replay._attempt(broken, "primed") == "not primed (AttributeError: JITFunction has no device_caches)"

    kwarm_env(KWARM_STRICT="1")
    with pytest.raises(AttributeError):
        replay._settle(replay.ReplayState(path="m.json"), job, "compiled")
    with pytest.raises(AttributeError):
        replay._attempt(broken, "primed")


PDL_LEARN = """
import dataclasses, json, torch
import replay_kernels as rk
rk.install_fake_driver()
from kwarm_ext.surfaces.triton import compat, hook
records = []
hook.listen(lambda kwargs: records.append(compat.describe_compile(kwargs)))
rk.pdl_kernel.warmup(torch.float16, torch.float16, 100, BLOCK=128, launch_pdl=True, grid=(1,))
print(json.dumps(dataclasses.asdict(records[0])))
"""

PDL_REPLAY = """
import json, os, types, triton
import replay_kernels as rk
rk.install_fake_driver()
from kwarm_ext.surfaces.triton import preload
with open(os.environ["PDL_RECORD"]) as f:
    record = json.load(f)
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
job = preload.preload_job("pdl", types.SimpleNamespace(jit=rk.pdl_kernel), record["key"], record["spec"],
                          record["launch_options"], lambda ref: None)
kernel = preload.preload(job)
print(json.dumps({"cache_hits": hits, "launch_pdl": kernel.metadata.launch_pdl,
                  "options": json.loads(job.spec_json)["options"]}))
"""


def test_a_replayed_kernel_with_a_launch_pdl_parameter_is_the_binary_its_launch_compiled(tmp_path):
    """vLLM passes ``launch_pdl=True`` to kernels with a ``launch_pdl`` constexpr: Triton reads it as
    the compiler option too, which the in-memory key does not show. The replay, in a fresh process on
    the same disk cache, must compile with it: a disk-cache hit, and a kernel that launches with PDL."""
    env = env_for(tmp_path)
    learned = last_json(run_py(PDL_LEARN, env=env))
    assert learned["launch_options"] == {"debug": False, "instrumentation_mode": ""}
    (tmp_path / "record.json").write_text(json.dumps(learned))
    replayed = last_json(run_py(PDL_REPLAY, env={**env, "PDL_RECORD": str(tmp_path / "record.json")}))
    assert (replayed["cache_hits"], replayed["launch_pdl"]) == ([True], True)
    assert replayed["options"]["launch_pdl"] is True


def test_options_named_by_parameters_are_allow_listed_in_range_constexprs_the_key_does_not_name():
    from kwarm_ext.surfaces.triton import preload

    spec = {"signature": {"x_ptr": "*fp16", "n": "i32", "launch_pdl": "constexpr", "num_warps": "constexpr",
                          "BLOCK": "constexpr"},
            "constant_keys": [[2], [3], [4]], "constant_vals": [True, 3, 128]}
    assert preload.options_named_by_parameters(spec, {"debug": False}) == {"launch_pdl": True}, \
        "num_warps=3 is out of range, BLOCK is no option"
    assert preload.options_named_by_parameters(spec, {"launch_pdl": False}) == {}, "the key's own option wins"
    spec["constant_vals"] = ["yes", 4, 128]
    assert preload.options_named_by_parameters(spec, {}) == {"num_warps": 4}
