"""The serving benchmark's CPU side (bench/serve_bench.py, serve_tokenizer.py, serve_probe/): the
tokenizer it builds, the request set, the probe in a real interpreter, the counting and the table,
and one whole measured phase against a stand-in for the GPU server (tests/fixtures/openai_standin.py:
real openai client, real probe, real xgrammar; only `vllm serve` itself is replaced)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import serve_bench  # noqa: E402
import serve_tokenizer  # noqa: E402

TINY = BENCH / "models" / "tiny-qwen3-next"
STANDIN = REPO / "tests" / "fixtures" / "openai_standin.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-model")
    info = serve_tokenizer.write_model_folder(TINY, out)
    return out, info


def test_the_tokenizer_fills_the_models_vocabulary_and_renders_tools(model_dir):
    from transformers import AutoTokenizer

    out, info = model_dir
    assert info["vocab_size"] == 4096 and info["tokenizer_ids"] == 4096
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 4096 and tok.eos_token == "<|im_end|>" and tok.eos_token_id == info["eos_id"]
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Session 1"}, {"role": "user", "content": "hello"}],
        tools=serve_bench.TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nSession 1<|im_end|>\n<|im_start|>system\n# Tools\n<tools>\n")
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # byte-level: any text round-trips, JSON included
    sample = 'Brastoo {"city": "x", "days": 12} ünïcode'
    assert tok.decode(tok(sample)["input_ids"]) == sample
    assert json.loads((out / "config.json").read_text()) == json.loads((TINY / "config.json").read_text())


def test_xgrammar_reads_the_tokenizer_as_byte_level(model_dir):
    import xgrammar
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir[0]), vocab_size=4096)
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL and info.vocab_size == 4096
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(serve_bench.SCHEMA_A))
    assert grammar is not None


def test_the_tokenizer_is_deterministic_and_refuses_a_config_without_vocabulary(tmp_path, model_dir):
    again = serve_tokenizer.write_model_folder(TINY, tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (model_dir[0] / "tokenizer.json").read_bytes()
    assert again["eos_id"] == model_dir[1]["eos_id"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"vocab_size": 10}')
    assert serve_tokenizer.main([str(tmp_path / "bad"), str(tmp_path / "o")]) == 1


def test_the_long_prompt_reaches_its_token_count(model_dir):
    from tokenizers import Tokenizer

    n = serve_bench.long_prompt_words(model_dir[0] / "tokenizer.json")
    tok = Tokenizer.from_file(str(model_dir[0] / "tokenizer.json"))
    text = serve_bench.prompt_text(serve_bench.content_seed("x", "long-prompt", "first"), n)
    assert len(tok.encode(text).ids) >= serve_bench.LONG_PROMPT_TOKENS


def test_the_request_set_covers_what_operators_send():
    kinds = {k.name: k for k in serve_bench.REQUEST_KINDS}
    bodies = {name: serve_bench.build_request(k, 5, "bench") for name, k in kinds.items()}
    sampled = [b for b in bodies.values() if b.get("temperature", 0) > 0]
    assert any("top_k" in b.get("extra_body", {}) for b in sampled)
    assert any("min_p" in b.get("extra_body", {}) for b in sampled)
    assert any("seed" in b for b in sampled)
    assert bodies["stream"]["stream"] and bodies["burst"]["stream"]
    assert bodies["n2"]["n"] == 2 and bodies["logprobs"]["top_logprobs"] == 5
    assert bodies["prompt-logprobs"]["extra_body"]["prompt_logprobs"] == 3
    assert {"presence_penalty", "frequency_penalty"} <= set(bodies["penalties"])
    assert "repetition_penalty" in bodies["penalties"]["extra_body"]
    assert bodies["logit-bias"]["logit_bias"] and bodies["stop-strings"]["stop"]
    schemas = [b["response_format"]["json_schema"]["schema"] for b in bodies.values() if "response_format" in b]
    assert schemas == [serve_bench.SCHEMA_A, serve_bench.SCHEMA_B]
    assert bodies["tool-call"]["tool_choice"]["function"]["name"] == "get_weather"
    assert "prompt" in bodies["completion"] and "messages" not in bodies["completion"]
    # structured and tool requests must be free to end (ignore_eos would fight the grammar)
    for name in ("json-schema", "json-schema-new", "tool-call"):
        assert "ignore_eos" not in bodies[name].get("extra_body", {})


def test_no_servers_first_follows_the_other_servers_first():
    """The default order sends each server's first and repeats of a kind back to back: a first never
    comes right after the other server's first (which, on plain `vllm serve`, compiles); the order
    of the runs published before it (``request``) always put kwarm's first there."""
    kinds = serve_bench.REQUEST_KINDS[:3]
    names = ["plain", "kwarm"]
    for order in serve_bench.ORDERS:
        schedule = serve_bench.request_schedule(kinds, names, order)
        assert sorted((k.name, o, n) for k, o, n in schedule) == sorted(
            (k.name, o, n) for k in kinds for o in ("first", *serve_bench.REPEATS) for n in names), "every request once"
        after_first = [(a[2], b[2]) for a, b in zip(schedule, schedule[1:]) if a[1] == "first" and b[1] == "first"]
        assert (after_first == []) == (order == "kind"), (order, after_first)
    kind_order = serve_bench.request_schedule(kinds, names)
    assert [(k.name, o, n) for k, o, n in kind_order[:5]] == [
        (kinds[0].name, "first", "plain"), (kinds[0].name, "repeat", "plain"), (kinds[0].name, "repeat2", "plain"),
        (kinds[0].name, "repeat3", "plain"), (kinds[0].name, "first", "kwarm")]


