"""Shared test helpers: fresh-interpreter runs (optionally against another vLLM release's
Python files from .rel/) and a handler on the ``kwarm`` logger."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RELEASES_DIR = REPO / ".rel"
SCENARIOS_DIR = REPO / "tests" / "scenarios"  # scripts run by run_scenario (not collected: no test_ prefix)
MATRIX = ("0.20.0", "0.22.0", "0.24.0", "0.26.0", "0.28.0")


def release_path(version: str) -> Path | None:
    """Folder of `version`'s Python files, or None for the venv's own vLLM (0.24.0)."""
    if version == "0.24.0":
        return None
    path = RELEASES_DIR / f"vllm-{version}"
    if not (path / ".complete").exists():
        pytest.skip(f"vLLM {version} files not fetched (run tests/run.sh)")
    return path


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWARM_")}
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def run_py(code: str, *, env: dict | None = None, release: str | None = None, args=(),
           timeout: float = 300, cwd=None, python=None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; `release` puts that vLLM's files first on sys.path."""
    return _child([*args, "-c", textwrap.dedent(code)], env=env, release=release, timeout=timeout,
                  cwd=cwd, python=python)


def run_scenario(name: str, *params, env: dict | None = None, release: str | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the script tests/scenarios/`name`.py as :func:`run_py` runs code, each of `params`
    one JSON command-line argument (the script's ``main`` reads them from ``sys.argv``)."""
    return _child([str(SCENARIOS_DIR / f"{name}.py"), *(json.dumps(p) for p in params)], env=env,
                  release=release, timeout=timeout)


def _child(argv: list, *, env: dict | None, release: str | None, timeout: float, cwd=None,
           python=None) -> subprocess.CompletedProcess:
    env = dict(clean_env() if env is None else env)
    if release is not None:
        path = release_path(release)
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    # Not the repository root: there `python -c` would import the source kwarm_ext (which has
    # no `kernels` subpackage) instead of the installed one. (A script's own folder comes first
    # on its sys.path instead: tests/scenarios/ holds no package of that name.)
    cwd = cwd or tempfile.gettempdir()
    return subprocess.run([python or sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def marked_json(proc: subprocess.CompletedProcess, mark: str = "RESULT ") -> tuple:
    """``(True, the JSON after the last line starting with `mark`)`` when the `run_py` child
    ran to that line, else ``(False, why)`` with the ends of its output."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith(mark)]
    if proc.returncode or not lines:
        return False, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return True, json.loads(lines[-1][len(mark):])


def result_of(proc: subprocess.CompletedProcess, mark: str = "RESULT "):
    """:func:`marked_json`'s value, asserting the child ran."""
    ok, value = marked_json(proc, mark)
    assert ok, value
    return value


def run_cases(scenario: str, cases: dict, release: str, timeout: float = 240, **env):
    """Run `scenario` once for `release` under :func:`cpu_triton_env` (plus `env`), with
    `cases` as JSON in place of its ``__ARGS__``; returns what it printed after ``RESULT ``.
    (Code in a string: tests/scenarios/ scripts run through :func:`run_scenario_cases`.)"""
    code = scenario.replace("__ARGS__", repr(json.dumps(cases)))
    return result_of(run_py(code, release=release, env=cpu_triton_env(**env), timeout=timeout))


def run_scenario_cases(name: str, cases: dict, release: str, *params, timeout: float = 240, **env):
    """Run tests/scenarios/`name`.py once for `release` under :func:`cpu_triton_env` (plus
    `env`), with `cases` (then `params`) as its JSON arguments; returns what it printed after
    ``RESULT ``."""
    return result_of(run_scenario(name, cases, *params, release=release, env=cpu_triton_env(**env),
                                  timeout=timeout))


def release_version(release: str) -> tuple:
    """'0.26.0' -> (0, 26)."""
    return tuple(int(x) for x in release.split(".")[:2])


def plan_steps(result: dict, plan: str) -> dict:
    """The steps of one recorded family plan, by name."""
    return {s["name"]: s for s in result["plans"][plan]}


def cpu_triton_env(**extra) -> dict:
    """vLLM's Triton kernels on CPU: the interpreter, and CUDA_VISIBLE_DEVICES set but empty
    (vLLM treats that as a distributed environment and keeps Triton enabled)."""
    return clean_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **extra)


class PerRelease:
    """One expensive scenario subprocess per vLLM release per session, two releases at a time
    (each is one CPU-bound process), started for every release a module's tests will ask for.

    `run(release)` returns ``(ok, value)``; :meth:`result` asserts ok and returns value.
    """

    def __init__(self, run):
        self._run = run
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self._futures: dict = {}

    def start(self, release: str) -> concurrent.futures.Future:
        if release not in self._futures:
            self._futures[release] = self._pool.submit(self._run, release)
        return self._futures[release]

    def result(self, release: str):
        ok, value = self.start(release).result()
        assert ok, value
        return value

    def autouse_fixture(self):
        """A module-scoped autouse fixture that starts, at the module's first test, the
        scenario of every release its tests ask for: ``_prefetch = SCENARIOS.autouse_fixture()``."""
        def _prefetch(request):
            yield from self.prefetch(request)

        return pytest.fixture(scope="module", autouse=True, name="_prefetch")(_prefetch)

    def prefetch(self, request):
        """Generator body of :meth:`autouse_fixture`."""
        for item in request.session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.module is request.module and "release" in params:
                self.start(params["release"])
        yield
        self._pool.shutdown(wait=False, cancel_futures=True)


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def kwarm_log():
    """Records of the ``kwarm`` logger (it does not propagate to the root, so caplog misses it)."""
    handler = LogRecords()
    log = logging.getLogger("kwarm")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.DEBUG)
    yield handler
    log.removeHandler(handler)
    log.setLevel(old)


@pytest.fixture
def kwarm_env(monkeypatch):
    """Set KWARM_* variables for one test; the parsed settings are reset around it."""
    from kwarm_ext import config

    for key in list(os.environ):
        if key.startswith("KWARM_"):
            monkeypatch.delenv(key)
    config.reset()

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        config.reset()

    yield set_env
    config.reset()
