"""Warmup family ``runner``: the model runner's own per-step kernels of hybrid and MLA models.

Why:
    Two Triton kernels run outside the model, in the runner's input preparation, and no
    dummy run, profile run or CUDA-graph capture reaches them with the production key, so
    the first request compiles them (0.24 on a tiny Qwen3-Next: 3 of its 8 first-request
    compiles):

    - ``_compute_slot_mapping_kernel`` (``vllm/v1/worker/block_table.py``), launched by
      ``BlockTable.compute_slot_mapping`` once per KV-cache group from
      ``GPUModelRunner._prepare_inputs``. Its key holds the table's own
      ``block_table_stride``/``block_size`` (and, from 0.26, the constexprs
      ``KV_CACHE_BLOCK_SIZE``/``BLOCKS_PER_KV_BLOCK``), and up to 0.23 the integer class of
      ``num_tokens`` (``do_not_specialize`` from 0.24).
    - ``_zero_kv_blocks_kernel`` (``vllm/v1/worker/utils.py``), launched by
      ``KVBlockZeroer.zero_block_ids(scheduler_output.new_block_ids_to_zero)`` on every step
      that allocates blocks when ``kv_cache_config.needs_kv_cache_zeroing`` (mamba/GDN
      layers). Up to 0.26 its key holds the integer class of ``n_blocks``.

How:
    Only through the runner's real objects, so the key is the production one:

    - slot mapping: each ``BlockTable`` of ``runner.input_batch.block_table`` (V1). Row 0
      gets one committed block id (the null block), ``compute_slot_mapping`` runs exactly as
      ``_prepare_inputs`` calls it, for one ``num_tokens`` per integer class the kernel
      specializes on ({1, 2, 16} up to 0.23, one otherwise); afterwards row 0, its block
      count and the table's ``slot_mapping`` buffer are restored. Query-start and position
      tensors take the dtypes of the runner's own buffers. Groups whose table does not map
      slots (``SlotMappingMode.NONE``, 0.28+ mamba groups) launch nothing and are not
      labelled. The V2 runner (``vllm/v1/worker/gpu/block_table.py``; the only runner from
      0.34) is not warmed: its ``_compute_slot_mappings_kernel`` has no per-step integer
      specialization (all its integers are fixed per engine; tests/test_family_runner.py
      checks it on 0.34) and V2's own ``warmup_kernels`` runs real steps through it, run by
      vLLM or, where vLLM's call is off (``enforce_eager``), by kwarm's ``v2_warmup``.
    - zeroing: ``runner._kv_block_zeroer`` (V1) or ``runner.kv_block_zeroer`` (V2);
      ``zero_block_ids([0] * n)`` for n in {1, 2, 16} where ``n_blocks`` is specialized,
      else ``zero_block_ids([0])`` (or ``.warmup(num_blocks)`` when forced and upstream
      has it).

    Safety (checked in the vLLM source, 0.20-0.34): only KV block 0 is ever written, and
    only with zeros. ``BlockPool.__init__`` pops block 0 off the free queue as
    ``null_block`` (``is_null=True``, ``v1/core/block_pool.py``), so it is never handed to
    a request; it is the padding target that attention and mamba kernels read for padded
    entries (the GDN kernels skip ``NULL_BLOCK_ID``). Warmup runs inside
    ``compile_or_warm_up_model`` before the engine core serves anything, so no request
    exists yet, and for the models that have a zeroer every block is zeroed again when the
    scheduler allocates it (``new_block_ids_to_zero``) before first use. Upstream does the
    same: 0.25-0.26 ``qwen_triton_warmup`` zeroes blocks 0-1, 0.27+
    ``KVBlockZeroer.warmup`` zeroes block 0, 0.33-0.34 V2 ``warmup_kernels`` writes blocks
    1.. with real steps. Slot mapping writes nothing into KV memory: it fills the table's own
    ``slot_mapping`` scratch buffer, which is restored.

Upstream (decided by feature, not version; a covered part is a skipped step unless forced):
    - 0.25-0.26 ``qwen_triton_warmup`` (Qwen model types only): zeroer with
      ``_ZERO_KV_N_BLOCKS`` = (1, 2): the n=16 class is still missing. Its slot-mapping
      warmup and ``warm_v1_block_table_kernels(device, max_tokens)`` use fresh tables with
      other strides/block sizes: not the production key (0.26 still compiles
      ``_compute_slot_mapping_kernel`` on the first request), so they count for nothing.
    - 0.27-0.28 ``warm_v1_block_table_kernels(runner)``: the runner's real tables, T=8,
      ``num_tokens`` not specialized: covers slot mapping (V1, non-pooling).
    - 0.27+ ``KVBlockZeroer.warmup``, ``n_blocks`` not specialized: covers zeroing where it
      runs: ``kernel_warmup`` calls it on the V1 runner (0.27-0.33; 0.34 has no V1 runner and
      no such call), V2's ``warmup_kernels`` on the V2 runner (0.28-0.34), which vLLM's worker
      calls for every V2 engine up to 0.28, from 0.29 only with ``enable_jit_warmup`` (0.34:
      or an extensible KV cache), and kwarm's ``v2_warmup`` where vLLM does not and no CUDA
      graph is captured. Elsewhere (V2, JIT warmup off by hand, graphs on) kwarm zeroes.
    - 0.29-0.33 ``ComputeSlotMappingKernel.register_warmup`` for every real V1 table, run by
      ``runner.jit_warmup_registry.warmup()`` unless ``kernel_config.enable_jit_warmup`` is
      False (enforce_eager sets it False): covers slot mapping when enabled.

Remove when:
    the oldest supported vLLM is 0.29 (or later) and runs its JIT-warmup registry for every
    engine, enforce_eager included.
"""
from __future__ import annotations