def test_every_first_occurrence_is_followed_by_its_repeat_with_other_content():
    plan = serve_bench.request_plan()
    assert [o for _, o in plan] == ["first", "repeat", "repeat2", "repeat3"] * len(serve_bench.REQUEST_KINDS)
    seeds = {serve_bench.content_seed("cold", "chat-greedy", o) for o in ("first", *serve_bench.REPEATS)}
    assert len(seeds) == 4, "other content for every repeat"
    assert [k.name for k, _ in plan[::4]] == [k.name for k in serve_bench.REQUEST_KINDS]
    seeds = {serve_bench.content_seed(p, k.name, o) for p in ("cold", "warm") for k, o in plan}
    assert len(seeds) == 2 * len(plan)  # no two requests share content, across phases too
    kind = serve_bench.KIND_BY_NAME["chat-greedy"]
    first = serve_bench.build_request(kind, serve_bench.content_seed("cold", kind.name, "first"), "m")
    repeat = serve_bench.build_request(kind, serve_bench.content_seed("cold", kind.name, "repeat"), "m")
    assert first["messages"][0]["content"] != repeat["messages"][0]["content"]
    assert len(first["messages"][1]["content"].split()) == len(repeat["messages"][1]["content"].split())


def _probe_run(tmp_path, code, model):
    log = tmp_path / "events.jsonl"
    env = dict(os.environ, SERVE_PROBE_LOG=str(log), PYTHONPATH=str(BENCH / "serve_probe"),
               TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code, str(model)], env=env, capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return serve_bench.load_events(log), proc


PROBED = """
import json, sys
import triton.knobs as knobs
knobs.compilation.listener(src=None, metadata={"name": "_my_kernel"}, metadata_group={}, times=None, cache_hit=False)
knobs.compilation.listener(src=None, metadata={"name": "_from_disk"}, metadata_group={}, times=None, cache_hit=True)
import xgrammar
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok))
schema = json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}})
compiler.compile_json_schema(schema)
compiler.compile_json_schema(schema)
tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
import torch
torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
print("ok")
"""


def test_the_probe_records_each_surface_in_a_real_interpreter(tmp_path, model_dir):
    events, proc = _probe_run(tmp_path, PROBED, model_dir[0])
    assert proc.stdout.strip().endswith("ok")
    hooked = {e["name"] for e in events if e["kind"] == "probe" and e.get("hooked")}
    assert {"triton.knobs", "xgrammar", "transformers.utils.chat_template_utils", "torch._dynamo.callback"} <= hooked
    lazy = serve_bench.summarize_lazy(events)
    assert lazy["names"]["triton"] == {"_my_kernel": 1} and lazy["names"]["triton_disk"] == {"_from_disk": 1}
    assert lazy["counts"]["torch_compile"] >= 1
    # tokenizer info and the first compile are work; the cached second compile is not
    assert lazy["names"]["xgrammar"]["GrammarCompiler.compile_json_schema"] == 1
    assert "TokenizerInfo.from_huggingface" in lazy["frontend_ms"]
    assert lazy["n"] == 2 + lazy["counts"]["torch_compile"]


def test_lazy_work_carries_its_time_per_surface():
    """The probe's seconds add up per compiled surface (what CuTe DSL's compiles cost a start, on
    every restart too), and the table says them; a result without them (before 2026-12-07) reads as
    before."""
    events = [{"kind": "cute_dsl", "name": "CPDeltaRulePrefillSm90", "s": 3.5},
              {"kind": "cute_dsl", "name": "LLBf16Dotprod", "s": 0.25},
              {"kind": "triton", "name": "_k", "cache_hit": True, "s": 0.004},
              {"kind": "xgrammar", "name": "TokenizerInfo.from_huggingface", "s": 0.02}]
    lazy = serve_bench.summarize_lazy(events)
    assert lazy["seconds"] == {"cute_dsl": 3.75, "triton_disk": 0.0}
    text = serve_bench.lazy_text(lazy)
    assert "triton disk 1, 0.0 s (_k)" in text and "cute dsl 2, 3.8 s (CPDeltaRulePrefillSm90, LLBf16Dotprod)" in text
    assert "xgrammar 20 ms" in text
    del lazy["seconds"]
    assert "cute dsl 2 (CPDeltaRulePrefillSm90, LLBf16Dotprod)" in serve_bench.lazy_text(lazy)


STATS = """
import os, sys, time
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # Model Runner V2
assert getattr(StructuredOutputManager.grammar_bitmask, "_serve_probe", False)
for _ in range(3):
    for call in (StructuredOutputManager.grammar_bitmask, GPUModelRunner.sample_tokens):
        try:
            call(None, {}, {}, {}, {})
        except Exception:
            pass
if os.fork() == 0:  # a forked process keeps its own lines
    time.sleep(0.6)
    os._exit(0)
os.wait()
time.sleep(0.6)
if len(sys.argv) > 1:  # CUDA cannot exist here: its allocators' counters stand in
    import torch
    torch.cuda.is_initialized = lambda: True
    torch.cuda.memory_stats = lambda: {"num_device_alloc": 7, "num_device_free": 2, "num_alloc_retries": 0, "x": 1}
    torch.cuda.host_memory_stats = lambda: {"num_host_alloc": 5, "host_alloc_time.total": 900, "active_requests.current": 1}
    time.sleep(0.6)
"""


