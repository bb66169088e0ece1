"""The one mechanism behind every kwarm monkey-patch: :class:`Patch`, a ``module[.owner].attribute``
wrapped by wrapt, applied once, checked and removed by the same code. The table of patches is
``kwarm_ext.patches.PATCHES``."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

logger = logging.getLogger("kwarm")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One monkey-patch: ``module[.owner].attribute`` wrapped (wrapt) by `wrapper`. The wrapper's
    docstring says why it exists and when it can go; `releases` where it is needed, and `when`
    (if set) decides at apply time whether this process needs it."""

    module: str
    attribute: str
    wrapper: Callable
    releases: str
    lost: str  # what does not happen when the patch cannot be applied
    owner: str | None = None  # the class holding `attribute`, or None for a module attribute
    announce: str | None = None  # an info line once applied
    when: Callable[[], bool] | None = None  # needed here (a library version); None: always

    @property
    def target(self) -> str:
        return ".".join(filter(None, (self.module, self.owner, self.attribute)))

    def holder(self, module):
        """What holds the attribute in `module` (the module or its class); None if absent."""
        holder = module if self.owner is None else getattr(module, self.owner, None)
        return holder if holder is not None and callable(getattr(holder, self.attribute, None)) else None

    def current(self, module):
        holder = self.holder(module)
        if holder is None:
            return None
        return getattr(holder, self.attribute) if self.owner is None else vars(holder).get(self.attribute)

    def applied(self, module) -> bool:
        import wrapt

        current = self.current(module)
        return isinstance(current, wrapt.FunctionWrapper) and current._self_wrapper is self.wrapper

    def apply(self, module) -> bool:
        """Wrap once; returns whether this call wrapped. An absent target is one warning."""
        import wrapt

        if self.when is not None and not self.when():
            return False
        holder = self.holder(module)
        if holder is None:
            logger.warning("kwarm: %s has no %s in this vLLM; %s", self.module,
                           ".".join(filter(None, (self.owner, self.attribute))), self.lost)
            return False
        if self.applied(module):
            return False
        wrapt.wrap_function_wrapper(holder, self.attribute, self.wrapper)
        if self.announce:
            logger.info("kwarm: hooked %s: %s", self.target, self.announce)
        return True

    def remove(self, module) -> bool:
        """Restore the original (tests, and a clean uninstall); returns whether it was wrapped."""
        if not self.applied(module):
            return False
        setattr(self.holder(module), self.attribute, self.current(module).__wrapped__)
        return True
