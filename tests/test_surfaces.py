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
import sys

import pytest

from kwarm_ext import manifest, manifest_files, monitor, surfaces
from kwarm_ext.surfaces import flashinfer as fi_surface
from kwarm_ext.surfaces.triton import learn, replay
from conftest import require
from test_manifest import STAMP

require("flashinfer")


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
    result = manifest_files.save(path, STAMP, surfaces={"flashinfer": ("0.7.2", [new])})
    assert manifest_files.load(path).surfaces == {"flashinfer": {"version": "0.7.2", "items": [new]}}
    # issue 59, hole 9: said, not dropped silently
    assert result.left_out == ("1 flashinfer items recorded with flashinfer 0.6.12 dropped: replaced by those of 0.7.2",)


def test_59_9_merge_says_what_another_flashinfer_versions_items_lost(tmp_path, capsys):
    """Hole 9: merging a manifest of another FlashInfer version printed "1 items" and exit status 0."""
    from kwarm_ext import manifest_cli

    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    manifest_files.save(a, STAMP, surfaces={"flashinfer": ("0.6.12", [
        _item("flashinfer.a.get_x_module", "x", [n]) for n in range(10)])})
    manifest_files.save(b, STAMP, surfaces={"flashinfer": ("0.7.2", [_item("flashinfer.a.get_x_module", "y")])})
    assert manifest_cli.merge([a, b], str(tmp_path / "out.json")) == 1
    out = capsys.readouterr().out
    assert "10 flashinfer items recorded with flashinfer 0.6.12 dropped: replaced by those of 0.7.2" in out, out


# ---------------------------------------------------------------------------- issue 59: untrusted items, third round


