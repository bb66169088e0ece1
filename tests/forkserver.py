"""A fork server for the tests' fresh-interpreter runs: torch, Triton and one vLLM release
imported once, then every run a forked child of that process.

Why: most of the suite's time on 2 cores went to starting interpreters, each importing torch
and a vLLM release (12-15 s on CPU) before running a scenario that takes a few seconds. A
forked child starts with those modules loaded and nothing else: kwarm is not imported in the
server, its ``.pth`` door did not fire (the server's environment has no ``KWARM_ENABLE``), and
the child gets the environment, ``sys.argv``, ``sys.path[0]`` and working folder the fresh
interpreter would have had. :func:`conftest._child` uses it for release runs only where that
holds (``conftest._ForkServers.get``: the same start-up environment, no ``KWARM_ENABLE``);
everything else, the door tests first, still starts a real interpreter.

Server (started by conftest, one per vLLM release and pytest run, shared by its workers, never
by hand): ``python forkserver.py SOCKET``; it imports :data:`PRELOAD`, listens on the Unix socket and,
for each connection, forks a supervisor that forks the run and reports on the connection:
``{"pid": N}`` once the run started, then ``{"rc": status}`` when it ended (a negative status: the
signal that ended it). The request is one JSON line: ``{"argv", "env", "cwd", "stdout",
"stderr"}`` (argv as ``python`` takes it after the interpreter: a script and its arguments, or
``-c CODE``; stdout and stderr: files the run writes to). The server exits when its parent (the
pytest worker that started it) is gone; runs already forked finish.
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import types

# What a scenario of the suite imports anyway; the heaviest part of each interpreter's start.
READY = "kwarm-forkserver-ready"  # after vLLM's import-time log lines, which go to stdout too
PRELOAD = ("torch", "triton", "vllm", "vllm.config", "vllm.v1.worker.gpu_worker")  # the worker: V1 or V2 runner


def run_request(request: dict) -> int:
    """In the forked run: become the fresh interpreter `request` describes, run it, exit."""
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    rc = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")  # as `python -c` has it: no __file__
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            rc = 0
        elif isinstance(code, int):
            rc = code
        else:
            print(code, file=sys.stderr)
            rc = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return rc


def supervise(conn: socket.socket, listener: socket.socket) -> None:
    """In the per-connection supervisor: fork the run, report its pid and then its status."""
    listener.close()
    with conn, conn.makefile("rb") as reader:
        line = reader.readline()
        if not line:  # a client checking that the server answers
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            conn.close()
            os._exit(run_request(request))
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
        except OSError:  # the client gave up (timeout) and closed
            pass


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    print(READY, flush=True)
    os.dup2(2, 1)  # nothing more for the pipe the client read READY from
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the supervisor waits for its run
            try:
                supervise(conn, listener)
            finally:
                os._exit(0)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
