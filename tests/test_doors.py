"""The three activation doors, each in fresh interpreters, and the cost of being off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import timeit
from pathlib import Path

import pytest

from conftest import REPO, clean_env, run_py

HEAVY = ("kwarm_ext", "wrapt", "torch", "vllm", "triton")
PROBE = """
import sys, json
print(json.dumps({m: m in sys.modules for m in %r}))
""" % (HEAVY,)
# KWARM_ENABLE=1 at start: the .pth line arms _kwarm_door (nothing else), which waits on sys.meta_path
DOOR_PROBE = """
import sys, json
door = sys.modules.get("_kwarm_door")
print(json.dumps({"heavy": [m for m in %r if m in sys.modules], "door": door is not None,
                  "armed": door is not None and door.armed()}))
""" % (HEAVY,)
ACTIVE = """
import sys, json
from kwarm_ext import activation
print(json.dumps({"active": activation.is_active(), "sources": activation.SOURCES,
                  "heavy": [m for m in ("torch", "vllm", "triton") if m in sys.modules]}))
"""


def bare_env(**extra):
    """No PYTHONPATH: the fresh venv must see only what is installed in it."""
    env = clean_env(**extra)
    env.pop("PYTHONPATH", None)
    return env


def last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, capture_output=True)
    return next(out.glob("kwarm_ext-*.whl"))


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel):
    """A new venv with only the wheel (and wrapt, its one dependency) installed."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                          env=bare_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return py


