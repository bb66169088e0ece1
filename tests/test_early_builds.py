"""FlashInfer's builds started at launch (kwarm_ext/early_builds.py): which ones vLLM's selection
logic implies, per release and backend choice; that the background build targets exactly what the
engine's own call builds (same workspace folder, same ninja file) without a CUDA device; and how
the background process reports."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types

import pytest

from conftest import run_py
from kwarm_ext import early_builds

PREDICT = """
import json, sys, types
from kwarm_ext import early_builds

def config(mla=False, heads=128, nope=128, rope=64, tp=1, runner="generate"):
    hf = types.SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=mla, hf_text_config=hf, runner_type=runner),
                                 parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))

def off():
    import os
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    try:
        return early_builds.predict(config(), [(9, 0)])
    finally:
        del os.environ["VLLM_USE_FLASHINFER_SAMPLER"]

cases = {
    "h100": early_builds.predict(config(), [(9, 0)]),
    "h100 off": off(),
    "pascal": early_builds.predict(config(), [(6, 0)]),
    "pooling": early_builds.predict(config(runner="pooling"), [(9, 0)]),
    "dsv32": early_builds.predict(config(mla=True), [(9, 0)]),
    "dsv32 tp2": early_builds.predict(config(mla=True, tp=2), [(9, 0)]),
    "no gpu": early_builds.predict(config(), []),
}
print(json.dumps({k: [[b.name for b in builds], why] for k, (builds, why) in cases.items()}))
"""


def _predict(release):
    proc = run_py(PREDICT, release=release)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_033_predicts_the_sampler_where_vllm_would_use_flashinfers_and_concat_mla_where_its_layers_call_it():
    got = _predict("0.33.0")
    assert got["h100"][0] == ["sampling"]
    assert got["h100 off"][0] == [] and "VLLM_USE_FLASHINFER_SAMPLER=0" in got["h100 off"][1][0]
    assert got["pooling"][0] == [] and "does not generate" in got["pooling"][1][0]
    assert got["dsv32"][0] == ["sampling", "concat_mla"]
    assert got["dsv32 tp2"][0] == ["sampling"] and "64 heads per rank" in got["dsv32 tp2"][1][-1]
    assert got["no gpu"] == [[], ["no NVIDIA GPU visible"]]


def test_024_checks_the_gpu_against_flashinfers_attention_backend_and_020_has_no_flashinfer_sampler_check():
    got = _predict("0.24.0")
    assert got["h100"][0] == ["sampling"] and got["dsv32"][0] == ["sampling", "concat_mla"]
    assert got["pascal"][0] == [] and "6.0 unsupported" in got["pascal"][1][0]
    old = _predict("0.20.0")
    assert old["h100"][0] == [] and "no FlashInfer sampler check" in old["h100"][1][0]


TARGET = """
import os, sys, json
if sys.argv[1] == "device":  # what an engine process sees: one H100, no arch list
    import torch
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
from flashinfer.jit import env as jit_env
from flashinfer.jit.sampling import gen_sampling_module
spec = gen_sampling_module()
spec.write_ninja()
print(json.dumps({"dir": str(jit_env.FLASHINFER_WORKSPACE_DIR), "ninja": spec.ninja_path.read_text()}))
"""


def test_the_background_build_targets_what_the_engines_own_call_builds(tmp_path):
    """The engine's process detects its GPUs; the background one gets FLASHINFER_CUDA_ARCH_LIST from
    NVML and sees no device: the same workspace folder (so the same file lock) and the same ninja file
    (so ninja finds the module up to date), with the real FlashInfer."""
    pytest.importorskip("flashinfer")
    base = {"FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    from conftest import clean_env

    out = {}
    for how, extra in (("device", {}), ("early", {"CUDA_VISIBLE_DEVICES": "", "FLASHINFER_CUDA_ARCH_LIST":
                                                    early_builds.arch_list([(9, 0)])})):
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TARGET), how], capture_output=True, text=True,
                              env=clean_env(**base, **extra), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[how] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"]["dir"] == out["early"]["dir"] and out["early"]["dir"].endswith("90a")
    assert out["device"]["ninja"] == out["early"]["ninja"] and "sm_90a" in out["early"]["ninja"]
    assert early_builds.arch_list([(9, 0), (8, 0), (9, 0)]) == "8.0 9.0"


def test_start_runs_one_background_process_without_a_cuda_device_once_per_process_tree(monkeypatch):
    monkeypatch.delenv(early_builds.STARTED_ENV, raising=False)
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(early_builds.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(early_builds, "visible_capabilities", lambda: [(9, 0)])
    started = []

    class Popen:
        def __init__(self, argv, env, **kwargs):
            started.append((argv, env, kwargs))
            self.pid = 4242

    monkeypatch.setattr(early_builds.subprocess, "Popen", Popen)
    monkeypatch.setattr(early_builds, "predict", lambda *a: pytest.fail("predicted in the API server: its imports hold it back"))
    hf = types.SimpleNamespace(num_attention_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64)
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=True, hf_text_config=hf, runner_type="generate"),
                                   parallel_config=types.SimpleNamespace(tensor_parallel_size=2))
    assert early_builds.start(config).pid == 4242
    (argv, env, kwargs), = started
    assert argv[1:4] == ["-m", "kwarm_ext.early_builds", "--predict"]
    assert json.loads(argv[4]) == {"facts": {"runner_type": "generate", "use_mla": True, "heads_per_rank": 64,
                                             "nope_rope": [128, 64], "gdn": None}, "capabilities": [[9, 0]]}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0"
    assert env["KWARM_ENABLE"] == "0", "the background process must not activate kwarm (deep_gemm's processes)"
    assert kwargs["start_new_session"] is True
    assert early_builds.start(types.SimpleNamespace()) is None and len(started) == 1, "once: the marker is inherited"


def test_the_background_process_builds_under_the_specs_lock_and_says_each_outcome(monkeypatch, capsys):
    calls = []

    class Spec:
        name = "sampling"

        def build(self, verbose, need_lock=False):
            calls.append((verbose, need_lock))

    module = types.ModuleType("kwarm_test_early_spec")
    module.good = Spec
    module.bad = lambda: (_ for _ in ()).throw(RuntimeError("nvcc not found"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    items = [{"name": "sampling", "spec": f"{module.__name__}:good"}, {"name": "other", "spec": f"{module.__name__}:bad"}]
    assert early_builds.main([json.dumps(items)]) == 1
    assert calls == [(False, True)], "FlashInfer's own file lock: vLLM's call waits for this build"
    err = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]  # vLLM's prefix, time included
    assert err[0].startswith("kwarm: early FlashInfer build: sampling ready in")
    assert err[1] == ("kwarm: early FlashInfer build: other failed, vLLM builds it when it needs it: "
                      "RuntimeError: nvcc not found")


def test_the_background_process_predicts_from_the_launch_facts_says_what_and_builds_it(monkeypatch, capsys):
    """`start` hands the process the configuration's facts; it predicts there (vLLM's and FlashInfer's
    imports off the API server's path), names the builds and what was not predicted, then builds."""
    built = []
    monkeypatch.setattr(early_builds, "build", lambda spec: built.append(spec) or f"{spec} ready in 0.0 s")
    monkeypatch.setattr(early_builds, "_sampler_reason", lambda facts, caps: None)
    facts = {"runner_type": "generate", "use_mla": True, "heads_per_rank": 64, "nope_rope": [128, 64]}
    payload = json.dumps({"facts": facts, "capabilities": [[9, 0]]})
    assert early_builds.main(["--predict", payload]) == 0
    assert built == [early_builds.SAMPLING.spec]
    lines = capsys.readouterr().err.splitlines()
    assert re.match(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[kwarm early_builds.py\] ", lines[0]), lines[0]
    err = [line.split("] ", 1)[1] for line in lines]
    assert err[0] == ("kwarm: early FlashInfer builds: sampling (not: concat_mla: 64 heads per rank, nope/rope "
                      "128/64 (vLLM calls it at 128, 128/64))")
    assert err[1].startswith("kwarm: early FlashInfer build: flashinfer.jit.sampling:gen_sampling_module ready")
    facts["heads_per_rank"] = 128
    assert early_builds.main(["--predict", json.dumps({"facts": facts, "capabilities": [[9, 0]]})]) == 0
    assert built[1:] == [early_builds.SAMPLING.spec, early_builds.CONCAT_MLA.spec]


def test_the_config_process_does_not_ask_again_for_the_build_started_at_launch(monkeypatch, capsys):
    """With the sampling build running since launch, the engine config's process builds what the
    layers imply and never asks the sampler's selection logic (seconds of vLLM and FlashInfer
    imports, for a build it would skip)."""
    built = []
    monkeypatch.setattr(early_builds, "build", lambda spec: built.append(spec) or f"{spec} ready in 0.0 s")

    def asked(facts, caps):
        raise AssertionError("the sampler's selection logic was asked for a build started at launch")

    monkeypatch.setattr(early_builds, "_sampler_reason", asked)
    facts = {"runner_type": "generate", "use_mla": True, "heads_per_rank": 128, "nope_rope": [128, 64]}
    payload = {"facts": facts, "capabilities": [[9, 0]], "started": ["sampling"]}
    assert early_builds.main(["--predict", json.dumps(payload)]) == 0
    assert built == [early_builds.CONCAT_MLA.spec]
    first = capsys.readouterr().err.splitlines()[0].split("] ", 1)[1]
    assert first == "kwarm: early FlashInfer builds: concat_mla (not: sampling: started at launch)"


class _Popen:
    """subprocess.Popen's stand-in: records what would have started."""

    started: list = []

    def __init__(self, argv, env, **kwargs):
        self.started.append((argv, env, kwargs))
        self.pid = 4243


def _dsv32(tp=1):
    hf = types.SimpleNamespace(num_attention_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=True, hf_text_config=hf, runner_type="generate"),
                                 parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))


