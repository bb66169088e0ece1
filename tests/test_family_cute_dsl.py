"""The ``cute_dsl`` family: FlashInfer's in-memory CuTe DSL kernels saved after capture and loaded at
the next start. Keys are written and read with the real CuTe DSL types (cutlass), torch dtypes and
the options FlashInfer's SM90 GDN prefill compiles with. A CuTe DSL kernel cannot be compiled here
(no CUDA): the compiled function is a stand-in whose ``export_to_c`` writes a file, and
``cutlass.cute.runtime.load_module`` is replaced by one that reads it back; the GPU check is
bench/cute_dsl_cache_check.py."""
from __future__ import annotations

import json
import os
import sys
import threading
import types

import pytest
import torch

from kwarm_ext import early_gdn
from kwarm_ext.engine import EngineView
from kwarm_ext.kernels import cute_dsl as fam

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

D = "_in_mem_compile_cache"  # FlashInfer's dict, by its attribute path
META = {"arch": "sm_90a", "cute_dsl": "nvidia-cutlass-dsl==test", "flashinfer": "0.7.2", "source_sha256": "0" * 64}


class _KernelBase:  # FlashInfer's KeyedCompileMixin's place in the MRO
    pass


class _Kernel(_KernelBase):
    pass


@pytest.fixture
def gdn_module(monkeypatch):
    """A module of FlashInfer's gdn_kernels package holding the kernel classes, as FlashInfer 0.7.2's
    ``delta_rule_sm90`` does (the FlashInfer installed here, 0.6.12, has no SM90 GDN prefill)."""
    module = types.ModuleType("flashinfer.gdn_kernels.kwarm_test_delta_rule")
    for cls in (_KernelBase, _Kernel):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def gdn_key(gdn_module, init_state=True, strides=(16384, 128, 1)):
    """A dict key as ``cached_compile`` makes it: (MRO, (attribute, value)...), options key."""
    compile_key = (_Kernel.__mro__, ("needs_init_state", init_state), ("dtype", cutlass.BFloat16),
                   ("acc_dtype", cutlass.Float32), ("cu_seqlens_dtype", torch.int64),
                   ("state_indices_dtype", None), ("state_inner_strides", strides), ("BLK_Q", 64))
    options = (cute.EnableTVMFFI(True), cute.GPUArch("sm_90a"))
    return compile_key, tuple((type(o), o.value) for o in options)


class Compiled:
    """A compiled CuTe DSL function's stand-in: ``export_to_c`` writes its name and symbol."""

    def __init__(self, name):
        self.name = name

    def export_to_c(self, path, function_name):
        with open(path, "w") as f:
            json.dump({"name": self.name, "symbol": function_name}, f)


@pytest.fixture
def flashinfer_source(monkeypatch):
    """A stand-in for FlashInfer's custom_compile_cache module, imported, and the Source naming its dict."""
    flashinfer = types.ModuleType("kwarm_test_flashinfer_cache")
    setattr(flashinfer, D, {})
    monkeypatch.setitem(sys.modules, flashinfer.__name__, flashinfer)
    return flashinfer, fam.Source("flashinfer_gdn", "FlashInfer GDN prefill", flashinfer.__name__, (D,), "flashinfer-python")


@pytest.fixture
def load_module(monkeypatch):
    calls = []

    def fake(path, enable_tvm_ffi=False):
        calls.append((os.path.basename(path), enable_tvm_ffi))
        with open(path) as f:
            saved = json.load(f)
        return types.SimpleNamespace(**{saved["symbol"]: ("loaded", saved["name"])})

    monkeypatch.setattr(cute.runtime, "load_module", fake)
    return calls


def test_keys_round_trip_through_json_with_real_cute_dsl_types(gdn_module):
    key = gdn_key(gdn_module)
    raw = fam.encode(key)
    text = json.dumps(raw)
    assert "pickle" not in text and "cutlass.base_dsl" in text
    back = fam.decode(json.loads(text))
    assert back == key and hash(back) == hash(key)
    assert back[0][0][0] is _Kernel and back[1][0][0] is cute.EnableTVMFFI


