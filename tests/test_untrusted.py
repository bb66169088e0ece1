"""Manifests, reports and configuration as untrusted input: the holes an adversarial test found
(issue 16), each as a case that must stay closed. The engine side is ``replay.prepare`` and
``manifest_files.save``/``load`` in-process; the CLI runs as a subprocess with a timeout, so that a
hang fails the test instead of the suite."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, require
from kwarm_ext import config, manifest, manifest_files, warmup
from kwarm_ext.surfaces.triton import replay
from kwarm_ext.surfaces.triton import compat as triton_compat
from kwarm_ext.manifest import BadManifest, Stamp

triton = require("triton")
from test_manifest import ALLOWED, OPTIONS, STAMP, entry, fake_driver, warnings_of, write  # noqa: E402,F401

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (device nodes, another user's files)")


def kwarm_cli(*args, timeout=20, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "kwarm_ext.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or "/", env=env or clean_env())


# ---------------------------------------------------------------------------- 2. constants vs key

def test_constants_that_disagree_with_the_key_are_refused(tmp_path, kwarm_log, fake_driver):
    liar = entry(block=128)
    liar.spec["constant_vals"] = [64]  # the key says BLOCK=128
    state = replay.prepare(str(write(tmp_path / "m.json", [liar, entry(block=32)])), STAMP, ALLOWED)
    assert [s.kind for s in state.skipped] == ["malformed"] and len(state.jobs) == 1
    assert "constant 3 is 64 but the key says 128" in state.skipped[0].reason


def test_1_compiler_attributes_the_key_does_not_justify_are_refused(tmp_path):
    aligned = entry(n_class="")  # the key says n is not divisible by 16 ...
    aligned.spec["attrs_vals"] = [[["tt.divisibility", 16]]] * 3  # ... the file says it is
    dropped = entry(n_class="D")
    dropped.spec["attrs_vals"] = [[["tt.divisibility", 16]], [], [["tt.divisibility", 16]]]  # y_ptr lost its 'D'
    path = write(tmp_path / "m.json", [aligned, dropped, entry(block=32)])
    data = manifest_files.load(str(path))
    assert [e.spec["constant_vals"] for e in data.entries] == [[32]]
    reasons = [reason for _, reason in data.problems]
    assert 'attributes of argument [2] are [["tt.divisibility", 16]] but the key implies null' in reasons[0]
    assert 'attributes of argument [1] are null but the key implies [["tt.divisibility", 16]]' in reasons[1]


@pytest.mark.parametrize("tagged", [{"tuple": []}, {"torch_dtype": "float16"}, {"jit_function": "replay_kernels:copy_kernel"},
                                    {"str": "128"}, {"constexpr": {"tuple": [128]}}, {"other": 128}, {"tuple": [], "str": "x"}])
def test_2_tagged_objects_do_not_pass_for_a_plain_constant(tmp_path, tagged):
    liar = entry(block=128)
    liar.spec["constant_vals"] = [tagged]  # the key says BLOCK=128
    data = manifest_files.load(str(write(tmp_path / "m.json", [liar])))
    assert data.entries == [] and "but the key says 128" in data.problems[0][1], data.problems


@pytest.mark.parametrize("recorded, usable", [(1, True), (True, False), (1.0, False), ("1", False), (None, False)])
def test_a_constant_must_be_the_keys_value_kind_for_kind(recorded, usable):
    """``true`` == 1 in Python: a constant of another kind than the key's would file a kernel under
    another specialization's key (issue 59: dropping the kind check was caught by no test)."""
    key = entry().key.replace("('constexpr', 128)", "('constexpr', 1)")
    raw = manifest.Manifest(STAMP, [entry()]).as_json()
    raw["entries"][0].update(key=key)
    raw["entries"][0]["spec"]["constant_vals"] = [recorded]
    data = manifest.parse(json.dumps(raw))
    assert bool(data.entries) is usable, (recorded, data.problems)
    if not usable:
        assert data.problems[0][1] == f"malformed: constant 3 is {recorded!r} but the key says 1"


def test_12_negative_zero_is_not_zero(tmp_path):
    key = entry().key.replace("('constexpr', 128)", "('constexpr', 0.0)")
    raw = manifest.Manifest(STAMP, [entry()]).as_json()
    raw["entries"][0].update(key=key)
    for recorded, usable in ((-0.0, False), (0.0, True)):
        raw["entries"][0]["spec"]["constant_vals"] = [recorded]
        data = manifest.parse(json.dumps(raw))
        assert bool(data.entries) is usable, (recorded, data.problems)
    assert manifest._same_constant(float("nan"), float("nan"))  # a key holding nan is that nan


def test_a_key_whose_specialization_cannot_be_read_is_refused(tmp_path, fake_driver):
    odd = entry()
    odd_key = odd.key.replace("('constexpr', 128)", "('constexpr', os.system)")
    raw = manifest.Manifest(STAMP, [odd]).as_json()
    raw["entries"][0]["key"] = odd_key
    data = manifest.parse(json.dumps(raw))
    assert data.entries == [] and "cannot be read" in data.problems[0][1]


# ---------------------------------------------------------------------------- 3, 4. FIFOs and devices