def test_vllm_serve_starts_the_sampling_build_at_launch_and_the_config_adds_only_what_its_layers_imply(monkeypatch):
    """As `vllm serve` starts (before vLLM's imports and engine config) one background process gets
    the sampling build, reading the GPUs itself; once the config is made, a second process starts only
    for a build the model's layers imply (concat_mla), told that sampling started already; a model
    without one starts nothing more. Help, other commands and the engine's processes start nothing."""
    monkeypatch.delenv(early_builds.STARTED_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(early_builds.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(early_builds, "visible_capabilities", lambda: [(9, 0)])
    monkeypatch.setattr(early_builds.subprocess, "Popen", _Popen)
    _Popen.started = []
    assert early_builds.start_at_launch(["/venv/bin/vllm", "serve", "m", "--help"]) is None
    assert early_builds.start_at_launch(["/venv/bin/vllm", "bench", "serve"]) is None
    assert _Popen.started == [] and early_builds.STARTED_ENV not in early_builds.os.environ
    assert early_builds.start_at_launch(["/venv/bin/vllm", "serve", "m", "--runner", "pooling"]) is None
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    assert early_builds.start_at_launch(["/venv/bin/vllm", "serve", "m"]) is None
    assert _Popen.started == [] and early_builds.STARTED_ENV not in early_builds.os.environ
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    assert early_builds.start_at_launch(["/venv/bin/vllm", "serve", "m"]).pid == 4243
    (argv, env, _), = _Popen.started
    assert json.loads(argv[4]) == {"facts": {"runner_type": "generate"}, "capabilities": None, "visible": "3"}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["KWARM_ENABLE"] == "0"
    assert early_builds.os.environ[early_builds.STARTED_ENV] == early_builds.LAUNCH
    assert early_builds.start_at_launch(["/venv/bin/vllm", "serve", "m"]) is None, "once per process tree"

    # the engine config of a model without concat_mla: nothing more starts
    plain = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=False, hf_text_config=None,
                                                                      runner_type="generate"))
    assert early_builds.start(plain) is None and len(_Popen.started) == 1
    assert early_builds.start(_dsv32()) is None, "done: the engine's processes start nothing"
    # DeepSeek-V3.2: concat_mla, sampling skipped
    monkeypatch.setenv(early_builds.STARTED_ENV, early_builds.LAUNCH)
    assert early_builds.start(_dsv32()).pid == 4243
    payload = json.loads(_Popen.started[-1][0][4])
    assert payload["started"] == ["sampling"] and payload["capabilities"] == [[9, 0]]