@pytest.mark.parametrize("raw, why", [
    ({"class": "os:PathLike"}, "not FlashInfer's"),
    ({"class": "subprocess:Popen"}, "not FlashInfer's"),
    ({"class": "flashinfer.gdn_kernels.kwarm_test_delta_rule:missing"}, "no class"),
    ({"class": "flashinfer.gdn_kernels.kwarm_absent_module:X"}, "no module"),
    ({"class": "flashinfer.gdn_kernels.kwarm_test_delta_rule:_Kernel.__init__"}, "no class"),
    ({"class": "builtins:print"}, "no class"),
    ({"class": "builtins:object; import os"}, "not a class name"),
    ({"torch.dtype": "Tensor"}, "not a torch dtype"),
    ({"torch.dtype": "float32", "class": "builtins:object"}, "not a key part"),
    ({"pickle": "gASV"}, "not a key part"),
    (float("nan"), "not a finite float"),
])
def test_decode_refuses_what_encode_never_writes(gdn_module, raw, why):
    with pytest.raises(ValueError, match=why):
        fam.decode(raw)


def test_decode_refuses_a_key_nested_past_the_limit():
    raw = 1
    for _ in range(fam.MAX_DEPTH + 2):
        raw = [raw]
    with pytest.raises(ValueError, match="nested too deeply"):
        fam.decode(raw)


class Elsewhere:  # a class of this test module's: not one a saved key may name
    pass


def test_a_kernel_whose_key_cannot_be_written_is_skipped_with_its_reason(tmp_path, gdn_module):
    cache = {gdn_key(gdn_module): Compiled("a"), ((Elsewhere.__mro__,), ()): Compiled("b")}
    result = fam.save(str(tmp_path / "stack"), {D: cache}, META)
    assert result["saved"] == 1
    assert [label for label, _ in result["skipped"]] == ["Elsewhere"]
    assert "not FlashInfer's gdn_kernels'" in result["skipped"][0][1]


def test_saved_kernels_load_into_a_new_processes_dict_under_equal_keys(tmp_path, gdn_module, load_module):
    keys = [gdn_key(gdn_module), gdn_key(gdn_module, init_state=False), gdn_key(gdn_module, strides=(8192, 128, 1))]
    where = fam.subfolder(str(tmp_path / "m.cute_dsl"), META)
    saved = fam.save(where, {D: {k: Compiled(f"k{i}") for i, k in enumerate(keys)}}, META)
    assert saved["saved"] == 3 and not saved["skipped"]
    assert json.load(open(os.path.join(where, "meta.json"))) == META
    fam._on_disk.clear()  # a new process
    cache = {}
    result = fam.load(where, {D: cache})
    assert result["loaded"] == 3 and not result["refused"]
    assert {cache[k] for k in keys} == {("loaded", f"k{i}") for i in range(3)}
    assert all(enable for _, enable in load_module)
    # what this process loaded is not saved again, and nothing new means nothing written
    assert fam.save(where, {D: cache}, META)["saved"] == 0


def test_load_leaves_a_kernel_the_dict_holds_already(tmp_path, gdn_module, load_module):
    key = gdn_key(gdn_module)
    where = str(tmp_path / "s")
    fam.save(where, {D: {key: Compiled("saved")}}, META)
    cache = {key: "compiled here"}
    assert fam.load(where, {D: cache})["loaded"] == 0 and cache[key] == "compiled here" and not load_module


@pytest.mark.parametrize("tamper, why", [
    (lambda json_path, obj_path: os.chmod(obj_path, 0o666), "writable by group and others"),
    (lambda json_path, obj_path: os.chmod(json_path, 0o664), "writable by group"),
    (lambda json_path, obj_path: open(json_path, "w").write(json.dumps({"dict": D, "key": [1, 2]})), "does not match its file name"),
    (lambda json_path, obj_path: open(json_path, "w").write(json.dumps({"dict": "os.environ", "key": [1]})), "not a kernel of the dicts"),
    (lambda json_path, obj_path: os.unlink(obj_path), "FileNotFoundError"),
    (lambda json_path, obj_path: open(json_path, "w").write("{"), "JSONDecodeError"),
])
def test_load_refuses_a_tampered_kernel_in_one_line_and_loads_the_rest(tmp_path, gdn_module, load_module, tamper, why):
    good, bad = gdn_key(gdn_module), gdn_key(gdn_module, init_state=False)
    where = str(tmp_path / "s")
    fam.save(where, {D: {good: Compiled("good"), bad: Compiled("bad")}}, META)
    stem = fam.symbol(fam.encode(bad), D)
    tamper(os.path.join(where, stem + ".json"), os.path.join(where, stem + ".o"))
    fam._on_disk.clear()
    cache = {}
    result = fam.load(where, {D: cache})
    assert result["loaded"] == 1 and cache == {good: ("loaded", "good")}
    assert [name for name, _ in result["refused"]] == [stem + ".json"]
    assert why in result["refused"][0][1] and "\n" not in result["refused"][0][1]