def test_wheel_layout(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "kwarm-ext.pth" in names  # at the root of site-packages
    assert "_kwarm_door.py" in names  # the one module the .pth line imports, beside kwarm_ext
    assert "kwarm_ext/_bootstrap/sitecustomize.py" in names
    assert "kwarm_ext/kernels/__init__.py" in names
    assert not any(n.startswith(("kernels/", "sitecustomize")) for n in names)  # no top-level squatting
    meta = next(n for n in names if n.endswith("METADATA"))
    requires = [l for l in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if l.startswith("Requires-Dist") and "extra ==" not in l]
    assert [r.split(":")[1].split(">")[0].split("=")[0].strip() for r in requires] == ["wrapt"]
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Name: kwarm-ext" in metadata


def test_sdist_builds_and_carries_what_the_wheel_is_built_from(tmp_path):
    """`pip install kwarm-ext` has no index to come from yet: the README installs from a clone
    or from a wheel or sdist built from it; both must build, with the same metadata."""
    import tarfile

    # -P: the clone's folder is not on sys.path, as in pip's build hooks: its kernels/ would shadow
    # the `kernels` package transformers 5.25+ installs, whose egg_info writer setuptools loads.
    proc = subprocess.run([sys.executable, "-P", "-c", "from setuptools import build_meta as b; import sys; "
                           f"print(b.build_sdist({str(tmp_path)!r}))"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sdist = tmp_path / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        pkg_info = tar.extractfile(next(n for n in names if n.endswith("/PKG-INFO"))).read().decode()
    root = names[0].split("/")[0]
    for path in ("kwarm_ext/kwarm-ext.pth", "_kwarm_door.py", "kernels/eager_gemm.py", "sitecustomize.py", "setup.py", "README.md"):
        assert f"{root}/{path}" in names, path
    assert "License-Expression: Apache-2.0" in pkg_info and "Requires-Dist: wrapt" in pkg_info


def stub_packages(tmp_path, *names) -> str:
    """A folder of empty packages named `names` (no vLLM or Triton in the fresh venv), each
    noting whether kwarm was active when its own code ran."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            "import sys\nactivation = sys.modules.get('kwarm_ext.activation')\n"
            "KWARM_ACTIVE_BEFORE = bool(activation and activation.is_active())\n")
    return str(tmp_path)


def test_pth_door_in_a_fresh_venv(fresh_venv, tmp_path):
    off = last_json(run_py(PROBE, env=bare_env(), python=str(fresh_venv)))
    assert off == {m: False for m in HEAVY}
    # enabled: nothing of kwarm but the door until a package kwarm hooks is imported
    armed = last_json(run_py(DOOR_PROBE, env=bare_env(KWARM_ENABLE="1"), python=str(fresh_venv)))
    assert armed == {"heavy": [], "door": True, "armed": True}
    stubs = stub_packages(tmp_path, "vllm", "triton")
    for package in ("vllm", "triton"):
        code = f"import {package}\n" + ACTIVE.replace('"active"', f'"before": {package}.KWARM_ACTIVE_BEFORE, "active"')
        env = dict(bare_env(KWARM_ENABLE="1"), PYTHONPATH=stubs)
        on = last_json(run_py(code, env=env, python=str(fresh_venv)))
        # active before the package's own code ran; a venv's lib64 -> lib link can make site run
        # the .pth twice: the door is armed once, activation is idempotent
        assert on["before"] is True and on["active"] is True and on["sources"] == [".pth"], package
        assert on["heavy"] == [package]
    # KWARM_ENABLE set but false: as free as unset, nothing of kwarm imported
    for falsy in ("0", "false", "no", "off", " OFF "):
        proc = run_py(PROBE, env=bare_env(KWARM_ENABLE=falsy), python=str(fresh_venv))
        assert last_json(proc) == {m: False for m in HEAVY} and proc.stderr == "", falsy
    # neither: one warning line in each Python process, and kwarm stays off (and unimported)
    proc = run_py(PROBE, env=bare_env(KWARM_ENABLE="banana"), python=str(fresh_venv))
    assert last_json(proc) == {m: False for m in HEAVY}
    assert proc.stderr.strip() == ("WARNING kwarm: KWARM_ENABLE='banana' is not 1/true/yes/on or "
                                   "0/false/no/off: kwarm is off")


def test_doctor_without_vllm_or_torch_says_why(fresh_venv):
    proc = subprocess.run([str(fresh_venv), "-m", "kwarm_ext.cli", "doctor"], capture_output=True, text=True,
                          env=bare_env(KWARM_ENABLE="1"), cwd="/", timeout=60)
    assert proc.returncode == 4, proc.stderr  # kwarm would not hook: no vLLM here (README, doctor statuses)
    text = proc.stdout
    assert "None.None" not in text
    assert "hook target: unknown (vllm is not installed; kwarm hooks vLLM's worker warmup)" in text
    assert "(vllm is not installed: nothing to compare with)" in text
    assert "GPU: none (torch is not installed)" in text
    assert "runs here: no: vllm is not installed" in text


def test_disabled_means_free_in_the_test_venv():
    assert last_json(run_py(PROBE, env=clean_env())) == {m: False for m in HEAVY}


def start_s(python: str, envs: list, runs: int = 9) -> list:
    """The fastest of `runs` starts of ``python -c pass`` in each of `envs` (interleaved, so that a
    loaded machine slows each alike; the minimum is what the start itself costs)."""
    best = [float("inf")] * len(envs)
    for _ in range(runs):
        for i, env in enumerate(envs):
            t0 = time.perf_counter()
            subprocess.run([python, "-c", "pass"], env=env, check=True, cwd="/")
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def test_enabled_costs_nothing_where_vllm_is_never_imported(tmp_path):
    """Issue 63: KWARM_ENABLE=1 set for a whole container cost every Python start 0.16-0.21 s
    (kwarm activated at start-up); the door defers all of it to vLLM's import. Here, in the test
    venv (vLLM, torch and Triton installed): a start imports nothing heavy, and takes as long as one
    with kwarm disabled, and one in a venv without kwarm."""
    proc = run_py(DOOR_PROBE, env=clean_env(KWARM_ENABLE="1"), args=("-X", "importtime"))
    assert last_json(proc) == {"heavy": [], "door": True, "armed": True}
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert not [m for m in imported if m.split(".")[0] in HEAVY], imported
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    enabled, disabled = start_s(sys.executable, [clean_env(KWARM_ENABLE="1"), clean_env()])
    (without,) = start_s(str(bare / "bin" / "python"), [bare_env(KWARM_ENABLE="1")])
    assert enabled - disabled < 0.02 and enabled - without < 0.02, \
        f"python -c pass: {enabled * 1e3:.1f} ms enabled, {disabled * 1e3:.1f} ms disabled, {without * 1e3:.1f} ms without kwarm"


def test_real_vllm_import_opens_the_door():
    """The real vLLM: its import activates kwarm through the door, before vLLM's own code runs, and
    the worker's hooks are applied as when the door opened at start-up."""
    code = """
    import json, sys
    import _kwarm_door
    armed = _kwarm_door.armed()
    import vllm
    from kwarm_ext import activation, patches
    active_with_vllm = activation.is_active()
    import vllm.v1.worker.gpu_worker as g
    print(json.dumps({"armed": armed, "active": active_with_vllm, "sources": activation.SOURCES,
                      "patched": patches.is_patched(g), "armed_after": _kwarm_door.armed(),
                      "door_on_meta_path": any(type(f).__name__ == "KwarmDoor" for f in sys.meta_path)}))
    """
    result = last_json(run_py(code, env=clean_env(KWARM_ENABLE="1", CUDA_VISIBLE_DEVICES=""), timeout=240))
    assert result == {"armed": True, "active": True, "sources": [".pth"], "patched": True, "armed_after": False,
                      "door_on_meta_path": False}


def test_door_triggers_cover_every_import_hook(monkeypatch):
    """The door opens at the first import of a package of :data:`_kwarm_door.TRIGGERS`: every module
    kwarm hooks must be under one, or its hook would be registered too late."""
    import _kwarm_door
    import wrapt

    from kwarm_ext import patches
    from kwarm_ext.surfaces import flashinfer

    hooked = []
    monkeypatch.setattr(wrapt, "register_post_import_hook", lambda hook, name: hooked.append(name))
    monkeypatch.setattr(patches, "_installed", False)
    monkeypatch.setattr(flashinfer, "_hook_registered", False)
    monkeypatch.delitem(sys.modules, flashinfer.FLASHINFER_BUILD.module, raising=False)
    patches.install()
    flashinfer._ensure_patched()
    assert {"vllm.v1.worker.gpu_worker", "triton.runtime.cache", "flashinfer.jit.core"} <= set(hooked)
    assert {name.split(".")[0] for name in hooked} <= _kwarm_door.TRIGGERS


def test_pth_line_costs_under_a_millisecond(fresh_venv):
    proc = run_py("pass", env=bare_env(), args=("-X", "importtime"), python=str(fresh_venv))
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert not [m for m in imported if m.split(".")[0] in HEAVY]
    line = (REPO / "kwarm_ext" / "kwarm-ext.pth").read_text().strip()
    env_before = os.environ.pop("KWARM_ENABLE", None)
    try:
        per_call = min(timeit.repeat(lambda: exec(line, {}), number=1000, repeat=5)) / 1000
    finally:
        if env_before is not None:
            os.environ["KWARM_ENABLE"] = env_before
    assert per_call < 1e-3, f"the .pth line took {per_call * 1e3:.3f} ms"


def test_kwarm_run_door_chains_user_sitecustomize(tmp_path):
    user = tmp_path / "usersite"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n")
    code = ACTIVE.replace('"active"', '"user": getattr(__import__("builtins"), "USER_SITECUSTOMIZE_RAN", False), "active"')
    kwarm = Path(sys.executable).parent / "kwarm"
    proc = subprocess.run([str(kwarm), "run", "--", sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(user)), timeout=120)
    result = last_json(proc)
    assert result["user"] is True
    assert result["active"] is True and "sitecustomize" in result["sources"]
    assert result["heavy"] == []


def test_kwarm_run_names_an_interpreter_that_lacks_kwarm(tmp_path):
    """The bootstrap runs in every Python the command starts; one without kwarm says which."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists() or Path(sys.prefix) == Path(sys.base_prefix):
        pytest.skip("no interpreter without kwarm next to this venv")
    proc = subprocess.run([sys.executable, "-m", "kwarm_ext.cli", "run", "--", str(base), "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=60, cwd=str(tmp_path), env=clean_env())
    if "bootstrap failed" not in proc.stderr:
        pytest.skip(f"{base} can import kwarm_ext after all")
    assert proc.stdout.strip() == "ran", "the command still runs"
    assert f"WARNING kwarm: bootstrap failed in {base}" in proc.stderr
    assert "kwarm is not installed for this interpreter" in proc.stderr


def test_kwarm_run_without_command_explains():
    kwarm = Path(sys.executable).parent / "kwarm"
    proc = subprocess.run([str(kwarm), "run"], capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 2 and "no command given" in proc.stderr


def test_plugin_door_through_vllms_loader():
    code = """
    import os, json
    os.environ["KWARM_ENABLE"] = "1"   # after startup, so the .pth door stays shut
    from vllm.plugins import load_general_plugins
    load_general_plugins(); load_general_plugins()
    import vllm.v1.worker.gpu_worker as g
    from kwarm_ext import activation, patches
    print(json.dumps({"sources": activation.SOURCES, "patched": patches.is_patched(g)}))
    """
    result = last_json(run_py(code, env=clean_env(CUDA_VISIBLE_DEVICES="")))
    assert result == {"sources": ["plugin"], "patched": True}


def test_plugin_door_stays_shut_without_kwarm_enable():
    """vLLM loads the plugin in every process it starts: without KWARM_ENABLE it must do nothing
    (issue 59: removing activation's gate was caught only by a Ray test)."""
    code = """
    import json
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.v1.worker.gpu_worker as g
    from kwarm_ext import activation, patches
    print(json.dumps({"sources": activation.SOURCES, "active": activation._active, "patched": patches.is_patched(g)}))
    """
    result = last_json(run_py(code, env=clean_env(CUDA_VISIBLE_DEVICES="")))
    assert result == {"sources": [], "active": False, "patched": False}


def test_plugin_respects_vllm_plugins_filter():
    code = """
    import os, json
    os.environ["KWARM_ENABLE"] = "1"
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from kwarm_ext import activation
    print(json.dumps(activation.SOURCES))
    """
    assert last_json(run_py(code, env=clean_env(CUDA_VISIBLE_DEVICES="", VLLM_PLUGINS="other"))) == []


def test_spawn_child_inherits_activation():
    code = """
    import json, multiprocessing as mp

    def child(q):
        import triton  # the door opens at the first import of a package kwarm hooks
        from kwarm_ext import activation
        q.put({"active": activation.is_active(), "sources": activation.SOURCES})

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start(); got = q.get(timeout=60); p.join(60)
        print(json.dumps(got))
    """
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kwarm_spawn_{os.getpid()}.py"
    path.write_text(__import__("textwrap").dedent(code))
    try:
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                              env=clean_env(KWARM_ENABLE="1"))
    finally:
        path.unlink()
    got = last_json(proc)
    assert got["active"] is True and set(got["sources"]) == {".pth"}


def test_python_run_from_the_clone_root_imports_vllms_worker():
    """From a clone's root (its folder first on sys.path) the top-level ``kernels/`` folder
    would shadow Hugging Face's ``kernels`` package, which transformers 5.x imports by name
    (``from kernels import CUDAProperties``) as vLLM's worker imports transformers: the import
    hands over the installed package; where none is installed, the folder stays (and
    transformers finds no version of it). The source kwarm_ext finds its families there too."""
    code = """
import json, os, sys
import kernels
installed = os.path.dirname(os.path.abspath(kernels.__file__)) != os.path.abspath("kernels")
import vllm.v1.worker.gpu_worker
import kwarm_ext, kwarm_ext.kernels.sampler
from transformers.utils.import_utils import is_kernels_available
del sys.modules["kernels"]
sys.path = [p for p in sys.path if "-packages" not in p]  # nothing installed: the folder stays
import kernels as alone
print(json.dumps({"installed": installed, "hub": is_kernels_available(),
                  "alone": os.path.abspath(alone.__file__) == os.path.abspath("kernels/__init__.py"),
                  "kwarm_ext": os.path.dirname(os.path.abspath(kwarm_ext.__file__))}))
"""
    has_hub = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('kernels') is not None)"],
                             capture_output=True, text=True, cwd="/").stdout.strip() == "True"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=240)
    out = last_json(proc)
    assert out["installed"] is has_hub and out["alone"] is True
    assert out["kwarm_ext"] == str(REPO / "kwarm_ext")  # the source package, with ../kernels
