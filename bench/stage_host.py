#!/usr/bin/env python3
"""Install what bench/stage_release.py staged, on the GPU host (called by the last receive.sh).

Usage: ``stage_host.py DEST SHA256``, where ``DEST/parts`` holds ``part.00`` ... ``part.NN``.

Result: ``DEST/site`` (vLLM's files and every staged wheel, installed with ``pip --no-deps
--target``) and ``DEST/env.sh``, which puts ``DEST/site`` and the folders its ``.pth`` files name
first on ``PYTHONPATH`` for the host's ``python3``. Then one check, printed: what imports from there (versions, CUDA, one GEMM, one Triton
kernel compiled and run) and each CUDA library the staged torch's metadata asks for against the
version installed on the host (``host`` is what ``importlib.metadata`` finds outside ``DEST``).
Exit status 1 when the checksum does not match; the check itself never fails the script.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

CHECK = r"""
import importlib.metadata as md, json, re, sys
site = sys.argv[1]
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = {"available": torch.cuda.is_available(), "runtime": torch.version.cuda}
    if torch.cuda.is_available():
        a = torch.randn(256, 256, device="cuda")
        out["cuda"]["gemm"] = float((a @ a).sum().isfinite())
        out["cuda"]["device"] = torch.cuda.get_device_name(0)
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:500]
try:
    import triton, triton.language as tl
    out["triton"] = triton.__version__

    @triton.jit
    def _add_one(x, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)

    import torch
    if torch.cuda.is_available():
        x = torch.zeros(8, device="cuda")
        _add_one[(1,)](x, 8, BLOCK=8)
        out["triton_kernel"] = float(x.sum())
except Exception as exc:
    out["triton_error"] = f"{type(exc).__name__}: {exc}"[:500]
try:
    import vllm
    out["vllm"] = vllm.__version__
except Exception as exc:
    out["vllm_error"] = f"{type(exc).__name__}: {exc}"[:500]
try:
    import flashinfer
    out["flashinfer"] = flashinfer.__version__
except Exception as exc:
    out["flashinfer_error"] = f"{type(exc).__name__}: {exc}"[:300]
import os, shutil
out["jit_toolchain"] = {"CUDA_HOME": os.environ.get("CUDA_HOME"), "nvcc": shutil.which("nvcc"),
                        "ninja": shutil.which("ninja")}
# the CUDA libraries torch asks for, against what the host has outside the staged folder
libs = {}
try:
    for req in md.distribution("torch").requires or []:
        if "extra ==" in req:
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*([=<>!~]=?[^;]*)?", req)
        name = m.group(1) if m else req
        if not re.match(r"^(nvidia-|cuda-)", name):
            continue
        host = [d.version for d in md.distributions() if d.metadata["Name"] and
                d.metadata["Name"].lower().replace("_", "-") == name.lower().replace("_", "-") and
                not str(d.locate_file("")).startswith(site)]
        libs[name] = {"wants": (m.group(3) or "").strip() if m else "", "host": host[0] if host else None}
except Exception as exc:
    libs = {"error": f"{type(exc).__name__}: {exc}"}
out["cuda_libraries"] = libs
print(json.dumps(out, indent=1))
"""


def main(argv: list[str]) -> int:
    dest, want = Path(argv[0]), argv[1]
    parts = sorted((dest / "parts").glob("part.*"))
    payload = dest / "payload.tar"
    digest = hashlib.sha256()
    with open(payload, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != want:
        print(f"checksum mismatch: the chunks are incomplete or mixed ({digest.hexdigest()} != {want})")
        return 1
    with tarfile.open(payload) as archive:
        archive.extractall(dest, filter="data")
    payload.unlink()
    wheels = sorted(str(p) for p in (dest / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(dest / "site"), *wheels], check=True)
    _let_vllm_import_without_flash_attention(dest / "site")
    env = dest / "env.sh"
    path = ":".join([str(dest / "site"), *pth_paths(dest / "site")])
    env.write_text(env_script(dest / "site", path))
    script = dest / "check.py"  # a file, not stdin: triton.jit reads its kernel's source from one
    script.write_text(CHECK)
    check = subprocess.run(["bash", "-c", f'source "{env}" && "{sys.executable}" "{script}" "{dest}/site"'],
                           capture_output=True, text=True)
    print(check.stdout.strip() or check.stderr[-3000:])
    print(f"ready: source {env}")
    return 0


def env_script(site: Path, path: str) -> str:
    """env.sh: the staged packages first on ``PYTHONPATH``. Every backend stays at vLLM's default
    where FlashInfer is staged (as ``pip install vllm`` installs it); a release staged without it
    (the older lists) keeps the sampler on its torch path, as vLLM would need to be told there."""
    text = f'export PYTHONPATH="{path}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    if not (site / "flashinfer").is_dir():
        text += ("# flashinfer is not staged: keep the sampler on its torch path\n"
                 "export VLLM_USE_FLASHINFER_SAMPLER=0\n")
    return text


def pth_paths(site: Path) -> list[str]:
    """The folders the ``.pth`` files in `site` add to ``sys.path``. Python processes ``.pth``
    files only in site directories, not in a ``pip --target`` folder on ``PYTHONPATH``, so
    env.sh names them. nvidia-cutlass-dsl (vLLM 0.29.0's DeepSeek-V3.2 path imports its
    ``cutlass``) adds ``nvidia_cutlass_dsl/dsl_packages`` from an ``import`` line, so the files
    are processed as Python does it (``site.addsitedir``, in a child with `site` on
    ``PYTHONPATH``) and the entries it added are read back. [] when there are none or the child
    fails (its error is printed)."""
    if not any(site.glob("*.pth")):
        return []
    code = ("import json, site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
            "print(json.dumps([p for p in sys.path if p not in before]))")
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", code, str(site)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"stage_host: the .pth files of {site} failed: {proc.stderr.strip()[-500:]}")
        return []
    return [p for p in json.loads(proc.stdout.strip().splitlines()[-1]) if p != str(site)]


def _let_vllm_import_without_flash_attention(site: Path) -> None:
    """Where both flash-attention binaries are left out (the trimmed releases of the team's kit;
    stage_release.py keeps FlashAttention 3), vLLM's package refuses to import; let it import,
    so that the engine picks another attention backend (pass ``attention_backend="TRITON_ATTN"``)."""
    init = site / "vllm" / "vllm_flash_attn" / "__init__.py"
    if init.exists():
        text = init.read_text()
        init.write_text(text.replace("if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise", "if False:\n    raise"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