def test_the_probes_stats_name_each_process_thread_collections_and_step_calls(tmp_path):
    env = dict(os.environ, SERVE_PROBE_LOG=str(tmp_path / "events.jsonl"), SERVE_PROBE_STATS="0.2",
               PYTHONPATH=str(BENCH / "serve_probe"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", STATS, "cuda"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(tmp_path.glob("stats.*.jsonl"))
    assert len(files) == 2, "one file per process, the forked one too"
    lines = {f: [json.loads(x) for x in f.read_text().splitlines()] for f in files}
    parent = next(v for v in lines.values() if v[-1]["calls"])
    assert parent[-1]["calls"]["StructuredOutputManager.grammar_bitmask"][0] == 3
    steps = [e for line in parent for e in line["steps"].get("GPUModelRunner.sample_tokens", [])]
    assert len(steps) == 3 and all(t > 1e9 and ms >= 0 for t, ms in steps), "each step once, in one line"
    assert not any("StructuredOutputManager.grammar_bitmask" in line["steps"] for line in parent)
    assert any(name.startswith("MainThread:") for name in parent[-1]["threads"])
    assert {"0", "1", "2"} <= set(parent[-1]["gc"]) and parent[-1]["switch_s"] > 0
    assert parent[0]["allocators"] is None, "no CUDA initialized: nothing read, nothing initialized"
    assert parent[-1]["allocators"] == {"num_device_alloc": 7, "num_device_free": 2, "num_alloc_retries": 0,
                                        "num_host_alloc": 5, "host_alloc_us": 900, "host_active": 1}
    child = next(v for v in lines.values() if v is not parent)
    assert child[-1]["calls"] == {}, "the child counts its own calls"


def test_the_probe_is_inert_without_its_variable_and_chains_the_users_sitecustomize(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    code = "import os, sys; print(os.environ.get('USER_SITE_RAN'), any(type(f).__name__ == 'Finder' for f in sys.meta_path))"
    env = {k: v for k, v in os.environ.items() if k != "SERVE_PROBE_LOG"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "serve_probe"), str(user)])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False"], out.stderr
    env["SERVE_PROBE_LOG"] = str(tmp_path / "e.jsonl")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "True"], out.stderr


def test_cache_folders_name_what_compiled_where_the_probe_cannot_see():
    surface = serve_bench.cache_surface
    assert surface("vllm/deep_gemm/cache/kernel.fp8_gemm.abc123/kernel.cubin") == ("deep_gemm", "kernel.fp8_gemm.abc123")
    assert surface("flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/sampling/sampling.so") == ("flashinfer", "sampling")
    assert surface("flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/sampling/sampling.cuda.o") is None
    assert surface("triton/AB12/_fwd_kernel.cubin") == ("triton", "_fwd_kernel")
    assert surface("vllm/torch_compile_cache/x/rank_0/triton_cache/CD/_gdn_fwd.cubin") == ("triton", "_gdn_fwd")
    assert surface("home/.cache/tvm-ffi/torch_c_dlpack/libtorch_c_dlpack.so") == ("tvm_ffi", "libtorch_c_dlpack.so")
    assert surface("triton/AB12/_fwd_kernel.json.tmp") is None
    new = ["vllm/deep_gemm/cache/kernel.k1.h/a.cubin", "vllm/deep_gemm/cache/kernel.k1.h/b.cubin",
           "home/.cache/tvm-ffi/x/lib.so", "triton/AB/_k.cubin"]
    lazy = serve_bench.summarize_lazy([], new)
    # one DeepGEMM kernel however many files; Triton's files are the probe's to count
    assert lazy["names"] == {"deep_gemm": {"kernel.k1.h": 1}, "tvm_ffi": {"lib.so": 1}} and lazy["n"] == 2


def test_backends_come_from_vllms_own_log_lines():
    lines = [
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:02 [cuda.py:509] Using FLASH_ATTN attention backend out of "
        "potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:02 [qwen_gdn_linear_attn.py:300] Using FlashInfer GDN prefill "
        "kernel (requested=auto, head_k_dim=128).",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:03 [topk_topp_sampler.py:149] Using FlashInfer for top-p & top-k sampling.",
        "INFO 12-05 08:01:03 [kwarm early_builds.py] kwarm: early FlashInfer builds: sampling, started at launch",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:03 [topk_topp_sampler.py:149] Using FlashInfer for top-p & top-k sampling.",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:04 [kv_cache_utils.py:1169] GPU KV cache size: 1,234,816 tokens, "
        "Maximum concurrency for 12,288 tokens per request: 100.49x",
        "(APIServer pid=10) INFO 12-05 08:01:09 [api_server.py:1] Starting vLLM API server on http://127.0.0.1:8100",
    ]
    assert serve_bench.backends_from_log(lines) == [
        "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].",
        "Using FlashInfer GDN prefill kernel (requested=auto, head_k_dim=128).",
        "Using FlashInfer for top-p & top-k sampling.",
        "GPU KV cache size: 1,234,816 tokens, Maximum concurrency for 12,288 tokens per request: 100.49x"]


def test_start_stages_place_each_milestone_after_launch_by_the_lines_own_time():
    """Where a start's time went: the first line of each milestone, vLLM's, FlashInfer's (logging's
    default format) and kwarm's background build line, at its own timestamp; lines without one and
    later repeats do not move a stage."""
    import datetime

    launched = datetime.datetime(2026, 12, 5, 8, 0, 0).timestamp()
    lines = [
        "(APIServer pid=10) INFO 12-05 08:00:30 [kwarm early_builds.py:1] kwarm: starting the FlashInfer builds",
        "INFO 12-05 08:00:02 [kwarm early_builds.py] kwarm: early FlashInfer builds: sampling (not: concat_mla: x)",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:00:40 [core.py:90] Initializing a V1 LLM engine (v0.33.0) with config: x",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:00:52 [gpu_model_runner.py:1] Model loading took 1.2 GiB memory and 3.1 seconds",
        "2026-12-05 08:01:10,123 - INFO - core.py:594 - flashinfer.jit: Building JIT module sampling; this can take minutes",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:01:20 [monitor.py:1] torch.compile took 20.10 s in total",
        "Initializing a V1 LLM engine again, without a time",
        "INFO 12-05 08:02:05 [kwarm early_builds.py] kwarm: early FlashInfer build: sampling ready in 84.0 s",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:02:30 [gpu_worker.py:1] Available KV cache memory: 4.0 GiB",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:02:31 [kv_cache_utils.py:1] GPU KV cache size: 1,234 tokens",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:02:40 [warmup.py:1] kwarm: warmup done in 9.0 s on rank 0",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:02:50 [gpu_model_runner.py:1] Graph capturing finished in 10 secs",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:02:51 [core.py:1] init engine (profile, create kv cache, warmup model) took 60 s",
        "(APIServer pid=10) INFO 12-05 08:02:53 [kwarm warm_requests.py:1] kwarm: warm requests: 17 of 17 kinds ran",
        "(APIServer pid=10) INFO 12-05 08:02:54 [api_server.py:1] Starting vLLM API server on http://127.0.0.1:8100",
        "(EngineCore_DP0 pid=11) INFO 12-05 08:09:00 [core.py:90] Initializing a V1 LLM engine (v0.33.0) again",
    ]
    stages = serve_bench.start_stages(lines, launched)
    assert stages == {"kwarm early builds started": 2, "engine": 40, "weights loaded": 52, "sampling build started": 70, "torch.compile done": 80,
                      "kwarm early sampling built": 125, "memory profiled": 150, "kv cache sized": 151,
                      "kwarm warmup done": 160, "graphs captured": 170, "engine ready": 171,
                      "kwarm warm requests done": 173, "api listening": 174}
    assert serve_bench.stages_text(stages).startswith("kwarm early builds started 2, engine 40, weights loaded 52, sampling build started 70,")
    assert serve_bench.stages_text({}) == "—"


