"""Shared test helpers: fresh-interpreter runs (optionally against another vLLM release's
Python files from .rel/) and a handler on the ``kwarm`` logger."""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

import forkserver  # tests/forkserver.py: its READY line

REPO = Path(__file__).resolve().parent.parent
RELEASES_DIR = REPO / ".rel"
SCENARIOS_DIR = REPO / "tests" / "scenarios"  # scripts run by run_scenario (not collected: no test_ prefix)
MATRIX = ("0.20.0", "0.22.0", "0.24.0", "0.26.0", "0.28.0")


def required() -> bool:
    """Whether a missing dependency fails instead of skipping: ``KWARM_TEST_REQUIRE=1``, which
    tests/run.sh sets (it installs every dependency, so in CI a skip would hide a broken setup:
    issue 59, six test files skipped whole); a bare ``pytest`` elsewhere still skips."""
    return os.environ.get("KWARM_TEST_REQUIRE", "").strip().lower() in ("1", "true", "yes", "on")


def require(module: str):
    """``pytest.importorskip(module)``, except that under :func:`required` a missing module is an
    ImportError (a failure), not a skip."""
    if required():
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def release_path(version: str) -> Path | None:
    """Folder of `version`'s Python files, or None for the venv's own vLLM (0.24.0)."""
    if version == "0.24.0":
        return None
    path = RELEASES_DIR / f"vllm-{version}"
    if not (path / ".complete").exists():
        if required():
            pytest.fail(f"vLLM {version} files not fetched (tests/run.sh fetches them)")
        pytest.skip(f"vLLM {version} files not fetched (run tests/run.sh)")
    return path


