"""``kwarm``: the command line.

  kwarm run [--learn] [--] CMD [ARGS...]   run CMD with kwarm active in every Python process it starts
  kwarm doctor [--json]                    what is installed, what would fire, what kwarm would do
  kwarm manifest show|verify PATH...       list / check learn-and-replay manifests
  kwarm manifest merge PATH... -o OUT      merge the manifests of several ranks or hosts
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

EPILOG = """\
examples:
  kwarm run -- vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct
  KWARM_ENABLE=1 vllm serve ...      (same, through the installed .pth line or vLLM plugin)
  kwarm run --learn -- vllm serve ... (record late compilations; the next start replays them)
  kwarm manifest show ~/.cache/kwarm/*.json
  kwarm doctor --json

configuration (environment):
""" + "\n".join(f"  {name:21s} {doc}" for name, doc in __import__(
    "kwarm_ext.config", fromlist=["VARIABLES"]).VARIABLES.items())


def run_command(argv: list[str], learn: bool = False) -> int:
    """Exec `argv` with KWARM_ENABLE=1 (and KWARM_LEARN=1 with `learn`) and kwarm's bootstrap
    first on PYTHONPATH."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("kwarm run: no command given (usage: kwarm run [--] CMD [ARGS...])", file=sys.stderr)
        return 2
    env = os.environ
    env["KWARM_ENABLE"] = "1"
    if learn:
        env["KWARM_LEARN"] = "1"
    from kwarm_ext.activation import bootstrap_dir, share_with_ray_workers

    share_with_ray_workers(env)  # KWARM_* reach vLLM's Ray workers (--distributed-executor-backend ray)

    boot = bootstrap_dir()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    env["PYTHONPATH"] = os.pathsep.join([boot, *parts])
    # like a shell: a bare NAME is looked up on PATH only, never in the current folder
    exe = shutil.which(argv[0]) if os.sep not in argv[0] else argv[0]
    if exe is None:
        print(f"kwarm run: {argv[0]}: command not found on PATH", file=sys.stderr)
        return 127
    try:
        os.execv(exe, argv)
    except OSError as exc:
        print(f"kwarm run: cannot run {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kwarm", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Moves vLLM's first-request Triton JIT to engine start.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run_p = sub.add_parser("run", help="run a command with kwarm active in all its Python processes",
                           description="Sets KWARM_ENABLE=1, puts kwarm's sitecustomize first on "
                                       "PYTHONPATH (a user sitecustomize still runs) and execs CMD.")
    run_p.add_argument("--learn", action="store_true",
                       help="also set KWARM_LEARN=1: record what compiles after warmup into the "
                            "deployment's manifest, which the next start replays")
    run_p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, optionally after --")
    doc_p = sub.add_parser("doctor", help="report versions, activation doors, hook target, upstream warmups",
                           description="Works without a GPU. Imports vLLM to check the hook target.")
    doc_p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_manifest_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args.cmd, learn=args.learn)
    if args.command == "manifest":
        from kwarm_ext import manifest_cli

        return manifest_cli.main(args.action, args.paths, getattr(args, "output", None))
    if args.command == "doctor":
        from kwarm_ext import doctor

        return doctor.main(as_json=args.json)
    parser.print_help()
    return 2


def _add_manifest_parser(sub) -> None:
    man_p = sub.add_parser("manifest", help="show, verify or merge learn-and-replay manifests",
                           description="Manifests are written by KWARM_LEARN=1 runs (default location: "
                                       "$XDG_CACHE_HOME/kwarm or ~/.cache/kwarm; KWARM_MANIFEST overrides).")
    actions = man_p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="list each manifest's kernels, entries and autotune choices")
    show.add_argument("paths", nargs="+", metavar="PATH")
    verify = actions.add_parser("verify", help="check manifests against the installed Triton, vLLM and GPU")
    verify.add_argument("paths", nargs="+", metavar="PATH")
    merge = actions.add_parser("merge", help="merge manifests of several ranks or hosts into OUT")
    merge.add_argument("paths", nargs="+", metavar="PATH")
    merge.add_argument("-o", "--output", required=True, metavar="OUT", help="the merged manifest")


def entry(argv: list[str] | None = None) -> int:
    """The ``kwarm`` script: :func:`main`, and a reader that stops early (``kwarm manifest show | head``)
    ends the command quietly instead of in a BrokenPipeError traceback (issue 59): stdout goes to
    /dev/null for the interpreter's last flush, and the status is 141 (128 + SIGPIPE), as a shell's."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(entry())