def test_a_fifo_at_the_manifest_path_is_refused_without_blocking(tmp_path):
    """In a child with a timeout: opening a FIFO for reading blocks until a writer comes."""
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo, 0o600)
    code = f"""
from kwarm_ext import manifest, manifest_files
from kwarm_ext.manifest import Stamp
for call in (lambda: manifest_files.load({str(fifo)!r}),
             lambda: manifest_files.save({str(fifo)!r}, Stamp("3.6.0", "cuda:90"))):
    try:
        call()
    except manifest.BadManifest as exc:
        print("REFUSED", exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                          env=clean_env(), cwd="/")
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2 and all("not a regular file" in line for line in refused), proc.stdout + proc.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "left as it was"
    for action in ("show", "verify"):
        proc = kwarm_cli("manifest", action, str(fifo))
        assert proc.returncode == 2 and "not a regular file" in proc.stdout and "Traceback" not in proc.stderr


@needs_root
def test_a_device_node_is_never_replaced(tmp_path):
    node = tmp_path / "dev-null"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with pytest.raises(BadManifest, match="refused to replace .*not a regular file"):
        manifest_files.save(str(node), STAMP, [entry()])
    with pytest.raises(BadManifest, match="not a regular file"):
        warmup.write_report({"total_s": 1}, str(node), 0)
    assert stat.S_ISCHR(os.lstat(node).st_mode), "still the device"


def test_a_report_path_that_is_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(BadManifest, match="not a regular file"):
        warmup.write_report({"total_s": 1}, str(fifo), 0)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---------------------------------------------------------------------------- 5. the lock

def test_a_held_lock_is_waited_for_a_bounded_time(tmp_path, monkeypatch):
    import fcntl

    path = tmp_path / "m.json"
    holder = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a stopped process that holds the lock
    monkeypatch.setattr(manifest_files, "LOCK_TIMEOUT_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(manifest_files.LockTimeout, match="held by another process for over 0.3 s; not saved"):
        manifest_files.save(str(path), STAMP, [entry()])
    assert time.monotonic() - t0 < 3 and not path.exists()
    os.close(holder)
    assert manifest_files.save(str(path), STAMP, [entry()]).added == 1, "saves once it is free"


def test_a_symlinked_lock_is_refused_and_its_target_never_created(tmp_path):
    path, target = tmp_path / "m.json", tmp_path / "elsewhere"
    os.symlink(target, str(path) + ".lock")
    with pytest.raises(BadManifest, match="cannot open the lock"):
        manifest_files.save(str(path), STAMP, [entry()])
    assert not target.exists() and not path.exists()


@needs_root
def test_another_users_lock_file_is_refused(tmp_path):
    path = tmp_path / "m.json"
    lock = Path(str(path) + ".lock")
    lock.write_text("")
    os.chmod(lock, 0o666)
    os.chown(lock, 65534, 65534)
    with pytest.raises(BadManifest, match="refused the lock .*not a regular file of this user"):
        manifest_files.save(str(path), STAMP, [entry()])


def test_a_learner_whose_save_times_out_exits_promptly(tmp_path):
    """A learning process's at-exit save waits at most the lock's timeout."""
    code = f"""
import fcntl, os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from kwarm_ext import manifest, manifest_files
from kwarm_ext.surfaces.triton import learn
from kwarm_ext.manifest import Stamp
manifest_files.LOCK_TIMEOUT_S = 0.5
path = {str(tmp_path / 'm.json')!r}
fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
pid = os.fork()
if pid == 0:  # a process that holds the lock and never lets go
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1), os.dup2(null, 2)
    fcntl.flock(os.open(path + ".lock", os.O_RDWR), fcntl.LOCK_EX)
    time.sleep(30)
    os._exit(0)
