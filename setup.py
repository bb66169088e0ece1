"""Build hook for the two files a wheel cannot express in pyproject.toml.

- ``kwarm-ext.pth`` goes to the root of site-packages: the first activation door
  (one env-gated line that arms ``_kwarm_door``, a top-level module of pyproject.toml's
  ``py-modules``; _kwarm_door.py says why).
- The repository's top-level ``sitecustomize.py`` goes to
  ``kwarm_ext/_bootstrap/sitecustomize.py``: the directory ``kwarm run`` puts first
  on PYTHONPATH. It is never installed as a top-level ``sitecustomize``.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithBootstrap(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib)
        shutil.copy(ROOT / "kwarm_ext" / "kwarm-ext.pth", out / "kwarm-ext.pth")
        boot = out / "kwarm_ext" / "_bootstrap"
        boot.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "sitecustomize.py", boot / "sitecustomize.py")


setup(cmdclass={"build_py": BuildWithBootstrap})
