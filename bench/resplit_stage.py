#!/usr/bin/env python3
"""Re-cut a vLLM release staged by ``../shared/gpu-kit/stage.py`` into smaller chunks.

The device tool carries at most 64 MiB per call, the working tree included (this
repository's tracked files, ``bench/results`` above all, are about 22 MiB), and stage.py
cuts 45 MiB chunks. This script joins the parts, checks them against the digest in the
chunks' ``receive.sh``, and writes new chunks of at most ``--mib`` MiB with the same
``receive.sh`` (its chunk count changed) and ``host_setup.py``:

    python3 bench/resplit_stage.py .gpu-stage/vllm-0.24.0 .gpu-stage/v24s --mib 38

Then, back to back, one device call per chunk: ``bash .gpu-stage/v24s/chunkNN/receive.sh``
with ``carry`` set to that chunk's folder.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("staged", type=Path, help="folder of stage.py's chunk00 ... chunkNN")
    ap.add_argument("out", type=Path, help="folder for the new chunks (replaced)")
    ap.add_argument("--mib", type=int, default=38, help="largest chunk in MiB (default 38)")
    args = ap.parse_args(argv)

    chunks = sorted(args.staged.glob("chunk[0-9][0-9]"))
    if not chunks:
        sys.exit(f"resplit_stage: no chunkNN folders in {args.staged}")
    receive = (chunks[0] / "receive.sh").read_text()
    total = re.search(r'-eq (\d+) \]', receive)
    digest = re.search(r'\b([0-9a-f]{64})\b', receive)
    if not total or not digest or int(total.group(1)) != len(chunks):
        sys.exit(f"resplit_stage: {chunks[0] / 'receive.sh'} is not stage.py's, or chunks are missing")
    payload = b"".join(next(c.glob("part.*")).read_bytes() for c in chunks)
    if hashlib.sha256(payload).hexdigest() != digest.group(1):
        sys.exit("resplit_stage: the parts do not match the digest in receive.sh")

    size = args.mib << 20
    count = -(-len(payload) // size)
    text = receive.replace(f"of {len(chunks)} chunks", f"of {count} chunks").replace(
        f"-eq {len(chunks)} ]", f"-eq {count} ]")
    if args.out.exists():
        shutil.rmtree(args.out)
    for i in range(count):
        folder = args.out / f"chunk{i:02d}"
        folder.mkdir(parents=True)
        (folder / f"part.{i:02d}").write_bytes(payload[i * size:(i + 1) * size])
        (folder / "receive.sh").write_text(text)
        shutil.copy(chunks[0] / "host_setup.py", folder / "host_setup.py")
    print(f"{count} chunks of at most {args.mib} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
