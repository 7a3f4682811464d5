"""The run directory before any compute: one writer at a time, writable paths, a changed config.

* **One writer.** The driver holds an exclusive ``flock`` on ``<train.output_dir>/.lock`` for the
  whole run; the file names the owner (host, pid, start time). A second run on the same directory
  is refused with one line naming the owner, before it writes anything (``config.yaml`` included).
  The kernel releases the lock when its process dies, however it dies, so a lock left by a killed
  run is simply taken over (and the takeover is said). ``flock`` holds across processes of one
  host and, on Linux NFS v4 and Lustre/GPFS mounts with locking on, across hosts.
* **Writable paths.** The output directory, its ``checkpoints/`` and (when the warm start will use
  it) ``train.cache_dir`` are created and written to once, so a bad path fails in a second instead
  of after the SFT warm start or the first steps.
* **Changed settings on resume** are listed (old -> new) so a resumed run says what differs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from megatron_rl_fp8.config_utils import ConfigError

LOCK_NAME = ".lock"


def _owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


class RunLock:
    """Exclusive ownership of a run directory (driver rank only). Release with :meth:`release`
    or by exiting: the kernel drops the lock with the process."""

    def __init__(self, out_dir: str | Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.previous: dict = {}
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ConfigError naming its holder; ``previous`` holds the owner a
        killed run left behind (empty when the directory was free or its last run ended cleanly)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = _owner(self.path)
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(who.get("started", 0)))
            raise ConfigError(
                f"train.output_dir={str(self.path.parent)!r} is in use by another run (pid "
                f"{who.get('pid', '?')} on {who.get('host', '?')}, started {since}); wait for it "
                "to end or choose another train.output_dir"
            ) from None
        self.previous = _owner(self.path)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """End of a run: the owner record is cleared (so the next run knows this one ended
        cleanly), then the lock dropped."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def check_writable(path: Path, field_name: str) -> None:
    """Create ``path`` (a directory) and write a file in it; ConfigError naming the field if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{field_name}={str(path)!r} is not a writable directory ({e.strerror or e}); "
            "choose a path this user can create and write"
        ) from None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def changed_settings(old_yaml: str, new: dict) -> list[str]:
    """``["a.b: old -> new", ...]`` between a run's saved config.yaml and the config resuming it."""
    try:
        old = yaml.safe_load(old_yaml) or {}
    except yaml.YAMLError:
        return ["(the saved config.yaml is unreadable)"]
    before, after = _flatten(old), _flatten(new)
    return [
        f"{k}: {before.get(k, '(unset)')!r} -> {after.get(k, '(unset)')!r}"
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    ]


def prepare(cfg, *, is_driver: bool) -> tuple[RunLock | None, str | None]:
    """This rank's start-up checks of the run directory: (the lock, on the driver; the first
    problem as a one-line message, or None). Every rank checks the paths it will write."""
    out = Path(cfg.train.output_dir)
    lock = None
    try:
        check_writable(out, "train.output_dir")
        check_writable(out / "checkpoints", "train.output_dir (its checkpoints/)")
        if cfg.sft.steps and cfg.sft.cache:
            check_writable(Path(cfg.train.cache_dir).expanduser(), "train.cache_dir")
        if is_driver:
            lock = RunLock(out)
            lock.acquire()
    except ConfigError as e:
        return None, str(e)
    return lock, None