def _item(getter, module="x", args=()):
    return {"getter": getter, "args": list(args), "module": module}


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A folder on ``flashinfer.__path__`` (as a namespace package's folder would be) holding a script
    that writes a marker file, reconfigures logging and exits with status 2 as it is imported, and
    defines a getter-shaped function: what ``flashinfer/data``'s CUTLASS scripts are to a manifest."""
    import flashinfer

    marker = tmp_path / "RAN"
    script = tmp_path / "kwarm_planted" / "gen" / "script.py"
    script.parent.mkdir(parents=True)
    script.write_text(f"import logging, sys\nopen({str(marker)!r}, 'w').write('ran')\n"
                      "logging.basicConfig(level=logging.DEBUG)\nsys.exit(2)\n"
                      "def get_x_module():\n    return None\n")
    monkeypatch.setattr(flashinfer, "__path__", [*flashinfer.__path__, str(tmp_path)])
    yield marker
    for name in [m for m in sys.modules if m.startswith("flashinfer.kwarm_planted")]:
        del sys.modules[name]


def test_59_1_a_getter_outside_flashinfers_own_modules_is_never_imported(no_nvcc, planted, kwarm_log):
    """Hole 1: replay imported the getter's module before looking for the getter; a manifest could
    name any importable file under the FlashInfer package (flashinfer/data's scripts) and run it."""
    real_data_script = "flashinfer.data.spdlog.scripts.extract_version"
    items = [_item("flashinfer.kwarm_planted.gen.script.get_x_module"), _item(f"{real_data_script}.get_x_module"),
             _item("flashinfer.concat_ops.get_nothing_module"),
             _item("flashinfer.concat_ops.get_concat_mla_module", "concat_mla")]
    result = fi_surface.SURFACE.replay(items, fi_surface.SURFACE.version())
    assert not planted.exists() and real_data_script not in sys.modules
    assert not any(m.startswith("flashinfer.kwarm_planted") for m in sys.modules)
    reasons = dict(result.skipped)
    assert "flashinfer.kwarm_planted is no regular package of FlashInfer; not imported" in \
        reasons[fi_surface.SURFACE.describe(items[0])]
    assert "flashinfer.data holds no JIT getters; not imported" in reasons[fi_surface.SURFACE.describe(items[1])]
    assert "get_nothing_module: no such function in this FlashInfer" in reasons[fi_surface.SURFACE.describe(items[2])]
    assert [d.split(" ")[0] for d in result.done] == ["concat_mla"], "a real getter still replays"


def test_59_1_a_module_not_imported_yet_is_checked_in_its_source(monkeypatch):
    import flashinfer.rope  # noqa: F401

    monkeypatch.delitem(sys.modules, "flashinfer.rope")  # as if nothing had imported it yet (restored after)
    assert fi_surface.getter_source_problem("flashinfer.rope.get_nothing_module") == \
        "getter flashinfer.rope.get_nothing_module: flashinfer.rope defines no function get_nothing_module; not imported"
    assert fi_surface.getter_source_problem("flashinfer.activation.get_act_and_mul_module") is None
    assert "flashinfer.rope" not in sys.modules, "checked without importing it"


def test_59_2_a_getter_that_exits_is_one_skip_and_the_rest_replays(no_nvcc, monkeypatch):
    """Hole 2, per item: a getter (or anything it runs) that raises SystemExit is that item's skip."""
    real = fi_surface._replay_one

    def exits(surface, item):
        if item["module"] == "boom":
            raise SystemExit(2)
        return real(surface, item)

    monkeypatch.setattr(fi_surface, "_replay_one", exits)
    items = [_item("flashinfer.concat_ops.get_concat_mla_module", "boom"),
             _item("flashinfer.concat_ops.get_concat_mla_module", "concat_mla")]
    result = fi_surface.SURFACE.replay(items, fi_surface.SURFACE.version())
    assert result.skipped == [(fi_surface.SURFACE.describe(items[0]), "SystemExit: 2")]
    assert [d.split(" ")[0] for d in result.done] == ["concat_mla"]


def test_59_6_verify_says_which_flashinfer_items_replay_would_refuse(tmp_path):
    """Hole 6: ``kwarm manifest verify`` called such items usable, with exit status 0."""
    import subprocess

    from conftest import clean_env

    version = fi_surface.SURFACE.version()
    good = _item("flashinfer.concat_ops.get_concat_mla_module", "concat_mla")
    path = tmp_path / "m.json"
    data = manifest.Manifest(STAMP).as_json()
    data["surfaces"] = {"flashinfer": {"version": version, "items": [good]}}
    path.write_text(json.dumps(data))
    path.chmod(0o600)

    def verify():
        return subprocess.run([sys.executable, "-m", "kwarm_ext.cli", "manifest", "verify", str(path)],
                              capture_output=True, text=True, timeout=120, cwd="/", env=clean_env(CUDA_VISIBLE_DEVICES=""))

    proc = verify()
    assert proc.returncode == 0 and "1 of 1 items usable here" in proc.stdout, proc.stdout + proc.stderr
    data["surfaces"]["flashinfer"]["items"].append(_item("flashinfer.data.spdlog.scripts.extract_version.get_x_module"))
    path.write_text(json.dumps(data))
    proc = verify()
    assert proc.returncode == 1 and "1 of 2 items usable here" in proc.stdout, proc.stdout + proc.stderr
    assert "flashinfer.data holds no JIT getters; not imported" in proc.stdout


def test_59_13_a_dtype_argument_never_makes_torch_import_anything(tmp_path):
    """Hole 13: ``{"dtype": "_inductor"}`` made torch import its lazily loaded submodules (2.3 s)
    before the item was refused: such a name is refused as the manifest is read, and replay looks a
    dtype up in torch's own namespace (no ``getattr``, which imports)."""
    import subprocess

    from conftest import clean_env

    data = manifest.Manifest(STAMP).as_json()
    data["surfaces"] = {"flashinfer": {"version": "0.6.12", "items": [
        _item("flashinfer.x.get_module", args=[{"dtype": "_inductor"}])]}}
    parsed = manifest.parse(json.dumps(data))
    assert parsed.surfaces["flashinfer"]["items"] == [] and "dict is not a plain value" in parsed.problems[0][1]
    code = ("import sys, torch\nfrom kwarm_ext.surfaces import flashinfer as fi\n"
            "before = set(sys.modules)\n"
            "for name in ('export', 'onnx', 'nn', 'bfloat16'):\n"
            "    try:\n        print(name, fi._decode({'dtype': name}))\n"
            "    except ValueError as exc:\n        print(name, exc)\n"
            "print('NEW', sorted(m for m in set(sys.modules) - before if m.startswith('torch.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                          env=clean_env(CUDA_VISIBLE_DEVICES=""))
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["export no torch dtype export", "onnx no torch dtype onnx", "nn no torch dtype nn",
                         "bfloat16 torch.bfloat16"], proc.stdout + proc.stderr
    assert lines[4] == "NEW []", lines[4]


def test_59_5_flashinfer_replay_builds_in_parallel_and_stops_at_the_deadline(no_nvcc, monkeypatch):
    """Hole 5: items were built one after another with no bound (two builds of 45 s took 90.7 s). They
    build on several threads now, and what is not built by the replay's deadline is left out; a build
    still running then goes on unwaited. A sleep stands in for nvcc."""
    import threading
    import time

    import flashinfer.jit.core as core

    import torch

    release, devices = threading.Event(), []
    monkeypatch.setattr(fi_surface, "_build_threads", lambda: 2)
    monkeypatch.setattr(fi_surface, "_current_cuda_device", lambda: 2)  # a TP rank's (no GPU here)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append(d))
    monkeypatch.setattr(core.JitSpec, "build", lambda self, verbose, need_lock=True: release.wait(0.6))
    items = [_item("flashinfer.concat_ops.get_concat_mla_module", "concat_mla"),
             _item("flashinfer.activation.get_act_and_mul_module", "silu_and_mul", ["silu"])]
    t0 = time.monotonic()
    result = fi_surface.SURFACE.replay(items, fi_surface.SURFACE.version(), deadline=time.monotonic() + 30)
    assert sorted(d.split(" ")[0] for d in result.done) == ["concat_mla", "silu_and_mul"], result.skipped
    assert time.monotonic() - t0 < 1.1, "two 0.6 s builds at once, not one after the other"
    assert devices == [2, 2], "each build thread took the caller's device"

    for getter in (__import__("flashinfer").concat_ops.get_concat_mla_module,
                   __import__("flashinfer").activation.get_act_and_mul_module):
        getter.cache_clear()
    monkeypatch.setattr(core.JitSpec, "build", lambda self, verbose, need_lock=True: release.wait(30))
    more = items + [_item("flashinfer.activation.get_act_and_mul_module", "gelu_and_mul", ["gelu"])]
    t0 = time.monotonic()
    result = fi_surface.SURFACE.replay(more, fi_surface.SURFACE.version(), deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 2, "the deadline, not the builds, ended the replay"
    assert result.done == [] and result.skipped == [] and len(result.out_of_time) == 3
    _let_go(release)


def _let_go(release):
    """End the builds a deadline left behind before the fixture clears the getters' caches."""
    import threading
    import time

    release.set()
    deadline = time.monotonic() + 30
    while any(t.name == "kwarm-flashinfer" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_59_5_the_surface_step_says_what_the_total_bound_left_out_in_one_line(no_nvcc, monkeypatch, tmp_path,
                                                                          kwarm_log):
    import threading
    import time

    import flashinfer.jit.core as core

    release = threading.Event()
    monkeypatch.setattr(core.JitSpec, "build", lambda self, verbose, need_lock=True: release.wait(30))
    items = {"flashinfer": (fi_surface.SURFACE.version(),
                            [_item("flashinfer.concat_ops.get_concat_mla_module", "concat_mla")])}
    path = tmp_path / "m.json"
    manifest_files.save(str(path), STAMP, surfaces=items)
    state = replay.prepare(str(path), STAMP, ("vllm.",))
    state.limit_s = 0.3
    t0 = time.monotonic()
    assert replay.replay_surface(state, "flashinfer") == []
    assert time.monotonic() - t0 < 2
    assert [s.kind for s in state.skipped] == ["out of time"] and state.out_of_time == 1
    assert kwarm_log.messages() == ["kwarm: replay reached its total bound of 0.3 s (KWARM_REPLAY_LIMIT): "
                                    "1 FlashInfer JIT modules left to the requests"]
    assert "1 skipped (out of time: 1)" in state.summary()
    _let_go(release)