def test_the_launch_process_reads_the_servers_gpus_builds_the_sampler_at_once_and_checks_it(monkeypatch, capsys):
    """Started at launch, the background process reads the capabilities of the GPUs the server sees
    (its own CUDA_VISIBLE_DEVICES is empty: no CUDA context), sets FlashInfer's arch list from them,
    starts the sampling build before vLLM's selection logic is imported, and says what that logic
    makes of it; the model's builds wait for its config."""
    seen, events = [], []
    monkeypatch.setattr(early_builds, "host_capabilities", lambda: None)  # vLLM's platform reads them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(early_builds, "visible_capabilities",
                        lambda: seen.append(early_builds.os.environ.get("CUDA_VISIBLE_DEVICES")) or [(9, 0)])
    started = __import__("threading").Event()

    def build(spec):
        events.append(("build", spec))
        started.set()
        return "sampling ready in 0.0 s"

    def sampler_reason(facts, caps):
        assert started.wait(10), "the build starts before vLLM's selection logic is asked"
        events.append(("predict", facts["runner_type"]))
        return verdict

    monkeypatch.setattr(early_builds, "build", build)
    monkeypatch.setattr(early_builds, "_sampler_reason", sampler_reason)
    monkeypatch.setattr(early_builds, "already_built", lambda spec: False)
    verdict = None
    payload = {"facts": {"runner_type": "generate"}, "capabilities": None, "visible": "2,3"}
    assert early_builds.main(["--predict", json.dumps(payload)]) == 0
    assert seen == ["2,3"] and early_builds.os.environ["CUDA_VISIBLE_DEVICES"] == "", "read as the server sees them"
    assert early_builds.os.environ["FLASHINFER_CUDA_ARCH_LIST"] == "9.0"
    assert events == [("build", early_builds.SAMPLING.spec), ("predict", "generate")]
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == ["kwarm: early FlashInfer builds: sampling, started at launch; vLLM's sampler check calls it here",
                     "kwarm: early FlashInfer build: sampling ready in 0.0 s"]
    # vLLM's logic disagrees: the line says so (the build is background CPU only); unset in the server: unset
    verdict = "compute capability 7.0 unsupported"
    payload["visible"] = None
    started.clear()
    early_builds.main(["--predict", json.dumps(payload)])
    assert seen[-1] is None and early_builds.os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert capsys.readouterr().err.splitlines()[0].split("] ", 1)[1] == (
        "kwarm: early FlashInfer builds: sampling, started at launch, though vLLM will not call it here "
        "(compute capability 7.0 unsupported): background CPU only")
    # a restart: FlashInfer's cache holds the module; nothing built, vLLM's logic not imported
    monkeypatch.setattr(early_builds, "already_built", lambda spec: spec == early_builds.SAMPLING.spec)
    events.clear()
    assert early_builds.main(["--predict", json.dumps(payload)]) == 0
    assert events == []
    assert capsys.readouterr().err.split("] ", 1)[1].strip() == (
        "kwarm: early FlashInfer builds: none, sampling is built already (FlashInfer's cache)")
    # no GPU: nothing built
    monkeypatch.setattr(early_builds, "visible_capabilities", lambda: [])
    assert early_builds.main(["--predict", json.dumps(payload)]) == 0
    assert capsys.readouterr().err.split("] ", 1)[1].strip() == "kwarm: early FlashInfer builds: none (not: sampling: no NVIDIA GPU visible)"


