"""The ``triton_attn`` family against each release's real ``TRITON_ATTN`` selection code.

Each release runs tests/scenarios/triton_attn.py in a fresh interpreter (``run_scenario_cases``)
with Triton's interpreter on CPU. What is real and what stands in:

- vLLM's own ``TritonAttentionImpl`` (its ``__init__`` and ``forward``), its
  ``TritonAttentionMetadataBuilder`` (``__init__`` computes ``seq_threshold_3D`` from the
  config, ``build`` the metadata), ``unified_attention`` (which picks the 2D or 3D form),
  ``FullAttentionSpec``, the runner's block tables (V1's ``MultiGroupBlockTable``; on 0.34, which
  has no V1 runner, V2's ``BlockTables``: tests/scenarios/block_tables.py), the group
  (``AttentionGroup``, whose ``build_metadata`` the runners call from 0.33) and the KV-cache
  layout of the backend.
- the engine config is a namespace holding what the builder reads (head counts, CUDA-graph
  mode and capture sizes, ``max_num_seqs``): a real ``VllmConfig`` needs a model on disk and
  a platform; the attention layer is an ``nn.Module`` with the attributes ``Attention.__init__``
  sets (that ``__init__`` needs a current vLLM config and a platform).
- "Production" is every batch of up to ``max_num_seqs`` requests: decodes, uniform prefills of
  several query lengths, and mixed batches (decodes plus one prefill), each through the same
  builder and ``forward``, with the kernels' launches recorded (their Triton key) instead of
  run. The family must reach exactly that set of keys.
"""
from __future__ import annotations

import functools

import pytest

from conftest import MATRIX, run_scenario_cases

RELEASES = MATRIX + ("0.33.0", "0.34.0")

# The published Qwen3-Next's attention per rank at TP 1 (16 query heads, 2 KV heads), CUDA graphs
# on as the bench runs it; then an eager engine with 8 KV heads, where vLLM's threshold (128 //
# kv heads = 16) falls inside max_num_seqs 40, so the selection switches forms on the way.
CASES = {
    "graphs": {"heads": 16, "kv_heads": 2, "seqs": 16, "tokens": 4096, "mode": "FULL_AND_PIECEWISE",
               "capture_sizes": [1, 2, 4, 8, 16, 24, 32], "prefill_lens": [2, 5, 40, 300], "run": True},
    "eager": {"heads": 16, "kv_heads": 8, "seqs": 40, "tokens": 2048, "mode": "NONE", "capture_sizes": [],
              "prefill_lens": [2, 3, 17, 33]},
}


@functools.lru_cache(maxsize=None)
def _batch(release: str) -> dict:
    return run_scenario_cases("triton_attn", CASES, release, timeout=400)


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.mark.parametrize("case", sorted(CASES))
def test_warmed_keys_are_exactly_the_keys_production_reaches(release, case):
    result = _batch(release)[case]
    assert result["missing"] == [], f"batches whose key no warmed batch has: {result['missing']}"
    assert result["extra"] == [], f"warmed batches no production batch matches: {result['extra']}"
    assert len(result["batches"]) == len(result["production"])


def test_eager_engine_switches_forms_inside_max_num_seqs(release):
    result = _batch(release)["eager"]
    assert result["threshold"] == 16
    assert result["forms"] == ["2D", "3D"], "both forms are reachable here, so both are warmed"
    decodes = [b for b in result["batches"] if b.startswith("decode")]
    assert "decode x1" in decodes and any(int(b.split("x")[1]) > 16 for b in decodes), decodes


def test_graphs_engine_runs_its_steps_with_launches(release):
    if release != "0.24.0":
        pytest.skip("launches under Triton's interpreter once, on the venv's release")
    result = _batch(release)["graphs"]
    assert result["threshold"] in (16, 32), "vLLM snaps it to the capture size nearest 128 // 2"
    assert len(result["steps"]) == 1 and result["steps"][0] == [
        f"{b}: {'kernel_unified_attention + reduce_segments' if b.startswith('decode') else 'kernel_unified_attention'}"
        for b in result["batches"]]
    summary = result["details"]["summary"]
    assert summary.startswith(f"group 0: {len(result['batches'])} batches, one per specialization (")
    assert "no compile ahead" in summary, "Triton's interpreter has nothing to compile"
