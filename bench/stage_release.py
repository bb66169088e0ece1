#!/usr/bin/env python3
"""Stage a vLLM release, and the torch and Triton it pins, for the project's offline GPU host.

The GPU host has no network, takes about 60 MB per transfer, and ships torch 2.11 and Triton 3.6
with their CUDA libraries. vLLM 0.27-0.29 pin torch 2.13.0 (Triton 3.7.1), 0.33 pins torch 2.14.0:
their wheels must travel too (torch 2.13.0 for Python 3.12: 527 MB, Triton 3.7.1: 198 MB).

On a machine that reaches the package index, from the repository root:

    python3 bench/stage_release.py --vllm 0.29.0 --torch 2.13.0 --deps bench/stage/vllm-0.29.0.txt

writes ``.gpu-stage/<tag>/chunk00`` ... ``chunkNN`` (keep ``.gpu-stage/`` out of git), each at
most 45 MB: one slice of a single gzipped tar that holds vLLM's files (its wheel unpacked,
without FlashAttention 2, which the H200 does not use), the wheels of torch, the Triton that torch
requires and the packages named in ``--deps`` (what the release needs beyond the host's own
packages), all for CPython 3.12 on manylinux x86_64. ``--wheel FILE`` adds a local wheel.
Each chunk carries ``receive.sh`` and ``stage_host.py``.

On the host, run each chunk's ``receive.sh`` in order, back to back (an idle host is recycled).
The last one checks the tar's sha256, unpacks it under ``/tmp/kwarm-gpu/<tag>/`` (``$STAGED``
overrides ``/tmp/kwarm-gpu``), installs every wheel there with ``pip --no-deps --target``, and
writes ``env.sh``, which puts the staged packages first on ``PYTHONPATH`` (the staged torch
shadows the host's), with the folders their ``.pth`` files name (``--target`` does not process
them: nvidia-cutlass-dsl's ``cutlass`` lives in one), and sets what the host lacks (no
flashinfer sampler). It then prints what the
staged torch imports (versions, CUDA, one GEMM, one Triton compile) and every CUDA library
torch's metadata asks for against the version the host has installed: torch loads the host's
libraries by their sonames, so a mismatch there is what to read first when the import or a
kernel fails. ``bench/gpu_run.sh`` then runs with ``STAGED`` and ``VER=<tag>``.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHUNK_BYTES = 45 * 1024 * 1024
PYTHON = "3.12"  # the GPU host's Python
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 36)]  # glibc 2.17-2.35 (NCCL: 2_18)
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]
# vLLM's files the host does not need: FlashAttention 2 (308 MB in 0.29.0; the H200 runs
# FlashAttention 3, 153 MB, which is kept: 0.29.0's DeepSeek-V3.2 path calls it, and the
# TRITON_ATTN backend stands in for both elsewhere) and DeepGEMM builds for other Pythons than 3.12.
SKIP_SUFFIXES = ("vllm_flash_attn/_vllm_fa2_C.abi3.so",)
OTHER_PYTHONS = ("cpython-310", "cpython-311", "cpython-313", "cpython-314")


def keep(name: str) -> bool:
    """Whether a file of vLLM's wheel goes to the host."""
    if name.endswith(SKIP_SUFFIXES):
        return False
    return not ("deep_gemm/_C." in name and any(tag in name for tag in OTHER_PYTHONS))


def download(requirements: list[str], dest: Path) -> list[Path]:
    """Wheels for the host's Python and platform, without their dependencies."""
    if not requirements:
        return []
    shutil.rmtree(dest, ignore_errors=True)  # only these requirements' wheels (pip's cache keeps the bytes)
    dest.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
                    *requirements], check=True)
    return sorted(dest.glob("*.whl"))


