"""JIT surfaces (kwarm_ext/surfaces/): the monitor counts every surface's builds, the learner records
FlashInfer's JIT modules into the manifest, a restart replays them, and a manifest's FlashInfer items
are untrusted input.

The real FlashInfer vLLM 0.24 installs (0.6.12) runs: its getters, its ``JitSpec`` and kwarm's wrapper
of ``build_and_load``. Stood in for, because they cannot exist here: the GPU check of
``gen_jit_spec`` (``check_cuda_arch``), the nvcc/ninja build (``JitSpec.build``) and loading the
built library (``JitSpec.load``).
"""
from __future__ import annotations

import json

import pytest

from kwarm_ext import manifest, manifest_files, monitor, surfaces
from kwarm_ext.surfaces import flashinfer as fi_surface
from kwarm_ext.surfaces.triton import learn, replay
from test_manifest import STAMP

pytest.importorskip("flashinfer")


class _Loaded:
    """A loaded module: every function of it exists and does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.fixture
def no_nvcc(monkeypatch):
    """FlashInfer's JIT without a GPU or compiler: returns the (step, module name) calls."""
    import flashinfer.activation
    import flashinfer.concat_ops
    import flashinfer.jit.core as core

    calls = []
    monkeypatch.setattr(core, "check_cuda_arch", lambda: None)
    monkeypatch.setattr(core.JitSpec, "build", lambda self, verbose, need_lock=True: calls.append(("build", self.name)))
    monkeypatch.setattr(core.JitSpec, "load", lambda self, so_path: calls.append(("load", self.name)) or _Loaded())
    getters = (flashinfer.concat_ops.get_concat_mla_module, flashinfer.activation.get_act_and_mul_module)
    for getter in getters:
        getter.cache_clear()
    yield calls
    for getter in getters:
        getter.cache_clear()


def test_every_surface_answers_the_interface():
    assert [s.name for s in surfaces.every()] == list(surfaces.NAMES)
    for surface in surfaces.every():
        assert isinstance(surface, surfaces.Surface) and surface.label != "?"
    assert [s.name for s in surfaces.with_sections()] == ["flashinfer"]
    assert surfaces.get("flashinfer").version() == __import__("flashinfer").__version__


def test_the_monitor_counts_flashinfer_builds_with_their_getter(no_nvcc):
    import flashinfer.activation
    import flashinfer.concat_ops

    with monitor.capture() as events:
        flashinfer.concat_ops.get_concat_mla_module()
        flashinfer.activation.get_act_and_mul_module("silu")
        flashinfer.activation.get_act_and_mul_module("silu")  # the getter's cache: no second build
    assert no_nvcc == [("build", "concat_mla"), ("load", "concat_mla"), ("build", "silu_and_mul"), ("load", "silu_and_mul")]
    assert [(e.surface, e.module, e.name) for e in events] == [
        ("flashinfer", "flashinfer.concat_ops", "concat_mla"), ("flashinfer", "flashinfer.activation", "silu_and_mul")]
    items = [fi_surface.SURFACE.item(e) for e in events]
    assert items == [{"getter": "flashinfer.concat_ops.get_concat_mla_module", "args": [], "module": "concat_mla"},
                     {"getter": "flashinfer.activation.get_act_and_mul_module", "args": ["silu"], "module": "silu_and_mul"}]
    with monitor.capture() as after:  # nothing built once nobody listens... and nothing counted twice
        flashinfer.concat_ops.get_concat_mla_module()
    assert after == []


def test_a_build_that_no_getter_asked_for_is_counted_not_learned(no_nvcc):
    import flashinfer.jit.dsv3_optimizations as gen

    with monitor.capture() as events:
        gen.gen_concat_mla_module().build_and_load()
    assert [e.name for e in events] == ["concat_mla"]
    assert fi_surface.SURFACE.item(events[0]) is None


def test_learned_flashinfer_modules_are_replayed_at_the_next_start(no_nvcc, tmp_path):
    import flashinfer.activation
    import flashinfer.concat_ops

    path = tmp_path / "m.json"
    recorder = learn.Recorder(("vllm.",))
    watched = learn.watch_surfaces(recorder)
    assert list(watched) == ["flashinfer"]
    try:
        flashinfer.concat_ops.get_concat_mla_module()
        flashinfer.activation.get_act_and_mul_module("gelu_tanh")
    finally:
        watched["flashinfer"]()
    recorder.on_built(monitor.Compiled("x", "y", "y", surface="flashinfer", payload={}))  # no getter: nothing
    items = recorder.take_unsaved_items()
    assert [i["module"] for i in items["flashinfer"][1]] == ["concat_mla", "gelu_tanh_and_mul"]
    result = manifest_files.save(str(path), STAMP, surfaces=items)
    assert result.added == 2 and result.total == 2
    assert manifest_files.save(str(path), STAMP, surfaces=items).added == 0  # merged by key

    # the next start: a fresh process has empty getter caches
    flashinfer.concat_ops.get_concat_mla_module.cache_clear()
    flashinfer.activation.get_act_and_mul_module.cache_clear()
    no_nvcc.clear()
    state = replay.prepare(str(path), STAMP, ("vllm.",))
    assert state.refused is None and not state.skipped
    done = replay.replay_surface(state, "flashinfer")
    assert [d.split(" ")[0] for d in done] == ["gelu_tanh_and_mul", "concat_mla"]  # in key order
    assert ("build", "concat_mla") in no_nvcc and ("build", "gelu_tanh_and_mul") in no_nvcc
    assert "2 flashinfer" in state.summary()
    no_nvcc.clear()
    with monitor.capture() as events:  # what a request then asks for is in the getter's cache
        flashinfer.activation.get_act_and_mul_module("gelu_tanh")
    assert events == [] and no_nvcc == []