import contextlib
import importlib
import logging

from kwarm_ext import upstream
from kwarm_ext.families import Step
from kwarm_ext.kernels.model_runner import synchronize
from kwarm_ext.kernels.specializations import INT_CLASSES, classes_for, partition, split_steps
from kwarm_ext.surfaces.triton.compat import param_mode
from kwarm_ext.vllm_compat import Missing, bind, params, resolve, resolve_or_none

logger = logging.getLogger("kwarm")

NAME = "runner"

# The only KV block this family ever names: the null block (see the module docstring).
_WARM_BLOCK_ID = 0

_SLOT_KERNEL = "_compute_slot_mapping_kernel"
_ZERO_KERNEL = "_zero_kv_blocks_kernel"
TRITON_KERNELS = (_SLOT_KERNEL, _ZERO_KERNEL)  # what this family compiles at start


# ---------------------------------------------------------------------------- applicability

def applies(view) -> str | None:
    if view.runner is None:
        return "no model runner"
    if view.is_pooling_model:
        return "pooling model: no generation slot mapping or KV-block zeroing"
    if zeroer_of(view.runner) is not None:
        return None
    if view.layers_of("MambaBase"):
        return None
    names = [n.upper() for group in view.backends for n in group]
    if any("MLA" in n or "INDEXER" in n or "GDN" in n or "MAMBA" in n for n in names):
        return None
    return "no KV-block zeroer, mamba/GDN layers or MLA/DSA backend"


def zeroer_of(runner):
    """The runner's KVBlockZeroer: private on V1, public on V2 (0.23+); None if absent."""
    for attr in ("_kv_block_zeroer", "kv_block_zeroer"):
        zeroer = getattr(runner, attr, None)
        if zeroer is not None:
            return zeroer
    return None


# ---------------------------------------------------------------------------- planning

def plan(view, forced: bool) -> list:
    return _slot_mapping_steps(view, forced) + _zero_steps(view, forced)


def _slot_mapping_steps(view, forced: bool) -> list:
    if view.runner_kind == "V2":
        who = v2_warmup_kernels_runs(view) or "run by neither vLLM nor kwarm's v2_warmup here: the first step compiles it"
        return [Step("slot_mapping", "_compute_slot_mappings_kernel",
                     skip="V2 runner: its slot-mapping kernel has no per-step integer "
                          f"specialization and V2 warmup_kernels runs real steps through it ({who})")]
    tables = block_tables(view.runner)
    if not tables:
        return [Step("slot_mapping", _SLOT_KERNEL, skip="runner has no input_batch.block_table")]
    try:
        kernel = resolve("vllm.v1.worker.block_table:_compute_slot_mapping_kernel",
                         "vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel")
    except Missing as exc:
        return [Step("slot_mapping", _SLOT_KERNEL, skip=str(exc))]
    mode = param_mode(kernel, "num_tokens")
    upstream = None if forced else _upstream_slot_mapping(view)
    todo, covered = partition(classes_for(mode), mode, upstream)
    return split_steps("slot_mapping", _SLOT_KERNEL, todo, covered, upstream and upstream[0],
                       lambda: warm_slot_mapping(view.runner, tables, todo))