def clean_env(**extra) -> dict:
    env = {k: v for k, v in _environ().items() if not k.startswith("KWARM_")}
    # vLLM 0.33's import of humming-kernels starts a background build of its CUDA launcher in a
    # process of its own (humming/ops/utils.py), which outlived the tests and loaded the 2 cores
    env.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def _environ() -> dict:
    """A copy of os.environ. PerRelease's threads read it while pytest's main thread sets and
    deletes PYTEST_CURRENT_TEST, and iterating os.environ then can fail (KeyError, or a dict
    changed size): try again."""
    while True:
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):
            continue


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
    if python is None and release is not None:
        server = _FORK_SERVERS.get(env)
        for _ in range(2):
            if server is None:
                break
            try:
                return server.run(argv, env, cwd, timeout)
            except ServerGone:
                server = _FORK_SERVERS.renew(env, server)
    return subprocess.run([python or sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _startup_env(env: dict) -> tuple:
    """What of `env` a fresh interpreter can have read before running its code: everything but
    kwarm's settings (read when kwarm_ext is imported, which the fork server never does) and
    pytest's own variables. KWARM_ENABLE stays: it arms kwarm's .pth door at start-up."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k == "KWARM_ENABLE" or not k.startswith(("KWARM_", "PYTEST_"))))


class ServerGone(Exception):
    """The fork server stopped (the pytest worker that started it ended)."""


class ForkServer:
    """One tests/forkserver.py process: a vLLM release imported once, each run a forked child.
    The pytest workers of one run share it: the first to need it starts it (``own``), under a
    lock file, and the others connect to its socket."""

    def __init__(self, env: dict, path: str, own: bool):
        self.path, self.proc = path, None
        if not own:
            return
        log = path + ".log"  # a file, not a pipe nobody reads
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkserver.py"), self.path],
                                         env=env, cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                                         stderr=stderr, text=True)
        seen = []  # vLLM logs to stdout while the server imports it
        for line in self.proc.stdout:
            if line.strip() == forkserver.READY:
                break
            seen.append(line)
        else:
            self.proc.kill()
            raise RuntimeError(f"fork server did not start: {''.join(seen)[-2000:]}{_read(log)[-3000:]}")

    @classmethod
    def shared(cls, env: dict, folder: Path) -> "ForkServer":
        """The server for `env` in `folder` (this run's), started here if none answers there."""
        name = hashlib.sha256(repr(sorted(env.items())).encode()).hexdigest()[:16]
        path = str(folder / f"{name}.s")
        with open(folder / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _answers(path):
                return cls(env, path, own=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return cls(env, path, own=True)

    def run(self, argv: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        args = [sys.executable, *argv]
        with tempfile.TemporaryDirectory(prefix="kwfs-run") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            request = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "stdout": out, "stderr": err}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                try:
                    conn.connect(self.path)
                except (ConnectionRefusedError, FileNotFoundError):
                    raise ServerGone(self.path) from None
                conn.sendall(json.dumps(request).encode() + b"\n")
                reader = conn.makefile("rb")
                started = reader.readline()
                if not started:
                    raise ServerGone(self.path)
                pid = json.loads(started)["pid"]
                try:
                    line = reader.readline()
                except (socket.timeout, TimeoutError):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(args, timeout, _read(out), _read(err)) from None
            rc = json.loads(line)["rc"] if line else -signal.SIGKILL
            return subprocess.CompletedProcess(args, rc, _read(out), _read(err))

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            for leftover in (self.path, self.path + ".log"):  # the lock files stay: other workers may hold them
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
            return True
        except OSError:
            return False


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class _ForkServers:
    """The fork servers this pytest process uses, one per start-up environment of a release run,
    shared with the run's other workers (``KWARM_TEST_FORKSERVER=0``: none, every run a fresh
    interpreter). Only an environment
    without KWARM_ENABLE gets one: with it, kwarm's .pth door is armed at interpreter start (and opens
    at the first import of vLLM or Triton, which a server would have made before forking)."""

    LIMIT = 6  # about 1 GB each: the five releases of MATRIX and one more environment

    def __init__(self):
        self._lock = threading.Lock()
        self._servers: dict = {}
        self.enabled = os.environ.get("KWARM_TEST_FORKSERVER", "1") != "0"
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"p{os.getpid()}")[:16]  # one per pytest run
        self.folder = Path(tempfile.gettempdir()) / f"kwfs-{run}"
        atexit.register(self.close)

    def get(self, env: dict) -> ForkServer | None:
        if not self.enabled or env.get("KWARM_ENABLE"):
            return None
        key = _startup_env(env)
        with self._lock:  # held briefly: servers of different releases start side by side
            slot = self._servers.get(key)
            if slot is None:
                if len(self._servers) >= self.LIMIT:
                    return None
                slot = self._servers[key] = {"lock": threading.Lock(), "server": None, "tried": False}
        with slot["lock"]:  # the runs that need this server wait for its start
            if not slot["tried"]:
                slot["tried"] = True
                slot["server"] = self._open(key)
            return slot["server"]

    def renew(self, env: dict, gone: ForkServer) -> ForkServer | None:
        """Another server for `env`, where `gone` stopped answering (its worker ended)."""
        slot = self._servers[_startup_env(env)]
        with slot["lock"]:
            if slot["server"] is gone:
                slot["server"] = self._open(_startup_env(env))
            return slot["server"]

    def _open(self, key: tuple) -> ForkServer | None:
        try:
            self.folder.mkdir(exist_ok=True)
            return ForkServer.shared(dict(key), self.folder)
        except Exception as exc:  # a fresh interpreter per run, as before
            print(f"conftest: {exc}", file=sys.stderr)
            return None

    def close(self):
        for slot in self._servers.values():
            if slot["server"] is not None:
                slot["server"].close()


_FORK_SERVERS = _ForkServers()


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


@pytest.fixture(autouse=True)
def _no_budget_left_over():
    """No test starts inside an earlier test's warmup budget: ``kwarm_ext.warmup.run`` begins
    a process-wide deadline and leaves it (an engine warms once), so an in-process warmup's
    deadline, passed by the time a later test on the same worker ran, spent its budget."""
    budget = sys.modules.get("kwarm_ext.budget")
    if budget is not None:
        budget.reset()
    yield


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
