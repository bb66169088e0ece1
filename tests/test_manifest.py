"""The manifest as untrusted input, its location and configuration, concurrent writers, and
``kwarm manifest`` / ``kwarm run --learn``.

Refusals are checked at replay's planning step (``replay.prepare``), which runs in-process
here: it resolves kernels and reads their source hashes but compiles nothing. Where a
check reaches Triton's per-device cache, tests/replay_kernels.FakeDriver stands in for the
GPU driver that cannot exist on this machine.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from conftest import clean_env, require, run_py
from kwarm_ext import config, manifest, manifest_files
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.surfaces.triton import replay
from kwarm_ext.manifest import BadManifest, Entry, Stamp, TuneChoice

triton = require("triton")
import replay_kernels as rk  # noqa: E402

TESTS = Path(__file__).resolve().parent
ALLOWED = config.DEFAULT_ALLOWED_MODULES + ("replay_kernels",)
STAMP = Stamp(triton=triton.__version__, arch="cuda:90", torch="2.11.0", vllm="0.24.0", tp_size=1, model="m")
OPTIONS = {"debug": False, "instrumentation_mode": ""}


def entry(module="replay_kernels", kernel="copy_kernel", n_class="D", block=128, options=None,
          source_key=None, name=None) -> Entry:
    """A well-formed entry for `kernel(x_ptr, y_ptr, n, BLOCK)` as Triton 3.6 records it."""
    options = dict(OPTIONS if options is None else options)
    key = (f"[('*fp16', 'D'), ('*fp16', 'D'), ('i32', '{n_class}'), ('constexpr', {block})]" + str(options))
    spec = {"name": name or f"{module}.{kernel}",
            "signature": {"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr"},
            "constant_keys": [[3]], "constant_vals": [block],
            "attrs_keys": [[0], [1], [2]],
            "attrs_vals": [[["tt.divisibility", 16]]] * (3 if n_class == "D" else 2) + ([] if n_class == "D" else [[]])}
    if source_key is None:
        source_key = getattr(sys.modules.get(module), kernel).cache_key if module in sys.modules else "0" * 64
    return Entry(module, kernel, source_key, key, json.loads(json.dumps(options)), spec)


def write(path: Path, entries=(), autotune=(), stamp=STAMP, mode=0o644) -> Path:
    data = manifest.Manifest(stamp, list(entries), list(autotune)).as_json()
    path.write_text(json.dumps(data))
    path.chmod(mode)
    return path


@pytest.fixture
def fake_driver():
    """The stub stands in for the GPU driver that cannot exist here; restored afterwards."""
    from triton.runtime import driver

    saved = driver._active
    rk.install_fake_driver()
    yield
    driver._active = saved


def warnings_of(kwarm_log):
    return kwarm_log.messages()


# ---------------------------------------------------------------------------- configuration


def test_new_settings_parse_with_defaults():
    s = config.parse({}, known_families=("replay",))
    assert (s.learn, s.learn_interval, s.manifest, s.allow_modules) == ("off", 60.0, None, ())
    assert s.allowed_modules == ("vllm.", "kwarm_ext.")
    s = config.parse({"KWARM_LEARN": "1", "KWARM_LEARN_INTERVAL": "5", "KWARM_MANIFEST": "/x/m.json",
                      "KWARM_ALLOW_MODULES": "mypkg., other"}, known_families=("replay",))
    assert (s.learn, s.learn_interval, s.manifest) == ("after", 5.0, "/x/m.json")
    assert s.allowed_modules == ("vllm.", "kwarm_ext.", "mypkg.", "other") and s.problems == ()
    assert config.parse({"KWARM_LEARN": "all"}, known_families=()).learn == "all"


@pytest.mark.parametrize("var, value, expect", [
    ("KWARM_LEARN", "sometimes", "KWARM_LEARN='sometimes' is invalid (expected 1/true/yes/on, all, or "
                                 "0/false/no/off); using the default '0'"),
    ("KWARM_LEARN_INTERVAL", "-3", "KWARM_LEARN_INTERVAL='-3' is invalid (expected a number of seconds from 0 to 86400); "
                                   "using the default '60'"),
    ("KWARM_MANIFEST", "/", "KWARM_MANIFEST='/' is invalid (it is a directory; give a file path); "
                            "using the default manifest path"),
    ("KWARM_ALLOW_MODULES", "good., bad name, 9x", "KWARM_ALLOW_MODULES='good., bad name, 9x' is invalid "
                                                   "(not module names: bad name, 9x); using 'good.'"),
])
def test_bad_values_each_get_one_clear_problem(var, value, expect):
    assert config.parse({var: value}, known_families=()).problems == (expect,)


def test_module_allow_list_semantics():
    allowed = ("vllm.", "mypkg")
    assert manifest.module_allowed("vllm.v1.worker.block_table", allowed)
    assert not manifest.module_allowed("vllm", allowed) and not manifest.module_allowed("vllmx.a", allowed)
    assert manifest.module_allowed("mypkg", allowed) and manifest.module_allowed("mypkg.k", allowed)
    assert not manifest.module_allowed("mypkgx", allowed) and not manifest.module_allowed("os", allowed)


def test_default_location_is_per_model_and_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = manifest_files.default_path(STAMP)
    assert path.startswith(str(tmp_path / "xdg" / "kwarm") + os.sep) and path.endswith(".json")
    assert os.path.basename(path).startswith("m.tp1.cuda90.")
    others = {manifest_files.default_path(Stamp(**{**STAMP.__dict__, field: value}))
              for field, value in (("triton", "3.7.0"), ("arch", "cuda:100"), ("vllm", "0.25.0"),
                                   ("torch", "2.12.0"), ("tp_size", 2), ("model", "other/m"))}
    assert len(others) == 6 and path not in others
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec wants an absolute path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert manifest_files.default_path(STAMP).startswith(str(tmp_path / "home" / ".cache" / "kwarm") + os.sep)


def test_kwarm_manifest_overrides_the_location(kwarm_env, fake_driver, tmp_path):
    ns = types.SimpleNamespace
    view = ns(worker=ns(vllm_config=ns(model_config=ns(model="org/Model-7B"))), runner=None, tp_size=2)
    stamp, path = learn.deployment(view)
    assert (stamp.model, stamp.tp_size, stamp.arch, stamp.triton) == ("org/Model-7B", 2, "cuda:90", triton.__version__)
    assert os.path.basename(path).startswith("Model-7B.tp2.cuda90.")
    kwarm_env(KWARM_MANIFEST=str(tmp_path / "mine.json"))
    assert learn.deployment(view)[1] == str(tmp_path / "mine.json")


# ---------------------------------------------------------------------------- bad files


def test_truncated_file(tmp_path):
    path = write(tmp_path / "m.json", [entry()])
    path.write_text(path.read_text()[:-40])
    with pytest.raises(BadManifest, match="not valid JSON"):
        manifest_files.load(str(path))


@pytest.mark.parametrize("text, match", [
    ('[1, 2]', "not a kwarm manifest"),
    ('{"format": "kwarm-manifest", "version": 99, "stamp": {}}', "format version 99"),
    ('{"format": "kwarm-manifest", "version": 1, "stamp": {"triton": 3.6, "arch": "cuda:90"}}', "bad stamp"),
    ('{"format": "kwarm-manifest", "version": 1, "stamp": {"triton": "3.6.0", "arch": "cuda:90"}, '
     '"entries": {}}', '"entries" is not a list'),
])
def test_not_a_manifest(tmp_path, text, match):
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(BadManifest, match=match):
        manifest_files.load(str(tmp_path / "m.json"))


def test_wrong_types_drop_only_the_bad_entries(tmp_path):
    good = entry().as_json()
    bad = [
        {**good, "module": 42},
        {**good, "launch_options": {"num_warps": {"nested": "object"}}},
        {**good, "launch_options": {"num_warps": 8, **OPTIONS}},  # not what the key says
        {**good, "spec": {**good["spec"], "name": "os.system"}},
        {**good, "spec": {**good["spec"], "signature": {"x_ptr": "*fp32", "y_ptr": "*fp16", "n": "i32",
                                                        "BLOCK": "constexpr"}}},  # key says *fp16
        {**good, "spec": {**good["spec"], "constant_keys": [["3"]]}},
        "just a string",
    ]
    data = write(tmp_path / "m.json", [entry()]).read_text()
    obj = json.loads(data)
    obj["entries"] += bad
    obj["autotune"] = [{"module": "replay_kernels", "qualname": "tuned_kernel", "source_key": "s",
                        "key": [64, {"x": 1}], "config": {}}]
    (tmp_path / "m.json").write_text(json.dumps(obj))
    loaded = manifest_files.load(str(tmp_path / "m.json"))
    assert [e.identity for e in loaded.entries] == [entry().identity]
    reasons = [reason for _, reason in loaded.problems]
    assert len(reasons) == len(bad) + 1 and all(r.startswith("malformed: ") for r in reasons)
    assert "module is not a non-empty string" in reasons[0]
    assert "launch_options disagree with the key" in reasons[2]
    assert "spec is for 'os.system'" in reasons[3]
    assert "does not match the signature" in reasons[4]
    assert loaded.problems[0][0].startswith("{'module': 42")
    assert loaded.problems[3][0].startswith("replay_kernels:copy_kernel [")


@pytest.mark.parametrize("mode, reason", [(0o666, "writable by group and others (mode 666)"),
                                          (0o646, "writable by others (mode 646)"),
                                          (0o664, "writable by group (mode 664)")])
def test_files_writable_by_others_are_refused(tmp_path, mode, reason):
    path = write(tmp_path / "m.json", [entry()], mode=mode)
    with pytest.raises(BadManifest, match=re.escape(f"refused: {reason}")):
        manifest_files.load(str(path))
    path.chmod(0o600)
    assert len(manifest_files.load(str(path)).entries) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_files_owned_by_another_user_are_refused(tmp_path):
    path = write(tmp_path / "m.json", [entry()])
    os.chown(path, 4242, 4242)
    with pytest.raises(BadManifest, match="refused: owned by uid 4242, not by this user"):
        manifest_files.load(str(path))


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "d.json").mkdir()
    with pytest.raises(BadManifest, match="^refused: not a regular file$"):
        manifest_files.load(str(tmp_path / "d.json"))


# ---------------------------------------------------------------------------- refusals at replay


def test_whole_manifest_refusals_are_one_line_each(tmp_path, kwarm_log):
    world = write(tmp_path / "w.json", [entry()], mode=0o666)
    other_triton = write(tmp_path / "t.json", [entry()], stamp=Stamp(**{**STAMP.__dict__, "triton": "3.4.0"}))
    other_arch = write(tmp_path / "a.json", [entry()], stamp=Stamp(**{**STAMP.__dict__, "arch": "cuda:80"}))
    truncated = tmp_path / "x.json"
    truncated.write_text(write(tmp_path / "x.json", [entry()]).read_text()[:100])
    for path, reason in ((world, "refused: writable by group and others"),
                         (other_triton, f"recorded with Triton 3.4.0, this is Triton {triton.__version__}"),
                         (other_arch, "recorded for GPU architecture cuda:80, this GPU is cuda:90"),
                         (truncated, "not valid JSON")):
        kwarm_log.records.clear()
        state = replay.prepare(str(path), STAMP, ALLOWED)
        assert reason in state.refused and state.jobs == [] and state.summary().startswith("manifest not used")
        assert warnings_of(kwarm_log) == [f"kwarm: replay did not use the manifest {path}: {state.refused}"]


def test_foreign_module_is_never_imported(tmp_path, kwarm_log, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "kw_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path / "m.json", [entry(module="kw_evil", kernel="k", source_key="0" * 64)])
    state = replay.prepare(str(path), STAMP, config.DEFAULT_ALLOWED_MODULES)
    assert not marker.exists() and "kw_evil" not in sys.modules
    assert [(s.kind, s.label.split(" [")[0]) for s in state.skipped] == [("module not allowed", "kw_evil:k")]
    (line,) = warnings_of(kwarm_log)
    assert line.startswith("kwarm: replay skipped kw_evil:k [") and "module kw_evil is not allowed" in line


def test_changed_kernel_source_is_skipped(tmp_path, kwarm_log, monkeypatch, fake_driver):
    source = textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
        ''')
    module = tmp_path / "kw_changing.py"
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    recorded = entry(module="kw_changing", source_key=importlib.import_module("kw_changing").copy_kernel.cache_key)
    path = write(tmp_path / "m.json", [recorded])
    allowed = ("kw_changing",)
    assert [j.label for j in replay.prepare(str(path), STAMP, allowed).jobs] == [recorded.label]
    module.write_text(source.replace("mask=offs < n)\n", "mask=offs < n) * 2\n"))  # a new release
    monkeypatch.delitem(sys.modules, "kw_changing")
    importlib.invalidate_caches()
    state = replay.prepare(str(path), STAMP, allowed)
    assert state.jobs == [] and [s.kind for s in state.skipped] == ["source changed"]
    assert warnings_of(kwarm_log) == [f"kwarm: replay skipped {recorded.label}: "
                                      "the kernel's source changed since it was recorded"]


@pytest.mark.parametrize("extra, reason", [
    ({"ir_override": "/tmp/evil.ptx"}, "compiler option ir_override is not allowed"),
    ({"extern_libs": [["libdevice", "/tmp/evil.bc"]]}, "compiler option extern_libs is not allowed"),
    ({"ptx_options": "--options-file /etc/shadow"}, "compiler option ptx_options is not allowed"),
    ({"num_warps": 3}, "compiler option num_warps=3 is out of range"),
    ({"num_stages": 10 ** 9}, "compiler option num_stages=1000000000 is out of range"),
    ({"instrumentation_mode": "a b;c"}, "compiler option instrumentation_mode='a b;c' is out of range"),
])
def test_only_allow_listed_compiler_options_with_bounded_values(tmp_path, kwarm_log, fake_driver, extra, reason):
    """An allow-list, not a deny-list: every option a key carries must be known and in range."""
    bad = entry(options={**OPTIONS, **extra})
    state = replay.prepare(str(write(tmp_path / "m.json", [bad, entry(block=64)])), STAMP, ALLOWED)
    assert [(s.kind, s.reason) for s in state.skipped] == [("malformed", f"malformed: {reason}")]
    assert len(state.jobs) == 1
    assert warnings_of(kwarm_log) == [f"kwarm: replay dropped 1 malformed item of {tmp_path / 'm.json'} "
                                      f"(first: {bad.label}: malformed: {reason})"]
    assert manifest.disallowed_options({"num_warps": 4, "num_stages": 3, "maxnreg": None, "debug": False}) == []


@pytest.mark.parametrize("ref, reason", [
    ("os:system", "constexpr function os:system: module os is not allowed"),
    ("replay_kernels:__builtins__", "is not a module:qualname reference"),
    ("replay_kernels:relu", "constexpr function replay_kernels:relu changed since it was recorded"),
])
def test_constexpr_functions_are_resolved_like_kernels(tmp_path, kwarm_log, fake_driver, ref, reason):
    key = ("[('*fp16', 'D'), ('*fp16', 'D'), ('i32', ''), ('constexpr', '" + "0" * 64 + "'), "
           "('constexpr', 128)]" + str(OPTIONS))
    spec = {"name": "replay_kernels.apply_kernel",
            "signature": {"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32", "FN": "constexpr", "BLOCK": "constexpr"},
            "constant_keys": [[3], [4]], "constant_vals": [{"jit_function": ref}, 128],
            "attrs_keys": [[0], [1], [2]], "attrs_vals": [[["tt.divisibility", 16]]] * 2 + [[]]}
    bad = Entry("replay_kernels", "apply_kernel", rk.apply_kernel.cache_key, key, dict(OPTIONS), spec)
    state = replay.prepare(str(write(tmp_path / "m.json", [bad])), STAMP, ALLOWED)
    assert state.jobs == [] and [s.kind for s in state.skipped] == ["constants"]
    (line,) = warnings_of(kwarm_log)
    assert line.startswith(f"kwarm: replay skipped {bad.label}: unusable constants: ") and reason in line


def test_malformed_entries_are_one_line_per_file_and_the_rest_replays(tmp_path, kwarm_log, fake_driver):
    obj = json.loads(write(tmp_path / "m.json", [entry()]).read_text())
    obj["entries"].append({**entry(block=64).as_json(), "launch_options": "fast"})
    obj["entries"].append({**entry(block=32).as_json(), "launch_options": "slow"})
    (tmp_path / "m.json").write_text(json.dumps(obj))
    state = replay.prepare(str(tmp_path / "m.json"), STAMP, ALLOWED)
    assert len(state.jobs) == 1 and [s.kind for s in state.skipped] == ["malformed", "malformed"]
    (line,) = warnings_of(kwarm_log)
    assert line.startswith(f"kwarm: replay dropped 2 malformed items of {tmp_path / 'm.json'} (first: "
                           "replay_kernels:copy_kernel [") and "launch_options" in line


def test_engine_starts_with_a_bad_manifest(tmp_path, kwarm_env, kwarm_log, fake_driver):
    require("vllm")
    from kwarm_ext import warmup

    path = tmp_path / "m.json"
    path.write_text('{"format": "kwarm-manifest", "versi')
    kwarm_env(KWARM_MANIFEST=str(path), KWARM_WARMUPS="replay", KWARM_LOG_LEVEL="DEBUG")  # the detail is DEBUG's
    ns = types.SimpleNamespace
    worker = ns(model_runner=ns(attn_groups=[], device="cpu", max_num_reqs=4, is_pooling_model=False,
                                compilation_config=ns(static_forward_context={}, cudagraph_mode=None)),
                vllm_config=ns(model_config=ns(model="m", enforce_eager=True, hf_text_config=ns(model_type="llama"),
                                               hf_config=ns(architectures=[])),
                               scheduler_config=ns(max_num_batched_tokens=64),
                               parallel_config=ns(tensor_parallel_size=1)))
    report = warmup.run(worker)
    fam = report["families"][0]
    assert fam["name"] == "replay" and fam["status"] == "ran"
    assert [s["status"] for s in fam["steps"]] == ["skipped"] * 4
    assert "not valid JSON" in fam["details"]["refused"]
    assert warnings_of(kwarm_log) == [f"kwarm: replay did not use the manifest {path}: {fam['details']['refused']}"]
    summary = [m for m in kwarm_log.messages(0) if "warmup done" in m]
    assert len(summary) == 1 and "ran replay;" in summary[0] and summary[0].endswith("left to requests: 1 manifests not used")
    assert report["left_to_requests"] == [{"family": "replay", "count": 1, "what": "manifests not used",
                                           "why": fam["details"]["refused"]}]
    detail = [m for m in kwarm_log.messages(0) if m.startswith("kwarm: warmup detail on rank 0: ")]
    assert len(detail) == 1 and "replay" in detail[0] and "manifest not used (not valid JSON" in detail[0]


# ---------------------------------------------------------------------------- writing


def test_save_merges_deduplicates_and_leaves_no_temp_files(tmp_path):
    path = str(tmp_path / "sub" / "m.json")
    choice = TuneChoice("replay_kernels", "tuned_kernel", "s" * 64, [64, "torch.float16"],
                        {"kwargs": {"BLOCK": 64}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None})
    first = manifest_files.save(path, STAMP, [entry(), entry(block=64)], [choice])
    again = manifest_files.save(path, STAMP, [entry(), entry(block=32)], [choice])
    assert (first.added, first.total, again.added, again.total) == (3, 3, 1, 4)
    loaded = manifest_files.load(path)
    assert len(loaded.entries) == 3 and loaded.autotune == [choice] and loaded.problems == []
    assert sorted(os.listdir(tmp_path / "sub")) == ["m.json", "m.json.lock"]
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)


def test_save_replaces_an_incompatible_or_unusable_file(tmp_path):
    path = write(tmp_path / "m.json", [entry()], stamp=Stamp(**{**STAMP.__dict__, "triton": "3.4.0"}))
    result = manifest_files.save(str(path), STAMP, [entry(block=64)])
    assert "replaced a manifest recorded with Triton 3.4.0" in result.note and result.total == 1
    path.chmod(0o666)
    before = path.read_text()
    result = manifest_files.save(str(path), STAMP, [entry(block=32)])
    assert "could not read the manifest (refused: writable by group and others" in result.note
    assert [e.key for e in manifest_files.load(str(path)).entries] == [entry(block=32).key]
    aside = [p for p in tmp_path.iterdir() if ".unreadable." in p.name]
    assert len(aside) == 1 and aside[0].read_text() == before and str(aside[0]) in result.note, "kept, not replaced"


WRITER = """
import sys
from kwarm_ext import manifest, manifest_files
from test_manifest import STAMP, entry
path, writer = sys.argv[1], int(sys.argv[2])
for i in range(25):
    manifest_files.save(path, STAMP, [entry(block=1000 * writer + i)])
