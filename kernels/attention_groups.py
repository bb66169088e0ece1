"""The model runner's attention groups, as the attention families read them: a backend's
groups, a group's metadata builder and layers, the rows of its real block table, and a
``CommonAttentionMetadata`` for a dummy batch that vLLM's own builders turn into metadata.

Not a family (no ``applies``/``plan``): shared by ``dsa_indexer``, ``triton_attn`` and ``triton_mla``.
"""
from __future__ import annotations

import dataclasses
import itertools

from kwarm_ext.vllm_compat import Missing, resolve


def groups_of(view, backend: str) -> list:
    """The runner's AttentionGroups whose backend is `backend` (``get_name()``)."""
    out = []
    for per_group in getattr(view.runner, "attn_groups", None) or ():
        for group in per_group:
            try:
                name = group.backend.get_name()
            except Exception:  # get_name may raise NotImplementedError
                continue
            if name == backend:
                out.append(group)
    return out


def backend_reason(view, backend: str) -> str | None:
    """An attention family's ``applies``: None when the engine runs `backend`, else why not."""
    if view.runner is None:
        return "no model runner"
    if not view.has_backend(backend):
        return f"no {backend} attention backend"
    return None


def group_layer(view, group):
    """The group's first layer in the engine's forward context, or None."""
    return next((view.forward_context[name] for name in getattr(group, "layer_names", None) or ()
                 if name in view.forward_context), None)


def group_id_of(group, label: str) -> int:
    """The group's ``kv_cache_group_id`` (its block table's index); Missing when it has none."""
    group_id = getattr(group, "kv_cache_group_id", None)
    if not isinstance(group_id, int):
        raise Missing(f"{label}: no kv_cache_group_id")
    return group_id


def vllm_config(view):
    """The engine's VllmConfig, from the worker or the runner."""
    return getattr(view.worker, "vllm_config", None) or getattr(view.runner, "vllm_config", None)


def model_dtype(view):
    """The model's dtype (its activations'), from the engine's model config; None if unknown."""
    return getattr(getattr(vllm_config(view), "model_config", None), "dtype", None)


def metadata_builder(group):
    """The group's first metadata builder (``metadata_builders[0]``, or ``get_metadata_builder()``)."""
    builders = getattr(group, "metadata_builders", None)
    if builders:
        return builders[0]
    get = getattr(group, "get_metadata_builder", None)
    return get() if get is not None else None


def metadata_build(group, builder):
    """``common -> metadata``, as the runner builds a batch's attention metadata: the group's own
    ``build_metadata`` (0.33+, both runners; it maps the block table to kernel blocks where the
    group splits the KV manager's blocks), else ``builder.build``."""
    own = getattr(group, "build_metadata", None)
    if callable(own):
        return lambda common: own(common)
    return lambda common: builder.build(common_prefix_len=0, common_attn_metadata=common)


def block_table(view, group_id: int, num_reqs: int):
    """Rows of the runner's real block table of KV-cache group `group_id` (what
    ``CommonAttentionMetadata.block_table_tensor`` is a slice of)."""
    runner = view.runner
    tables = getattr(getattr(runner, "input_batch", None), "block_table", None)
    if tables is not None:  # V1: MultiGroupBlockTable (0.20-0.33)
        return tables[group_id].get_device_tensor(num_reqs)
    v2 = getattr(getattr(runner, "block_tables", None), "input_block_tables", None)
    if v2 is not None:  # V2 (v1/worker/gpu/block_table.py; the only runner from 0.34): the rows
        # gather_block_tables fills and the attention metadata slices
        return v2[group_id][:num_reqs]
    raise Missing("runner has neither input_batch.block_table (V1) nor block_tables (V2)")


def bound_kv_cache(layer):
    """The KV cache bound to `layer`: a tensor (0.24+) or the first virtual engine's."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    if kv is None or not hasattr(kv, "shape") or kv.numel() == 0:
        raise Missing(f"layer {getattr(layer, 'layer_name', '?')} has no bound kv_cache")
    return kv


def dataclass_instance(cls, **values):
    """`cls` (a dataclass, such as a backend's metadata class) from `values`; a required field
    `values` does not name gets None, an optional one its default."""
    kwargs = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name in values:
            kwargs[field.name] = values[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            kwargs[field.name] = None
    return cls(**kwargs)


def common_metadata(table, query_lens: list, seq_lens: list, device):
    """vLLM's ``CommonAttentionMetadata`` for a batch of ``len(query_lens)`` requests whose
    block-table rows are `table` and whose new-token slots are all -1 (padding: no KV write).

    Built from the dataclass's own fields, so a release that adds an optional field leaves
    it at its default; a required field kwarm does not know is a :class:`Missing`."""
    import torch

    cls = resolve("vllm.v1.attention.backend:CommonAttentionMetadata",
                  "vllm.v1.attention.backends.utils:CommonAttentionMetadata")
    n, tokens = len(query_lens), sum(query_lens)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    computed = seqs - torch.tensor(query_lens, dtype=torch.int32)
    values = {
        "query_start_loc": starts.to(device), "query_start_loc_cpu": starts,
        "seq_lens": seqs.to(device), "seq_lens_cpu": seqs, "_seq_lens_cpu": seqs,
        "num_computed_tokens_cpu": computed, "_num_computed_tokens_cpu": computed,
        "num_reqs": n, "num_actual_tokens": tokens, "max_query_len": max(query_lens),
        "max_seq_len": max(seq_lens), "block_table_tensor": table[:n],
        "slot_mapping": torch.full((tokens,), -1, dtype=torch.int64, device=device), "causal": True,
    }
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in values and field.init:
            kwargs[field.name] = values[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise Missing(f"CommonAttentionMetadata needs {field.name}, which kwarm does not fill")
    return cls(**kwargs)