def test_a_new_stack_replaces_the_kernels_of_the_old_one(tmp_path, gdn_module):
    base = str(tmp_path / "m.cute_dsl")
    old = fam.subfolder(base, META)
    fam.save(old, {D: {gdn_key(gdn_module): Compiled("old")}}, META)
    new_meta = dict(META, cute_dsl="nvidia-cutlass-dsl==next")
    new = fam.subfolder(base, new_meta)
    assert new != old
    fam._on_disk.clear()
    assert fam.save(new, {D: {gdn_key(gdn_module): Compiled("new")}}, new_meta)["saved"] == 1
    assert os.listdir(base) == [os.path.basename(new)]


def test_keys_of_plain_values_round_trip_and_land_in_their_own_dict(tmp_path, load_module):
    """vLLM's router GEMM: two objects, a dict per backend, keys of ints and a dtype."""
    dicts = {"ll_bf16_gemm_kernel._compiled_cache": {(3, 512, 128, torch.float32): Compiled("m3")},
             "ll_bf16_gemm_c1_pdl_kernel._compiled_cache": {(1, 512, 128, torch.float32): Compiled("m1")},
             "ll_bf16_gemm_kernel._splitk_cache": {}}
    where = str(tmp_path / "r")
    assert fam.save(where, dicts, META)["saved"] == 2
    fam._on_disk.clear()
    fresh = {path: {} for path in dicts}
    assert fam.load(where, fresh)["loaded"] == 2
    assert fresh["ll_bf16_gemm_kernel._compiled_cache"] == {(3, 512, 128, torch.float32): ("loaded", "m3")}
    assert fresh["ll_bf16_gemm_c1_pdl_kernel._compiled_cache"] == {(1, 512, 128, torch.float32): ("loaded", "m1")}
    assert fresh["ll_bf16_gemm_kernel._splitk_cache"] == {}


def test_the_family_loads_ahead_and_saves_after_capture(tmp_path, gdn_module, load_module, monkeypatch):
    flashinfer = types.ModuleType("kwarm_test_flashinfer_cache")
    router = types.ModuleType("kwarm_test_router")
    router.ll_bf16_gemm_kernel = types.SimpleNamespace(_compiled_cache={}, _splitk_cache={})
    sources = (fam.Source("flashinfer_gdn", "FlashInfer GDN prefill", flashinfer.__name__, (D,), "flashinfer-python"),
               fam.Source("vllm_router_gemm", "vLLM router GEMM", router.__name__,
                          ("ll_bf16_gemm_kernel._compiled_cache", "ll_bf16_gemm_kernel._splitk_cache",
                           "absent._compiled_cache"), "vllm"))
    monkeypatch.setattr(fam, "SOURCES", sources)
    monkeypatch.setattr(fam, "folder_for", lambda view: str(tmp_path / "m.cute_dsl"))
    monkeypatch.setattr(fam, "stack", lambda source: dict(META, library=source.dist))
    view = EngineView(worker=object(), device="cpu")
    assert fam.applies(view) == "no CuTe DSL kernels saved for this deployment yet"
    view.after_capture = True
    assert "no CuTe DSL kernel was compiled" in fam.applies(view)
    monkeypatch.setitem(sys.modules, flashinfer.__name__, flashinfer)
    monkeypatch.setitem(sys.modules, router.__name__, router)
    setattr(flashinfer, D, {})
    assert "no CuTe DSL kernel was compiled" in fam.applies(view)
    key = gdn_key(gdn_module)
    getattr(flashinfer, D)[key] = Compiled("profile run")
    assert fam.applies(view) is None
    plan = fam.plan(view, forced=False)
    assert [s.name for s in plan.steps] == ["save flashinfer_gdn"], "a source with nothing compiled saves nothing"
    labels = plan.steps[0].run()
    assert labels == [f"FlashInfer GDN prefill: 1 kernels saved in {plan.details()['flashinfer_gdn']['seconds']:.2f} s"]
    router.ll_bf16_gemm_kernel._compiled_cache[(1, 512, 128, torch.float32)] = Compiled("warmup")
    plan = fam.plan(view, forced=False)
    assert [s.name for s in plan.steps] == ["save flashinfer_gdn", "save vllm_router_gemm"]
    assert [label for step in plan.steps for label in step.run()] == [
        f"vLLM router GEMM: 1 kernels saved in {plan.details()['vllm_router_gemm']['seconds']:.2f} s"]
    # the next start: a new process, its dicts empty until kwarm's ahead run
    fam._on_disk.clear()
    setattr(flashinfer, D, {})
    router.ll_bf16_gemm_kernel._compiled_cache = {}
    view = EngineView(worker=object(), device="cpu")
    assert fam.applies(view) is None
    plan = fam.plan(view, forced=False)
    assert [s.name for s in plan.steps] == ["load flashinfer_gdn", "load vllm_router_gemm"]
    assert [step.run()[0].split(" in ")[0] for step in plan.steps] == [
        "FlashInfer GDN prefill: 1 kernels loaded", "vLLM router GEMM: 1 kernels loaded"]
    assert getattr(flashinfer, D) == {key: ("loaded", "profile run")}
    assert router.ll_bf16_gemm_kernel._compiled_cache == {(1, 512, 128, torch.float32): ("loaded", "warmup")}


