"""One Triton compile per node: the ranks that share a Triton cache folder elect one compiler per
cache key, and the others load what it wrote.

Why: under tensor or data parallelism every rank runs the same warmups (kwarm's, vLLM's) in a
process of its own, on the same CPUs and into the same cache folder: on a node of 8 GPUs the same
kernel compiles 8 times at once, 7 of them wasted work and contention, and a rank that finishes
late holds the others at NCCL's first collective (vLLM issues 57133, 54866; kwarm issue 62).
Triton itself only makes each write atomic (a temporary folder, then ``os.replace``): it never
waits for a compile another process has in flight.

How: :class:`NodeCacheManager` is Triton's own ``FileCacheManager`` (``triton.runtime.cache``)
with one change. Where ``triton.compiler.compile`` asks for a key's metadata group and it is not
there yet, the process takes an exclusive ``flock`` on ``<key folder>/kwarm-compile.lock`` before
answering: the first rank gets it at once and compiles (the lock goes when it has written the
group, ``put_group``, or when its compile fails and the manager is dropped); the others wait, find
the group written and load it (Triton's own load: the files it names, each written atomically).
``flock`` goes with the process that holds it, so a rank killed mid-compile frees the key at
once; a holder that hangs is waited for at most :data:`WAIT_S`, after which the waiter compiles
itself. Dump and override managers (Triton's debugging folders) are Triton's own, unchanged.

Installed by kwarm's activation in every vLLM process where the user has no cache manager of
their own (``TRITON_CACHE_MANAGER`` / ``knobs.cache.manager_class``): Triton 3.4+ through
``knobs.cache.manager_class``, earlier ones through ``TRITON_CACHE_MANAGER``. Counts per process
(:func:`counts`) go into kwarm's report. It can go when Triton serializes concurrent compiles of
one key itself.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time

from triton.runtime.cache import FileCacheManager

WAIT_S = 300.0  # the longest a rank waits for another's compile of one key before compiling itself
POLL_S = 0.05
LOCK_NAME = "kwarm-compile.lock"
SPEC = "kwarm_ext.surfaces.triton.node_cache:NodeCacheManager"

_counts = {"compiled": 0, "loaded_after_wait": 0, "waited_s": 0.0, "wait_expired": 0}
_counts_lock = threading.Lock()


def counts() -> dict:
    """This process's compiles elected to it, loads of another rank's compile after waiting, the
    seconds waited and the waits that ran out."""
    with _counts_lock:
        return dict(_counts, waited_s=round(_counts["waited_s"], 3))


def counts_in_use() -> dict | None:
    """:func:`counts` where Triton uses :class:`NodeCacheManager` in this process, else None."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4: the environment names the manager
        return counts() if os.environ.get("TRITON_CACHE_MANAGER") == SPEC else None
    return counts() if knobs.cache.manager_class is NodeCacheManager else None


def users_own_manager() -> bool:
    """Whether the user gave Triton a cache manager of their own (``TRITON_CACHE_MANAGER`` or
    ``knobs.cache.manager_class``): kwarm then leaves it, and cannot read Triton's folder layout."""
    if os.environ.get("TRITON_CACHE_MANAGER") not in (None, "", SPEC):
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    return knobs.cache.manager_class not in (None, NodeCacheManager)


def _count(**deltas) -> None:
    with _counts_lock:
        for key, value in deltas.items():
            _counts[key] += value


class NodeCacheManager(FileCacheManager):
    """Triton's file cache, where the first process to miss a key compiles it and the others wait."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._elected = not (override or dump)  # only the cache proper is shared between ranks
        self._fd = None

    def get_group(self, filename: str):
        group = super().get_group(filename)
        if not self._elected or (group and filename in group):
            return group
        t0 = time.monotonic()
        fd = os.open(os.path.join(self.cache_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        got, waited = False, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() - t0 > WAIT_S:
                    break
                time.sleep(POLL_S)
        if waited:
            _count(waited_s=time.monotonic() - t0)
        group = super().get_group(filename)
        if group and filename in group:  # another process compiled it while this one waited
            os.close(fd)
            _count(loaded_after_wait=1)
            return group
        if not got:
            os.close(fd)
            _count(wait_expired=1, compiled=1)
            return group
        self._fd = fd  # held until this process has written the key, or given up on it
        _count(compiled=1)
        return group

    def put_group(self, filename: str, group):
        try:
            return super().put_group(filename, group)
        finally:
            self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self):  # a compile that failed: the key is free again for the next one to try
        self._release()


def install() -> str | None:
    """Make Triton use :class:`NodeCacheManager` in this process (and, on Triton before 3.4, in the
    processes it starts); a description, or None where the user has a cache manager of their own."""
    if users_own_manager():
        return None
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4: read from the environment on every compile
        os.environ["TRITON_CACHE_MANAGER"] = SPEC
        return "TRITON_CACHE_MANAGER"
    knobs.cache.manager_class = NodeCacheManager
    return "knobs.cache.manager_class"