def test_the_launch_process_reads_a_uniform_hosts_gpus_through_nvml_alone(monkeypatch):
    """On a host whose GPUs share one capability, the launch process takes it from NVML
    (milliseconds) without importing vLLM's platform (torch and vLLM: seconds before the build could
    start); a host of mixed GPUs, an empty CUDA_VISIBLE_DEVICES or no NVML asks vLLM's platform,
    which maps the variable as the engine will."""
    calls = []

    class FakeNVML(types.ModuleType):
        caps = [(9, 0), (9, 0)]

        def nvmlInit(self):
            calls.append("init")

        def nvmlShutdown(self):
            calls.append("shutdown")

        def nvmlDeviceGetCount(self):
            return len(self.caps)

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetCudaComputeCapability(self, handle):
            return self.caps[handle]

    nvml = FakeNVML("pynvml")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(early_builds, "visible_capabilities", lambda: ["from vLLM's platform"])
    assert early_builds.host_capabilities() == [(9, 0), (9, 0)] and calls == ["init", "shutdown"]
    assert early_builds.capabilities_of("0,1") == [(9, 0)]
    assert early_builds.capabilities_of(None) == [(9, 0)]
    assert early_builds.capabilities_of("") == ["from vLLM's platform"], "empty: vLLM's reading of it"
    nvml.caps = [(9, 0), (8, 0)]
    assert early_builds.capabilities_of("1") == ["from vLLM's platform"], "mixed GPUs: vLLM maps the entries"
    nvml.caps = []
    assert early_builds.capabilities_of(None) == ["from vLLM's platform"]

    def broken(self):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(FakeNVML, "nvmlInit", broken)
    assert early_builds.host_capabilities() is None
    assert early_builds.capabilities_of("0") == ["from vLLM's platform"]