def save_one_gdn_kernel(tmp_path, gdn_module, monkeypatch, flashinfer_source):
    """One GDN prefill kernel saved under `tmp_path` for the stack META; returns (module, source)."""
    flashinfer, source = flashinfer_source
    setattr(flashinfer, D, {gdn_key(gdn_module): Compiled("saved")})
    monkeypatch.setattr(fam, "stack", lambda source: META)
    fam.save_source(source, str(tmp_path), {})
    return flashinfer, source


def test_a_stack_that_changed_loads_nothing_and_says_so(tmp_path, gdn_module, load_module, monkeypatch,
                                                       flashinfer_source):
    flashinfer, source = save_one_gdn_kernel(tmp_path, gdn_module, monkeypatch, flashinfer_source)
    fam._on_disk.clear()
    setattr(flashinfer, D, {})
    monkeypatch.setattr(fam, "stack", lambda source: dict(META, flashinfer="0.7.3"))
    assert fam.load_source(source, str(tmp_path), {}) == ["FlashInfer GDN prefill: none saved for this CuTe DSL stack"]
    assert getattr(flashinfer, D) == {} and not load_module


def test_a_source_whose_module_is_gone_loads_nothing_in_one_label(tmp_path, gdn_module, load_module, monkeypatch,
                                                                 flashinfer_source):
    flashinfer, source = save_one_gdn_kernel(tmp_path, gdn_module, monkeypatch, flashinfer_source)
    monkeypatch.delitem(sys.modules, flashinfer.__name__)  # an upgrade without it
    details = {}
    assert fam.load_source(source, str(tmp_path), details) == [
        "FlashInfer GDN prefill: kwarm_test_flashinfer_cache is not in this installation"]
    assert details["flashinfer_gdn"]["loaded"] == 0 and not load_module


class Unexportable(Compiled):
    def export_to_c(self, path, function_name):
        raise RuntimeError("no execution engine")


def test_kernels_that_cannot_be_exported_are_one_warning_and_the_rest_are_saved(tmp_path, gdn_module, monkeypatch, caplog,
                                                                                flashinfer_source):
    flashinfer, source = flashinfer_source
    keys = [gdn_key(gdn_module, strides=(n, 128, 1)) for n in (1, 2, 3)]
    setattr(flashinfer, D, {keys[0]: Unexportable("a"), keys[1]: Unexportable("b"), keys[2]: Compiled("c")})
    monkeypatch.setattr(fam, "stack", lambda source: META)
    with caplog.at_level("WARNING", logger="kwarm"):
        labels = fam.save_source(source, str(tmp_path), {})
    assert labels[0].startswith("FlashInfer GDN prefill: 1 kernels saved in ")
    warnings = [r.getMessage() for r in caplog.records if r.name == "kwarm"]
    assert warnings == ["kwarm: cute_dsl: 2 FlashInfer GDN prefill kernels not saved, they compile at the next start; "
                        "first: _Kernel: RuntimeError: no execution engine"]
    assert not [n for n in os.listdir(next((tmp_path / "flashinfer_gdn").iterdir())) if n.endswith(".tmp")]


