"""Checkpoints: Megatron ``dist_checkpointing`` (torch_dist) + a JSON trainer state, atomically.

Layout under ``<output_dir>/checkpoints``::

    iter_0000010/          model (+ optimizer) shards written by dist_checkpointing
        trainer_state.json step, dataset position, calibration state, ...
    latest                 text file naming the last complete checkpoint

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed only after every rank finished and
the trainer state is fsynced; ``latest`` is replaced atomically after that. A crash mid-save leaves
the previous checkpoint as ``latest`` and a stale ``.tmp`` that the next save removes. Because
dist_checkpointing stores global shapes, a checkpoint loads into any TP/PP layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_rl_fp8.utils.fs import atomic_write_text, fsync_dir


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
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(path))


def save(ckpt_root: str | Path, name: str, sharded_state_dict: dict, trainer_state: dict) -> Path:
    """Collective over all ranks. Returns the final directory."""
    root = Path(ckpt_root)
    final = root / name
    tmp = root / (name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    save_sharded(sharded_state_dict, tmp)
    dist.barrier()
    if rank == 0:
        atomic_write_text(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_text(root / "latest", name + "\n")
    dist.barrier()
    return final


def latest(ckpt_root: str | Path) -> Path | None:
    root = Path(ckpt_root)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(
            f"{marker} names {path.name}, which is incomplete (no trainer_state.json); remove "
            f"{marker} to restart from an earlier checkpoint or from scratch"
        )
    return path


def load(path: str | Path, sharded_state_dict: dict) -> tuple[dict, dict]:
    """(loaded state dict, trainer state). Collective over all ranks."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    loaded = dist_checkpointing.load(sharded_state_dict, str(path))
    state = json.loads((path / "trainer_state.json").read_text())
    return loaded, state


def prune(ckpt_root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (rank 0 only)."""
    root = Path(ckpt_root)
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in done[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