def _zero_steps(view, forced: bool) -> list:
    zeroer = zeroer_of(view.runner)
    if zeroer is None:
        return [Step("zero_kv_blocks", _ZERO_KERNEL, skip="runner has no KV-block zeroer")]
    if getattr(zeroer, "_meta", True) is None:
        return [Step("zero_kv_blocks", _ZERO_KERNEL,
                     skip="zeroer has no attention segments: it never launches")]
    try:
        kernel = resolve("vllm.v1.worker.utils:_zero_kv_blocks_kernel")
        bind(zeroer.zero_block_ids, [_WARM_BLOCK_ID])
    except (Missing, AttributeError) as exc:
        return [Step("zero_kv_blocks", _ZERO_KERNEL, skip=str(exc))]
    mode = param_mode(kernel, "n_blocks")
    upstream = None if forced else _upstream_zero(view, zeroer)
    todo, covered = partition(classes_for(mode), mode, upstream)
    use_warmup = forced and len(todo) == 1 and callable(getattr(zeroer, "warmup", None))
    return split_steps("zero_kv_blocks", _ZERO_KERNEL, todo, covered, upstream and upstream[0],
                       lambda: warm_zero_blocks(view.runner, zeroer, todo, use_warmup))








# ---------------------------------------------------------------------------- upstream

def _upstream_slot_mapping(view):
    """(name, token counts upstream warms with the production key) or None."""
    if view.runner_kind == "V2" or view.is_pooling_model:
        return None
    registry_kernel = resolve_or_none("vllm.v1.worker.block_table:ComputeSlotMappingKernel")
    if registry_kernel is not None and hasattr(registry_kernel, "register_warmup"):
        enabled = _read(view, "kernel_config.enable_jit_warmup", True)
        if enabled is False:
            return None  # enforce_eager: the registry does not run
        return "jit_warmup_registry (ComputeSlotMappingKernel.register_warmup)", INT_CLASSES
    warm = resolve_or_none("vllm.model_executor.warmup.v1_block_table_warmup:warm_v1_block_table_kernels")
    if warm is None or "runner" not in params(warm) or not upstream.kernel_warmup_calls("warm_v1_block_table_kernels"):
        return None  # 0.25-0.26 fresh tables: not the production key
    mod = importlib.import_module("vllm.model_executor.warmup.v1_block_table_warmup")
    tokens = int(getattr(mod, "_SLOT_MAPPING_WARMUP_TOKENS", 8))
    return "v1_block_table_warmup (real block tables)", (tokens,)


def _upstream_zero(view, zeroer):
    if callable(getattr(zeroer, "warmup", None)):
        if view.runner_kind != "V2":
            return "KVBlockZeroer.warmup (called by kernel_warmup)", (1,)
        who = v2_warmup_kernels_runs(view)
        if who is not None:
            return f"KVBlockZeroer.warmup (called by Model Runner V2's warmup_kernels, {who})", (1,)
        return None  # V2 with nobody running warmup_kernels: kernel_warmup never calls it on V2
    qwen = upstream.upstream_qwen_module(view)
    if qwen is not None and hasattr(qwen, "_warm_zero_kv_blocks_with_runner_zeroer"):
        counts = tuple(getattr(qwen, "_ZERO_KV_N_BLOCKS", ()))
        if counts:
            return "qwen_triton_warmup (zero_block_ids)", counts
    return None






# ---------------------------------------------------------------------------- warm calls

def warm_slot_mapping(runner, tables, counts) -> list:
    import torch

    labels = []
    with torch.inference_mode():
        for gid, table in enumerate(tables):
            if getattr(getattr(table, "slot_mapping_mode", None), "name", "") == "NONE":
                continue  # launches nothing (mamba groups, 0.28+)
            for count in counts:
                if count > int(table.max_num_batched_tokens):
                    continue
                with _restored(table):
                    _slot_mapping_call(runner, table, count)
                labels.append(f"group{gid}:bs={table.block_size},T={count}")
    return labels


