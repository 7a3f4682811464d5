"""Writing checkpoints (atomic, manifest last) and retention (see the package docstring)."""

from __future__ import annotations

import json
import os
import queue
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8.checkpoint.layout import (
    CHECKSUM,
    MANIFEST,
    MANIFEST_FORMAT,
    RANK_STATE,
    TRAINER_STATE,
    complete_names,
    file_checksum,
    from_rank0,
    latest_entry,
    one_line,
    rank_world,
    step_of,
)
from megatron_rl_fp8.utils.fs import StorageError, atomic_write_text, fsync_dir, storage_refusal


def save_sharded(sharded_state_dict: dict, path: str | Path) -> None:
    """``dist_checkpointing.save`` (collective) without a helper process that can outlive us.

    Megatron's torch_dist writer hands each rank's write results back through a queue it makes
    with ``multiprocessing.get_context("spawn").Manager()``: a server process, created at the
    first save, that is not tied to the trainer and survives a kill -9 of it (two ~330 MB orphans
    per killed run). Our saves are synchronous: the results are produced and consumed inside this
    call, in this process, so a thread queue carries them and no server is started. (The writer's
    forked per-file workers are joined inside the call.) Megatron creates its queue only while the
    module global is None, so setting it first is all it takes.
    """
    # lazy: Megatron-Core (~6 s) only to save; manifests, verification and `study` import this
    # package without it
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(path))


def _describe(root: Path, files: Iterable[Path]) -> dict[str, dict]:
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, CHECKSUM: file_checksum(p)}
        for p in files
    }


def save(
    ckpt_root: str | Path,
    name: str,
    sharded_state_dict: dict,
    trainer_state: dict,
    rank_state: dict | None = None,
    *,
    latest: bool = True,
) -> Path:
    """Collective over all ranks. Returns the final directory (module docstring: the layout).
    ``rank_state``: this rank's own state (tensors and plain values), kept when not empty.
    ``latest=False`` leaves ``ckpt_root/latest`` alone (a directory of unrelated entries, such as
    the warm-start cache, that other processes write at the same time).

    A write the storage refuses (full disk, quota, read-only, permission) on any rank is a
    :class:`StorageError` on every rank, naming the path and what ran out, with the partial
    ``.tmp`` removed and ``latest`` unchanged; any other failure is re-raised after the same
    clean-up."""
    # lazy: torch.distributed.checkpoint (~1 s) only to save (as in save_sharded above)
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(ckpt_root)
    final = root / name
    tmp = root / (name + ".tmp")
    rank, world = dist.get_rank(), dist.get_world_size()
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = e
    why = from_rank0(one_line(error) if error else None)
    if why is not None:  # nothing written yet
        _raise_save_error(error, why, tmp, name, root)
    mine: dict[str, dict] = {}
    try:
        save_sharded(sharded_state_dict, tmp)
        # torch_dist names a rank's files __<rank>_<k>.distcp; this rank's are complete (the
        # save is synchronous), so it hashes them now, while their bytes are in its page cache.
        files = sorted(tmp.glob(f"__{rank}_*.distcp"))
        if rank_state:
            (tmp / RANK_STATE).mkdir(exist_ok=True)
            torch.save(rank_state, tmp / RANK_STATE / f"{rank}.pt")
            files.append(tmp / RANK_STATE / f"{rank}.pt")
        mine = _describe(tmp, files)
    # torch's CheckpointException is a BaseException; dist_checkpointing raises it on every rank.
    except (Exception, CheckpointException) as e:
        error = e
    everyone = [None] * world if rank == 0 else None
    dist.gather_object((mine, one_line(error) if error else None), everyone, dst=0)
    failed = None
    if rank == 0:
        failed = next(((r, why) for r, (_, why) in enumerate(everyone) if why), None)
        if failed is None:
            try:
                _publish(root, name, tmp, final, trainer_state, everyone, latest)
            except OSError as e:
                error, failed = e, (0, one_line(e))
    failed = from_rank0(failed)
    if failed is not None:
        _raise_save_error(error, failed[1], tmp, name, root, failed_rank=failed[0])
    return final


