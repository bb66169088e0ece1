"""kwarm: vLLM's first request as fast as its second.

Enabled by ``KWARM_ENABLE=1``, kwarm hooks vLLM's worker kernel warmup and compiles,
at engine start, the Triton specializations that the first requests would otherwise
compile. This module stays import-light: the activation doors (the ``.pth`` line,
``kwarm run``'s ``sitecustomize`` and the ``vllm.general_plugins`` entry point)
import it before anything else is known, so it imports nothing but the standard
library until :func:`activate` decides that kwarm is enabled.
"""

from kwarm_ext._version import __version__
__all__ = ["activate", "__version__"]


def _source_checkout_kernels() -> None:
    """In a source checkout ``kernels/`` sits beside this package (the wheel ships it as
    ``kwarm_ext.kernels``, pyproject.toml's package-dir): let ``kwarm_ext.kernels`` resolve
    there too, so that scripts run from a clone (bench/) import the same families."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(os.path.join(here, "kernels")) and os.path.isfile(os.path.join(root, "kernels", "__init__.py")):
        __path__.append(root)  # noqa: F821 (a package's __path__)


_source_checkout_kernels()


def activate(source: str = "api") -> bool:
    """Install kwarm's hooks in this process, once; a no-op unless KWARM_ENABLE is truthy.

    `source` names the door that called (``.pth``, ``sitecustomize``, ``plugin``,
    ``api``) for ``kwarm doctor`` and the logs. Returns whether kwarm is active.
    """
    from kwarm_ext.activation import activate as _activate

    return _activate(source)
