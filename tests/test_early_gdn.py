"""FlashInfer's SM90 GDN prefill kernels compiled at launch on the CPU (kwarm_ext/early_gdn.py): what
vLLM's own backend choice and warmup imply, per release and backend choice; the real compile of
FlashInfer 0.7.2's CuTe DSL kernels with no CUDA device, written in the ``cute_dsl`` family's format
and for CUDA tensors; the hand-over to the engine (a summary file, waited for), and the family
loading them before the profile run."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import types

import pytest

from conftest import RELEASES_DIR, clean_env, required, run_py
from kwarm_ext import early_builds, early_gdn
from kwarm_ext.kernels import cute_dsl

FLASHINFER_072 = RELEASES_DIR / "flashinfer-0.7.2"

TINY = {"head_k_dim": 128, "head_v_dim": 128, "num_k_heads": 2, "num_v_heads": 4, "dtype": "bfloat16",
        "mamba_cache_mode": "align", "additional_config": {}}


def _qwen3_next(tp=1, cache_mode="align", additional=None):
    hf = types.SimpleNamespace(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, num_attention_heads=16)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=hf, dtype="torch.bfloat16", use_mla=False, runner_type="generate"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        cache_config=types.SimpleNamespace(mamba_cache_mode=cache_mode), additional_config=additional or {})


def test_the_facts_are_the_gdn_layers_dimensions_per_rank_and_the_variants_vllms_warmup_makes():
    facts = early_gdn.config_facts(_qwen3_next(tp=2))
    assert facts == {"head_k_dim": 128, "head_v_dim": 128, "num_k_heads": 8, "num_v_heads": 16, "dtype": "bfloat16",
                     "mamba_cache_mode": "align", "additional_config": {}}
    assert early_gdn.config_facts(types.SimpleNamespace(model_config=types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_attention_heads=128)))) is None, "no GDN layers: no facts"
    # vLLM 0.33's _warmup_flashinfer_prefill_variants: CP and not, with checkpoints where align mode exports them
    assert early_gdn.variants(facts) == [(True, False), (True, True), (False, False), (False, True)]
    assert early_gdn.variants(dict(facts, mamba_cache_mode="none")) == [(True, False), (False, False)]


# vLLM's CUDA platform module loads vLLM's compiled extension, which a CPU-only install lacks
STUB_EXTENSION = """
import sys, types
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
"""
PREDICT = STUB_EXTENSION + """
import json, sys
from kwarm_ext import early_gdn
facts = json.loads(sys.argv[1])
cases = {
    "h100": early_gdn.reason(facts, [(9, 0)]),
    "triton asked": early_gdn.reason(dict(facts, additional_config={"gdn_prefill_backend": "triton"}), [(9, 0)]),
    "blackwell": early_gdn.reason(facts, [(10, 0)]),
    "mixed": early_gdn.reason(facts, [(9, 0), (8, 0)]),
    "no gdn": early_gdn.reason(None, [(9, 0)]),
}
print(json.dumps(cases))
"""


def _reasons(release, extra_path=None):

    env = clean_env(PYTHONPATH=extra_path) if extra_path is not None else None
    proc = run_py(PREDICT.replace("json.loads(sys.argv[1])", repr(TINY)), release=release, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_033s_own_backend_choice_decides_and_only_flashinfers_sm90_cute_dsl_prefill_is_compiled():
    got = _reasons("0.33.0")  # the venv's FlashInfer (0.6.12): no SM90 GDN prefill in CuTe DSL
    assert got["h100"] == "this FlashInfer has no SM90 GDN prefill in CuTe DSL"
    assert got["triton asked"] == "vLLM picks the triton GDN prefill backend"
    assert got["blackwell"].startswith("FlashInfer's SM90 GDN prefill only")
    assert got["mixed"].startswith("FlashInfer's SM90 GDN prefill only")
    assert got["no gdn"] == "no GDN layers"
    assert _reasons("0.33.0", _flashinfer_072())["h100"] is None


def _flashinfer_072() -> str:
    """PYTHONPATH for FlashInfer 0.7.2 and its CuTe DSL (the folder its ``.pth`` names, which a
    ``--target`` install does not process), ahead of the venv's own."""
    if not (FLASHINFER_072 / ".complete").exists():
        if required():
            pytest.fail("FlashInfer 0.7.2 not fetched (tests/run.sh fetches it)")
        pytest.skip("FlashInfer 0.7.2 not fetched (run tests/run.sh)")
    return os.pathsep.join([str(FLASHINFER_072 / "nvidia_cutlass_dsl" / "dsl_packages"), str(FLASHINFER_072)])


