"""kwarm's bootstrap for ``kwarm run -- CMD`` (shipped as kwarm_ext/_bootstrap/sitecustomize.py).

``kwarm run`` puts this file's directory first on PYTHONPATH, so every Python
process of CMD (vLLM's engine core and workers included) imports it at startup.
It activates kwarm, then imports the user's own ``sitecustomize`` if one exists
further down ``sys.path``, as ddtrace-run and opentelemetry-instrument do.
"""
import os
import sys


def _chain_user_sitecustomize():
    """Import the next ``sitecustomize`` on sys.path, hiding this file's directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the user's own, if any)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


try:
    import kwarm_ext

    kwarm_ext.activate("sitecustomize")
except Exception as exc:  # never break the user's interpreter
    hint = (" (kwarm is not installed for this interpreter: install it there, or run a Python that has it)"
            if isinstance(exc, ImportError) and getattr(exc, "name", "") == "kwarm_ext" else "")
    sys.stderr.write(f"WARNING kwarm: bootstrap failed in {sys.executable}, kwarm is off in this process: "
                     f"{exc!r}{hint}\n")

_chain_user_sitecustomize()