time.sleep(0.5)
learner = learn.Learner(path, Stamp("3.6.0", "cuda:90"), learn.Recorder(("vllm.",)), 0)
learner.recorder.give_back([manifest.Entry("vllm.x", "k", "0" * 64, "[]{{}}", {{}}, {{}})])
learner.save_quietly("exit")
os.kill(pid, 9)
print("RESULT", learner.saves)
"""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, env=clean_env(),
                          cwd="/")  # the installed kwarm, not this tree's
    assert "RESULT 0" in proc.stdout, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------- 6, 7. parse cost, nesting

def test_crafted_long_keys_cost_no_quadratic_time(tmp_path):
    e = manifest.Manifest(STAMP, [entry()]).as_json()
    raw = e["entries"][0]
    crafted = [dict(raw, key="[" + "]{" * 15_000 + "]" + str(OPTIONS)) for _ in range(10)]  # 30k > MAX_KEY
    near_limit = [dict(raw, key="]{" * 9_000 + raw["key"])]
    text = json.dumps(dict(e, entries=crafted + near_limit))
    t0 = time.monotonic()
    data = manifest.parse(text)
    assert time.monotonic() - t0 < 2.0
    assert data.entries == [] and len(data.problems) == 11


def test_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    path.chmod(0o600)
    with pytest.raises(BadManifest, match="nested too deeply"):
        manifest_files.load(str(path))
    proc = kwarm_cli("manifest", "show", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stdout.splitlines()) == 1
    result = manifest_files.save(str(path), STAMP, [entry()])  # learning can replace it
    assert result.added == 1 and "nested too deeply" in result.note


# ---------------------------------------------------------------------------- 5, 6. bounds and log volume

def test_5_entries_past_the_bound_are_dropped_in_one_line_and_constants_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "MAX_ENTRIES", 3)
    raw = manifest.Manifest(STAMP, [entry(block=b) for b in (16, 32, 64, 128, 256)]).as_json()
    data = manifest.parse(json.dumps(raw))
    assert len(data.entries) == 3 and data.problems == [("entries", "2 past the first 3 dropped")]
    big = entry(block=128)
    big.spec["constant_vals"] = [{"tuple": [1] * 400}]
    data = manifest.parse(json.dumps(manifest.Manifest(STAMP, [big]).as_json()))
    assert data.entries == [] and "larger than 1000 characters" in data.problems[0][1]


HOSTILE = r'''
import json, logging, resource, sys, time
sys.path.insert(0, sys.argv[2])
from test_manifest import STAMP, ALLOWED
from kwarm_ext.surfaces.triton import replay
lines = []
class Count(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("kwarm").addHandler(Count())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
state = replay.prepare(sys.argv[1], STAMP, ALLOWED)
print(json.dumps({"s": time.perf_counter() - t0, "mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "lines": lines, "refused": state.refused, "summary": state.summary()}))
'''


@pytest.mark.parametrize("shape", ["tiny objects", "plain numbers", "entries that lie"])
def test_6_an_8_mib_hostile_manifest_is_cheap_and_one_line(tmp_path, shape):
    raw = manifest.Manifest(STAMP, [entry()]).as_json()
    if shape == "tiny objects":
        raw["entries"] = [{}] * ((8 << 20) // 3)
    elif shape == "plain numbers":
        raw["entries"] = [0] * ((8 << 20) // 2)
    else:
        liar = raw["entries"][0]
        liar["spec"]["constant_vals"] = [64]  # the key says 128
        raw["entries"] = [liar] * ((8 << 20) // len(json.dumps(liar)))
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(raw, separators=(",", ":")))
    path.chmod(0o600)
    assert path.stat().st_size > 7 << 20
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    proc = subprocess.run([sys.executable, str(script), str(path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120, cwd="/", env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert len(out["lines"]) == 1 and str(path) in out["lines"][0], out["lines"][:5]
    assert out["s"] < 10.0 and out["mb"] < 60, out  # measured alone on this CPU: 0.02-0.97 s, 16-49 MB; CI shares 2 cores


# ---------------------------------------------------------------------------- 7, 9. write what read accepts; no stat-then-open

def test_7_a_save_or_merge_past_what_read_accepts_is_not_written(tmp_path, monkeypatch, capsys):
    from kwarm_ext import manifest_cli

    path = str(write(tmp_path / "m.json", [entry(block=16)], mode=0o600))
    other = str(write(tmp_path / "o.json", [entry(block=32)], mode=0o600))
    before = Path(path).read_text()
    monkeypatch.setattr(manifest, "MAX_BYTES", max(len(before), len(Path(other).read_text())) + 100)  # one entry fits
    with pytest.raises(BadManifest, match="not written: it would be .* MiB, more than the 0 MiB"):
        manifest_files.save(path, STAMP, [entry(block=b) for b in (32, 64, 128)])
    assert Path(path).read_text() == before and len(manifest_files.load(path).entries) == 1
    assert manifest_cli.merge([path, other], path) == 2
    assert "cannot write" in capsys.readouterr().out and Path(path).read_text() == before


def test_7_a_manifest_of_exactly_the_bound_is_written_and_read_and_one_byte_more_is_not(tmp_path, monkeypatch):
    path = str(write(tmp_path / "m.json", [entry()], mode=0o600))
    obj = manifest_files.load(path).as_json()
    size = len(manifest_files._dumps(obj).encode("utf-8"))
    monkeypatch.setattr(manifest, "MAX_BYTES", size)
    manifest_files._write_atomic(path, obj)
    assert os.path.getsize(path) == size and len(manifest_files.load(path).entries) == 1
    Path(path).write_text(Path(path).read_text() + " ")  # still valid JSON, one byte past the bound
    with pytest.raises(BadManifest, match="larger than"):
        manifest_files.load(path)
    monkeypatch.setattr(manifest, "MAX_BYTES", size - 1)
    with pytest.raises(BadManifest, match="not written"):
        manifest_files._write_atomic(path, obj)


def test_9_a_fifo_swapped_in_after_the_check_is_never_opened_for_reading(tmp_path, monkeypatch):
    path = str(write(tmp_path / "m.json", [entry()], mode=0o600))
    real_open, opened = os.open, []

    def swapping_open(target, flags, *args, **kwargs):
        if str(target) == path and not opened:  # the attacker wins the race: a FIFO now
            os.unlink(path)
            os.mkfifo(path, 0o600)
        fd = real_open(target, flags, *args, **kwargs)
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            opened.append(bool(flags & getattr(os, "O_PATH", 0)))
        return fd

    monkeypatch.setattr(os, "open", swapping_open)
    with pytest.raises(BadManifest, match="refused: not a regular file"):
        manifest_files.load(path)
    assert opened == [True], "the FIFO was opened for reading"


# ---------------------------------------------------------------------------- 8. log injection

def test_manifest_strings_are_escaped_in_logs_and_show(tmp_path, kwarm_log, fake_driver, capsys):
    raw = manifest.Manifest(Stamp(**{**STAMP.__dict__, "model": "m\x1b[31mRED\nWARNING forged"}), [entry()]).as_json()
    raw["entries"].append(dict(raw["entries"][0], module="vllm.x\nWARNING kwarm: forged", key=7))
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    path.chmod(0o600)
    replay.prepare(str(path), Stamp(**{**STAMP.__dict__, "model": "other"}), ALLOWED)
    for line in kwarm_log.messages(0) + warnings_of(kwarm_log):
        assert "\n" not in line and "\x1b" not in line, repr(line)
    proc = kwarm_cli("manifest", "show", str(path))
    assert "\x1b" not in proc.stdout and "forged" not in "".join(
        line for line in proc.stdout.splitlines() if line.startswith("WARNING"))
    assert "model m\\x1b[31mRED\\x0aWARNING forged" in proc.stdout



def test_10_a_trailing_newline_is_no_module_name():
    assert manifest.is_dotted_name("vllm.x") and not manifest.is_dotted_name("vllm.x\n")
    assert config._MODULE_PREFIX.fullmatch("vllm.") and not config._MODULE_PREFIX.fullmatch("vllm.\n")


def test_10_verify_and_merge_print_no_raw_control_character(tmp_path):
    raw = manifest.Manifest(STAMP, [entry()]).as_json()
    raw["entries"].append(dict(raw["entries"][0], module="vllm.x\x1b[2J", key=7))
    raw["entries"].append(dict(raw["entries"][0], kernel="k\rWARNING kwarm: forged\x07", key=8))
    path = tmp_path / "m\x1b[31m.json"
    path.write_text(json.dumps(raw))
    path.chmod(0o600)
    for args in (["verify", str(path)], ["merge", "-o", str(tmp_path / "out.json"), str(path)]):
        proc = kwarm_cli("manifest", *args)
        text = proc.stdout + proc.stderr
        assert "Traceback" not in text and text.strip(), args
        assert not any(ch in text for ch in "\x1b\r\x07"), (args, text)
        assert "\\x1b" in text, (args, text)  # the file name is shown, escaped

# ---------------------------------------------------------------------------- 9. imports

def test_only_modules_that_define_triton_kernels_are_imported(tmp_path, monkeypatch):
    pkg = tmp_path / "allowedpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "effects.py").write_text("import sys\nsys.path.insert(0, '/kwarm-was-here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = triton_compat.not_a_kernel_module("allowedpkg.sub.effects")
    assert why == "module allowedpkg.sub.effects defines no Triton kernel (no function decorated with triton.jit); not imported"
    with pytest.raises(triton_compat.Unresolvable, match="defines no Triton kernel"):
        triton_compat.resolve("allowedpkg.sub.effects", "kernel")
    assert "/kwarm-was-here" not in sys.path and "allowedpkg.sub.effects" not in sys.modules
    assert "allowedpkg" not in sys.modules, "not even its package was imported to find it"
    assert "defines no Triton kernel" in triton_compat.not_a_kernel_module("kwarm_ext._bootstrap.sitecustomize")
    assert triton_compat.not_a_kernel_module("replay_kernels") is None
    assert "no Python source" in triton_compat.not_a_kernel_module("allowedpkg.missing")


def test_11_a_comment_or_string_that_mentions_triton_jit_defines_no_kernel(tmp_path, monkeypatch):
    pkg = tmp_path / "allowedpkg11"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "effects.py").write_text("import os  # @triton.jit\nos.environ['KWARM_WAS_HERE'] = 'triton.jit'\n"
                                    "def kernel():\n    return '@jit'\n")
    (pkg / "kernels.py").write_text("import triton\n@triton.autotune(configs=[], key=[])\n@triton.jit(do_not_specialize=['n'])\n"
                                    "def k1(x):\n    pass\n@jit\ndef k2(x):\n    pass\nk3 = triton.jit(k2)\n"
                                    "def helper():\n    pass\n")
    (pkg / "broken.py").write_text("@triton.jit\ndef k(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "defines no Triton kernel" in triton_compat.not_a_kernel_module("allowedpkg11.effects")
    with pytest.raises(triton_compat.Unresolvable, match="defines no Triton kernel"):
        triton_compat.resolve("allowedpkg11.effects", "kernel")
    assert "KWARM_WAS_HERE" not in os.environ and "allowedpkg11.effects" not in sys.modules
    assert triton_compat.jit_names((pkg / "kernels.py").read_text()) == {"k1", "k2", "k3"}
    assert triton_compat.not_a_kernel_module("allowedpkg11.kernels", "k1") is None
    assert triton_compat.not_a_kernel_module("allowedpkg11.kernels", "helper") == \
        "module allowedpkg11.kernels defines no Triton kernel helper; not imported"
    assert "does not parse" in triton_compat.not_a_kernel_module("allowedpkg11.broken")


# ---------------------------------------------------------------------------- 10-12. configuration

def test_configuration_edges():
    s = config.parse({"KWARM_LEARN_INTERVAL": "1e10"}, known_families=("runner",))
    assert s.learn_interval == 60.0 and "KWARM_LEARN_INTERVAL" in s.problems[0]
    s = config.parse({"KWARM_WARMUPS": "-*"}, known_families=("runner", "qwen_gdn"))
    assert not s.warmups.wants("runner") and not s.warmups.wants("qwen_gdn"), "-* is no family"
    s = config.parse({"KWARM_WARMUPS": "-*,runner"}, known_families=("runner", "qwen_gdn"))
    assert s.warmups.wants("runner") and not s.warmups.wants("qwen_gdn")
    s = config.parse({"KWARM_MANIFEST": "~/m.json", "KWARM_REPORT": "~/r.json"}, known_families=())
    assert s.manifest == os.path.expanduser("~/m.json") and s.report == os.path.expanduser("~/r.json")


# ---------------------------------------------------------------------------- 13, 14. the CLI

def test_kwarm_run_never_runs_a_program_from_the_current_folder(tmp_path):
    prog = tmp_path / "sneaky"
    prog.write_text("#!/bin/sh\necho RAN\n")
    prog.chmod(0o755)
    env = dict(clean_env(), PATH="/usr/bin:/bin")
    proc = kwarm_cli("run", "--", "sneaky", cwd=str(tmp_path), env=env)
    assert proc.returncode == 127 and "RAN" not in proc.stdout
    assert proc.stderr.strip() == "kwarm run: sneaky: command not found on PATH"


@pytest.mark.parametrize("output", ["DIR", "/proc/kwarm-x.json"])
def test_merge_into_an_unwritable_output_is_one_line(tmp_path, output):
    src = write(tmp_path / "a.json", [entry()], mode=0o600)
    out = str(tmp_path) if output == "DIR" else output
    proc = kwarm_cli("manifest", "merge", str(src), "-o", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().startswith(f"kwarm manifest merge: cannot write {out}")
    assert not Path(str(tmp_path) + ".lock").exists(), "no stray lock beside a directory"


# ---------------------------------------------------------------------------- 15. temporaries

def test_a_killed_saves_temporary_is_cleaned_up(tmp_path):
    path = tmp_path / "m.json"
    stale = tmp_path / ".m.json.abc123.tmp"
    stale.write_text("")
    other = tmp_path / ".other.json.x.tmp"
    other.write_text("")
    manifest_files.save(str(path), STAMP, [entry()])
    assert not stale.exists() and other.exists() and path.exists()


# ---------------------------------------------------------------------------- a second user

@needs_root
def test_a_manifest_written_by_another_user_in_a_shared_folder_is_refused(tmp_path, kwarm_log, fake_driver):
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="kwarm-shared-", dir="/tmp"))  # reachable by another user
    os.chmod(shared, 0o1777)
    request_cleanup = shared
    path = shared / "m.json"
    good = json.dumps(manifest.Manifest(STAMP, [entry()]).as_json())
    subprocess.run(["/bin/sh", "-c", 'cat > "$1" && chmod 644 "$1"', "sh", str(path)], input=good, text=True,
                   check=True, timeout=20, user=65534, group=65534, env={"PATH": "/usr/bin:/bin"})
    assert os.stat(path).st_uid == 65534
    state = replay.prepare(str(path), STAMP, ALLOWED)
    assert state.jobs == [] and "owned by uid 65534" in state.refused
    with pytest.raises(BadManifest, match="owned by uid 65534, not this user"):
        manifest_files.save(str(path), STAMP, [entry()])
    assert os.stat(path).st_uid == 65534, "not replaced"
    shutil.rmtree(request_cleanup)


# ---------------------------------------------------------------------------- issue 51, second round

def test_3_the_reports_temporary_file_follows_no_link_planted_at_its_old_name(tmp_path):
    """A user who can write the report's folder plants ``<report>.tmp.<pid>`` -> a file of the
    engine's user: the report is written, the file untouched."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    report = tmp_path / "shared" / "report.json"
    report.parent.mkdir()
    for pid in {os.getpid(), os.getpid() + 1}:
        os.symlink(victim, f"{report}.tmp.{pid}")
    assert warmup.write_report({"ok": 1}, str(report), 0) == str(report)
    assert json.loads(report.read_text()) == {"ok": 1} and victim.read_text() == "keep"
    assert stat.S_IMODE(report.stat().st_mode) == 0o644


