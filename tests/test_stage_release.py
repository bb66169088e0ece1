"""bench/stage_release.py and bench/stage_host.py without the network or a GPU: a local wheel
staged in small chunks, each chunk's receive.sh run in order as on the host, then what the
installed folder, env.sh and the host check hold; a missing or foreign chunk is refused."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import stage_release  # noqa: E402


def _wheel(folder: Path) -> Path:
    """A real, minimal wheel: one module and its dist-info (METADATA, WHEEL, RECORD)."""
    path = folder / "kwarmstagetest-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("kwarmstagetest/__init__.py", "VALUE = 42\n")
        archive.writestr("kwarmstagetest/padding.bin", random.Random(0).randbytes(12000))  # survives gzip
        # a package behind a .pth import line, as nvidia-cutlass-dsl keeps its `cutlass`
        archive.writestr("kwarmstagetest/extra/kwarmstageextra.py", "VALUE = 7\n")
        archive.writestr("kwarmstagetest.pth", "import sys, os, kwarmstagetest; "
                         "sys.path.insert(0, os.path.join(kwarmstagetest.__path__[0], 'extra'))\n")
        archive.writestr("kwarmstagetest-1.0.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: kwarmstagetest\nVersion: 1.0\nRequires-Dist: nvidia-nope==1.2\n")
        archive.writestr("kwarmstagetest-1.0.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("kwarmstagetest-1.0.dist-info/RECORD", "")
    return path


@pytest.fixture
def staged(tmp_path):
    wheel = _wheel(tmp_path)
    out = tmp_path / "stage"
    assert stage_release.main(["--wheel", str(wheel), "--tag", "t1", "--out", str(out), "--chunk-mb", "0.004"]) == 0
    return out / "t1", wheel


def _receive(chunk: Path, staged_root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, STAGED=str(staged_root), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", str(chunk / "receive.sh")], env=env, capture_output=True, text=True, timeout=300)


def test_chunks_are_small_ordered_and_each_carries_the_host_side(staged):
    folder, _ = staged
    chunks = sorted(folder.iterdir())
    assert len(chunks) > 2 and [c.name for c in chunks] == [f"chunk{i:02d}" for i in range(len(chunks))]
    for i, chunk in enumerate(chunks):
        assert (chunk / f"part.{i:02d}").stat().st_size <= int(0.004 * 2**20)
        assert (chunk / "stage_host.py").is_file() and (chunk / "receive.sh").is_file()


def test_receiving_every_chunk_in_order_installs_and_checks(staged, tmp_path):
    folder, _ = staged
    root = tmp_path / "host"
    chunks = sorted(folder.iterdir())
    for i, chunk in enumerate(chunks):
        proc = _receive(chunk, root)
        assert proc.returncode == 0, proc.stderr
        assert f"t1: {i + 1} of {len(chunks)} chunks on this host" in proc.stdout
    dest = root / "t1"
    assert f"ready: source {dest}/env.sh" in proc.stdout
    assert (dest / "site" / "kwarmstagetest" / "__init__.py").is_file()
    env = (dest / "env.sh").read_text()
    assert f'export PYTHONPATH="{dest}/site' in env and "VLLM_USE_FLASHINFER_SAMPLER=0" in env
    value = subprocess.run(["bash", "-c", f'source "{dest}/env.sh" && "{sys.executable}" -c '
                            '"import kwarmstagetest; print(kwarmstagetest.VALUE)"'],
                           capture_output=True, text=True, cwd=tmp_path)
    assert value.stdout.strip() == "42", "the staged folder comes first on PYTHONPATH"
    extra = subprocess.run(["bash", "-c", f'source "{dest}/env.sh" && "{sys.executable}" -c '
                            '"import kwarmstageextra; print(kwarmstageextra.VALUE)"'],
                           capture_output=True, text=True, cwd=tmp_path)
    assert extra.stdout.strip() == "7", f"the folder a .pth import line adds is on PYTHONPATH: {env}"
    report = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert "torch" in report or "torch_error" in report, "the check says what torch imports"
    assert "cuda_libraries" in report
    # the check's kernel is defined from a file: triton.jit reads its source (the test venv has Triton)
    assert "triton" in report and "triton_error" not in report, report.get("triton_error")


def test_a_missing_or_foreign_chunk_is_refused(staged, tmp_path):
    folder, _ = staged
    chunks = sorted(folder.iterdir())
    dest = tmp_path / "host" / "t1"
    (dest / "parts").mkdir(parents=True)
    for chunk in chunks[:-1]:
        for part in chunk.glob("part.*"):
            (dest / "parts" / part.name).write_bytes(part.read_bytes())
    (dest / "parts" / "part.99").write_bytes(b"not ours")
    want = (chunks[0] / "receive.sh").read_text().split("stage_host.py\" \"$dest\" ")[1].split()[0]
    proc = subprocess.run([sys.executable, str(chunks[0] / "stage_host.py"), str(dest), want],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout
    assert not (dest / "site").exists()


def test_requirement_of_a_wheel_and_nothing_to_stage(tmp_path, capsys):
    wheel = _wheel(tmp_path)
    assert stage_release.wheel_requires(wheel, "nvidia-nope") == "nvidia-nope==1.2"
    assert stage_release.wheel_requires(wheel, "nvidia") is None, "a whole name, not a prefix"
    assert stage_release.keep("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so") is False
    assert stage_release.keep("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") is True, "the H200's FlashAttention"
    assert stage_release.keep("deep_gemm/_C.cpython-311-x86_64-linux-gnu.so") is False
    assert stage_release.keep("deep_gemm/_C.cpython-312-x86_64-linux-gnu.so") is True
    with pytest.raises(SystemExit):
        stage_release.main([])
    assert "nothing to stage" in capsys.readouterr().err


def test_env_sh_leaves_flashinfers_sampler_at_vllms_default_where_flashinfer_is_staged(tmp_path):
    """What `pip install vllm` runs: FlashInfer staged, no variable that turns its sampler off; a
    release staged without FlashInfer keeps the sampler on its torch path."""
    import stage_host

    site = tmp_path / "site"
    site.mkdir()
    without = stage_host.env_script(site, str(site))
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in without
    (site / "flashinfer").mkdir()
    with_fi = stage_host.env_script(site, str(site))
    assert "FLASHINFER" not in with_fi and with_fi.startswith(f'export PYTHONPATH="{site}')
