"""The Triton surface: kernels compiled per specialization on their first launch.

Modules: ``compat`` (the adapter to Triton's internals, per release), ``hook`` (kwarm's one
``jit_post_compile_hook``: how the monitor counts Triton compiles), ``compile`` and ``preload``
(compiling a recorded specialization without launching it), ``learn`` (recording what compiled
late into the deployment's manifest) and ``replay`` (the ``replay`` family: compiling it at the
next start, then every other surface's items). The manifest keeps Triton's items in its own
sections (``entries``: kernel, cache key, specialization and launch options; ``autotune``: the
autotuners' choices), parsed by kwarm_ext/manifest.py.
"""
from __future__ import annotations

from kwarm_ext.surfaces import Surface


class TritonSurface(Surface):
    name = "triton"
    label = "Triton kernels"

    def version(self):
        from kwarm_ext.surfaces.triton import compat

        return compat.triton_version()

    def watch(self, on_built):
        from kwarm_ext.surfaces.triton import hook

        def listener(kwargs):
            on_built(hook.compiled(kwargs))

        if not hook.listen(listener):
            hook.unlisten(listener)
            return None
        return lambda: hook.unlisten(listener)


SURFACE = TritonSurface()