def test_activation_starts_the_launch_build_only_in_vllms_server_process(monkeypatch):
    from kwarm_ext import activation, config

    calls = []
    monkeypatch.setattr(early_builds, "start_at_launch", lambda: calls.append(list(activation.sys.argv)))
    monkeypatch.delenv(early_builds.STARTED_ENV, raising=False)
    settings = config.parse({}, known_families=("flashinfer_jit",))
    for argv in (["/venv/bin/python", "-c", "pass"], ["/venv/bin/vllm", "serve", "m"]):
        monkeypatch.setattr(activation.sys, "argv", argv)
        activation._start_early_builds(settings)
    assert calls == [["/venv/bin/vllm", "serve", "m"]]
    monkeypatch.setenv(early_builds.STARTED_ENV, "1")  # an engine process: inherited
    activation._start_early_builds(settings)
    assert len(calls) == 1
    monkeypatch.delenv(early_builds.STARTED_ENV)
    activation._start_early_builds(config.parse({"KWARM_WARMUPS": "-flashinfer_jit"}, known_families=("flashinfer_jit",)))
    assert len(calls) == 1, "KWARM_WARMUPS=-flashinfer_jit: nothing"


def test_serve_launches_are_vllms_server_commands_only():
    from kwarm_ext import activation, config

    yes = (["/v/bin/vllm", "serve", "m"], ["/v/lib/vllm/entrypoints/cli/main.py", "serve", "m"],
           ["/v/lib/vllm/entrypoints/openai/api_server.py", "--model", "m"])
    no = (["/v/bin/vllm", "serve", "m", "-h"], ["/v/bin/vllm", "chat"], ["/v/app/main.py", "serve"],
          ["/v/bin/python", "-c", "pass"], [])
    assert [early_builds.serve_launch(a) for a in yes] == [True] * 3
    assert [early_builds.serve_launch(a) for a in no] == [False] * 5
    assert early_builds.launch_runner(["vllm", "serve", "m", "--convert=embed"]) == "pooling"
    assert early_builds.launch_runner(["vllm", "serve", "m", "--convert", "none"]) == "generate"
    assert config.SERVE_PROGRAMS == ("vllm", "main.py", "api_server.py", "-m")
    # python -m: while the module is located, argv[0] is "-m"; the interpreter's command line names it
    located = early_builds.launch_argv(["-m", "serve", "m"], ["/v/bin/python3", "-X", "utf8", "-m",
                                                              "vllm.entrypoints.cli.main", "serve", "m", "--port", "1"])
    assert located == ["vllm/entrypoints/cli/main.py", "serve", "m", "--port", "1"]
    assert early_builds.serve_launch(located)
    assert early_builds.serve_launch(early_builds.launch_argv(["-m"], ["python", "-m", "vllm.entrypoints.openai.api_server"]))
    assert not early_builds.serve_launch(early_builds.launch_argv(["-m"], ["python", "-m", "vllm.entrypoints.cli.main", "bench"]))
    assert early_builds.launch_argv(["/v/bin/vllm", "serve"], ["whatever"]) == ["/v/bin/vllm", "serve"]
    assert "config.SERVE_PROGRAMS" in open(activation.__file__).read(), \
        "activation reads the same names before importing early_builds"