def test_servers_never_get_a_backend_forcing_variable_and_each_has_its_own_caches(tmp_path):
    base = {"PATH": "/bin", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ATTENTION_BACKEND": "TRITON_ATTN",
            "KWARM_ENABLE": "1", "PYTHONPATH": "/staged/site"}
    plain = serve_bench.server_env(base, tmp_path / "plain", "plain")
    kwarm = serve_bench.server_env(base, tmp_path / "kwarm", "kwarm")
    for env in (plain, kwarm):
        assert not {"VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ATTENTION_BACKEND"} & set(env)
        assert env["PYTHONPATH"].split(os.pathsep) == [str(BENCH / "serve_probe"), "/staged/site"]
    assert "KWARM_ENABLE" not in plain and "KWARM_REPORT" in kwarm
    for key in ("HOME", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                "FLASHINFER_WORKSPACE_BASE", "CUTE_DSL_CACHE_DIR"):
        assert plain[key] != kwarm[key] and Path(plain[key]).is_dir()


def test_kwarm_env_reaches_kwarms_server_alone(tmp_path):
    """``--kwarm-env``: a variant of kwarm's server (a family left out, learning off) beside the
    others; the base environment's KWARM_ variables still never reach either server."""
    base = {"PATH": "/bin", "KWARM_WARMUPS": "sampler"}
    extra = {"KWARM_WARMUPS": "-eager_gemm"}
    plain = serve_bench.server_env(base, tmp_path / "plain", "plain", extra)
    kwarm = serve_bench.server_env(base, tmp_path / "kwarm", "kwarm", extra)
    assert "KWARM_WARMUPS" not in plain and kwarm["KWARM_WARMUPS"] == "-eager_gemm"


@pytest.mark.parametrize("argv, error", [
    (["--kwarm-env", "WARMUPS=-eager_gemm"], "--kwarm-env: expected KWARM_NAME=VALUE"),
    (["--kinds", "json-schema,no-such-kind"], "--kinds: expected some of"),
    (["--kinds", ","], "--kinds: expected some of"),
])
def test_a_bad_variant_or_kind_is_refused_in_one_line(capsys, argv, error):
    with pytest.raises(SystemExit):
        serve_bench.main([str(BENCH / "models" / "tiny-qwen3-next"), *argv])
    assert error in capsys.readouterr().err


def test_kinds_keeps_the_plans_order():
    namespace = serve_bench.main.__globals__["argparse"].Namespace
    assert [k.name for k in serve_bench.kinds_of(namespace(kinds="tool-call, json-schema"))] == ["json-schema", "tool-call"]
    assert serve_bench.kinds_of(namespace(kinds=None)) == serve_bench.REQUEST_KINDS
    plan = serve_bench.request_plan(serve_bench.kinds_of(namespace(kinds="penalties")))
    assert [(k.name, o) for k, o in plan] == [("penalties", o) for o in ("first", *serve_bench.REPEATS)]


