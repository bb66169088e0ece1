"""Manifest files: read only when trusted (a regular file owned by this user, writable by no
one else), written by every learning rank under an ``fcntl`` lock as merge-and-deduplicate,
atomically, in their default location. The schema and the parser are ``kwarm_ext.manifest``.
Imports neither Triton nor torch."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat
import tempfile
import time
from kwarm_ext import manifest
from kwarm_ext.manifest import (
    BadManifest, Manifest, Stamp, _document, _stamp, _token_counts, parse, printable, short_hash)


# ---------------------------------------------------------------------------- files


def untrusted_reason(st: os.stat_result) -> str | None:
    """Why a file with this status may not be read as a manifest (None when it may)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def foreign_link(path: str) -> str | None:
    """The first symbolic link on the way to `path` (a folder of it or the file) owned by another
    user than this one or root, else None. Such a link was planted by someone who can write a
    shared folder (issue 59: followed for the manifest and for the report's folder); a link of
    this user's or root's is followed. Links are resolved as the kernel does, at most 40."""
    todo = [part for part in os.path.abspath(path).split(os.sep) if part]
    current, hops = os.sep, 0
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        step = os.path.join(current, part)
        try:
            st = os.lstat(step)
        except OSError:
            return None  # the rest does not exist yet: nothing to follow
        if not stat.S_ISLNK(st.st_mode):
            current = step
            continue
        if st.st_uid not in (os.geteuid(), 0):
            return step
        hops += 1
        if hops > 40:
            return None  # ELOOP: the open fails on its own
        target = os.readlink(step)
        todo[:0] = [p for p in target.split(os.sep) if p]
        if os.path.isabs(target):
            current = os.sep
    return None