def _publish(root, name, tmp, final, trainer_state, everyone, latest: bool) -> None:
    """Rank 0: trainer state, the manifest (last), the rename, then ``latest``."""
    atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1))
    files: dict[str, dict] = {}
    for part, _ in everyone:
        files.update(part)
    # Rank 0's own files (.metadata, common.pt, metadata.json, trainer_state.json) and anything
    # a later Megatron adds that no rank claimed by name.
    rest = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    files.update(_describe(tmp, [p for p in rest if p.relative_to(tmp).as_posix() not in files]))
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": trainer_state.get("step"),
        "checksum": CHECKSUM,
        "files": dict(sorted(files.items())),
    }
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    if not latest:
        return
    try:
        atomic_write_text(root / "latest", name + "\n")
    except OSError:
        # Not published after all: `latest` still names the previous checkpoint, and a complete
        # directory newer than it would be mistaken for the trajectory's next step.
        shutil.rmtree(final, ignore_errors=True)
        raise


def _remove_partial(tmp: Path, name: str, root: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    for leftover in root.glob(f"{name}.tmp*"):  # atomic_write_text's siblings included
        if leftover.is_file():
            leftover.unlink(missing_ok=True)


def _raise_save_error(
    error: BaseException | None,
    why: str,
    tmp: Path,
    name: str,
    root: Path,
    failed_rank: int = 0,
) -> None:
    """Every rank: remove the partial output (rank 0), then raise the failure: one line when
    the storage refused the write, else this rank's own error (or a line naming the rank)."""
    rank, _ = rank_world()
    refusal = None
    if rank == 0:
        if error is not None:
            refusal = storage_refusal(error, tmp)
        _remove_partial(tmp, name, root)
    refusal = from_rank0(refusal)
    if refusal is not None:
        kept, _ = latest_entry(root)
        raise StorageError(
            f"cannot write checkpoint {root / name}: {refusal}"
            + (f"; {kept} is still the latest checkpoint" if kept else "")
            + f"; the partial write was removed. Free space under {root} (or choose another "
            "path) and run again"
        )
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint {root / name}: rank {failed_rank} failed to write it: {why}")


def prune(ckpt_root: str | Path, keep: int, protect: Iterable[str] = ()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints, the ones named in ``protect`` and the one
    ``latest`` names; remove the other ``iter_*`` and every stale ``*.tmp`` directory. Rank 0
    only. Returns the names removed.

    "Newest" counts up to the checkpoint ``latest`` names: ones with a higher step are left over
    from before a fallback (damaged, or from the abandoned trajectory). They neither count towards
    ``keep`` nor are removed here; the run overwrites each when it reaches its step again.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(ckpt_root)
    current, _ = latest_entry(root)
    complete = complete_names(root)
    cut = step_of(current) if current else None
    counted = [n for n in complete if cut is None or step_of(n) <= cut]
    kept = set(counted[:keep]) | set(protect) | ({current} if current else set())
    kept |= {n for n in complete if n not in counted}
    removed = [n for n in complete if n not in kept]
    removed += [p.name for p in root.glob("*.tmp") if p.is_dir()] if root.is_dir() else []
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    return removed


def discard_from(ckpt_root: str | Path, first_step: int) -> list[str]:
    """Remove every ``iter_*`` of step >= ``first_step`` and point ``latest`` at the newest one
    left (no ``latest`` when none is left). Rank 0 only (the stability guard's rollback). Returns
    the names removed, oldest first."""
    root = Path(ckpt_root)
    complete = complete_names(root)
    removed = sorted((n for n in complete if step_of(n) >= first_step), key=step_of)
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    left = [n for n in complete if n not in removed]
    if left:
        atomic_write_text(root / "latest", left[0] + "\n")
    elif (root / "latest").exists():
        (root / "latest").unlink()
    if removed:
        fsync_dir(root)
    return removed
