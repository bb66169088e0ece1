"""kwarm's version: keep it equal to pyproject.toml's ``version``."""
__version__ = "0.1.0"