COMPILE = STUB_EXTENSION + """
import json, os, sys
from kwarm_ext import early_gdn
folder, facts = sys.argv[1], json.loads(sys.argv[2])
lines = []
first = early_gdn.run(facts, (9, 0), folder, lines.append)
del sys.modules["flashinfer.gdn_prefill"]
second = early_gdn.run(facts, (9, 0), folder, lines.append)
again = "flashinfer.gdn_prefill" in sys.modules
marker = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("compiled-")][0]
keys = json.load(open(marker))["keys"]
one = os.path.join(json.load(open(marker))["folder"], keys[0])
os.rename(one, one + ".away")  # as if another stack's save removed them
after_removal = early_gdn.compiled_before(marker)
os.rename(one + ".away", one)
print(json.dumps({"first": first, "second": second, "lines": lines, "flashinfer_gdn_imported_again": again,
                  "after_removal": after_removal, "keys": len(keys)}))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """FlashInfer 0.7.2's SM90 GDN prefill kernels at tiny Qwen3-Next's dimensions, compiled by
    early_gdn.run in a process with no CUDA device (vLLM 0.33.0), then asked again."""
    folder = tmp_path_factory.mktemp("early")

    env = clean_env(PYTHONPATH=_flashinfer_072(), CUDA_VISIBLE_DEVICES="")
    code = COMPILE.replace("sys.argv[1], json.loads(sys.argv[2])", f"{str(folder)!r}, {TINY!r}")
    proc = run_py(code, release="0.33.0", env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kernels_vllms_warmup_compiles_are_compiled_on_the_cpu_once(compiled):
    folder, got = compiled
    assert got["first"]["compiled"] == 7 and got["first"]["saved"] == 7, got
    assert [line.split(":")[0] for line in got["lines"]] == ["CP", "CP, checkpoints", "fused", "fused, checkpoints"]
    keys = [json.loads(p.read_text()) for p in folder.glob("flashinfer_gdn/*/kwarm_cute_*.json")]
    kernels = sorted(k["kernel"] for k in keys)
    assert kernels == ["CPDeltaRuleFixupSimtSm90", "CPDeltaRuleMNPrecomputeSm90", "CPDeltaRulePrefillSm90",
                       "CPDeltaRulePrefillSm90", "CPDeltaRuleTPrecomputeSm90", "_FullyFusedDeltaRuleSm90",
                       "_FullyFusedDeltaRuleSm90"]
    for key in keys:  # FlashInfer's own options: TVM FFI, sm_90a
        assert ["sm_90a"] == [opt[1] for opt in key["key"][1] if opt[0] == {"class": "cutlass.base_dsl.compiler:GPUArch"}]
    assert got["second"]["skipped"] == "compiled before" and not got["flashinfer_gdn_imported_again"]
    assert got["keys"] == 7 and got["after_removal"] is False, "files gone: compiled again"


def test_the_kernels_take_cuda_tensors_as_the_engines_own_compile_makes_them(compiled):
    """The DSL's TVM FFI wrapper checks its arguments' device: compiled from CPU tensors as they are,
    it would refuse the engine's CUDA tensors."""
    folder, _ = compiled
    objects = list(folder.glob("flashinfer_gdn/*/kwarm_cute_*.o"))
    assert len(objects) == 7
    for path in objects:
        data = path.read_bytes()
        assert b"expected device_type=cuda" in data and b"expected device_type=cpu" not in data, path.name


