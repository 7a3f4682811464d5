"""The SFT warm start: a few hundred supervised steps before RL, cached by content.

RL from a random tiny model learns nothing (no completion is ever right), so the shipped tasks
start from a policy that is right some of the time. The result is cached under
``train.cache_dir`` keyed by everything it depends on (model, task, SFT settings, seed,
vocabulary) and loaded, resharded, by any layout. It always runs unquantized, so every precision
mode starts RL from the same policy (and shares the cache): mode comparisons measure RL alone.
The optimizer state is reset afterwards, so cached and fresh warm starts continue identically.

The cache is shared state (every run's default ``train.cache_dir`` is the same, and the precision
modes are meant to share entries), so an entry is used under a lock and trusted only once checked:

* **One builder per entry.** The driver holds ``warmstart-<key>.lock`` (an ``flock``) while it
  checks, loads or builds the entry. A second run wanting the same entry waits for the first and
  then loads what it wrote: the SFT runs once. A killed builder's lock is taken over and its
  partial ``.tmp`` replaced.
* **Published whole.** An entry is written as a checkpoint (``megatron_rl_fp8/checkpoint/``): into a
  ``.tmp`` directory, its manifest last, then renamed; no other file of the cache is touched.
* **Verified before use.** Every file of the entry is checked against its manifest, checksums
  included (the load reads it all anyway). A damaged entry, or one without a manifest, is said in
  one line, removed and built again.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8 import checkpoint
from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import ConfigError, to_dict
from megatron_rl_fp8.data import PromptDataset, collate, sft_examples_from_records
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.batch import build_sft_batch, rows_for_rank
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.utils.fs import FileLock


def cache_key(cfg: RunConfig, tokenizer) -> str:
    blob = json.dumps(
        {
            # The KL reference does not change what SFT produces.
            "model": {k: v for k, v in to_dict(cfg.model).items() if k != "ref_checkpoint"},
            # task.seed orders RL's prompts only (SFT shuffles by sft.seed).
            "task": {k: v for k, v in to_dict(cfg.task).items() if k != "seed"},
            "tokenizer": to_dict(cfg.tokenizer),
            "sft": to_dict(cfg.sft),
            "seed": cfg.sft.seed,
            "vocab": tokenizer.tokenizer.get_vocab(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(cfg: RunConfig, actor: Actor, groups: Groups, tokenizer, records) -> dict:
    """SFT the fresh actor (or load the cached result), then reset the optimizer state."""
    if cfg.sft.steps == 0:
        return {}
    if not cfg.sft.cache:
        return _sft(cfg, actor, groups, tokenizer, records)
    entry = CacheEntry(Path(cfg.train.cache_dir).expanduser(), cache_key(cfg, tokenizer))
    entry.lock()
    try:
        problem = entry.problem()
        if problem is None:
            loaded, state = entry.load(actor.sharded_state_dict(with_optimizer=False))
            actor.load_sharded(loaded)
            print_rank0(f"warm start: loaded cached SFT policy {entry.path}")
            return {"sft/final_loss": state["final_loss"]}
        if problem != ABSENT:
            print_rank0(
                f"warm start: cached entry {entry.path} is damaged ({problem}); rebuilding it"
            )
            entry.remove()
        first = _sft(cfg, actor, groups, tokenizer, records)
        entry.save(actor.sharded_state_dict(with_optimizer=False), first["sft/final_loss"])
        return first
    finally:
        entry.unlock()


def _sft(cfg: RunConfig, actor: Actor, groups: Groups, tokenizer, records) -> dict:
    """The supervised steps themselves, then the optimizer reset. Collective."""
    sft = cfg.sft
    t0 = time.perf_counter()
    g = groups
    data = PromptDataset(records, seed=cfg.sft.seed + 1, shuffle=True)
    loss_value = float("nan")
    # The reported loss is the mean of the last steps' batch losses: one batch's loss swings by
    # more than the differences between seeds that it is compared across.
    tail: list[float] = []
    tail_len = max(1, min(50, sft.steps // 10))
    for s in range(sft.steps):
        actor.set_lr(sft.lr_at(s))
        batch = build_sft_batch(
            collate(sft_examples_from_records(tokenizer, data.next_batch(sft.batch_size))),
            pad_id=tokenizer.pad_token_id,
        )
        total = max(batch["loss_mask"].sum().item(), 1.0)

        def nll(mb, logprobs, _n=total):
            loss = -(logprobs * mb["loss_mask"]).sum() / _n
            return loss, {}

        with actor.full_precision():
            outs, _, _ = actor.train_step(
                rows_for_rank(batch, g.dp_rank, g.dp_size),
                cfg.train.micro_batch_size,
                nll,
                max_tokens=cfg.train.max_tokens_per_gpu,
            )
        if outs:
            local = torch.tensor(
                [sum(o["loss"].item() for o in outs)], dtype=torch.float64, device=g.device
            )
            if g.dp_size * g.cp_size > 1:  # each CP rank's loss covers its own tokens
                dist.all_reduce(local, group=g.dp_cp if g.cp_size > 1 else g.dp)
            loss_value = local.item()
            if s >= sft.steps - tail_len:
                tail.append(loss_value)
        if (s + 1) % 50 == 0 or s == sft.steps - 1:
            loss_value = broadcast_object(loss_value, g.last_stage_rank)
            print_rank0(f"warm start: SFT step {s + 1}/{sft.steps} loss {loss_value:.4f}")
    loss_value = broadcast_object(math.fsum(tail) / len(tail) if tail else None, g.last_stage_rank)
    loss_value = float("nan") if loss_value is None else loss_value
    # Fresh Adam state, and the RL lr schedule (which set_lr had paused for sft.lr) at its step 0.
    actor.reset_optimizer()
    if not math.isfinite(loss_value):
        # No checkpoint or cache entry of non-finite weights is ever written.
        raise ConfigError(
            f"warm start: the SFT loss is {loss_value} after {sft.steps} steps; lower sft.lr "
            f"(now {sft.lr}) and run again (nothing was cached)"
        )
    return {"sft/final_loss": loss_value, "perf/sft_time_s": time.perf_counter() - t0}


ABSENT = "absent"
_WAIT_S = 5.0  # between tries for a lock another run holds (each try is one short collective)


class CacheEntry:
    """One warm-start entry of the shared cache (module docstring). Every method is collective
    over the job; the lock and the file system are the global rank 0's."""

    def __init__(self, root: Path, key: str):
        self.root = root
        self.name = f"warmstart-{key}"
        self.path = root / self.name
        self._lock = FileLock(root / f"{self.name}.lock", "train.cache_dir")
        self._rank0 = dist.get_rank() == 0

    def lock(self) -> None:
        """Hold the entry, waiting (said once) while another run builds or reads it."""
        said = False
        while True:
            mine = self._lock.try_acquire() if self._rank0 else None
            if broadcast_object(mine, 0):
                return
            if not said and self._rank0:
                print_rank0(
                    f"warm start: {self.path} is being built by another run "
                    f"({self._lock.describe_owner()}); waiting for it"
                )
                said = True
            time.sleep(_WAIT_S)

    def unlock(self) -> None:
        if self._rank0:
            self._lock.release()

    def problem(self) -> str | None:
        """None when the entry is complete and every file matches its manifest; :data:`ABSENT`
        when there is none; else what is wrong, in a few words."""
        if not broadcast_object(self.path.is_dir() if self._rank0 else None, 0):
            return ABSENT
        problem, verified = checkpoint.verify(self.path, "full", {"final_loss": float})
        if problem is None and not verified:
            problem = f"no {checkpoint.MANIFEST}, so its files cannot be checked"
        return problem

    def load(self, sharded_state_dict: dict) -> tuple[dict, dict]:
        try:
            return checkpoint.load(self.path, sharded_state_dict)
        except checkpoint.CheckpointError as e:
            # Its files are as written (just verified), and its key holds the model config: not
            # damage this run can repair by itself (the actor's weights are partly overwritten).
            raise ConfigError(
                f"warm start: the cached entry {self.path} matches its manifest but does not "
                f"load ({e.reason}); delete it (rm -r {self.path}) and run again"
            ) from e

    def remove(self) -> None:
        if self._rank0:
            shutil.rmtree(self.path, ignore_errors=True)
        dist.barrier()

    def save(self, sharded_state_dict: dict, final_loss: float) -> None:
        checkpoint.save(
            self.root, self.name, sharded_state_dict, {"final_loss": final_loss}, latest=False
        )