def test_the_kwarm_server_runs_through_kwarm_run(tmp_path):
    args = serve_bench.main.__globals__["argparse"].Namespace(
        max_model_len=12288, gpu_util=0.2, kv_bytes="4G", serve_arg=["--enforce-eager"], learn=True)
    plain = serve_bench.serve_command(tmp_path, 8100, args, kwarm=False)
    kw = serve_bench.serve_command(tmp_path, 8101, args, kwarm=True)
    assert plain[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert "--load-format" in plain and plain[-1] == "--enforce-eager"
    # a named tool_choice needs both on vLLM 0.33 (measured: 400 with --tool-call-parser alone)
    i = plain.index("--enable-auto-tool-choice")
    assert plain[i + 1:i + 3] == ["--tool-call-parser", "hermes"]
    i = kw.index("run")
    assert kw[i + 1:i + 3] == ["--learn", "--"] and kw[i + 3:][4] == str(tmp_path)


def _standin_server(tmp_path, name, port, tokenizer_dir):
    root = tmp_path / name
    root.mkdir()
    env = serve_bench.server_env(dict(os.environ), root, name)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return serve_bench.Server(name, root, port, [sys.executable, str(STANDIN), str(port), str(tokenizer_dir), "0.5"], env)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_whole_phase_against_a_stand_in_server(tmp_path, model_dir):
    servers = [_standin_server(tmp_path, n, _free_port(), model_dir[0]) for n in ("plain", "kwarm")]
    messages = []
    try:
        started = serve_bench.start_phase(servers, "cold", 120, messages.append)
        for s in servers:
            assert started[s.name]["ready"] and started[s.name]["launch_to_ready_s"] >= 0.5
            assert "Using FlashInfer for top-p & top-k sampling." in started[s.name]["backends"]
        measured = serve_bench.measure_phase(servers, "cold", "bench", 100, time.time() + 300, messages.append)
    finally:
        for s in servers:
            s.stop()
    assert not any(s.alive() for s in servers)
    for name in ("plain", "kwarm"):
        reqs = measured[name]["requests"]
        assert len(reqs) == 4 * len(serve_bench.REQUEST_KINDS)
        assert [r.get("error") for r in reqs] == [None] * len(reqs)
        by = {(r["kind"], r["occurrence"]): r for r in reqs}
        assert by[("stream", "first")]["ttft_s"] > 0 and by[("stream", "first")]["itl_s"] > 0
        assert by[("burst", "first")]["completed"] == serve_bench.BURST
        assert by[("tool-call", "first")]["tool_calls"] == 1 and by[("json-schema", "first")]["valid_json"]
        # the stand-in's first structured request builds xgrammar's tokenizer info and compiles a grammar;
        # the same schema again compiles nothing; a new schema compiles once more
        first = by[("json-schema", "first")]["lazy"]
        assert "TokenizerInfo.from_huggingface" in first["names"]["xgrammar"]
        # (a cached grammar returns in microseconds, but on a loaded test machine its lookup may pass
        # the probe's 1 ms floor, and the stand-in's schema compiles in about 2 ms: no tokenizer info
        # again, and no more than a lookup's time)
        repeat = by[("json-schema", "repeat")]["lazy"]
        assert set(repeat["names"].get("xgrammar", {})) <= {"GrammarCompiler.compile_json_schema"}
        assert repeat["frontend_ms"].get("GrammarCompiler.compile_json_schema", 0) < 5
        assert by[("json-schema-new", "first")]["lazy"]["names"]["xgrammar"] == {"GrammarCompiler.compile_json_schema": 1}
        assert by[("chat-greedy", "first")]["lazy"]["n"] == 0
    result = {"model": "tiny", "versions": {"vllm": "0.33.0"}, "request_kinds": [
        {"name": k.name} for k in serve_bench.REQUEST_KINDS], "phases": [{"phase": "cold", "servers": {
            n: {**started[n], **measured[n]} for n in ("plain", "kwarm")}}]}
    table = serve_bench.render([result])
    assert "| launch to ready |" in table and "| json-schema |" in table and "xgrammar" in table
    assert table.count("\n| ") >= len(serve_bench.REQUEST_KINDS) + 3


def test_table_cli_and_help(tmp_path, capsys):
    path = tmp_path / "r.serve.json"
    path.write_text(json.dumps({"schema": serve_bench.SCHEMA, "model": "m", "versions": {}, "phases": []}))
    assert serve_bench.main(["--table", str(path)]) == 0
    assert serve_bench.main(["--table", str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err
    out = subprocess.run([sys.executable, str(BENCH / "serve_bench.py"), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--restarts" in out.stdout and "vllm serve" in out.stdout
    bad = subprocess.run([sys.executable, str(BENCH / "serve_bench.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "no config.json" in bad.stderr


def test_importing_the_benchmark_needs_no_vllm_torch_or_openai():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import serve_bench, serve_tokenizer; "
            "print(sorted(m for m in ('vllm', 'torch', 'openai', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_chart_draws_every_kind_for_both_servers(tmp_path):
    """One published result: every kind of both servers gets its first (filled) and repeat (hollow)."""
    published = sorted((BENCH / "published").glob("*/serve/tiny-qwen3-next.serve.json"))
    assert published, "the published serving result"
    out = tmp_path / "c.svg"
    assert serve_bench.main(["--chart", str(out), str(published[0])]) == 0
    import xml.etree.ElementTree as ET

    root = ET.parse(out).getroot()
    circles = root.findall("{http://www.w3.org/2000/svg}circle")
    data = json.loads(published[0].read_text())
    answered = sum(1 for p in data["phases"] for s in p["servers"].values() for r in s.get("requests", [])
                   if not r.get("error"))
    assert len(circles) == answered
    with pytest.raises(SystemExit):
        serve_bench.main(["--chart", str(out)])


def test_production_memory_mode_records_kv_tokens_peak_memory_and_draws_the_curves(tmp_path, monkeypatch):
    """--one-at-a-time: vLLM's KV cache line, nvidia-smi's samples thinned keeping each maximum, the
    table's memory rows and the memory chart (one polyline per server)."""
    assert serve_bench.kv_cache_tokens(["INFO (EngineCore) GPU KV cache size: 1,234,567 tokens",
                                        "GPU KV cache size: 2,048 tokens"]) == 2048
    assert serve_bench.kv_cache_tokens(["no such line"]) is None
    samples = iter([1000, 30000, 79215, 20600, None, 21000])
    monkeypatch.setattr(serve_bench, "gpu_used_mib", lambda: next(samples, None))
    sampler = serve_bench.GpuMemory(time.time(), interval=0.01)
    with sampler:
        time.sleep(0.3)
    summary = sampler.summary(every=1000)
    assert summary["peak_gpu_mib"] == 79215 and summary["gpu_mib_timeline"] == [[0, 79215]]
    result = {"schema": serve_bench.SCHEMA, "model": "m", "versions": {}, "args": {"gpu_util": 0.92},
              "request_kinds": [], "phases": [{"phase": "cold", "servers": {
                  "plain": {"kv_cache_tokens": 1000, "peak_gpu_mib": 70000, "launch_to_ready_s": 10,
                            "gpu_mib_timeline": [[0, 500], [10, 70000]]},
                  "kwarm": {"kv_cache_tokens": 1000, "peak_gpu_mib": 69000, "launch_to_ready_s": 12,
                            "gpu_mib_timeline": [[0, 500], [12, 69000]],
                            "kwarm_report_summary": {"memory": "bound 2.00 GiB"}}}}]}
    table = serve_bench.render([result])
    assert "| GPU KV cache (vLLM's log) | 1000 tokens | 1000 tokens |" in table
    assert "| peak GPU memory (nvidia-smi, alone on the GPU) | 70000 MiB | 69000 MiB |" in table
    assert "bound 2.00 GiB" in table
    path = tmp_path / "r.serve.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "m.svg"
    assert serve_bench.main(["--memory-chart", str(out), str(path)]) == 0
    import xml.etree.ElementTree as ET

    lines = ET.parse(out).getroot().findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2


def test_one_at_a_time_runs_each_server_alone_and_saves_the_result(tmp_path, monkeypatch):
    """The whole of ``run`` in --one-at-a-time mode against stand-in servers: plain starts, answers
    and stops before kwarm starts; the result file holds both, with their memory samples."""
    monkeypatch.setattr(serve_bench, "serve_command", lambda model_dir, port, args, kwarm: [
        sys.executable, str(STANDIN), str(port), str(model_dir), "0.2"])
    monkeypatch.setattr(serve_bench, "gpu_used_mib", lambda: 1234)
    out = tmp_path / "out"
    code = serve_bench.main([str(TINY), "--out", str(out), "--work", str(tmp_path / "work"), "--one-at-a-time",
                             "--restarts", "0", "--port", str(_free_port()), "--gpu-util", "0.92", "--kv-bytes=",
                             "--share-flashinfer-cache", "--budget", "300"])
    assert code == 0
    result = json.loads((out / "tiny-qwen3-next.serve.json").read_text())
    servers = result["phases"][0]["servers"]
    assert set(servers) == {"plain", "kwarm"}
    for s in servers.values():
        assert s["ready"] and s["peak_gpu_mib"] == 1234 and len(s["requests"]) == 4 * len(serve_bench.REQUEST_KINDS)
    assert all(s["requests"][-1]["t1"] < servers["kwarm"]["requests"][0]["t0"] for s in [servers["plain"]])
    assert result["args"]["kv_bytes"] == "" and "--kv-cache-memory-bytes" not in result["commands"]["plain"]


def test_servers_stop_before_the_request_lock_goes(tmp_path, monkeypatch):
    """Beside other benchmarks (--sync-lock), a benchmark stops its servers before it lets the
    request lock go: the next one's first requests never share the CPU with a shutdown."""
    import contextlib

    events = []
    real_stop = serve_bench.Server.stop

    def stop(self, grace: float = 30):
        if self.proc is not None:
            events.append(("stop", self.name))
        return real_stop(self, grace)

    @contextlib.contextmanager
    def lock(path, exclusive):
        events.append(("take", exclusive))
        try:
            yield 0.0
        finally:
            events.append(("release", exclusive))

    monkeypatch.setattr(serve_bench.Server, "stop", stop)
    monkeypatch.setattr(serve_bench, "sync_lock", lock)
    monkeypatch.setattr(serve_bench, "serve_command", lambda model_dir, port, args, kwarm: [
        sys.executable, str(STANDIN), str(port), str(model_dir), "0.2"])
    out = tmp_path / "out"
    assert serve_bench.main([str(TINY), "--out", str(out), "--work", str(tmp_path / "work"), "--restarts", "0",
                             "--port", str(_free_port()), "--sync-lock", str(tmp_path / "lock"),
                             "--share-flashinfer-cache", "--budget", "300"]) == 0
    released = events.index(("release", True))
    assert events.index(("take", True)) < released
    assert {("stop", "plain"), ("stop", "kwarm")} <= set(events[:released]), events


def test_traffic_at_ready_reads_vllms_and_the_http_middlewares_counters_from_a_real_metrics_page():
    """What a user could see of kwarm's warm requests: vLLM's engine counters and the HTTP metrics
    at ready, read from a page prometheus_client itself writes (vLLM's names, label sets summed)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    success = Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=registry)
    success.labels("bench", "length").inc(2)
    success.labels("bench", "stop").inc(1)
    Counter("vllm:prompt_tokens", "", ["model_name"], registry=registry).labels("bench").inc(0)
    Counter("http_requests", "", ["handler", "status"], registry=registry).labels("/v1/models", "2xx").inc()
    Gauge("vllm:num_requests_running", "", registry=registry).set(5)  # not traffic: left out
    counters = serve_bench.traffic_counters(generate_latest(registry).decode())
    assert counters == {"vllm:request_success_total": 3.0, "vllm:prompt_tokens_total": 0.0,
                        "http_requests_total": 1.0}
    assert serve_bench.traffic_text(counters) == "requests 3, prompt tokens 0, HTTP requests 1"
    assert serve_bench.traffic_text(None) == "—" and serve_bench.traffic_text({}) == "none of them"
    table = serve_bench.render([{"model": "m", "versions": {}, "phases": [{"phase": "cold", "servers": {
        "plain": {"launch_to_ready_s": 10.0, "traffic_at_ready": {"http_requests_total": 1.0}},
        "kwarm": {"launch_to_ready_s": 9.0, "traffic_at_ready": counters}}}]}])
    assert "| `/metrics` at ready (besides the readiness poll) | HTTP requests 1 | requests 3, prompt tokens 0, HTTP requests 1 |" in table


def test_the_memory_sampler_says_which_process_held_what(tmp_path, monkeypatch):
    """--one-at-a-time names each process's most memory and who held what at the peak, from
    nvidia-smi's compute apps (a stand-in nvidia-smi on PATH; the labels from /proc)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "case \"$1\" in --query-compute-apps*) "
                    f"printf '%s, 70000\\n%s, 1500\\n' {os.getpid()} 999999999 ;; *) echo 71500 ;; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert serve_bench.gpu_used_mib() == 71500
    apps = serve_bench.gpu_processes_mib()
    cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    assert apps[0] == [f"{os.getpid()} {cmdline[:60]}", 70000]  # this process, by its command line
    assert apps[1] == ["999999999 ?", 1500]
    sampler = serve_bench.GpuMemory(time.time(), interval=0.01)
    with sampler:
        time.sleep(0.2)
    summary = sampler.summary()
    assert summary["peak_gpu_mib"] == 71500
    assert summary["gpu_processes_peak_mib"]["999999999 ?"] == 1500
    assert summary["gpu_processes_at_peak_mib"] == apps


def test_the_tables_repeat_is_the_median_of_the_kinds_repeats_and_a_single_one_is_itself():
    """One repeat is a single sample (10-20 ms apart from its first with nothing lazy in either, on
    the GPU host): the table's repeat, its ratio and the claims read the median of three."""
    row = {"kind": "logit-bias", "first": {"s": 0.0575},
           "repeat": {"s": 0.0395}, "repeat2": {"s": 0.0520}, "repeat3": {"s": 0.0510}}
    assert serve_bench.repeat_time(row) == 0.0510
    assert serve_bench.repeat_time({"repeat": {"s": 0.0395}}) == 0.0395, "results with one repeat read as before"
    assert serve_bench.repeat_time({"repeat": {"s": 0.04}, "repeat2": {"error": "cut"}}) == 0.04
    assert serve_bench.repeat_time({"first": {"s": 0.05}}) is None
    requests = [dict(r, kind="logit-bias", occurrence=o) for o, r in row.items() if o != "kind"]
    result = {"model": "m", "request_kinds": [{"name": "logit-bias"}], "versions": {}, "gpu": "g",
              "phases": [{"phase": "cold", "servers": {"plain": {"requests": requests}, "kwarm": {"requests": requests}}}]}
    line = next(l for l in serve_bench.render([result]).splitlines() if l.startswith("| logit-bias"))
    assert line.startswith("| logit-bias | 57.5 | 51.0 | 1.13 |"), line


def test_the_memory_sampler_reads_one_nvidia_smi_loop_and_falls_back_to_one_call_a_sample(tmp_path, monkeypatch):
    """A capture's peak lasts about a second: one ``nvidia-smi --loop-ms`` process samples every
    0.1 s (a stand-in nvidia-smi on PATH prints three samples, then waits to be stopped); where
    that process prints nothing, one call a sample, as before."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *--query-compute-apps*) printf '%s, 70000\\n' 999999999 ;;\n"
                    "  *--loop-ms=100*) printf '71000\\n72000\\n[N/A]\\n71500\\n'; exec sleep 30 ;;\n"
                    "  *) echo 60000 ;; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    sampler = serve_bench.GpuMemory(time.time())
    t0 = time.time()
    with sampler:
        time.sleep(0.5)
    assert time.time() - t0 < 5, "stopping ends the loop process"
    assert [mib for _, mib in sampler.samples] == [71000, 72000, 71500]
    summary = sampler.summary()
    assert summary["peak_gpu_mib"] == 72000 and summary["gpu_sample_interval_s"] == 0.1
    assert summary["gpu_processes_at_peak_mib"] == [["999999999 ?", 70000]]
    fake.write_text(fake.read_text().replace("*--loop-ms=100*)", "*--loop-ms=100*) exit 1 ;; *--never*)"))
    sampler = serve_bench.GpuMemory(time.time(), interval=0.05)
    with sampler:
        time.sleep(0.3)
    assert sampler.samples and {mib for _, mib in sampler.samples} == {60000}, "one call a sample"


def test_the_noise_floor_counts_firsts_against_their_repeats_and_each_repeat_against_the_other_two(tmp_path, capsys):
    """Issue 60's bar (1.1x and 10 ms) against the host's noise: a kind counts when its first and
    three repeats ran with no lazy work named; its first is over against the repeats' median, each
    repeat against the mean of the other two."""
    def kind(name, first, reps, lazy=0):
        occ = dict(zip(("first", *serve_bench.REPEATS), (first, *reps)))
        return [{"kind": name, "occurrence": o, "s": t, "lazy": {"n": lazy if o == "first" else 0}}
                for o, t in occ.items()]

    requests = (kind("a", 0.080, (0.050, 0.052, 0.051))          # first over; repeats within
                + kind("b", 0.050, (0.050, 0.070, 0.050))        # first within; repeat2 over the other two
                + kind("c", 0.500, (0.050, 0.050, 0.050), lazy=1)  # a compile in its first: not counted
                + kind("d", 0.060, (0.050, 0.055, 0.045))        # 60 vs median 50: 1.2x and 10 ms, not over
                + [{"kind": "e", "occurrence": "first", "s": 0.05}])  # no repeats: not counted
    result = {"schema": serve_bench.SCHEMA, "model": "m", "phases": [
        {"phase": "cold", "servers": {"kwarm": {"requests": requests}}}]}
    [row] = serve_bench.noise_rows([result])
    assert (row["kinds"], row["firsts_over"], row["repeats"], row["repeats_over"]) == (3, 1, 9, 1)
    path = tmp_path / "serve-x" / "m.serve.json"
    path.parent.mkdir()
    path.write_text(json.dumps(result))
    assert serve_bench.main(["--noise", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| serve-x | m | cold | kwarm | 3 | 1 of 3 | 1 of 9 |" in out
    assert "| all | | | kwarm | 3 | 1 of 3 (33%) | 1 of 9 (11%) |" in out


def test_the_detached_run_outlives_its_call_and_hands_its_results_to_the_call_that_sees_it_end(tmp_path):
    """bench/serve_detached.sh: `start` leaves serve_run.sh running (setsid) and says so when WAIT
    ends first; a second `start` is refused; `wait` copies the results and the log into the
    call's $OUT and ends with serve_run's exit status (a stand-in serve_run here: no GPU)."""
    stand_in = tmp_path / "serve_run.sh"
    stand_in.write_text('sleep 2; echo "| table |" > "$OUT/table.md"; echo "BUDGET=$BUDGET"; exit 3\n')
    env = dict(os.environ, RUN=str(tmp_path / "run"), SERVE_RUN=str(stand_in), BUDGET="1100")

    def detached(cmd, out, wait):
        return subprocess.run(["bash", str(BENCH / "serve_detached.sh"), cmd], capture_output=True, text=True,
                              timeout=60, env=dict(env, OUT=str(out), WAIT=str(wait)))

    first = detached("start", tmp_path / "call1", 0)
    assert first.returncode == 0 and "still running" in first.stdout, first.stdout + first.stderr
    assert not (tmp_path / "call1" / "table.md").exists()
    again = detached("start", tmp_path / "call1", 0)
    assert again.returncode == 1 and "already going" in again.stdout
    done = detached("wait", tmp_path / "call2", 30)
    assert done.returncode == 3 and "exit status 3" in done.stdout and "BUDGET=1100" in done.stdout, done.stdout
    assert (tmp_path / "call2" / "table.md").read_text() == "| table |\n"
    assert (tmp_path / "call2" / "run.log").is_file()
    nothing = subprocess.run(["bash", str(BENCH / "serve_detached.sh"), "wait"], capture_output=True, text=True,
                             timeout=60, env=dict(env, RUN=str(tmp_path / "none")))
    assert nothing.returncode == 1 and "nothing started" in nothing.stdout


def test_the_run_keeps_the_keys_of_the_cute_dsl_kernels_kwarm_saved_but_not_their_native_code(tmp_path):
    """Beside the manifest, ``<manifest>.cute_dsl/<source>/<stack>/`` holds each kernel's key
    (JSON), its object file and meta.json: the results keep the JSON (which kernels the engine
    compiled, and with what), never the object files."""
    saved = tmp_path / "kwarm-manifest.cute_dsl" / "flashinfer_gdn" / "0123456789abcdef"
    saved.mkdir(parents=True)
    (saved / "kwarm_cute_a.json").write_text('{"dict": "d", "key": [1], "kernel": "K"}')
    (saved / "kwarm_cute_a.o").write_bytes(b"\x7fELF")
    (saved / "meta.json").write_text("{}")
    dest = tmp_path / "out" / "m.kwarm.cute_dsl"
    assert serve_bench.keep_cute_dsl_keys(tmp_path / "kwarm-manifest.cute_dsl", dest) == 2
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == ["flashinfer_gdn/0123456789abcdef/kwarm_cute_a.json", "flashinfer_gdn/0123456789abcdef/meta.json"]
    assert serve_bench.keep_cute_dsl_keys(tmp_path / "none.cute_dsl", tmp_path / "out2") == 0
    assert not (tmp_path / "out2").exists()


def test_phase_labels_name_each_cold_start_and_each_warm_restart():
    assert serve_bench.phase_labels(1, 1) == ["cold", "warm"]
    assert serve_bench.phase_labels(3, 2) == ["cold", "cold2", "cold3", "warm", "warm2"]


def test_each_further_cold_start_empties_every_servers_caches(tmp_path, monkeypatch):
    """``--colds 2``: the whole of ``run`` against stand-in servers; before the second cold start every
    compile cache (and kwarm's manifest) a server's first start wrote is gone."""
    monkeypatch.setattr(serve_bench, "serve_command", lambda model_dir, port, args, kwarm: [
        sys.executable, str(STANDIN), str(port), str(model_dir), "0.2"])
    seen = []
    real = serve_bench.start_phase

    def start_phase(group, label, timeout, log):
        seen.append((label, sorted(p.name for s in group for p in (s.root / "cache" / "triton").iterdir())))
        for s in group:  # what a start leaves in its caches
            (s.root / "cache" / "triton" / f"kernel-{label}").write_text("compiled")
        return real(group, label, timeout, log)

    monkeypatch.setattr(serve_bench, "start_phase", start_phase)
    out = tmp_path / "out"
    code = serve_bench.main([str(TINY), "--out", str(out), "--work", str(tmp_path / "work"), "--colds", "2",
                             "--restarts", "1", "--port", str(_free_port()), "--kinds", "chat-greedy,n2",
                             "--budget", "600"])
    assert code == 0
    assert seen == [("cold", []), ("cold2", []), ("warm", ["kernel-cold2", "kernel-cold2"])]
    result = json.loads((out / "tiny-qwen3-next.serve.json").read_text())
    assert [p["phase"] for p in result["phases"]] == ["cold", "cold2", "warm"]
    rows = serve_bench.firsts_rows([result])
    assert {r["colds"] for r in rows} == {2} and {r["kind"] for r in rows} == {"chat-greedy", "n2"}


def test_a_further_cold_start_refuses_a_shared_flashinfer_cache(capsys):
    with pytest.raises(SystemExit):
        serve_bench.main([str(TINY), "--colds", "2", "--share-flashinfer-cache"])
    assert "--colds" in capsys.readouterr().err


def test_the_median_first_over_every_cold_start_meets_the_bar_where_single_firsts_may_not(tmp_path, capsys):
    """Issue 60's bar on the median of a kind's firsts over several cold starts: one slow first of
    three (the host) leaves the median under it; a cost every cold start's first pays does not."""
    def kind(name, first, reps=(0.050, 0.051, 0.049), lazy=0):
        occ = dict(zip(("first", *serve_bench.REPEATS), (first, *reps)))
        return [{"kind": name, "occurrence": o, "s": t, "lazy": {"n": lazy if o == "first" else 0}} for o, t in occ.items()]

    def cold(label, noisy, paying, lazy=0):
        return {"phase": label, "servers": {"kwarm": {"requests": kind("noisy", noisy) + kind("paying", paying, lazy=lazy)}}}

    result = {"schema": serve_bench.SCHEMA, "model": "m", "phases": [
        cold("cold", 0.090, 0.080, lazy=1), cold("cold2", 0.051, 0.081), cold("cold3", 0.050, 0.079),
        {"phase": "warm", "servers": {"kwarm": {"requests": kind("noisy", 0.500) + kind("paying", 0.500)}}}]}
    rows = {r["kind"]: r for r in serve_bench.firsts_rows([result])}
    assert rows["noisy"]["colds"] == 3 and rows["noisy"]["first_s"] == 0.051 and not rows["noisy"]["over"]
    assert rows["paying"]["first_s"] == 0.080 and rows["paying"]["over"] and rows["paying"]["firsts_with_lazy"] == 1
    assert rows["noisy"]["repeat_s"] == 0.050, "the repeats of every cold start, not the warm restart's"
    path = tmp_path / "m.serve.json"
    path.write_text(json.dumps(result))
    assert serve_bench.main(["--firsts", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| m | kwarm | noisy | 3 | 90.0, 51.0, 50.0 | 51.0 | 50.0 | 1.02 | 0 |  |" in out
    assert "| all | kwarm | | | | | | | | 1 of 2 kinds |" in out