def test_4_the_manifests_mode_is_set_on_its_descriptor_not_through_a_swapped_path(tmp_path, monkeypatch):
    """Between writing the temporary file and setting its mode, a writer of the folder swaps it for a
    link to another file: that file's mode must not change (a chmod by path would make it 0644)."""
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    path = tmp_path / "m.json"
    real_fsync = os.fsync

    def swap_then_fsync(fd):  # the race, at the moment a path-based chmod would come next
        for tmp in tmp_path.glob(".m.json.*.tmp"):
            os.unlink(tmp)
            os.symlink(victim, tmp)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", swap_then_fsync)
    manifest_files.save(str(path), STAMP, [entry(block=32)])
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "secret"


def test_8_merge_onto_a_symbolic_link_is_refused_and_the_link_kept(tmp_path):
    src = write(tmp_path / "a.json", [entry(block=32)])
    target = tmp_path / "target.json"
    target.write_text("mine")
    link = tmp_path / "out.json"
    os.symlink(target, link)
    proc = kwarm_cli("manifest", "merge", str(src), "-o", str(link))
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0], lines
    assert link.is_symlink() and target.read_text() == "mine"


def test_12_a_boolean_is_no_format_version(tmp_path):
    path = write(tmp_path / "m.json", [entry(block=32)])
    data = json.loads(path.read_text())
    data["version"] = True
    path.write_text(json.dumps(data))
    with pytest.raises(BadManifest, match="format version True"):
        manifest_files.load(str(path))


