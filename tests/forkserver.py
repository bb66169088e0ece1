"""A fork server for the tests' fresh-interpreter runs (``conftest.run_py``).

Most per-release tests run a scenario in a fresh interpreter with that release's vLLM first on
``sys.path``; importing torch, Triton and vLLM costs about 6.5 s of CPU each time, on a 2-core
machine the larger part of the suite. A server is one interpreter per (environment, folder)
that imports them once and then forks a child per scenario: the child starts from a copy of
that state, runs the code as ``python -c`` would (``__main__``, ``sys.argv == ["-c"]``, its
own stdout and stderr, a normal interpreter exit with atexit handlers), and its exit status
comes back. Nothing a scenario does reaches the server or the next scenario.

``KWARM_TEST_FORKSERVER=0`` turns it off (every run is a new interpreter again).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading

# Imported once per server; a scenario imports what else it needs. Only modules every
# scenario's release loads anyway, and nothing of kwarm (its activation is under test).
PRELOAD = ("numpy", "torch", "triton", "vllm", "vllm.config", "vllm.envs")

SERVER = r'''
import json, os, sys, time, traceback
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what the imports print goes to the server's stderr, not into the protocol
for name in json.loads(sys.argv[1]):
    try:
        __import__(name)
    except Exception as exc:
        print(f"forkserver: preload {name} failed: {exc!r}", file=sys.stderr)
proto.write("READY\n")
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        proto.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(os.devnull)
        sys.argv = ["-c"]
        code = 0
        try:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
        raise SystemExit(code)  # the interpreter's own exit: atexit handlers, thread joins, flushes
    deadline = time.monotonic() + req["timeout"]
    status = None
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    rc = None if status is None else os.waitstatus_to_exitcode(status)
    proto.write(json.dumps({"rc": rc}) + "\n")
'''


def enabled() -> bool:
    return os.environ.get("KWARM_TEST_FORKSERVER", "1") != "0" and hasattr(os, "fork")


class Server:
    def __init__(self, env: dict, cwd: str):
        self.lock = threading.Lock()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kwarm-forkserver-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(PRELOAD)], env=env, cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        if self._line(180) != "READY":
            self.close()
            raise RuntimeError(f"fork server did not start: {self.tail()}")

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.strip() if line else None

    def tail(self) -> str:
        try:
            with open(self.log.name) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def run(self, code: str, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="kwarm-fork-") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            self.proc.stdin.write(json.dumps({"code": code, "timeout": timeout, "out": out, "err": err}) + "\n")
            self.proc.stdin.flush()
            line = self._line(timeout + 60)
            if line is None:
                raise BrokenPipeError(f"fork server gave no answer: {self.tail()}")
            rc = json.loads(line)["rc"]
            stdout, stderr = (open(p).read() if os.path.exists(p) else "" for p in (out, err))
        if rc is None:
            raise subprocess.TimeoutExpired(["python", "-c", "..."], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["python", "-c", "..."], rc, stdout, stderr)

    def close(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(10)
        except Exception:
            pass


_servers: dict = {}  # key -> Server, least recently used first
_seen: dict = {}  # key -> runs asked for
_guard = threading.Lock()
# A server holds torch and vLLM in memory (0.5-0.75 GB): at most this many per test process,
# and one only for an (environment, folder) asked for a second time (a key used once gains
# nothing from a server).
MAX_SERVERS = 2


def run(code: str, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess | None:
    """`code` in a fork of the server for (`env`, `cwd`); None when no server can run it (the
    caller then starts a fresh interpreter)."""
    if not enabled():
        return None
    key = (cwd, tuple(sorted(env.items())))
    with _guard:
        _seen[key] = _seen.get(key, 0) + 1
        server = _servers.pop(key, None)
        if server is None or server.proc.poll() is not None:
            if _seen[key] < 2:
                return None
            while len(_servers) >= MAX_SERVERS:
                _servers.pop(next(iter(_servers))).close()
            try:
                server = Server(env, cwd)
            except Exception as exc:
                print(f"forkserver: {exc}", file=sys.stderr)
                return None
        _servers[key] = server  # most recently used last
    try:
        return server.run(code, timeout)
    except (BrokenPipeError, OSError, ValueError, json.JSONDecodeError) as exc:
        print(f"forkserver: {exc}", file=sys.stderr)
        with _guard:
            _servers.pop(key, None)
        server.close()
        return None


def close_all() -> None:
    with _guard:
        for server in _servers.values():
            server.close()
        _servers.clear()