def _slot_mapping_call(runner, table, count: int) -> None:
    import torch

    device = table.block_table.gpu.device
    table.add_row([_WARM_BLOCK_ID], 0)
    table.commit_block_table(1)
    query_start_loc = torch.tensor([0, count], device=device,
                                   dtype=_buffer_dtype(getattr(runner, "query_start_loc", None), torch.int32))
    # Every position in the row's first block: the kernel reads only block 0 of row 0.
    positions = (torch.arange(count, device=device) % int(table.block_size)).to(
        _buffer_dtype(getattr(runner, "positions", None), torch.int64))
    bind(table.compute_slot_mapping, 1, query_start_loc, positions)
    table.compute_slot_mapping(1, query_start_loc, positions)
    synchronize(device)


@contextlib.contextmanager
def _restored(table):
    """Put row 0, its block count and the slot-mapping buffer back as they were."""
    row_np = table.block_table.np[0].copy()
    row_gpu = table.block_table.gpu[0].clone()
    row_count = int(table.num_blocks_per_row[0])
    slots = table.slot_mapping.gpu.clone()
    try:
        yield
    finally:
        table.block_table.np[0] = row_np
        table.num_blocks_per_row[0] = row_count
        table.block_table.gpu[0].copy_(row_gpu)
        table.slot_mapping.gpu.copy_(slots)


def warm_zero_blocks(runner, zeroer, counts, use_warmup: bool = False) -> list:
    import torch

    labels = []
    with torch.inference_mode():
        if use_warmup:
            num_blocks = int(getattr(getattr(runner, "kv_cache_config", None), "num_blocks", 1) or 1)
            bind(zeroer.warmup, num_blocks)
            zeroer.warmup(num_blocks)
            labels.append("warmup()")
        else:
            for count in counts:
                zeroer.zero_block_ids([_WARM_BLOCK_ID] * count)
                labels.append(f"n_blocks={count}")
        synchronize(getattr(zeroer, "device", None))
    return labels


# ---------------------------------------------------------------------------- eager steps (shared)







# ---------------------------------------------------------------------------- helpers

def block_tables(runner) -> list:
    multi = getattr(getattr(runner, "input_batch", None), "block_table", None)
    if multi is None:
        return []
    tables = getattr(multi, "block_tables", None)
    return list(tables) if tables is not None else [multi]








def _buffer_dtype(buf, default):
    if buf is None:
        return default
    gpu = getattr(buf, "gpu", buf)
    return getattr(gpu, "dtype", default)




def v2_warmup_kernels_runs(view) -> str | None:
    """Who runs Model Runner V2's ``warmup_kernels`` on this engine (which calls
    ``KVBlockZeroer.warmup``, 0.28-0.34), or None: vLLM where its worker calls it (every V2 engine
    up to 0.28; 0.29-0.33 with ``kernel_config.enable_jit_warmup`` on, 0.34 also with
    ``cache_config.enable_extensible_kv_cache``), else kwarm's ``v2_warmup`` family after start-up
    where it is selected and no CUDA graph is captured (on 0.28 vLLM runs it there itself, and
    ``v2_warmup`` then does not). JIT warmup off by hand with CUDA graphs: None, also on 0.28,
    where the family's own zeroing is then one launch more than needed, never a second compile."""
    from kwarm_ext import config
    from kwarm_ext.kernels import v2_warmup

    if resolve_or_none(v2_warmup.WARMUP_KERNELS) is None:
        return None
    if _read(view, "kernel_config.enable_jit_warmup", None) in (None, True) or \
            _read(view, "cache_config.enable_extensible_kv_cache", False) is True:
        return "run by vLLM"

    if config.get().warmups.wants("v2_warmup") and v2_warmup.applies(view) is None and \
            v2_warmup.captured_nothing(view):
        return "run by kwarm's v2_warmup after start-up where vLLM's call is off"
    return None


def _read(view, path: str, default):
    for root in (getattr(view.worker, "vllm_config", None), getattr(view.runner, "vllm_config", None)):
        obj = root
        for part in path.split("."):
            obj = getattr(obj, part, None) if obj is not None else None
        if obj is not None:
            return obj
    return default