def wheel_requires(wheel: Path, name: str) -> str | None:
    """The requirement on `name` in `wheel`'s metadata (``triton==3.7.1``), or None."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                requirement = line.split(":", 1)[1].strip().split(";")[0].strip()
                if requirement.lower().startswith(name.lower()) and requirement[len(name):][:1] in "=<>!~ [":
                    return requirement
    return None


def build(args, work: Path) -> Path:
    """The payload tar: ``site/`` (vLLM's files), ``wheels/`` and ``stage_host.py``."""
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "wheels").mkdir(parents=True)
    wheels = [Path(w).resolve() for w in args.wheel]
    if args.vllm:
        vllm = download([f"vllm=={args.vllm}"], work / "vllm")
        with zipfile.ZipFile(vllm[0]) as archive:
            archive.extractall(tree / "site", [n for n in archive.namelist() if keep(n)])
    requirements = [line.split("#")[0].strip() for line in Path(args.deps).read_text().splitlines()] if args.deps else []
    requirements = [r for r in requirements if r]
    if args.torch:
        torch = download([f"torch=={args.torch}"], work / "torch")
        wheels += torch
        triton = wheel_requires(torch[0], "triton")
        if triton:
            requirements.append(triton)
    wheels += download(requirements, work / "deps")
    for wheel in wheels:
        shutil.copy(wheel, tree / "wheels" / wheel.name)
    shutil.copy(HERE / "stage_host.py", tree / "stage_host.py")
    payload = work / "payload.tar.gz"
    # gzip level 1: the wheels are compressed already, vLLM's unpacked binaries are not (FA3:
    # 153 MB raw, 47 MB compressed)
    with tarfile.open(payload, "w:gz", compresslevel=1) as archive:
        archive.add(tree, arcname=".")
    shutil.rmtree(tree)
    return payload


def split(payload: Path, tag: str, out: Path, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Cut `payload` into ``out/chunkNN/part.NN``, each beside its receive.sh; returns the count."""
    digest = hashlib.sha256()
    with open(payload, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    shutil.rmtree(out, ignore_errors=True)
    total = -(-payload.stat().st_size // chunk_bytes)
    with open(payload, "rb") as f:
        for i in range(total):
            chunk = out / f"chunk{i:02d}"
            chunk.mkdir(parents=True)
            (chunk / f"part.{i:02d}").write_bytes(f.read(chunk_bytes))
            (chunk / "receive.sh").write_text(RECEIVE.format(tag=tag, total=total, sha256=digest.hexdigest()))
            shutil.copy(HERE / "stage_host.py", chunk / "stage_host.py")
    return total


RECEIVE = """#!/usr/bin/env bash
# One chunk of {tag} (bench/stage_release.py); the last one installs it all.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${{STAGED:-/tmp/kwarm-gpu}}/{tag}
mkdir -p "$dest/parts"
cp "$here"/part.* "$dest/parts/"
have=$(ls "$dest/parts" | wc -l)
echo "{tag}: $have of {total} chunks on this host"
if [ "$have" -eq {total} ]; then
  "${{PYTHON:-python3}}" "$here/stage_host.py" "$dest" {sha256}
fi
"""


def tag_of(args) -> str:
    if args.tag:
        return args.tag
    parts = [f"vllm-{args.vllm}" if args.vllm else "wheels"]
    if args.torch:
        parts.append(f"torch{args.torch}")
    return "-".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", help="vLLM release to stage (its wheel, unpacked, without FlashAttention 2)")
    ap.add_argument("--torch", help="torch release to stage with it, and the Triton it requires")
    ap.add_argument("--deps", help="file of pinned requirements the host lacks, one per line")
    ap.add_argument("--wheel", action="append", default=[], help="a local wheel to stage too (repeatable)")
    ap.add_argument("--tag", help="the staged folder's name (default vllm-<vllm>[-torch<torch>])")
    ap.add_argument("--out", default=".gpu-stage", help="folder for the chunks; keep it out of git")
    ap.add_argument("--chunk-mb", type=float, default=CHUNK_BYTES / 2**20, help="chunk size in MiB (default 45)")
    args = ap.parse_args(argv)
    if not (args.vllm or args.torch or args.wheel or args.deps):
        ap.error("nothing to stage: give --vllm, --torch, --deps or --wheel")
    tag = tag_of(args)
    root = Path(args.out).resolve()
    work = root / f".work-{tag}"
    work.mkdir(parents=True, exist_ok=True)
    payload = build(args, work)
    total = split(payload, tag, root / tag, int(args.chunk_mb * 2**20))
    size = payload.stat().st_size
    payload.unlink()
    out = root / tag
    shown = out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out
    print(f"{tag}: {size / 2**20:.0f} MiB in {total} chunks under {shown}; on the host, in order:")
    for i in range(total):
        print(f"  bash {shown}/chunk{i:02d}/receive.sh")
    print(f"then: source /tmp/kwarm-gpu/{tag}/env.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