def test_a_replay_on_another_flashinfer_version_skips_with_one_reason(no_nvcc):
    item = {"getter": "flashinfer.concat_ops.get_concat_mla_module", "args": [], "module": "concat_mla"}
    result = fi_surface.SURFACE.replay([item], "0.0.1")
    assert result.done == [] and no_nvcc == []
    assert result.skipped == [(fi_surface.SURFACE.describe(item),
                               f"recorded with FlashInfer 0.0.1, this is {fi_surface.SURFACE.version()}")]


def test_a_getter_that_builds_another_module_is_reported(no_nvcc):
    item = {"getter": "flashinfer.activation.get_act_and_mul_module", "args": ["silu"], "module": "gelu_and_mul"}
    result = fi_surface.SURFACE.replay([item], fi_surface.SURFACE.version())
    assert result.done == [] and "built silu_and_mul, not gelu_and_mul" in result.skipped[0][1]


@pytest.mark.parametrize("raw, why", [
    ({"getter": "os.system", "args": ["id"], "module": "x"}, "not a public function of a flashinfer module"),
    ({"getter": "flashinfer.jit.core.gen_jit_spec", "args": [], "module": "x"}, "not a get_*module* function"),
    ({"getter": "flashinfer._x.get_module", "args": [], "module": "x"}, "not a public function"),
    ({"getter": "flashinfer.x.get_module\n", "args": [], "module": "x"}, "not a dotted name"),
    ({"getter": "flashinfer.x.get_module", "args": ["../../etc"], "module": "x"}, "no plain word"),
    ({"getter": "flashinfer.x.get_module", "args": ["a/b"], "module": "x"}, "no plain word"),
    ({"getter": "flashinfer.x.get_module", "args": [[1]], "module": "x"}, "list is not a plain value"),
    ({"getter": "flashinfer.x.get_module", "args": [1e999], "module": "x"}, "not finite"),
    ({"getter": "flashinfer.x.get_module", "args": [{"dtype": "bfloat16; x"}], "module": "x"}, "dict is not a plain value"),
    ({"getter": "flashinfer.x.get_module", "args": [0] * 33, "module": "x"}, "at most 32"),
    ({"getter": "flashinfer.x.get_module", "args": [], "module": "x", "extra": 1}, "exactly the fields"),
])
def test_untrusted_flashinfer_items_are_refused_with_their_reason(tmp_path, raw, why):
    good = {"getter": "flashinfer.activation.get_act_and_mul_module", "args": [{"dtype": "bfloat16"}, True, None, 2.5],
            "module": "m"}
    data = manifest.Manifest(STAMP).as_json()
    data["surfaces"] = {"flashinfer": {"version": "0.6.12", "items": [good, raw]},
                        "tilelang\x1b[2J": {"version": "1", "items": []}}
    parsed = manifest.parse(json.dumps(data))
    assert parsed.surfaces["flashinfer"]["items"] == [good]
    problems = dict(parsed.problems)
    assert why in problems["flashinfer item 1"], problems
    assert problems["surface tilelang\\x1b[2J"] == "not a surface this kwarm knows: ignored"


def test_a_malformed_surfaces_section_is_one_problem():
    data = manifest.Manifest(STAMP).as_json()
    for section, expected in (([], "surfaces"), ({"flashinfer": {"items": 3}}, "surface flashinfer")):
        data["surfaces"] = section
        parsed = manifest.parse(json.dumps(data))
        assert [label for label, _ in parsed.problems] == [expected] and parsed.surfaces == {}


def test_items_of_a_new_flashinfer_version_replace_the_old_ones(tmp_path):
    path = str(tmp_path / "m.json")
    old = {"getter": "flashinfer.a.get_x_module", "args": [1], "module": "x1"}
    new = {"getter": "flashinfer.a.get_x_module", "args": [2], "module": "x2"}
    manifest_files.save(path, STAMP, surfaces={"flashinfer": ("0.6.12", [old])})
    manifest_files.save(path, STAMP, surfaces={"flashinfer": ("0.7.2", [new])})
    assert manifest_files.load(path).surfaces == {"flashinfer": {"version": "0.7.2", "items": [new]}}