def test_a_kernel_refused_at_load_is_written_again_and_loads_at_the_next_start(tmp_path, gdn_module, load_module):
    key = gdn_key(gdn_module)
    where = str(tmp_path / "s")
    fam.save(where, {D: {key: Compiled("first")}}, META)
    stem = fam.symbol(fam.encode(key), D)
    os.chmod(os.path.join(where, stem + ".o"), 0o666)
    fam._on_disk.clear()
    cache = {}
    assert fam.load(where, {D: cache})["loaded"] == 0
    cache[key] = Compiled("compiled again")  # what the library then compiles
    assert fam.save(where, {D: cache}, META)["saved"] == 1
    fam._on_disk.clear()
    fresh = {}
    assert fam.load(where, {D: fresh})["loaded"] == 1 and fresh == {key: ("loaded", "compiled again")}


def test_save_never_writes_through_a_link_planted_where_a_kernel_goes(tmp_path, gdn_module):
    key = gdn_key(gdn_module)
    where = tmp_path / "s"
    where.mkdir()
    target = tmp_path / "elsewhere.o"
    target.write_text("kept")
    os.symlink(target, where / (fam.symbol(fam.encode(key), D) + ".o"))
    result = fam.save(str(where), {D: {key: Compiled("k")}}, META)
    assert result["saved"] == 0 and "a symbolic link" in result["skipped"][0][1]
    assert target.read_text() == "kept"


def test_the_family_loads_the_kernels_compiled_since_launch_once_the_background_process_is_done(
        tmp_path, gdn_module, load_module, monkeypatch, flashinfer_source):
    """kwarm_ext/early_gdn.py compiles FlashInfer's GDN prefill kernels from launch into a folder of
    the same format; the family waits for its summary, then loads them before the profile run."""
    flashinfer, source = flashinfer_source
    monkeypatch.setattr(fam, "SOURCES", (source,))
    monkeypatch.setattr(fam, "stack", lambda source, capability=None: META)
    monkeypatch.setattr(fam, "folder_for", lambda view: str(tmp_path / "m.cute_dsl"))
    key = gdn_key(gdn_module)
    folder = tmp_path / "cute_dsl_early"
    assert fam.save(fam.subfolder(str(folder / "flashinfer_gdn"), META), {D: {key: Compiled("early")}}, META)["saved"] == 1
    fam._on_disk.clear()  # the engine's process
    early = {"folder": str(folder), "done": str(folder / ".done-9.json"), "pid": os.getpid()}
    monkeypatch.setenv(early_gdn.EARLY_ENV, json.dumps(early))
    view = EngineView(worker=object(), device="cpu")
    assert fam.applies(view) is None, "nothing saved for the deployment yet, but compiled since launch"
    plan = fam.plan(view, forced=False)
    assert [s.name for s in plan.steps] == ["load early flashinfer_gdn"]
    threading.Timer(0.3, lambda: early_gdn.finish(early, {"compiled": 1, "saved": 1})).start()
    label, = plan.steps[0].run()
    assert label.startswith("FlashInfer GDN prefill compiled since launch: 1 kernels loaded in ") and "(waited " in label
    assert float(label.split("(waited ")[1].split(" s")[0]) >= 0.2, "it waited for the summary"
    assert getattr(flashinfer, D) == {key: ("loaded", "early")}
    assert plan.details()["early"]["loaded"] == 1

    # a start where the background process compiled nothing: one label, nothing loaded
    fam._on_disk.clear()
    setattr(flashinfer, D, {})
    early_gdn.finish(early, {"compiled": 0, "not": "gdn_prefill: vLLM picks the triton GDN prefill backend"})
    plan = fam.plan(view, forced=False)
    assert plan.steps[0].run() == [
        "no GDN prefill kernels compiled since launch (gdn_prefill: vLLM picks the triton GDN prefill backend)"]
    assert getattr(flashinfer, D) == {}
