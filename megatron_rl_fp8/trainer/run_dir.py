"""The run directory before any compute: one writer at a time, writable paths, a changed config.

* **One writer.** The driver holds ``<train.output_dir>/.lock`` (``utils/fs.FileLock``: an
  exclusive ``flock``, the file naming the owner) for the whole run. A second run on the same
  directory is refused with one line naming the owner, before it writes anything (``config.yaml``
  included); a lock left by a killed run is taken over (and the takeover is said).
* **Writable paths.** The output directory, its ``checkpoints/`` and (when the warm start will use
  it) ``train.cache_dir`` are created and written to once, so a bad path fails in a second instead
  of after the SFT warm start or the first steps.
* **Changed settings on resume** are listed (old -> new) so a resumed run says what differs. The
  run's ``config.yaml`` is replaced only once the start is settled (a refused resume leaves the
  one that describes the checkpoints); a saved one that is not a YAML mapping is said, not fatal.
* **Crash logs** of an earlier run (``crash-rank<R>.log``) are renamed ``*.previous.log`` at the
  start, so a log in the directory always belongs to its latest run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.utils.fs import FileLock, atomic_write_text

LOCK_NAME = ".lock"
CONFIG_NAME = "config.yaml"


class RunLock(FileLock):
    """Exclusive ownership of a run directory (driver rank only). Release with :meth:`release`
    or by exiting: the kernel drops the lock with the process."""

    def __init__(self, out_dir: str | Path):
        super().__init__(Path(out_dir) / LOCK_NAME, "train.output_dir")

    def acquire(self) -> None:
        """Take the lock or raise ConfigError naming its holder; ``previous`` holds the owner a
        killed run left behind (empty when the directory was free or its last run ended cleanly)."""
        if not self.try_acquire():
            raise ConfigError(
                f"train.output_dir={str(self.path.parent)!r} is in use by another run "
                f"({self.describe_owner()}); wait for it to end or choose another "
                "train.output_dir"
            )


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


def changed_settings(saved: Path, new: dict, *, absent: dict | None = None) -> list[str]:
    """``["a.b: old -> new", ...]`` between a run's saved ``config.yaml`` and the config resuming
    it; one item saying so when the saved file is not a readable YAML mapping. ``absent`` (dotted
    path -> value): what a run whose code had no such field ran with (``FieldDoc.before``); a
    setting the saved file lacks that has that value now is not listed."""
    try:
        old = yaml.safe_load(saved.read_bytes().decode()) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: not UTF-8
        return [f"(the saved {saved.name} is unreadable: {type(e).__name__}; it is replaced)"]
    if not isinstance(old, dict):
        return [f"(the saved {saved.name} is not a mapping of settings; it is replaced)"]
    saved_flat, new_flat = _flatten(old), _flatten(new)
    absent = absent or {}

    def newer_field_as_run(k: str) -> bool:
        if k in saved_flat or k not in absent:
            return False
        value = absent[k]
        return new_flat.get(k) == (list(value) if isinstance(value, tuple) else value)

    return [
        f"{k}: {saved_flat.get(k, '(unset)')!r} -> {new_flat.get(k, '(unset)')!r}"
        for k in sorted(set(saved_flat) | set(new_flat))
        if saved_flat.get(k) != new_flat.get(k) and not newer_field_as_run(k)
    ]


def report_changed_settings(out: Path, new: dict) -> None:
    """Driver, before the resume: what differs from the directory's last run, in one line."""
    saved = out / CONFIG_NAME
    if saved.is_file():
        changed = changed_settings(saved, new)
        if changed:
            print_rank0("config: changed since this directory's last run: " + "; ".join(changed))


def save_config(out: Path, config_yaml: str) -> None:
    """Driver, once the run has resumed or started fresh: the directory's ``config.yaml``."""
    atomic_write_text(out / CONFIG_NAME, config_yaml)


def _set_aside_crash_log(out: Path, rank: int) -> None:
    log = out / f"crash-rank{rank}.log"
    if log.is_file():
        os.replace(log, out / f"crash-rank{rank}.previous.log")


def prepare(cfg, *, is_driver: bool, rank: int = 0) -> tuple[RunLock | None, str | None]:
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
        _set_aside_crash_log(out, rank)
    except ConfigError as e:
        return None, str(e)
    return lock, None


def claim(cfg, groups) -> RunLock | None:
    """One writer per run directory, writable paths: checked on every rank before any compute,
    and refused on all ranks together (one gather) so none is left waiting in a collective.
    Returns the lock (the driver's; None elsewhere). Collective."""
    lock, problem = prepare(cfg, is_driver=groups.is_driver, rank=dist.get_rank())
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        if lock is not None:
            lock.release()
        raise ConfigError(next(p for p in problems if p))
    if lock is not None and lock.previous:
        who = lock.previous
        print_rank0(
            f"run directory: taking over from pid {who.get('pid')} on {who.get('host')}, "
            "which ended without releasing it"
        )
    return lock
