"""vLLM 0.34's extensible KV cache is sized from the allocator's peak since ``compile_or_warm_up_model``
began; kwarm's warmup runs inside vLLM's own ``_outside_kv_cache_transient_window`` (what vLLM's
one-off autotuning runs in), so its peak is not kept free as a serving transient. Run on the real
0.33.0 and 0.34.0 modules through kwarm's real kernel_warmup wrapper; what cannot exist here (a GPU's
allocator statistics, the KV cache's device buffer) is a recorder."""
from __future__ import annotations

import pytest

from conftest import clean_env, result_of, run_py

SCRIPT = r"""
import json, os, types
import torch
from kwarm_ext import patches, warmup

calls = []
torch.accelerator.synchronize = lambda *a: None  # no accelerator here
torch.accelerator.reset_peak_memory_stats = lambda *a: calls.append("reset peak")


class KVCache:  # ExtensibleKVCache's part the window uses
    def record_transient_peak(self):
        calls.append("record peak")
        return {}


warmup.run = lambda worker: calls.append("kwarm warmup")
out = {}
for name, kv in (("extensible", KVCache()), ("fixed", None)):
    calls.clear()
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(extensible_kv_cache=kv), device="cpu")
    patches._wrap_kernel_warmup(lambda w: calls.append("vllm kernel_warmup"), None, (worker,), {})
    out[name] = list(calls)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_kwarms_warmup_peak_stays_out_of_the_kv_cache_reserve(release):
    out = result_of(run_py(SCRIPT, env=clean_env(CUDA_VISIBLE_DEVICES=""), release=release))
    if release == "0.34.0":
        assert out["extensible"] == ["vllm kernel_warmup", "record peak", "kwarm warmup", "reset peak"]
    else:  # no extensible KV cache, no window
        assert out["extensible"] == ["vllm kernel_warmup", "kwarm warmup"]
    assert out["fixed"] == ["vllm kernel_warmup", "kwarm warmup"]
