"""The tests' fork server (tests/forkserver.py) against a fresh interpreter: a run forked from it
sees what ``python -c`` or ``python SCRIPT`` would see, and ends the same way."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import conftest
from conftest import cpu_triton_env

PROBE = """
import json, os, sys
print("RESULT " + json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
    "file": "__file__" in globals(), "main_file": hasattr(sys.modules["__main__"], "__file__"),
    "env": os.environ.get("KWARM_PROBE"), "kwarm_loaded": "kwarm_ext" in sys.modules,
    "door": os.environ.get("KWARM_ENABLE")}))
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _both(argv, tmp_path, timeout=120):
    env = cpu_triton_env(KWARM_PROBE="x")
    server = conftest._FORK_SERVERS.get(env)
    if server is None:
        pytest.skip("fork server disabled (KWARM_TEST_FORKSERVER=0) or at its limit")
    forked = server.run(argv, env, tmp_path, timeout)
    fresh = subprocess.run([sys.executable, *argv], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=timeout)
    return forked, fresh


def _result(proc) -> dict:
    return json.loads(proc.stdout.split("RESULT ")[-1])


def test_code_run_sees_what_python_c_sees(tmp_path):
    forked, fresh = _both(["-c", PROBE, "3"], tmp_path)
    assert forked.returncode == fresh.returncode == 3
    seen = _result(forked)
    assert seen == _result(fresh)
    assert seen["argv"] == ["-c", "3"] and seen["path0"] == "" and seen["name"] == "__main__"
    assert seen["env"] == "x" and seen["cwd"] == str(tmp_path) and not seen["kwarm_loaded"]
    assert seen["main_file"] is False, "__main__ is the code's own module, not the server's"


def test_script_run_sees_what_python_script_sees(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    forked, fresh = _both([str(script)], tmp_path)
    assert forked.returncode == fresh.returncode == 0
    assert _result(forked) == _result(fresh)
    assert _result(forked)["path0"] == str(tmp_path) and _result(forked)["file"] is True


def test_an_exception_and_a_timeout_end_as_in_a_fresh_interpreter(tmp_path):
    forked, fresh = _both(["-c", "raise ValueError('boom')"], tmp_path)
    assert forked.returncode == fresh.returncode == 1
    assert "ValueError: boom" in forked.stderr and "Traceback" in forked.stderr
    server = conftest._FORK_SERVERS.get(cpu_triton_env())
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["-c", "import time; print('started', flush=True); time.sleep(60)"],
                   cpu_triton_env(), tmp_path, 3)


def test_a_door_run_never_forks():
    """KWARM_ENABLE arms kwarm's .pth door at interpreter start: such runs are fresh interpreters."""
    assert conftest._FORK_SERVERS.get(dict(cpu_triton_env(), KWARM_ENABLE="1")) is None