def shared_folder(path: str) -> str | None:
    """Why the folder `path` is in can be written by others (None when it cannot): anyone there
    can plant a file or a link under a name kwarm will use, or (without the sticky bit) replace one."""
    folder = os.path.dirname(os.path.realpath(path))
    try:
        st = os.stat(folder)
    except OSError:
        return None
    who = [w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if not who:
        return None
    sticky = " (sticky: others cannot replace your files, but can plant their own)" if st.st_mode & stat.S_ISVTX else ""
    return f"its folder {printable(folder)} is writable by {' and '.join(who)}{sticky}"


def _refuse_foreign_link(path: str, what: str) -> None:
    link = foreign_link(path)
    if link is not None:
        raise BadManifest(f"refused to {what} {printable(path)}: {printable(link)} is a symbolic link of another "
                          f"user (uid {os.lstat(link).st_uid})")


def read_trusted(path: str) -> str:
    """The file's text, if it passes :func:`untrusted_reason` (checked before opening, so that
    no FIFO or device is ever opened, and again on the opened file, so that a swap between the
    check and the read is impossible), and not through another user's symbolic link
    (:func:`foreign_link`). FileNotFoundError passes through."""
    _refuse_foreign_link(path, "read")
    fd = _open_checked(path)
    reason = untrusted_reason(os.fstat(fd))
    if reason:
        os.close(fd)
        raise BadManifest(f"refused: {reason}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(manifest.MAX_BYTES + 1)
    if len(data) > manifest.MAX_BYTES:
        raise BadManifest(f"larger than {manifest.MAX_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadManifest("not UTF-8 text") from None


O_PATH = getattr(os, "O_PATH", 0)  # Linux
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_checked(path: str) -> int:
    """A descriptor for reading `path`, opened only once what it names passed
    :func:`untrusted_reason`. On Linux the check is made on an ``O_PATH`` descriptor (which opens
    nothing: no device driver, no FIFO) and the file is then reopened through
    ``/proc/self/fd``, the same inode whatever happens to the path meanwhile; elsewhere it is
    stat, then a non-blocking open (and the caller checks the opened file again)."""
    def failed(exc, what):
        if isinstance(exc, FileNotFoundError):
            raise exc
        raise BadManifest(f"cannot {what} ({exc.strerror})") from None

    if O_PATH and os.path.isdir("/proc/self/fd"):
        try:
            handle = os.open(path, O_PATH | _CLOEXEC)
        except OSError as exc:
            failed(exc, "open")
        try:
            reason = untrusted_reason(os.fstat(handle))
            if reason:
                raise BadManifest(f"refused: {reason}")
            try:
                return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
            except OSError as exc:
                failed(exc, "open")
        finally:
            os.close(handle)
    try:
        reason = untrusted_reason(os.stat(path))
    except OSError as exc:
        failed(exc, "read")
    if reason:
        raise BadManifest(f"refused: {reason}")
    try:  # non-blocking: a FIFO swapped in after the check does not hang the open
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    except OSError as exc:
        failed(exc, "open")


def check_writable_target(path: str) -> None:
    """Raise :class:`BadManifest` unless `path` is absent or a regular file this user owns:
    a save never replaces a device, a FIFO, a directory, a symbolic link or another user's file,
    nor writes through another user's symbolic link to a folder (:func:`foreign_link`)."""
    _refuse_foreign_link(path, "write")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):  # replacing the link would not write where it points, nor keep it
        raise BadManifest(f"refused to replace {printable(path)}: a symbolic link (give the path it points to)")
    if not stat.S_ISREG(st.st_mode):
        raise BadManifest(f"refused to replace {printable(path)}: not a regular file")
    if st.st_uid != os.geteuid():
        raise BadManifest(f"refused to replace {printable(path)}: owned by uid {st.st_uid}, not this user")


_kept: tuple | None = None  # (path, the file's identity, its Manifest): load(keep=True)


def load(path: str, keep: bool = False) -> Manifest:
    """Read and validate `path`. Raises FileNotFoundError or :class:`BadManifest`.

    `keep`: the parse is kept for the next load of the same unchanged file (device, inode, size,
    modification time), which takes it instead of parsing again: replay keeps it when this process
    learns, and the learner's load takes it (issue 59: one start parsed the file twice, up to 20 s
    and 368 MB each at 64 MiB). Only readers keep: a save merges into what it loads."""
    global _kept
    try:
        st = os.stat(path)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        identity = None
    kept, _kept = _kept, None
    if identity is not None and kept is not None and kept[:2] == (path, identity):
        return kept[2]
    data = parse(read_trusted(path))
    if keep and identity is not None:
        _kept = (path, identity, data)
    return data


def read_token_counts(path: str, stamp: Stamp) -> list:
    """The learned step sizes of the manifest at `path` if it serves `stamp`, else []: the
    same trust checks as :func:`load`, without validating every entry a second time at
    engine start (replay does that)."""
    try:
        data = _document(read_trusted(path))
        if _stamp(data.get("stamp")).incompatibility(stamp):
            return []
    except (FileNotFoundError, BadManifest):
        return []
    return _token_counts(data.get("token_counts", []), [])


@dataclasses.dataclass(frozen=True)
class SaveResult:
    path: str
    added: int
    total: int
    note: str | None = None  # why an existing file was replaced (or kept aside) rather than merged
    step_sizes: int = 0  # learned step sizes in the file (not in `total`)
    new_step_sizes: int = 0  # of them, added by this save (in `added`)
    left_out: tuple = ()  # what the merge did not keep, one line each (Manifest.left_out)


def save(path: str, stamp: Stamp, entries=(), autotune=(), token_counts=(), surfaces=None) -> SaveResult:
    """Merge `entries`/`autotune` (and `surfaces`: name -> (version, items)) into the manifest at
    `path`, under a lock, atomically.

    Several TP ranks and processes may call this at once: the read-merge-write runs under an
    exclusive ``flock`` on ``<path>.lock``, and readers only ever see a complete file. An
    existing file stamped for another Triton/GPU is replaced; one that cannot be read (not
    valid, past a bound, untrusted) is first kept aside as ``<path>.unreadable.<time>`` (issue 59:
    a learner replaced the 2,200 entries it could not read with the one it had learned); both
    are said in ``note``, never merged. What the merge leaves out (past MAX_ENTRIES, another
    library version's items) is in ``left_out``."""
    directory = os.path.dirname(os.path.abspath(path))
    check_writable_target(path)  # before the lock: no <dir>.lock beside a directory
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with _locked(path + ".lock"):
        check_writable_target(path)
        _remove_stale_temporaries(path)
        current, note = _existing(path, stamp)
        counts_before = len(current.token_counts)
        added = current.merge(entries, autotune, token_counts, surfaces)
        if added or note or not os.path.exists(path):
            _write_atomic(path, current.as_json())
    return SaveResult(path, added, len(current.entries) + len(current.autotune) + current.surface_items(), note,
                      len(current.token_counts), len(current.token_counts) - counts_before, tuple(current.left_out))


def _existing(path: str, stamp: Stamp) -> tuple[Manifest, str | None]:
    try:
        current = load(path)
    except FileNotFoundError:
        return Manifest(stamp), None
    except BadManifest as exc:
        aside = _keep_aside(path)
        return Manifest(stamp), f"could not read the manifest ({exc}); kept it aside as {printable(aside)} and started a new one"
    why = current.stamp.incompatibility(stamp)
    if why:
        return Manifest(stamp), f"replaced a manifest {why}"
    current.stamp = stamp
    return current, None


def _keep_aside(path: str) -> str:
    """Rename the unreadable manifest at `path` to a free ``<path>.unreadable.<time>`` beside it
    (the caller holds the lock; check_writable_target passed: a regular file of this user), so
    that no save ever replaces what it could not read. Returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in range(100):
        aside = f"{path}.unreadable.{stamp}" + (f".{n}" if n else "")
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise BadManifest(f"cannot keep the unreadable {printable(path)} aside: too many kept already; not saved")


def _dumps(obj: dict) -> str:
    """JSON with one top-level field per line and one list item per line: diffable, compact."""
    lines = []
    for name, value in obj.items():
        if isinstance(value, list) and value:
            items = ",\n".join("  " + json.dumps(item, separators=(",", ":")) for item in value)
            lines.append(f" {json.dumps(name)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(name)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


LOCK_TIMEOUT_S = 10.0


class LockTimeout(BadManifest):
    """Another process held the manifest's lock for too long: this save is skipped."""


@contextlib.contextmanager
def _locked(lock_path: str):
    """An exclusive ``flock`` on `lock_path`, a regular file of this user's opened without
    following a symlink; waits at most LOCK_TIMEOUT_S seconds, then raises
    :class:`LockTimeout`: a stopped or hostile holder never blocks a save, or an exit, for good."""
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as exc:
        raise BadManifest(f"cannot open the lock {printable(lock_path)} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise BadManifest(f"refused the lock {printable(lock_path)}: not a regular file of this user")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"the lock {printable(lock_path)} was held by another process for over "
                                      f"{LOCK_TIMEOUT_S:g} s; not saved") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _remove_stale_temporaries(path: str) -> None:
    """Delete this user's ``.<name>.<random>.tmp`` files beside `path` (what :func:`write_atomic`
    names them: no dot in ``<random>``): under the lock no save is writing one, so they are what a
    killed save left. Another file's temporary (``.<name>.report.<random>.tmp`` of a report
    ``<name>.report`` beside it, written without this lock) is not one of them (issue 59)."""
    directory, name = os.path.split(os.path.abspath(path))
    mine = re.compile(re.escape(f".{name}.") + r"[A-Za-z0-9_]+\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if mine.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                        os.unlink(entry.path)


def _write_atomic(path: str, obj: dict) -> None:
    """What read refuses, write never produces: a manifest over MAX_BYTES is not written (the file
    keeps what it held, and the next start still reads it)."""
    text = _dumps(obj)
    size = len(text.encode("utf-8"))
    if size > manifest.MAX_BYTES:
        raise BadManifest(f"not written: it would be {size / (1 << 20):.1f} MiB, more than the "
                          f"{manifest.MAX_BYTES >> 20} MiB a manifest may be read at")
    count = manifest.containers(text)
    if count > manifest.MAX_CONTAINERS:  # issue 59: 2,200 entries of a 60-argument kernel held 420,205
        raise BadManifest(f"not written: it would hold {count} JSON objects and arrays, more than the "
                          f"{manifest.MAX_CONTAINERS} a manifest may be read with")
    write_atomic(path, text)


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Write `text` to `path` atomically, following no link: a temporary file created beside it
    with ``O_EXCL|O_NOFOLLOW`` (``tempfile.mkstemp``), its mode set on the descriptor (a swapped-in
    link cannot redirect a chmod), flushed, renamed into place; removed again when anything fails
    (a full disk included). Refuses a `path` that :func:`check_writable_target` refuses."""
    check_writable_target(path)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------- location


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/kwarm`` (when absolute, as the XDG spec requires), else ``~/.cache/kwarm``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kwarm")


def default_path(stamp: Stamp) -> str:
    """One file per model and versions, e.g. ``Qwen3-Next-80B-A3B-Instruct.tp2.cuda90.1a2b3c4d5e.json``."""
    tail = (stamp.model or "model").rstrip("/").split("/")[-1]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:60].strip("._") or "model"
    digest = short_hash(json.dumps(dataclasses.asdict(stamp), sort_keys=True))
    arch = re.sub(r"[^A-Za-z0-9]+", "", stamp.arch)
    return os.path.join(cache_dir(), f"{tail}.tp{stamp.tp_size or 1}.{arch}.{digest}.json")


def current_stamp(model: str | None = None, tp_size: int | None = None) -> Stamp | None:
    """This process's stamp; None without Triton or without an active driver (no target)."""
    import importlib.metadata as md

    from kwarm_ext.surfaces.triton import compat as triton_compat

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    triton, arch = triton_compat.triton_version(), triton_compat.current_arch()
    if triton is None or arch is None:
        return None
    return Stamp(triton=triton, arch=arch, torch=version("torch"), vllm=version("vllm"),
                 tp_size=tp_size, model=model)
