"""``kwarm``: the command line.

  kwarm run [--] CMD [ARGS...]   run CMD with kwarm active in every Python process it starts
  kwarm doctor [--json]          what is installed, what would fire, what kwarm would do
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
  kwarm doctor --json

configuration (environment):
""" + "\n".join(f"  {name:16s} {doc}" for name, doc in __import__(
    "kwarm_ext.config", fromlist=["VARIABLES"]).VARIABLES.items())


def bootstrap_dir() -> str:
    """The folder holding kwarm's ``sitecustomize.py`` (``kwarm_ext/_bootstrap`` when installed)."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "_bootstrap")
    if os.path.isfile(os.path.join(installed, "sitecustomize.py")):
        return installed
    return os.path.dirname(here)  # a source checkout: the repository root


def run_command(argv: list[str]) -> int:
    """Exec `argv` with KWARM_ENABLE=1 and kwarm's bootstrap first on PYTHONPATH."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("kwarm run: no command given (usage: kwarm run [--] CMD [ARGS...])", file=sys.stderr)
        return 2
    env = os.environ
    env["KWARM_ENABLE"] = "1"
    boot = bootstrap_dir()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    env["PYTHONPATH"] = os.pathsep.join([boot, *parts])
    exe = shutil.which(argv[0]) or argv[0]
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
    run_p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, optionally after --")
    doc_p = sub.add_parser("doctor", help="report versions, activation doors, hook target, upstream warmups",
                           description="Works without a GPU. Imports vLLM to check the hook target.")
    doc_p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args.cmd)
    if args.command == "doctor":
        from kwarm_ext import doctor

        return doctor.main(as_json=args.json)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
