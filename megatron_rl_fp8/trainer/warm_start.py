"""The SFT warm start: a few hundred supervised steps before RL, cached by content.

RL from a random tiny model learns nothing (no completion is ever right), so the shipped tasks
start from a policy that is right some of the time. The result is cached under
``train.cache_dir`` keyed by everything it depends on (model, task, SFT settings, seed,
vocabulary) and loaded, resharded, by any layout. It always runs unquantized, so every precision
mode starts RL from the same policy (and shares the cache): mode comparisons measure RL alone.
The optimizer state is reset afterwards, so cached and fresh warm starts continue identically.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import to_dict
from megatron_rl_fp8.data import PromptDataset, collate, sft_examples_from_records
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer import checkpoint
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.batch import build_sft_batch, rows_for_rank
from megatron_rl_fp8.trainer.collectives import broadcast_object


def cache_key(cfg: RunConfig, tokenizer) -> str:
    blob = json.dumps(
        {
            # The KL reference does not change what SFT produces.
            "model": {k: v for k, v in to_dict(cfg.model).items() if k != "ref_checkpoint"},
            "task": to_dict(cfg.task),
            "tokenizer": to_dict(cfg.tokenizer),
            "sft": to_dict(cfg.sft),
            "seed": cfg.train.seed,
            "vocab": tokenizer.tokenizer.get_vocab(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(cfg: RunConfig, actor: Actor, groups: Groups, tokenizer, records) -> dict:
    """SFT the fresh actor (or load the cached result), then reset the optimizer state."""
    sft = cfg.sft
    if sft.steps == 0:
        return {}
    cache_root = Path(cfg.train.cache_dir).expanduser()
    name = f"warmstart-{cache_key(cfg, tokenizer)}"
    cached = cache_root / name
    if sft.cache and (cached / "trainer_state.json").exists():
        loaded, state = checkpoint.load(cached, actor.sharded_state_dict(with_optimizer=False))
        actor.load_sharded(loaded)
        print_rank0(f"warm start: loaded cached SFT policy {cached}")
        return {"sft/final_loss": state["final_loss"]}
    t0 = time.perf_counter()
    g = groups
    data = PromptDataset(records, seed=cfg.train.seed + 1, shuffle=True)
    actor.set_lr(sft.lr)
    loss_value = float("nan")
    for s in range(sft.steps):
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
        if (s + 1) % 50 == 0 or s == sft.steps - 1:
            loss_value = broadcast_object(loss_value, g.last_stage_rank)
            print_rank0(f"warm start: SFT step {s + 1}/{sft.steps} loss {loss_value:.4f}")
    # Fresh Adam state, and the RL lr schedule (which set_lr had paused for sft.lr) at its step 0.
    actor.reset_optimizer()
    if sft.cache:
        checkpoint.save(
            cache_root,
            name,
            actor.sharded_state_dict(with_optimizer=False),
            {"final_loss": loss_value},
        )
    return {"sft/final_loss": loss_value, "perf/sft_time_s": time.perf_counter() - t0}
