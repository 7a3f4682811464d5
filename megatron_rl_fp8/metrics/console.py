"""What a run prints: a progress bar and one line of headline metrics per logged step (the driver
rank only; everything else goes to ``metrics.jsonl``)."""

from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(enabled: bool, total: int, initial: int):
    """The RL steps' progress bar (tqdm; disabled off the driver rank, and where stderr is not a
    terminal: in a log file its redraws would interleave with the step lines)."""
    return tqdm(
        total=total,
        initial=initial,
        disable=None if enabled else True,  # None: tqdm's own rule, off when not a TTY
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
    "calib/keep_neg_lower",
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


class StepProgress:
    """The driver's console during RL: the progress bar, its reward, a headline line every
    ``log_interval`` steps. Silent on the other ranks."""

    def __init__(self, enabled: bool, total: int, initial: int, log_interval: int):
        self.enabled = enabled
        self.log_interval = log_interval
        self.bar = progress_bar(enabled, total, initial)

    def done(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")
        if step % self.log_interval == 0:
            print_step(step, metrics, self.bar)

    def rewound(self, step: int) -> None:
        """A rollback: the bar goes back to ``step`` (the replayed steps count again)."""
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
