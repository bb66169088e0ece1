"""kwarm: vLLM's first request as fast as its second.

Enabled by ``KWARM_ENABLE=1``, kwarm hooks vLLM's worker kernel warmup and compiles,
at engine start, the Triton specializations that the first requests would otherwise
compile. This module stays import-light: the activation doors (the ``.pth`` line,
``kwarm run``'s ``sitecustomize`` and the ``vllm.general_plugins`` entry point)
import it before anything else is known, so it imports nothing but the standard
library until :func:`activate` decides that kwarm is enabled.
"""

__version__ = "0.1.0"
__all__ = ["activate", "__version__"]


def activate(source: str = "api") -> bool:
    """Install kwarm's hooks in this process, once; a no-op unless KWARM_ENABLE is truthy.

    `source` names the door that called (``.pth``, ``sitecustomize``, ``plugin``,
    ``api``) for ``kwarm doctor`` and the logs. Returns whether kwarm is active.
    """
    from kwarm_ext.activation import activate as _activate

    return _activate(source)
