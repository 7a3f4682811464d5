"""What a run prints: a progress bar and one line of headline metrics per logged step (the driver
rank only; everything else goes to ``metrics.jsonl``)."""

from __future__ import annotations


def progress_bar(enabled: bool, total: int, initial: int):
    """The RL steps' progress bar (tqdm; disabled off the driver rank)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="rl",
        dynamic_ncols=True,
        leave=False,
    )


# Headline metrics of the console line, in this order, when the step has them.
SHOWN = (
    "rollout/reward_mean",
    "eval/reward_mean",
    "train/loss",
    "train/entropy",
    "train/pg_clipfrac",
    "fp8/token_mult_prob_error",
    "calib/lower",
    "calib/upper",
    "perf/step_time_s",
    "sft/final_loss",
)


def print_step(step: int, metrics: dict, progress=None) -> None:
    """One console line with the step's headline metrics (through the bar when there is one)."""
    parts = [
        f"{k.removeprefix('rollout/').replace('/', '_')}={metrics[k]:.4g}"
        for k in SHOWN
        if k in metrics
    ]
    line = f"step {step}: " + " ".join(parts)
    (progress.write if progress is not None else print)(line)