def test_start_hands_the_engine_the_folder_and_the_summary_to_wait_for(monkeypatch, tmp_path):
    for name in (early_builds.STARTED_ENV, early_gdn.EARLY_ENV):  # set by start(): removed again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("KWARM_MANIFEST", str(tmp_path / "m.json"))
    monkeypatch.setattr(early_builds.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(early_builds, "visible_capabilities", lambda: [(9, 0)])
    started = []

    class Popen:
        def __init__(self, argv, env, **kwargs):
            started.append(json.loads(argv[4]))
            self.pid = 4244

    monkeypatch.setattr(early_builds.subprocess, "Popen", Popen)
    from kwarm_ext import config

    config.reset()  # KWARM_MANIFEST read again
    assert early_builds.start(_qwen3_next()).pid == 4244
    payload, = started
    assert payload["facts"]["gdn"]["num_v_heads"] == 32
    early = json.loads(os.environ[early_gdn.EARLY_ENV])
    assert early == dict(payload["early"], pid=4244)
    assert early["folder"] == str(tmp_path / "cute_dsl_early") and early["done"].startswith(early["folder"] + "/.done-")

    # without the family that would load them, nothing is compiled for it
    monkeypatch.delenv(early_builds.STARTED_ENV)
    monkeypatch.delenv(early_gdn.EARLY_ENV)
    monkeypatch.setenv("KWARM_WARMUPS", "-cute_dsl")
    config.reset()
    assert early_builds.start(_qwen3_next()).pid == 4244
    assert "early" not in started[-1] and early_gdn.EARLY_ENV not in os.environ
    config.reset()


def test_the_background_process_always_tells_the_engine_it_is_done(monkeypatch, tmp_path, capsys):
    """Predicted or not, compiled or failed: the summary file is written, so the engine stops waiting."""
    early = {"folder": str(tmp_path), "done": str(tmp_path / ".done-1.json")}
    facts = {"runner_type": "generate", "use_mla": False, "heads_per_rank": 16, "nope_rope": [None, None],
             "gdn": dict(TINY, additional_config={"gdn_prefill_backend": "triton"})}
    monkeypatch.setattr(early_builds, "_sampler_reason", lambda facts, caps: "not here")
    monkeypatch.setattr(early_gdn, "reason", lambda facts, caps, ask_vllm=True: "vLLM picks the triton GDN prefill backend")
    payload = {"facts": facts, "capabilities": [[9, 0]], "early": early}
    assert early_builds.main(["--predict", json.dumps(payload)]) == 0
    assert json.loads((tmp_path / ".done-1.json").read_text()) == {
        "compiled": 0, "not": "gdn_prefill: vLLM picks the triton GDN prefill backend"}

    os.unlink(early["done"])
    monkeypatch.setattr(early_gdn, "reason", lambda facts, caps, ask_vllm=True: None)
    monkeypatch.setattr(early_gdn, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("MLIR says no")))
    assert early_builds.main(["--predict", json.dumps(payload)]) == 1
    assert json.loads((tmp_path / ".done-1.json").read_text())["failed"] == "RuntimeError: MLIR says no"
    err = capsys.readouterr().err
    assert "gdn_prefill failed, vLLM compiles its kernels in its profile run: RuntimeError: MLIR says no" in err


def test_the_engine_waits_for_the_summary_and_not_for_a_process_that_ended_without_one(tmp_path):
    early = {"folder": str(tmp_path), "done": str(tmp_path / ".done-2.json"), "pid": os.getpid()}
    timer = threading.Timer(0.5, lambda: early_gdn.finish(early, {"compiled": 7}))
    timer.start()
    t0 = time.monotonic()
    assert cute_dsl.wait_early(early, 30) == {"compiled": 7} and 0.4 < time.monotonic() - t0 < 5
    gone = dict(early, done=str(tmp_path / ".done-3.json"), pid=2 ** 22 + 12345)
    t0 = time.monotonic()
    assert cute_dsl.wait_early(gone, 30) is None and time.monotonic() - t0 < 1
    assert cute_dsl.wait_early(dict(gone, pid=os.getpid()), 0.3) is None, "still running past the limit"
