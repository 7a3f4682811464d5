"""Run the real Trainer inside spawned ranks (tests/dist_utils) on a small variant of tiny_cpu."""

from __future__ import annotations

SMALL = [
    "sft.steps=30",
    "sft.batch_size=32",
    "train.steps=1",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=8",
    "train.updates_per_step=2",
    "train.eval_prompts=16",
    "train.save_interval=0",
    # After 30 SFT steps nothing is correct yet; the format bonus gives groups reward variance, so
    # advantages (and gradients) are nonzero and layout comparisons test the update itself.
    "reward.format_weight=0.5",
]


def trainer_body(rank, world_size, overrides, config=None):
    """One rank's whole run of ``config`` (None: the embedded tiny_cpu) with ``overrides``; rank
    0 returns the metrics written."""
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.metrics.logger import read_metrics
    from megatron_rl_fp8.trainer.loop import Trainer

    cfg = load_config(config, list(overrides))
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
        parallel.destroy()
    return read_metrics(cfg.train.output_dir) if rank == 0 else None
