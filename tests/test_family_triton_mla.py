"""The ``triton_mla`` family against each release's real ``TRITON_MLA`` decode code.

Each release runs tests/scenarios/triton_mla.py in a fresh interpreter (``run_scenario_cases``)
with Triton's interpreter on CPU. What is real and what stands in:

- vLLM's own ``TritonMLAImpl.forward_mqa`` (which picks ``num_kv_splits``), ``decode_attention_fwd``
  and its kernels, ``MLACommonMetadata`` / ``MLACommonDecodeMetadata``, ``TritonMLABackend`` and
  the runner's block tables (V1's ``MultiGroupBlockTable``; V2's ``BlockTables`` on 0.34, which
  has no V1 runner);
- the impl is built without its ``__init__`` (it asks the platform for a CUDA device), with the
  attributes ``__init__`` sets; its SM count is 2, so the release's cap (2 x SMs) falls inside
  ``max_model_len`` 4096 and the split counts stop at 4;
- "production" is every decode of 1, 2, 5 and 16 requests (of 1 query token, and from 0.28 also
  of 3: speculative decoding) at longest contexts from 1 to
  ``max_model_len`` (every 97 tokens and around each power-of-two switch), through the same
  ``forward_mqa``, with the kernels' launches recorded (their Triton key) instead of run. The
  family must reach exactly that set of keys.
"""
from __future__ import annotations

import functools

import pytest

from conftest import MATRIX, release_path, release_version, run_scenario_cases

RELEASES = tuple(r for r in (*MATRIX, "0.33.0", "0.34.0") if r == "0.24.0" or release_path(r) is not None)
SHAPE = {"heads": 16, "kv_lora_rank": 256, "rope": 32, "block": 16, "max_model_len": 4096, "sms": 2}


@functools.lru_cache(maxsize=None)
def _result(release: str) -> dict:
    return run_scenario_cases("triton_mla", SHAPE, release, timeout=400)


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


def test_warmed_keys_are_exactly_the_keys_production_reaches(release):
    result = _result(release)
    assert result["missing"] == [], f"decodes whose key no warmed decode has: {result['missing']}"
    assert result["extra"] == [], f"warmed decodes no production decode matches: {result['extra']}"
    assert len(result["chosen"]) == len(result["production"]) == 3
    # 0.28+: decodes verifying speculative tokens (3 query rows per request) are production too
    assert result["query_lens"] == ([1, 3] if release_version(release) >= (0, 28) else [1])


def test_windowed_decode_0_34_stops_splitting_at_the_window():
    """0.34's windowed layers (``decode_sliding_window``: DSpark drafts) clamp the context to the
    window before choosing the split count, and pass the window as a constexpr: the family's
    probes go through the same ``forward_mqa``, so they stop where production does."""
    result = run_scenario_cases("triton_mla", dict(SHAPE, window=1024), "0.34.0", timeout=400)
    assert result["missing"] == [] and result["extra"] == []
    assert result["splits"] == ["1", "2"], "1024 // 512 = 2 splits at most, whatever the context"
    assert all("('SLIDING_WINDOW', 1024)" in key for key in result["chosen"])


def test_split_counts_come_from_the_release_and_stop_at_its_cap(release):
    result = _result(release)
    assert result["splits"] == ["1", "2", "4"], "next power of two of context / 512, at most 2 x 2 SMs"
    assert sorted(result["chosen"].values()) == [512, 1024, 2048], "the first probe reaching each"
    # production reaches 2 splits at 1024 and 4 already at 1536 (1536 // 512 = 3 -> 4)
    assert sorted(v[1] for v in result["production"].values())[1] == 1024


def test_steps_launch_one_decode_per_split_count(release):
    result = _result(release)
    (labels,) = result["steps"]
    assert labels == [f"context {n}: NUM_KV_SPLITS {s}: _fwd_grouped_kernel_stage1 + _fwd_kernel_stage2"
                      for n, s in ((512, 1), (1024, 2), (2048, 4))]
    assert result["details"]["summary"].startswith("group 0: 3 split counts (1/2/4), 4 probes in ")


def test_applies_only_to_triton_mla(release):
    result = _result(release)
    assert result["applies"] is None
    assert result["applies_none"] == "no TRITON_MLA attention backend"
    assert {"decode", "max_seq_len"} <= set(result["metadata_fields"]), "what forward_mqa reads"


def test_plan_without_a_group_or_a_kernel_says_why(monkeypatch):
    from types import SimpleNamespace

    from kwarm_ext.engine import EngineView
    from kwarm_ext.kernels import triton_mla
    from kwarm_ext.vllm_compat import Missing

    empty = EngineView(runner=SimpleNamespace(attn_groups=[]))
    (step,) = triton_mla.plan(empty, False)
    assert step.skip == "no TRITON_MLA attention group in the runner"

    def missing():
        raise Missing("vllm.v1.attention.ops.triton_decode_attention has no _fwd_grouped_kernel_stage1")

    monkeypatch.setattr(triton_mla, "ops_kernels", missing)
    (step,) = triton_mla.plan(empty, False)
    assert step.skip.endswith("has no _fwd_grouped_kernel_stage1")