FULL_DISK = r'''
import os, resource, signal, sys
from kwarm_ext import manifest_files, warmup
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
for write in (lambda: warmup.write_report({"x": "x" * 100_000}, sys.argv[1], 0),
              lambda: manifest_files.save(sys.argv[1] + ".manifest", manifest_files.Stamp(
                  triton="3.6.0", arch="cuda:90"), token_counts=range(1, 9000))):
    try:
        write()
    except OSError as exc:
        print("failed", exc.errno)
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))))
'''


def test_12_a_write_that_fails_for_want_of_space_leaves_no_temporary_file(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(folder / "m.json")], capture_output=True, text=True,
                          timeout=60, cwd="/")
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["failed 27", "failed 27"], proc.stdout + proc.stderr
    assert [n for n in eval(lines[2]) if not n.endswith(".lock")] == [], lines  # the lock file is not a temporary


def test_5_an_entry_still_compiling_past_the_bound_is_skipped_unwaited(tmp_path, kwarm_log, fake_driver, monkeypatch):
    """Case 5, third part: one entry's compile is bounded (``replay.ENTRY_COMPILE_S``). Triton's compile
    cannot be interrupted: past the bound the entry is skipped with its reason, the compile goes on in
    a daemon thread unwaited, and the other entries and the engine's start go on. Here the bound is
    set below what the real compile of these entries takes on this CPU; with the real bound they compile."""
    from kwarm_ext.surfaces.triton import compile as triton_compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # nothing compiled before: no cache hit
    path = write(tmp_path / "m.json", [entry(block=b) for b in (2048, 4096, 8192)])
    monkeypatch.setattr(replay, "ENTRY_COMPILE_S", 0.001)
    state = replay.prepare(str(path), STAMP, ALLOWED)
    state.threads = 2
    compiled = replay.compile_entries(state)
    bounded = [s for s in state.skipped if s.reason.startswith(
        "still compiling after 0.001 s: skipped, the compile goes on unwaited")]
    assert bounded and len(bounded) + len(compiled) == 3, [s.reason for s in state.skipped]
    assert all(s.kind == "compile failed" for s in bounded)
    monkeypatch.setattr(replay, "ENTRY_COMPILE_S", 180.0)
    state = replay.prepare(str(path), STAMP, ALLOWED)
    state.threads = 1  # one thread: bounded too (the bound needs the pool)
    assert len(replay.compile_entries(state)) == 3 and state.skipped == []
    # what a timed-out entry says, and that the replay's total bound did not end these compiles
    assert str(triton_compile.CompileTimedOut(0.001)) == "still compiling after 0.001 s" and state.out_of_time == 0


def test_5_the_bounded_pool_fails_a_late_job_at_once_and_does_not_wait_for_it():
    """The executor behind the bound, on Triton's real AsyncCompileMode: a job still running past
    the bound fails with CompileTimedOut within a few polls, the next job runs on a new worker, and
    leaving the block does not wait for the late one (a sleep stands in for a 30 s compile)."""
    import threading

    from kwarm_ext.surfaces.triton import compile as triton_compile

    release = threading.Event()
    pool = triton_compile.BoundedCompiles(1, 0.05)
    t0 = time.perf_counter()
    with triton.AsyncCompileMode(pool, ignore_errors=True) as mode:
        slow = mode.submit("slow", lambda: release.wait(30) and "late", lambda kernel: None)
        quick = mode.submit("quick", lambda: "kernel", lambda kernel: None)
    elapsed = time.perf_counter() - t0
    pool.shutdown()
    with pytest.raises(triton_compile.CompileTimedOut, match="still compiling after 0.05 s"):
        slow.result()
    assert quick.result() == "kernel"
    assert elapsed < 10, "the block did not wait for the late job"
    release.set()


