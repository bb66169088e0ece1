"""kwarm's warmup families, one module per kernel family (shipped as ``kwarm_ext.kernels``).

The registry is kwarm_ext/families.py; each module documents Why / How / Upstream /
Remove-when for the kernels it warms.
"""
if __name__ == "kernels":
    # Imported as a top-level ``kernels``: Python runs from a clone's root, whose folder comes
    # first on sys.path. transformers (5.x) imports Hugging Face's ``kernels`` package by that
    # name when it is installed (``from kernels import CUDAProperties``), and vLLM's worker
    # imports transformers: hand the importer the installed package instead of this folder
    # (the import system returns what ``sys.modules`` holds once this module has run).
    def _installed_kernels():
        import importlib.machinery
        import importlib.util
        import os
        import sys

        clone = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != clone]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            return  # nothing installed under that name: transformers finds no version here
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("kernels", None)
            raise

    _installed_kernels()
