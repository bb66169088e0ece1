"""kwarm's warmup families, one module per kernel family (shipped as ``kwarm_ext.kernels``).

The registry is kwarm_ext/families.py; each module documents Why / How / Upstream /
Remove-when for the kernels it warms.
"""