def test_each_build_says_its_line_as_it_ends(monkeypatch):
    """The start's milestones read a build's time from its line: the sampling module's is written
    before the next build begins, not after all of them."""
    written = []
    monkeypatch.setattr(early_builds, "say", written.append)
    monkeypatch.setattr(early_builds, "build",
                        lambda spec: f"{spec} ready in 0.0 s, after {len(written)} line(s)")
    items = [{"name": "sampling", "spec": "a"}, {"name": "concat_mla", "spec": "b"}]
    assert early_builds.main([json.dumps(items)]) == 0
    assert written == ["kwarm: early FlashInfer build: a ready in 0.0 s, after 0 line(s)",
                       "kwarm: early FlashInfer build: b ready in 0.0 s, after 1 line(s)"]


def test_the_engine_processes_gpus_are_those_vllms_platform_counts_and_can_read(monkeypatch):
    """Where the launch cannot read a uniform host from NVML, vLLM's platform says which GPUs the
    engine will see (``device_count``, every release 0.20-0.34) and what each is; a GPU whose
    capability it cannot read is left out, and a platform that is not CUDA has none."""
    import vllm.platforms

    class Platform:  # a CUDA platform: none exists on this machine
        cuda = True

        def is_cuda(self):
            return self.cuda

        def device_count(self):
            return 3

        def get_device_capability(self, i):
            return None if i == 1 else types.SimpleNamespace(major=9 if i == 0 else 10, minor=0)

    platform = Platform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    assert early_builds.visible_capabilities() == [(9, 0), (10, 0)]
    platform.cuda = False
    assert early_builds.visible_capabilities() == []


def test_a_module_in_flashinfers_cache_counts_as_built(monkeypatch):
    """`already_built` asks the spec FlashInfer's own question (its library's path exists); a spec
    that cannot answer counts as not built, and the build runs as before."""
    class Spec:
        is_compiled = True

    module = types.ModuleType("kwarm_test_built_spec")
    module.built, module.fresh = Spec, lambda: types.SimpleNamespace(is_compiled=False)
    module.broken = lambda: (_ for _ in ()).throw(RuntimeError("no CUDA arch"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert early_builds.already_built(f"{module.__name__}:built") is True
    assert early_builds.already_built(f"{module.__name__}:fresh") is False
    assert early_builds.already_built(f"{module.__name__}:broken") is False
