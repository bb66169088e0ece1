"""One Triton compile per node (kwarm_ext/surfaces/triton/node_cache.py): ranks sharing a cache
folder, each a process of its own compiling with the real Triton compiler (for an sm90 target,
without a GPU: tests/replay_kernels.py's stand-in driver), compile each key once and every rank
ends with the kernel; a rank killed mid-compile frees the key at once, and a hung one is waited
for only up to the bound."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import clean_env

TESTS = Path(__file__).resolve().parent

RANK = """
import json, sys, time
sys.path.insert(0, {tests!r})
import torch, triton
import replay_kernels as rk
rk.install_fake_driver()
from kwarm_ext.surfaces.triton import node_cache
print(node_cache.install(), file=sys.stderr)
import os
ready, n = sys.argv[1], int(sys.argv[3])  # every rank imported torch and Triton before any compiles
open(os.path.join(ready, str(os.getpid())), "w").close()
while len(os.listdir(ready)) < n:
    time.sleep(0.005)
compiled = rk.copy_kernel.warmup(torch.float16, torch.float16, 64, BLOCK=int(sys.argv[2]), grid=(1,))
print(json.dumps({{**node_cache.counts(), "kernel": compiled.name, "asm": sorted(compiled.asm)}}))
"""


def _ranks(tmp_path, n, block=64, env_extra=None):
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "triton"), **(env_extra or {}))
    env.pop("TRITON_INTERPRET", None)
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    ready.mkdir()
    code = textwrap.dedent(RANK.format(tests=str(TESTS)))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ready), str(block), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_ranks_compile_each_key_once_and_every_rank_ends_with_the_kernel(tmp_path):
    outs = _ranks(tmp_path, 3)
    assert sum(o["compiled"] for o in outs) == 1, outs  # (a rank slower than the compile finds it without waiting)
    for o in outs:
        assert o["kernel"] == "copy_kernel" and "cubin" in o["asm"], o
    # a warm cache: nobody compiles, nobody waits
    again = _ranks(tmp_path, 2)
    assert [o["compiled"] + o["loaded_after_wait"] + o["wait_expired"] for o in again] == [0, 0]


ELECTION = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import triton
from kwarm_ext.surfaces.triton import node_cache
ready, n = sys.argv[1], int(sys.argv[2])
open(os.path.join(ready, str(os.getpid())), "w").close()
while len(os.listdir(ready)) < n:
    time.sleep(0.005)
manager = node_cache.NodeCacheManager("b" * 52)
group = manager.get_group("k.json")
if group is None:  # elected: a compile that takes 2 s, then its group written as Triton writes it
    time.sleep(2.0)
    path = manager.put(b"cubin", "k.cubin")
    manager.put_group("k.json", {{"k.json": manager.put("{{}}", "k.json"), "k.cubin": path}})
print(json.dumps(node_cache.counts()))
"""


def test_ranks_missing_a_key_together_elect_one_compiler_and_the_others_wait_and_load(tmp_path):
    """Triton's side of the protocol (get_group on a miss, put_group once compiled) from 4 processes
    that miss the key at the same moment, with a compile long enough that they all overlap it."""
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    ready = tmp_path / "ready"
    ready.mkdir()
    code = textwrap.dedent(ELECTION.format(tests=str(TESTS)))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ready), "4"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(o["compiled"] for o in outs) == 1 and sum(o["loaded_after_wait"] for o in outs) == 3, outs
    assert all(o["wait_expired"] == 0 for o in outs)


HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
import triton
from kwarm_ext.surfaces.triton import node_cache
manager = node_cache.NodeCacheManager("a" * 52)
assert manager.get_group("k.json") is None
print("holding", flush=True)
time.sleep(600)
"""

WAITER = """
import json, sys, time
sys.path.insert(0, {tests!r})
import triton
from kwarm_ext.surfaces.triton import node_cache
node_cache.WAIT_S = float(sys.argv[1])
t0 = time.monotonic()
manager = node_cache.NodeCacheManager("a" * 52)
manager.get_group("k.json")
print(json.dumps({{**node_cache.counts(), "s": time.monotonic() - t0}}))
"""


def _holder(tmp_path):
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER.format(tests=str(TESTS)))], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc, env


def _waiter(env, wait_s):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(WAITER.format(tests=str(TESTS))), str(wait_s)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_killed_mid_compile_frees_the_key_and_a_hung_one_is_waited_for_only_up_to_the_bound(tmp_path):
    holder, env = _holder(tmp_path)
    try:
        hung = _waiter(env, 1.0)
        assert hung["wait_expired"] == 1 and hung["compiled"] == 1 and 1.0 <= hung["s"] < 5, hung
        os.killpg(holder.pid, signal.SIGKILL)  # mid-compile: its flock goes with it
        holder.wait(30)
        freed = _waiter(env, 60.0)
        assert freed["wait_expired"] == 0 and freed["compiled"] == 1 and freed["s"] < 5, freed
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)


def test_installed_only_where_the_user_has_no_cache_manager_of_their_own(monkeypatch):
    from triton import knobs

    from kwarm_ext.surfaces.triton import node_cache

    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    try:
        del knobs.cache.manager_class  # no override: the environment decides (as in a fresh process)
        assert node_cache.install() == "knobs.cache.manager_class"
        assert knobs.cache.manager_class is node_cache.NodeCacheManager
        del knobs.cache.manager_class
        monkeypatch.setenv("TRITON_CACHE_MANAGER", "my.remote:Cache")
        assert node_cache.install() is None
    finally:
        del knobs.cache.manager_class  # (a knob set to None would keep ignoring the environment)