"""


def test_two_writers_at_once(tmp_path):
    """Four processes (as TP ranks would) each save 25 entries, one save at a time, at once."""
    path = str(tmp_path / "m.json")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, str(w)], env=env, stderr=subprocess.PIPE,
                              text=True) for w in range(4)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    loaded = manifest_files.load(path)
    assert len(loaded.entries) == 100 and loaded.problems == []
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


# ---------------------------------------------------------------------------- command line


def kwarm_cli(*argv, env_extra=None):
    env = clean_env(CUDA_VISIBLE_DEVICES="", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    code = f"import sys; from kwarm_ext import cli; sys.exit(cli.main({list(argv)!r}))"
    return run_py(code, env=env)


def test_manifest_show(tmp_path):
    choice = TuneChoice("replay_kernels", "tuned_kernel", rk.tuned_kernel.fn.cache_key,
                        [64, "torch.float16", "torch.float16"],
                        {"kwargs": {"BLOCK": 64}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None})
    path = write(tmp_path / "m.json", [entry(), entry(n_class="", options={"num_warps": 8, **OPTIONS})], [choice])
    proc = kwarm_cli("manifest", "show", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"stamp: triton {triton.__version__}, cuda:90, torch 2.11.0, vllm 0.24.0, tp 1, model m" in out
    assert "2 entries, 1 autotune choices, 2 kernels" in out
    assert "replay_kernels:copy_kernel  (source " in out
    assert "x_ptr:*fp16%16 y_ptr:*fp16%16 n:i32 BLOCK=128 | num_warps=8" in out
    assert "x_ptr:*fp16%16 y_ptr:*fp16%16 n:i32%16 BLOCK=128\n" in out
    assert "autotune (64, 'torch.float16', 'torch.float16') -> BLOCK=64 num_warps=2 num_stages=3 num_ctas=1" in out


def test_manifest_verify(tmp_path):
    good, stale = entry(source_key=rk.copy_kernel.cache_key), entry(block=64, source_key="f" * 64)
    foreign = entry(module="kw_nowhere", kernel="k", source_key="0" * 64)
    path = write(tmp_path / "m.json", [good, stale, foreign])
    proc = kwarm_cli("manifest", "verify", str(path), env_extra={"KWARM_ALLOW_MODULES": "replay_kernels"})
    assert proc.returncode == 1, proc.stderr
    assert f"{path}: 1 of 3 items usable here" in proc.stdout
    assert "note: GPU architecture cuda:90 not checked: no GPU driver is active" in proc.stdout
    assert f"{stale.label}: the kernel's source changed since it was recorded" in proc.stdout
    assert f"{foreign.label}: module kw_nowhere is not allowed" in proc.stdout
    only_good = write(tmp_path / "g.json", [good])
    proc = kwarm_cli("manifest", "verify", str(only_good), env_extra={"KWARM_ALLOW_MODULES": "replay_kernels"})
    assert proc.returncode == 0 and "1 of 1 items usable here" in proc.stdout


def test_manifest_merge(tmp_path):
    rank0 = write(tmp_path / "r0.json", [entry(), entry(block=64)])
    rank1 = write(tmp_path / "r1.json", [entry(), entry(block=32)])
    other = write(tmp_path / "o.json", [entry(block=16)], stamp=Stamp(**{**STAMP.__dict__, "arch": "cuda:80"}))
    out = tmp_path / "merged.json"
    proc = kwarm_cli("manifest", "merge", str(rank0), str(rank1), str(other), "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    assert f"{other}: not merged: recorded for GPU architecture cuda:80, this GPU is cuda:90" in proc.stdout
    assert f"merged 2 manifests into {out}: 3 items (3 new), 0 step sizes (0 new)" in proc.stdout
    assert len(manifest_files.load(str(out)).entries) == 3
    manifest_files.save(str(rank0), STAMP, token_counts=[1, 2, 3, 8, 512])
    proc = kwarm_cli("manifest", "merge", str(rank0), "-o", str(out))
    assert proc.returncode == 0 and "3 items (0 new), 5 step sizes (5 new)" in proc.stdout  # items and counts apart
    shown = kwarm_cli("manifest", "show", str(out)).stdout
    assert "3 entries, 0 autotune choices, 1 kernels, 5 learned step sizes (1-3, 8, 512)" in shown
    assert kwarm_cli("manifest", "merge", str(tmp_path / "nope.json"), "-o", str(out)).returncode == 2


def test_run_learn_sets_kwarm_learn():
    code = "import os; print(os.environ.get('KWARM_ENABLE'), os.environ.get('KWARM_LEARN'))"
    env = clean_env()
    base = [sys.executable, "-c",
            "import sys; from kwarm_ext import cli; sys.exit(cli.main(sys.argv[1:]))", "run"]
    learned = subprocess.run(base + ["--learn", "--", sys.executable, "-c", code], env=env,
                             capture_output=True, text=True)
    plain = subprocess.run(base + ["--", sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert learned.stdout.split() == ["1", "1"] and plain.stdout.split() == ["1", "None"]


def test_a_save_with_nothing_new_creates_the_file_once_and_then_leaves_it_alone(tmp_path):
    """The first start of a deployment that learned nothing still leaves a manifest (``kwarm
    manifest show`` finds it); later saves with nothing new do not rewrite it."""
    path = str(tmp_path / "new" / "m.json")
    assert manifest_files.save(path, STAMP).added == 0 and manifest_files.load(path).entries == []
    before = os.stat(path)
    assert manifest_files.save(path, STAMP).added == 0
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "rewritten with nothing new"


def test_replay_keeps_an_autotuned_entry_only_where_it_is_a_recorded_winner():
    """Autotuning compiles every candidate config; replay keeps the entries whose constexprs and
    launch options are a recorded winner's (the real ``@triton.autotune`` kernel of
    tests/replay_kernels.py): another warp count, a missing constexpr or another value is left out."""
    from kwarm_ext.surfaces.triton import compat as triton_compat

    kernel = triton_compat.resolve("replay_kernels", "tuned_kernel")
    winner = triton_compat.config_to_json(rk.TUNE_CONFIGS[1])  # BLOCK 128, 4 warps
    chosen = {("replay_kernels", "tuned_kernel", "src"): [winner]}
    options = {f: winner[f] for f in ("num_warps", "num_stages", "num_ctas", "maxnreg")}

    def entry(block=128, **launch):
        keys, vals = ([[3]], [{"constexpr": block}]) if block is not None else ([], [])  # BLOCK: parameter 3
        return types.SimpleNamespace(module="replay_kernels", qualname="tuned_kernel", source_key="src",
                                     spec={"constant_keys": keys, "constant_vals": vals},
                                     launch_options={**options, **launch})

    assert replay._is_chosen(entry(), kernel, chosen)
    assert not replay._is_chosen(entry(num_warps=8), kernel, chosen), "another warp count"
    assert not replay._is_chosen(entry(block=None), kernel, chosen), "no BLOCK constexpr"
    assert not replay._is_chosen(entry(block=256), kernel, chosen), "another BLOCK"
    assert replay._is_chosen(entry(block=256), kernel, {}), "no choice recorded: every candidate"
