"""The runner's real block tables for the attention scenarios (triton_attn.py, triton_mla.py), on CPU.

Not a scenario (no ``main``): imported by them (tests/scenarios/ is first on a scenario's path).

- 0.20-0.33: the V1 runner's ``MultiGroupBlockTable`` (``vllm/v1/worker/block_table.py``), at
  ``runner.input_batch.block_table``, where the V1 ``GPUModelRunner`` keeps it.
- 0.34+ (the V1 runner is gone: only Model Runner V2): V2's ``BlockTables``
  (``vllm/v1/worker/gpu/block_table.py``), at ``runner.block_tables``; production's attention
  metadata gets the rows ``gather_block_tables`` copies into ``input_block_tables``.

What cannot exist here: pinned host memory and UVA (no driver). V2's staging buffers fall back
to their non-UVA form (``NonUvaBuffer``: pageable memory and explicit copies, what vLLM itself
uses where UVA is off) with the platform's device type "cpu" while the tables are built.
"""
from __future__ import annotations

import contextlib
import inspect
import types

import torch

try:
    from vllm.v1.worker.block_table import MultiGroupBlockTable
except ImportError:  # 0.34+: Model Runner V2 only
    MultiGroupBlockTable = None


def accepted(fn, **kwargs):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


@contextlib.contextmanager
def _no_pinned_memory():
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import buffer_utils

    current_platform.is_pin_memory_available = lambda: False  # stays: no driver, no pinned memory
    buffer_utils.is_pin_memory_available = lambda: False
    buffer_utils.is_uva_available = lambda: False
    saved = current_platform.device_type
    current_platform.device_type = "cpu"  # where NonUvaBuffer puts its device copy
    try:
        yield
    finally:
        current_platform.device_type = saved


def build(max_reqs: int, max_model_len: int, max_tokens: int, block: int):
    """``(tables, runner attributes, rows)``: the release's block tables of one KV-cache group,
    the attributes a stand-in runner carries them at, and ``rows(n)``: the block-table tensor
    production's attention metadata holds for a batch of n requests."""
    if MultiGroupBlockTable is not None:
        tables = MultiGroupBlockTable(**accepted(
            MultiGroupBlockTable, max_num_reqs=max_reqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_tokens, pin_memory=False, device=torch.device("cpu"), block_sizes=[block],
            kernel_block_sizes=[block], max_num_blocks=[max_model_len // block]))
        return tables, {"input_batch": types.SimpleNamespace(block_table=tables)}, tables[0].get_device_tensor
    from vllm.v1.worker.gpu.block_table import BlockTables

    with _no_pinned_memory():
        tables = BlockTables(block_sizes=[block], max_num_reqs=max_reqs, max_num_batched_tokens=max_tokens,
                             max_num_blocks_per_group=[max_model_len // block], device=torch.device("cpu"))
    return tables, {"block_tables": tables}, lambda n: tables.input_block_tables[0][:n]
