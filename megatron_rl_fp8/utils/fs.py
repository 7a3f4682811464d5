"""Durable file-system writes: what checkpoints, conversion outputs and logs rely on.

A file is replaced atomically (write a sibling, fsync it, ``os.replace``), and a rename becomes
durable only once its directory is fsynced too; a crash at any point leaves the old or the new
content, never a mix. When the storage refuses a write (a full disk, a quota, a read-only
mount), :func:`storage_refusal` says so in a few words, so callers can give one line naming the
path instead of a library's traceback.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (the directory's own fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- the file system refusing a write ------------------------------------------------------------
# errno values that mean "the storage said no" rather than "the program is wrong": what a user
# fixes by freeing space, raising a quota, or choosing another path.
_REFUSALS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
# Below this much free space a failed write is taken for a full file system even when the error
# lost its errno on the way (torch's zip writer reports a short write as "unexpected pos").
_NEARLY_FULL = 64 << 20


class StorageError(ConfigError):
    """A write was refused by the storage (full, quota, read-only, permission). The message
    names the path and what ran out; the partial output has already been removed."""


def _chain(e: BaseException):
    """``e``, its causes and contexts, and the per-rank errors torch's CheckpointException
    carries, each once."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def free_bytes(path: Path) -> int | None:
    """Free bytes for this user on the file system holding ``path`` (its nearest existing
    ancestor); None when that cannot be read."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def storage_refusal(
    e: BaseException, path: Path, *, judge_by_free_space: bool = True
) -> str | None:
    """What the storage refused, in a few words, when ``e`` (a failed write under ``path``) is
    the storage's refusal rather than a bug; None otherwise. Without an errno that says so,
    ``judge_by_free_space`` takes a failure on a nearly full file system for a full one."""
    what = None
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _REFUSALS:
            what = _REFUSALS[x.errno]
            break
        # A worker's OSError that reached us as text (Megatron's writer processes do that).
        text = str(x)
        what = next((w for n, w in _REFUSALS.items() if os.strerror(n) in text), None)
        if what is not None:
            break
    if what is None:
        free = free_bytes(path) if judge_by_free_space else None
        if free is None or free >= _NEARLY_FULL:
            return None
        what = "no space left on the device"
    free = free_bytes(path)
    return what + (f" ({_size(free)} free)" if free is not None else "")


# -- ownership of a path shared by runs ----------------------------------------------------------
class FileLock:
    """An exclusive ``flock`` on ``path``, a small file naming its holder (host, pid, start).

    The kernel drops the lock when its process dies, however it dies, so a lock a killed run
    left is simply taken over. ``flock`` holds across processes of one host and, on Linux NFS v4
    and Lustre/GPFS mounts with locking on, across hosts. A ``path`` that cannot be a lock file
    (a directory, unreadable) is a :class:`ConfigError` naming it and what to remove.

    Why not ``filelock`` (installed with torch): its native Unix lock never writes the lock file
    and offers no public handle to write a holder into it, so "held by pid P on host H" needs
    this class anyway; and before filelock's fix of 2026-07 (tox-dev/filelock#591, #594: 3.29.7
    and older, which torch accepts) every refused contender opened the file with ``O_TRUNC``,
    erasing the holder record this class keeps there. filelock 4.3.2 (checked here) refuses,
    takes over and fails on a directory as this class does; what it lacks is the record.
    """

    def __init__(self, path: str | Path, setting: str):
        self.path = Path(path)
        self.setting = setting  # the field that chose the path, for the one-line errors
        self.previous: dict = {}  # the holder a killed process left behind ({} if none)
        self._fd: int | None = None

    def owner(self) -> dict:
        """Who holds (or, after a kill, last held) the lock; {} when unknown or garbled."""
        try:
            who = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):  # ValueError: not UTF-8, not JSON
            return {}
        return who if isinstance(who, dict) else {}

    def describe_owner(self) -> str:
        who = self.owner()
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(who.get("started", 0)))
        return f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started {since}"

    def try_acquire(self) -> bool:
        """Take the lock now (True) or find it held (False); the holder is written on success."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except IsADirectoryError:
            raise ConfigError(
                f"{self.setting}: {self.path} is a directory, where this project keeps a lock "
                "file; remove it (nothing of a run is stored in it) and run again"
            ) from None
        except OSError as e:
            raise ConfigError(
                f"{self.setting}: cannot open the lock file {self.path} ({e.strerror or e}); "
                "fix its permissions or remove it"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.previous = self.owner()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        """The holder record is cleared (the next holder knows this one ended cleanly), then
        the lock dropped."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
