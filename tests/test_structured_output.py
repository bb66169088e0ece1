"""The ``structured_output`` warmup against vLLM's real ``StructuredOutputManager`` (0.33.0 and the
venv's 0.24.0), its real ``XgrammarBackend`` and xgrammar, on a real byte-level BPE tokenizer
(bench/serve_tokenizer.py). Only vLLM's config (which cannot be built without a GPU here) is a
namespace with the attributes the manager and the backend read, and the request a namespace with
the fields ``grammar_init`` reads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import clean_env, result_of

REPO = Path(__file__).resolve().parent.parent

SCENARIO = r'''
import json, sys, time, types
sys.path.insert(0, sys.argv[1])
import serve_tokenizer
ARGS = json.loads(sys.argv[3])
folder = sys.argv[2]
serve_tokenizer.write_model_folder(serve_tokenizer.Path(sys.argv[1]) / "models" / "tiny-qwen3-next", folder)

import kwarm_ext
kwarm_ext.activate("test")  # installs kwarm's patches (post-import hooks)
import vllm.v1.structured_output as so
from kwarm_ext import patches, structured_output

ns = types.SimpleNamespace
model_config = ns(skip_tokenizer_init=False, tokenizer=folder, model=folder, tokenizer_mode="auto",
                  tokenizer_revision=None, revision=None, trust_remote_code=False, runner_type="generate",
                  code_revision=None, hf_config=ns(model_type="qwen3_next"), get_vocab_size=lambda: 4096)
vllm_config = ns(model_config=model_config, parallel_config=ns(distributed_executor_backend="mp"),
                 scheduler_config=ns(max_num_seqs=16), speculative_config=None,
                 structured_outputs_config=ns(backend=ARGS["backend"], reasoning_parser="", reasoning_parser_plugin="",
                                              enable_in_reasoning=False, disable_any_whitespace=False,
                                              disable_additional_properties=False),
                 decoding_config=ns(backend=ARGS["backend"], reasoning_backend="", disable_any_whitespace=False,
                                    disable_additional_properties=False))
out = {"hooked": [p.target for p in (patches.STRUCTURED_OUTPUT_INIT, patches.GRAMMAR_INIT) if p.applied(so)]}
t0 = time.perf_counter()
manager = so.StructuredOutputManager(vllm_config)
out["init_s"] = time.perf_counter() - t0
future = getattr(manager, structured_output.PREBUILT, None)
out["prebuilt"] = future is not None
prebuilt = future.result(timeout=120) if future is not None else None

schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def request(backend):
    params = ns(structured_outputs=ns(_backend=backend, json=schema), guided_decoding=None, all_stop_token_ids=set())
    spec = ns(structured_output_key=(so.StructuredOutputOptions.JSON if hasattr(so, "StructuredOutputOptions")
                                     else __import__("vllm.v1.structured_output.backend_types",
                                                     fromlist=["x"]).StructuredOutputOptions.JSON, schema),
              grammar=None, reasoning_ended=None)
    return ns(structured_output_request=spec, sampling_params=params, request_id="r", use_structured_output=True,
              vllm_xargs=None, prompt_token_ids=[1, 2], num_computed_tokens=0)


first = request(ARGS["first"])
try:
    manager.grammar_init(first)
    grammar = first.structured_output_request.grammar
    grammar = grammar.result(timeout=60) if hasattr(grammar, "result") else grammar
    out["grammar"] = type(grammar).__name__
except Exception as exc:
    out["grammar_error"] = f"{type(exc).__name__}: {exc}"[:300]
out["backend"] = type(manager.backend).__name__ if manager.backend is not None else None
out["is_prebuilt"] = prebuilt is not None and manager.backend is prebuilt
out["backend_name"] = getattr(manager, "backend_name", "absent")
print("RESULT " + json.dumps(out))
'''


def _run(tmp_path, release=None, **args):
    """The scenario in a fresh interpreter (vLLM `release`'s files first on sys.path; None: the venv's)."""
    import subprocess
    import tempfile

    from conftest import release_path

    args = {"backend": "auto", "first": "xgrammar", **args}
    env = clean_env(CUDA_VISIBLE_DEVICES="", KWARM_ENABLE="1", **args.pop("env", {}))
    path = release_path(release) if release else None
    if path is not None:
        env["PYTHONPATH"] = str(path)
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    proc = subprocess.run([sys.executable, str(script), str(REPO / "bench"), str(tmp_path / "model"), json.dumps(args)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    return result_of(proc)


@pytest.mark.parametrize("release", [None, "0.33.0"], ids=["0.24.0", "0.33.0"])
def test_the_first_xgrammar_request_gets_the_backend_built_at_start(tmp_path, release):
    out = _run(tmp_path, release)
    assert out["hooked"] == ["vllm.v1.structured_output.StructuredOutputManager.__init__",
                             "vllm.v1.structured_output.StructuredOutputManager.grammar_init"]
    assert out["prebuilt"] and out["init_s"] < 5, out
    assert out["backend"] == "XgrammarBackend" and out["is_prebuilt"], out
    assert out.get("grammar") == "XgrammarGrammar", out
    if release == "0.33.0":
        assert out["backend_name"] == "xgrammar"


def test_a_first_request_on_another_backend_gets_that_backend(tmp_path):
    out = _run(tmp_path, "0.33.0", first="guidance")
    assert out["prebuilt"] and out["backend"] == "GuidanceBackend" and not out["is_prebuilt"], out
    assert out["backend_name"] == "guidance"


@pytest.mark.parametrize("args, why", [({"backend": "guidance"}, "backend"),
                                       ({"env": {"KWARM_WARMUPS": "-structured_output"}}, "KWARM_WARMUPS")])
def test_nothing_is_built_where_xgrammar_is_not_configured_or_the_warmup_is_off(tmp_path, args, why):
    out = _run(tmp_path, "0.33.0", **{**args, "first": "guidance" if why == "backend" else "xgrammar"})
    assert not out["prebuilt"], why
    assert out["backend"] in ("GuidanceBackend", "XgrammarBackend") and not out["is_prebuilt"]
