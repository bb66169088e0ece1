"""``kwarm doctor`` on this CPU machine, against the installed vLLM and other releases' files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, cpu_triton_env, run_py

DOCTOR_JSON = "import sys; from kwarm_ext import cli; sys.exit(cli.main(['doctor', '--json']))"


def doctor(env, release=None, status=0):
    proc = run_py(DOCTOR_JSON, env=env, release=release)
    assert proc.returncode == status, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # stdout holds the JSON alone (vLLM's log lines go to stderr)


def test_doctor_reports_installed_doors_and_hook_target():
    r = doctor(clean_env(KWARM_ENABLE="1", KWARM_WARMUPS="qwen_gdn,-runner", CUDA_VISIBLE_DEVICES=""))
    assert r["versions"]["vllm"] == "0.24.0" and r["versions"]["triton"] and r["versions"]["torch"]
    assert r["doors"][".pth"]["installed"] and r["doors"][".pth"]["would_fire"]
    assert r["doors"][".pth"]["note"] == "opens at the first import of flashinfer, triton, vllm"
    assert r["active_in_this_process"] is True  # the door opened at the doctor's import of vLLM
    assert r["doors"]["vllm.general_plugins"]["would_fire"]
    assert r["doors"]["kwarm run (sitecustomize)"]["would_fire"] is False  # not under `kwarm run`
    assert r["hook_target"]["found"] is True and r["hook_target"]["patched"] is True
    assert r["hook_target"]["after_capture"] == {"attribute": "Worker.compile_or_warm_up_model",
                                                 "found": True, "patched": True, "serving_threads": False}
    assert r["hook_target"]["before_profile"] == {"attribute": "Worker.determine_available_memory",
                                                  "found": True, "patched": True}
    assert r["hook_target"]["before_load"] == {"attribute": "Worker.load_model", "found": True, "patched": True}
    assert r["hook_target"]["model_built"] == {
        "attribute": "vllm.model_executor.model_loader.base_loader.initialize_model", "found": True, "patched": True}
    assert r["hook_target"]["engine_config"] == {
        "attribute": "vllm.engine.arg_utils.EngineArgs.create_engine_config", "found": True, "patched": True}
    # 0.24 has none of them but Model Runner V2's warmup_kernels
    assert {n for n, u in r["upstream_warmups"].items() if u["present"]} == {"v2_warmup_kernels"}
    assert r["families"]["qwen_gdn"]["forced"] and not r["families"]["runner"]["selected"]
    assert r["config"]["KWARM_WARMUPS"] == "qwen_gdn,-runner"


def test_doctor_disabled_and_filtered():
    # an invalid setting (1) and kwarm disabled, so it would not hook vLLM (4)
    r = doctor(clean_env(VLLM_PLUGINS="other", KWARM_LOG_LEVEL="chatty", CUDA_VISIBLE_DEVICES=""), status=5)
    assert r["enabled"] is False and not any(d["would_fire"] for d in r["doors"].values())
    assert "excludes kwarm" in r["doors"]["vllm.general_plugins"]["note"]
    assert r["hook_target"]["patched"] is False and r["hook_target"]["after_capture"]["patched"] is False
    assert r["config_problems"] == ["KWARM_LOG_LEVEL='chatty' is invalid (expected one of DEBUG, INFO, "
                                    "WARNING, ERROR); using the default 'INFO'"]


V2 = {"v2_warmup_kernels"}  # Model Runner V2's warmup_kernels, in every release


@pytest.mark.parametrize("release, present", [
    ("0.20.0", V2),
    ("0.26.0", V2 | {"qwen_triton_warmup", "sparse_mla_triton_warmup", "v1_block_table_warmup"}),
    ("0.28.0", V2 | {"qwen_triton_warmup", "sparse_mla_triton_warmup", "v1_block_table_warmup",
                     "kv_block_zeroer_warmup", "jit_warmup_registry"}),
    ("0.33.0", V2 | {"qwen_triton_warmup", "kv_block_zeroer_warmup", "jit_warmup_registry", "mamba_triton_warmup",
                     "qwen_vl_triton_warmup", "flashinfer_attention_warmup"}),
    ("0.34.0", V2 | {"qwen_triton_warmup", "kv_block_zeroer_warmup", "jit_warmup_registry",
                     "replayssm_lifecycle_warmup", "qwen_vl_triton_warmup", "flashinfer_attention_warmup"}),
])
def test_doctor_finds_upstream_warmups_per_release(release, present):
    env = cpu_triton_env()
    r = doctor(env, release=release, status=0 if env.get("KWARM_ENABLE") == "1" else 4)  # the release's fork server's environment
    assert r["versions"]["vllm"] is not None
    assert r["hook_target"]["found"] is True and r["hook_target"]["after_capture"]["found"] is True
    assert r["hook_target"]["before_profile"]["found"] is True and r["hook_target"]["before_load"]["found"] is True
    assert r["hook_target"]["model_built"]["found"] is True and r["hook_target"]["engine_config"]["found"] is True
    assert {n for n, u in r["upstream_warmups"].items() if u["present"]} == present
    # vLLM 0.28+ lowers torch's thread count for serving (kwarm applies it before the warmups)
    assert r["hook_target"]["after_capture"]["serving_threads"] is (release >= "0.28.0")


def test_doctor_text_and_help():
    kwarm = Path(sys.executable).parent / "kwarm"
    text = subprocess.run([str(kwarm), "doctor"], capture_output=True, text=True, env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert text.returncode == 4  # disabled: kwarm would not hook this vLLM
    assert "hook target: vllm.v1.worker.gpu_worker.kernel_warmup found=yes" in text.stdout
    first = text.stdout.splitlines()[:5]  # the verdict first: would kwarm act here, and why not
    assert first[1].startswith("  worker hook: found") and first[1].endswith("GPU: none"), first
    assert first[2] == "  families that run here: none", first
    assert first[3].startswith("  not here (kwarm is disabled (KWARM_ENABLE)): ") and "runner" in first[3], first
    enabled = subprocess.run([str(kwarm), "doctor"], capture_output=True, text=True,
                             env=clean_env(KWARM_ENABLE="1", CUDA_VISIBLE_DEVICES="")).stdout.splitlines()
    assert enabled[2] == "  families that run here: none; in vLLM's other processes: frontend, structured_output, warm_requests"
    assert enabled[3].startswith("  not here (no CUDA GPU is visible"), enabled[:5]
    help_ = subprocess.run([str(kwarm), "--help"], capture_output=True, text=True, env=clean_env())
    assert "kwarm run" in help_.stdout and "KWARM_WARMUPS" in help_.stdout


def test_doctor_json_is_pure_json_and_says_there_is_no_gpu():
    """`kwarm doctor --json | jq .enabled` works: importing vLLM logs to stderr, not stdout."""
    from kwarm_ext import doctor as doctor_module

    kwarm = Path(sys.executable).parent / "kwarm"
    proc = subprocess.run([str(kwarm), "doctor", "--json"], capture_output=True, text=True,
                          env=clean_env(KWARM_ENABLE="banana", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 5  # an invalid setting, and kwarm off
    assert "KWARM_ENABLE" not in proc.stderr, "said once, by the doctor, not also by the .pth line"
    r = json.loads(proc.stdout)
    assert r["enabled"] is False and r["gpu"]["available"] is False
    assert r["enable_text"] == "disabled (KWARM_ENABLE='banana' is not 1/true/yes/on or 0/false/no/off)"
    assert r["families"]["runner"]["here"] == "no: kwarm is disabled (KWARM_ENABLE)"
    text = doctor_module.render(r)
    assert text.splitlines()[0].endswith("disabled (KWARM_ENABLE='banana' is not 1/true/yes/on or 0/false/no/off)")
    assert "GPU: none (no CUDA GPU is visible (torch.cuda.is_available() is False)): kwarm's warmups run on " \
           "CUDA GPUs only" in text
    for backend in ("FLASH_ATTN", "FLASHMLA"):  # issue 20: backends without run-time compiles say so
        assert r["attention_backends"][backend]["warmed_by"] == "nothing compiles at run time: nothing to warm"
    assert "  TRITON_ATTN           Triton: kernel_unified_attention (2D/3D), reduce_segments: triton_attn" in text
    from importlib.metadata import version

    assert r["surfaces"]["flashinfer"] == {"label": "FlashInfer JIT modules", "version": version("flashinfer-python")}
    assert f"  flashinfer  FlashInfer JIT modules: {version('flashinfer-python')}" in text


def test_every_family_says_what_upstream_covers_and_what_kwarm_adds():
    from kwarm_ext import doctor as doctor_module
    from kwarm_ext.families import FAMILIES, PROCESS_FAMILIES

    for family in (*FAMILIES.values(), *PROCESS_FAMILIES.values()):
        assert len(family.upstream) > 10, family.name
    r = {"kwarm": "x", "enable_text": "enabled", "versions": {}, "gpu": {"available": True, "name": "H200", "count": 1},
         "doors": {}, "hook_target": {"module": None, "error": "e"}, "upstream_warmups": {},
         "families": {"eager_gemm": {"summary": "s", "upstream": FAMILIES["eager_gemm"].upstream, "forced": False,
                                     "selected": True, "here": "yes"}},
         "config": {}, "config_problems": []}
    text = doctor_module.render(r)
    assert "upstream: none: no release warms GEMM shapes outside CUDA-graph capture (0.20-0.34)" in text
    assert text.index("upstream:") < text.index("runs here: yes")


def test_attention_backends_name_real_families():
    from kwarm_ext.families import FAMILIES
    from kwarm_ext.upstream import ATTENTION_BACKENDS

    named = [by for _, by in ATTENTION_BACKENDS.values() if " " not in by]
    assert named and all(by in FAMILIES for by in named), named


@pytest.mark.parametrize("value, first", [
    ("banana", "disabled (KWARM_ENABLE='banana' is not 1/true/yes/on or 0/false/no/off)"),
    ("0", "disabled (KWARM_ENABLE='0')"),
    (None, "disabled (KWARM_ENABLE is not set)"),
    ("yes", "enabled"),
])
def test_doctor_first_line_says_what_kwarm_enable_is(value, first):
    from kwarm_ext import doctor as doctor_module

    assert doctor_module.enabled_text(value, value == "yes") == first


def test_doctor_says_per_family_whether_it_would_run_here():
    from kwarm_ext import config, doctor as doctor_module
    from kwarm_ext.families import FAMILIES, PROCESS_FAMILIES

    fams = {**FAMILIES, **PROCESS_FAMILIES}
    on = config.parse({"KWARM_ENABLE": "1", "KWARM_WARMUPS": "-runner"}, known_families=tuple(fams))
    no_gpu = {"available": False, "why": "no CUDA GPU is visible"}
    here = lambda name, vllm="0.24.0", gpu=no_gpu: doctor_module._applies_here(fams[name], on, vllm, gpu)  # noqa: E731
    assert here("runner") == "no: disabled by KWARM_WARMUPS"
    assert here("qwen_gdn") == "no: no CUDA GPU is visible"
    assert here("qwen_gdn", None) == "no: vllm is not installed"
    assert here("frontend") == "in vLLM's front-end process"
    assert here("structured_output") == "in vLLM's engine core process"
    assert here("qwen_gdn", "0.24.0", {"available": True}).startswith("yes")


def test_doctor_says_whether_flashinfer_can_build_its_jit_modules(tmp_path, monkeypatch):
    from kwarm_ext import doctor as doctor_module

    monkeypatch.setattr(doctor_module, "_version", lambda dist: None if dist == "flashinfer-python" else "1")
    assert "not installed" in doctor_module.flashinfer_jit({})["why"]
    monkeypatch.setattr(doctor_module, "_version", lambda dist: "0.7.2.post1")
    assert "FLASHINFER_DISABLE_JIT" in doctor_module.flashinfer_jit({"FLASHINFER_DISABLE_JIT": "1"})["why"]
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    bins = tmp_path / "bin"
    bins.mkdir()
    no_compiler = doctor_module.flashinfer_jit({"CUDA_HOME": str(cuda), "PATH": str(bins)})
    assert not no_compiler["can_build"] and "no nvcc or ninja" in no_compiler["why"] and "CUDA_HOME" in no_compiler["why"]
    for tool in (cuda / "bin" / "nvcc", bins / "ninja"):
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    ok = doctor_module.flashinfer_jit({"CUDA_HOME": str(cuda), "PATH": str(bins)})
    assert ok["can_build"] and ok["nvcc"] == str(cuda / "bin" / "nvcc") and ok["ninja"] == str(bins / "ninja")


def test_doctor_json_stays_json_when_kwarm_is_enabled_with_a_bad_setting():
    """The .pth door activates kwarm in the CLI's own process and logs the bad setting: to stderr
    when the CLI prints JSON, so that `kwarm doctor --json | jq` works."""
    kwarm = Path(sys.executable).parent / "kwarm"
    proc = subprocess.run([str(kwarm), "doctor", "--json"], capture_output=True, text=True,
                          env=clean_env(KWARM_ENABLE="1", KWARM_BUDGET="fast", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert any("KWARM_BUDGET='fast'" in p for p in r["config_problems"])
    assert "KWARM_BUDGET='fast' is invalid" not in proc.stderr  # said once, in the JSON


@pytest.mark.parametrize("env, status", [
    ({"KWARM_ENABLE": "1"}, 0),                               # valid, and the hook target is found
    ({"KWARM_ENABLE": "1", "KWARM_BUDGET": "fast"}, 1),       # an invalid setting
    ({}, 4),                                                  # disabled: would not hook vLLM
    ({"KWARM_ENABLE": "1", "VLLM_PLUGINS": "other"}, 0),      # the .pth door still fires
    ({"KWARM_ENABLE": "0", "KWARM_LOG_LEVEL": "chatty"}, 5),  # both
    ({"KWARM_ENABLE": "banana"}, 5),  # the .pth line's warning is not a second telling
])
def test_doctor_exit_status_and_each_problem_once(env, status):
    """Issue 63: `kwarm doctor` gates a deployment (documented statuses), and the text output
    names a bad value once, stdout and stderr together."""
    kwarm = Path(sys.executable).parent / "kwarm"
    proc = subprocess.run([str(kwarm), "doctor"], capture_output=True, text=True,
                          env=clean_env(CUDA_VISIBLE_DEVICES="", **env))
    assert proc.returncode == status, proc.stdout[:2000] + proc.stderr[-2000:]
    for key in ("KWARM_BUDGET", "KWARM_LOG_LEVEL", "KWARM_ENABLE"):
        if key in env and env[key] not in ("0", "1"):  # the invalid values
            assert (proc.stdout + proc.stderr).count(f"{key}={env[key]!r}") == 1, proc.stdout + proc.stderr


def test_doctor_exit_status_when_the_hook_target_is_missing():
    from kwarm_ext import doctor as doctor_module

    r = {"config_problems": [], "enabled": True, "enable_text": "enabled", "versions": {"vllm": "0.99.0"},
         "doors": {".pth": {"would_fire": True}}, "hook_target": {"found": False, "error": "ImportError: x"}}
    assert doctor_module.exit_status(r) == doctor_module.WOULD_NOT_HOOK
    r["hook_target"] = {"found": True}
    assert doctor_module.exit_status(r) == doctor_module.OK
    r["versions"]["vllm"] = None
    assert doctor_module.exit_status(r) == 4


def test_kwarm_command_knows_kwarms_cli_in_each_form():
    """One reading of argv for 'is this kwarm's own CLI' (the .pth door's warning, activation's
    quiet doctor and JSON-to-stderr), whichever way the CLI was started."""
    from _kwarm_door import kwarm_command

    assert kwarm_command("doctor", ["/venv/bin/kwarm", "doctor", "--json"])
    assert kwarm_command("--json", ["/venv/bin/python3", "-m", "kwarm_ext.cli", "doctor", "--json"])
    assert kwarm_command("doctor", ["kwarm", "doctor"])
    assert not kwarm_command("doctor", ["/venv/bin/vllm", "serve", "doctor"])  # a model called doctor
    assert not kwarm_command("--json", ["/venv/bin/kwarm", "doctor"])
    assert not kwarm_command("doctor", ["/venv/bin/kwarmish", "doctor"])


def test_doctor_lists_the_cute_dsl_kernels_each_deployment_saved(tmp_path):
    """The cute_dsl family's folders beside the manifests: counts per source, nothing loaded."""
    from kwarm_ext import doctor as doctor_module

    cache = tmp_path / "kwarm"
    for source, stack, n in (("flashinfer_gdn", "0123456789abcdef", 7), ("vllm_router_gemm", "fedcba9876543210", 16)):
        folder = cache / "Qwen3-Next.tp1.cuda90.abc.cute_dsl" / source / stack
        folder.mkdir(parents=True)
        for i in range(n):
            (folder / f"kwarm_cute_{i}.o").write_bytes(b"")
            (folder / f"kwarm_cute_{i}.json").write_text("{}")
    (cache / "Other.tp1.cuda90.def.cute_dsl").mkdir()
    r = doctor(clean_env(XDG_CACHE_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES=""), status=4)
    saved = {Path(k).name: v for k, v in r["manifests"]["cute_dsl"].items()}
    assert saved == {"Qwen3-Next.tp1.cuda90.abc.cute_dsl": {"flashinfer_gdn": 7, "vllm_router_gemm": 16},
                     "Other.tp1.cuda90.def.cute_dsl": {}}
    text = doctor_module.render(r)
    assert "  saved CuTe DSL kernels (cute_dsl family), 2 deployments:" in text
    assert "    Qwen3-Next.tp1.cuda90.abc.cute_dsl: flashinfer_gdn 7, vllm_router_gemm 16" in text
    assert "    Other.tp1.cuda90.def.cute_dsl: none" in text