# ---------------------------------------------------------------------------- issue 59, third round

def test_59_2_systemexit_in_a_step_is_one_warning_and_keyboardinterrupt_still_stops(kwarm_log):
    """Hole 2: kwarm's guards caught Exception only, and a script a manifest made kwarm import called
    ``sys.exit(2)``: the worker ended. A SystemExit in a step is contained like an error; a real
    Ctrl-C (KeyboardInterrupt) still stops the engine."""
    from kwarm_ext.log import fail_open

    def exits():
        sys.exit(2)

    with pytest.raises(warmup.StepFailed, match="SystemExit: 2"):
        warmup.guarded("replay: flashinfer", exits)
    assert kwarm_log.messages() == ["kwarm: replay: flashinfer failed, skipped: SystemExit: 2"]
    with pytest.raises(KeyboardInterrupt):
        with fail_open("a step"):
            raise KeyboardInterrupt
    assert len(kwarm_log.messages()) == 1, "a Ctrl-C is no warning: it propagates"


def test_59_2_a_kernel_module_that_exits_as_it_is_imported_is_unresolvable(tmp_path, monkeypatch):
    pkg = tmp_path / "exitpkg59"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "k.py").write_text("import sys, triton\n@triton.jit\ndef kernel(x):\n    pass\nsys.exit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(triton_compat.Unresolvable, match="cannot import exitpkg59.k: SystemExit: 2"):
        triton_compat.resolve("exitpkg59.k", "kernel")


def test_59_4_the_whole_replay_is_bounded_and_what_is_left_is_one_line(tmp_path, kwarm_log, fake_driver, monkeypatch):
    """Hole 4: the bound on one entry did not bound the start (40 entries that never finish, 0.5 s, 2
    threads: 10.1 s; with Triton 3.5's sequential compile, no bound at all). The replay's total bound
    (KWARM_REPLAY_LIMIT) ends the step at its deadline whatever the compile path; a compile that never
    returns (a stand-in for Triton's, in the compile loop's own thread) is left behind, unwaited."""
    from kwarm_ext.surfaces.triton import preload as triton_preload

    import torch

    release = threading.Event()
    started, devices = [], []
    monkeypatch.setattr(triton_preload, "preload", lambda job: started.append(job) or release.wait(30))
    # a TP rank's device (no GPU here): the compile loop's thread takes it before it compiles anything
    monkeypatch.setattr(triton_preload, "_current_cuda_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append((d, threading.current_thread().name)))
    path = write(tmp_path / "m.json", [entry(block=b) for b in range(16, 56)])
    state = replay.prepare(str(path), STAMP, ALLOWED)
    assert len(state.jobs) == 40
    state.limit_s, state.threads = 0.5, 2
    t0 = time.monotonic()
    assert replay.compile_entries(state) == []
    assert time.monotonic() - t0 < 3, "the replay's deadline ended the step"
    assert len(started) == 1 and state.out_of_time == 40 and {s.kind for s in state.skipped} == {"out of time"}
    assert devices == [(3, "kwarm-replay-loop")], devices
    assert kwarm_log.messages() == ["kwarm: replay reached its total bound of 0.5 s (KWARM_REPLAY_LIMIT): "
                                    "40 Triton entries left to the requests"]
    assert "40 skipped (out of time: 40)" in state.summary() and state.details()["out_of_time"] == 40
    assert state.details()["left_to_requests"] == [{"count": 40, "what": "manifest entries", "why": "out of time"}]
    release.set()
    assert config.parse({"KWARM_REPLAY_LIMIT": "5"}, known_families=()).replay_limit == 5.0
    assert config.parse({}, known_families=()).replay_limit == config.DEFAULT_REPLAY_LIMIT == 600.0
    assert config.parse({"KWARM_REPLAY_LIMIT": "-1"}, known_families=()).problems == (
        "KWARM_REPLAY_LIMIT='-1' is invalid (expected a number of seconds from 0 to 86400); using the default '600'",)


def test_59_4_the_bounded_pool_fails_every_job_at_the_deadline_and_leaves_few_threads_behind():
    """The executor behind both bounds, on Triton's real AsyncCompileMode: at the deadline every job not
    finished fails with OutOfTime and none is started after it; past the bound on one entry, at most
    2 x threads workers are left behind (40 slow entries had left 42 threads), the rest fail at once."""
    from kwarm_ext.surfaces.triton import compile as triton_compile

    release = threading.Event()

    def slow():
        release.wait(30)
        return "late"

    pool = triton_compile.BoundedCompiles(2, 30.0, deadline=time.monotonic() + 0.3)
    t0 = time.perf_counter()
    with triton.AsyncCompileMode(pool, ignore_errors=True) as mode:
        futures = [mode.submit(f"slow{i}", slow, lambda kernel: None) for i in range(5)]
    pool.shutdown()
    assert time.perf_counter() - t0 < 5
    for future in futures:
        with pytest.raises(triton_compile.OutOfTime):
            future.result()

    pool = triton_compile.BoundedCompiles(2, 0.05)
    with triton.AsyncCompileMode(pool, ignore_errors=True) as mode:
        futures = [mode.submit(f"slow{i}", slow, lambda kernel: None) for i in range(40)]
    pool.shutdown()
    assert pool.abandoned <= 4, pool.abandoned
    errors = [type(f.future.exception()) for f in futures]
    assert set(errors) == {triton_compile.CompileTimedOut, triton_compile.OutOfTime}
    assert errors.count(triton_compile.CompileTimedOut) <= 4
    assert isinstance(triton_compile.OutOfTime(), Exception) and not isinstance(triton_compile.OutOfTime(), KeyboardInterrupt)
    release.set()


def test_59_3_save_never_writes_what_load_refuses_and_a_learner_keeps_an_unreadable_file_aside(tmp_path, monkeypatch):
    """Hole 3: saving checked bytes, not the container count load enforces: a learned file of 420,205
    JSON objects and arrays (cap 400,000) was refused by the next load, and the next save replaced its
    2,200 entries with the 1 that run learned."""
    path = tmp_path / "m.json"
    manifest_files.save(str(path), STAMP, [entry(block=16)])
    before = path.read_text()
    monkeypatch.setattr(manifest, "MAX_CONTAINERS", manifest.containers(before) + 5)  # one more entry does not fit
    with pytest.raises(BadManifest, match=r"not written: it would hold \d+ JSON objects and arrays, more than the \d+"):
        manifest_files.save(str(path), STAMP, [entry(block=32)])
    assert path.read_text() == before and len(manifest_files.load(str(path)).entries) == 1

    monkeypatch.setattr(manifest, "MAX_CONTAINERS", manifest.containers(before) - 1)  # the file no longer loads
    with pytest.raises(BadManifest, match="JSON objects and arrays, more than a manifest holds"):
        manifest_files.load(str(path))
    monkeypatch.setattr(manifest, "MAX_CONTAINERS", 400_000)
    path.write_text(before.replace('"entries": [', '"entries": [[', 1))  # a file this kwarm cannot read
    unreadable = path.read_text()
    result = manifest_files.save(str(path), STAMP, [entry(block=64)])
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("m.json.unreadable.")]
    assert len(aside) == 1 and aside[0].read_text() == unreadable, "kept, not replaced"
    assert result.note.startswith("could not read the manifest (not valid JSON") and \
        f"kept it aside as {aside[0]} and started a new one" in result.note
    assert [e.key for e in manifest_files.load(str(path)).entries] == [entry(block=64).key]


def test_59_3_a_learner_says_it_kept_the_unreadable_manifest_aside(tmp_path, kwarm_log):
    from kwarm_ext.surfaces.triton import learn

    path = tmp_path / "m.json"
    path.write_text("{not json")
    path.chmod(0o600)
    learner = learn.Learner(str(path), STAMP, learn.Recorder(ALLOWED), 0)
    learner.recorder.give_back([entry(block=32)])
    learner.save_quietly("exit")
    warnings = kwarm_log.messages()
    assert len(warnings) == 1 and "could not read the manifest (not valid JSON" in warnings[0] \
        and "kept it aside as" in warnings[0], warnings
    assert [p.read_text() for p in tmp_path.iterdir() if ".unreadable." in p.name] == ["{not json"]


def test_59_7_the_entry_cap_is_kept_on_save_and_said(tmp_path, monkeypatch, capsys):
    """Hole 7: entries past MAX_ENTRIES were saved, then dropped silently by the next load."""
    from kwarm_ext import manifest_cli

    monkeypatch.setattr(manifest, "MAX_ENTRIES", 3)
    path = tmp_path / "m.json"
    result = manifest_files.save(str(path), STAMP, [entry(block=b) for b in (16, 32, 64, 128, 256)])
    assert result.added == 3 and result.left_out == ("2 new entries left out: a manifest keeps at most 3",)
    data = manifest_files.load(str(path))
    assert len(data.entries) == 3 and data.problems == []
    other = write(tmp_path / "o.json", [entry(block=512)], mode=0o600)
    assert manifest_cli.merge([str(path), str(other)], str(tmp_path / "out.json")) == 1
    assert "1 new entries left out: a manifest keeps at most 3" in capsys.readouterr().out


def test_59_12_a_save_leaves_other_files_temporaries_alone(tmp_path):
    """Hole 12: the cleanup of a killed save's temporaries of m.json also deleted those of a report
    m.json.report written beside it (443 of 781 report writes failed)."""
    report_tmp = tmp_path / ".m.json.report.k3j_x9a2.tmp"  # what write_atomic names the report's
    report_tmp.write_text("")
    other = tmp_path / ".m.json.x.abcd1234.tmp"
    other.write_text("")
    stale = tmp_path / ".m.json.ab12cd_3.tmp"
    stale.write_text("")
    manifest_files.save(str(tmp_path / "m.json"), STAMP, [entry()])
    assert report_tmp.exists() and other.exists() and not stale.exists()


@pytest.mark.parametrize("var, value", [("KWARM_WARMUPS", "runner,x\nWARNING kwarm: forged"),
                                        ("KWARM_ALLOW_MODULES", "vllm.,x\nWARNING kwarm: forged\x1b[2J")])
def test_59_10_a_newline_in_a_setting_forges_no_log_line(var, value):
    """Hole 10: the names a problem line quotes from KWARM_WARMUPS or KWARM_ALLOW_MODULES reached the
    log raw; a newline in them printed a line of its own."""
    problems = config.parse({var: value}, known_families=("runner",)).problems
    assert len(problems) == 1 and "forged" in problems[0], problems
    assert not any(ch in problems[0] for ch in "\n\r\x1b"), repr(problems[0])


def test_59_14_kwarm_doctor_prints_cache_file_names_escaped(tmp_path):
    """Hole 14: ``kwarm doctor`` printed the names of the files in kwarm's cache folder raw."""
    folder = tmp_path / "xdg" / "kwarm"
    folder.mkdir(parents=True)
    (folder / "m\x1b[2J\x07.json").write_text("{}")
    proc = kwarm_cli("doctor", timeout=300, env=clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 4, proc.stderr[-2000:]  # disabled: would not hook (README, doctor statuses)
    assert "m\\x1b[2J\\x07.json" in proc.stdout and "\x1b" not in proc.stdout and "\x07" not in proc.stdout


def test_59_14_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """``kwarm manifest show | head``: the command ended in a BrokenPipeError traceback."""
    path = write(tmp_path / "m.json", [entry(block=b) for b in range(16, 2016)], mode=0o600)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from kwarm_ext import cli; sys.exit(cli.entry())",
                             "manifest", "show", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd="/", env=clean_env())
    assert proc.stdout.readline().decode().strip() == str(path)
    proc.stdout.close()  # what head does after its lines
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and stderr == "", stderr


def test_59_14_kwarm_run_from_a_source_checkout_puts_only_sitecustomize_first(tmp_path, monkeypatch):
    """With an editable install ``kwarm run`` put the repository root first on PYTHONPATH: its setup.py
    shadowed a user's ``import setup``. The bootstrap folder holds kwarm's sitecustomize.py alone."""
    from kwarm_ext import activation

    checkout = tmp_path / "repo"
    (checkout / "kwarm_ext").mkdir(parents=True)
    (checkout / "sitecustomize.py").write_text("# kwarm's bootstrap\n")
    (checkout / "setup.py").write_text("raise SystemExit('the checkout was on the path')\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    boot = activation.bootstrap_dir(str(checkout / "kwarm_ext"))
    assert boot == str(tmp_path / "xdg" / "kwarm" / "bootstrap") and os.listdir(boot) == ["sitecustomize.py"]
    assert Path(boot, "sitecustomize.py").read_text() == "# kwarm's bootstrap\n"
    assert activation.bootstrap_dir(str(checkout / "kwarm_ext")) == boot, "the same folder every time"
    installed = activation.bootstrap_dir()  # the installed kwarm (tests/run.sh installs it): its own folder
    assert installed.endswith(os.path.join("kwarm_ext", "_bootstrap"))


@needs_root
def test_59_11_another_users_link_in_a_shared_folder_is_not_followed(tmp_path, kwarm_log, fake_driver):
    """Hole 11: a link planted by another user in a shared folder was followed for the manifest and for
    the report's folder, and nothing said the folder was writable by others."""
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)
    victim.mkdir(mode=0o700)
    target = write(victim / "m.json", [entry()], mode=0o600)
    planted = shared / "m.json"
    os.symlink(target, planted)
    os.lchown(planted, 65534, 65534)
    with pytest.raises(BadManifest, match=f"refused to read {planted}: {planted} is a symbolic link of another user"):
        manifest_files.load(str(planted))
    state = replay.prepare(str(planted), STAMP, ALLOWED)
    assert state.jobs == [] and "a symbolic link of another user (uid 65534)" in state.refused
    os.symlink(victim, shared / "reports")  # the report's folder, through another user's link
    os.lchown(shared / "reports", 65534, 65534)
    with pytest.raises(BadManifest, match="refused to write .*reports is a symbolic link of another user"):
        warmup.write_report({"ok": 1}, str(shared / "reports" / "r.json"), 0)
    with pytest.raises(BadManifest, match="symbolic link of another user"):
        manifest_files.save(str(shared / "reports" / "m2.json"), STAMP, [entry()])
    assert sorted(os.listdir(victim)) == ["m.json"], "nothing written through the links"
    mine = tmp_path / "mine.json"
    os.symlink(target, mine)  # a link of this user's is followed
    assert len(manifest_files.load(str(mine)).entries) == 1

    kwarm_log.records.clear()
    in_shared = write(shared / "own.json", [entry()], mode=0o600)
    state = replay.prepare(str(in_shared), STAMP, ALLOWED)
    assert state.refused is None and len(state.jobs) == 1
    assert kwarm_log.messages() == [f"kwarm: manifest {in_shared}: its folder {shared} is writable by group and others "
                                    "(sticky: others cannot replace your files, but can plant their own); keep "
                                    "manifests in a folder only you can write"]


def test_59_8_a_start_that_replays_and_learns_parses_the_manifest_once(tmp_path, monkeypatch, fake_driver):
    """Hole 8: a learning start loaded the manifest twice (replay, then the learner); at 64 MiB each load
    cost 19.8 s and 368 MB. Reads are now at most 16 MiB (README: what that costs), and the learner
    takes the parse replay kept when the file did not change."""
    assert manifest.MAX_BYTES == 16 << 20
    path = str(write(tmp_path / "m.json", [entry()], mode=0o600))
    parses = []
    real = manifest_files.parse
    monkeypatch.setattr(manifest_files, "parse", lambda text: parses.append(1) or real(text))
    monkeypatch.setenv("KWARM_LEARN", "1")
    config.reset()
    try:
        replay.prepare(path, STAMP, ALLOWED)
        from kwarm_ext.surfaces.triton import learn

        known = learn._known_manifest(path, STAMP)
        assert len(known.entries) == 1 and len(parses) == 1, "the learner took replay's parse"
        manifest_files.load(path)
        assert len(parses) == 2, "taken once: a later load reads the file again"
        manifest_files.load(path, keep=True)
        os.utime(path, ns=(1, 1))  # the file changed: its parse is not reused
        manifest_files.load(path)
        assert len(parses) == 4
    finally:
        config.reset()


def test_59_4_a_failure_of_the_compile_loop_is_one_warning_and_strict_raises_it(tmp_path, kwarm_log, fake_driver,
                                                                               monkeypatch):
    """The loop runs in a thread of its own: its failure still reaches kwarm's policy in the step's thread."""
    from kwarm_ext.surfaces.triton import compile as triton_compile

    def broken(*args, **kwargs):
        raise RuntimeError("no pool")

    monkeypatch.setattr(triton_compile, "parallel_compiles", broken)
    path = write(tmp_path / "m.json", [entry(block=32)])
    state = replay.prepare(str(path), STAMP, ALLOWED)
    assert replay.compile_entries(state) == [] and state.out_of_time == 0
    assert [(s.kind, s.reason) for s in state.skipped] == [("compile failed", "the compile loop failed: RuntimeError")]
    assert kwarm_log.messages() == ["kwarm: replay's compile loop failed: RuntimeError: no pool"]
    monkeypatch.setenv("KWARM_STRICT", "1")
    config.reset()
    try:
        with pytest.raises(RuntimeError, match="no pool"):
            replay.compile_entries(replay.prepare(str(path), STAMP, ALLOWED))
    finally:
        monkeypatch.delenv("KWARM_STRICT")
        config.reset()
