"""Knobs of the RL loop: optimisation, policy loss, warm start, checkpointing."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Megatron optimizer settings (Adam) and the learning-rate schedule.

    The schedule is Megatron-Core's ``OptimizerParamScheduler``, advanced once per applied
    optimizer step (``train.updates_per_step`` per RL step): linear warmup from 0 to ``lr`` over
    ``lr_warmup_steps``, then ``lr_decay_style`` down to ``min_lr`` at ``lr_decay_steps``.
    """

    lr: float = field(1e-4, help="Peak learning rate (reached after the warmup).")
    lr_warmup_steps: int = field(
        0,
        help="Optimizer steps of linear warmup from 0 to lr (as Megatron: the first update of a "
        "warmup has lr 0).",
    )
    lr_decay_style: Literal["constant", "cosine", "linear"] = field(
        "constant", help="After the warmup: keep lr, or decay it to min_lr at lr_decay_steps."
    )
    min_lr: float = field(0.0, help="Learning rate at the end of the decay (cosine, linear).")
    lr_decay_steps: int | None = field(
        None,
        help="Optimizer step at which the decay reaches min_lr, warmup included (null = the "
        "whole run: train.steps * train.updates_per_step).",
    )
    weight_decay: float = field(
        0.0, help="Decoupled weight decay (not applied to biases and norm weights, as Megatron)."
    )
    adam_beta1: float = field(0.9, help="Adam beta1.")
    adam_beta2: float = field(0.999, help="Adam beta2.")
    adam_eps: float = field(1e-8, help="Adam epsilon.")
    clip_grad: float = field(1.0, help="Global gradient-norm clip (0 disables).")

    def __post_init__(self):
        for name in ("lr", "min_lr"):
            # NaN passes every comparison below; reject it (and inf) by name first.
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"lr_decay_steps={self.lr_decay_steps} must be > lr_warmup_steps="
                f"{self.lr_warmup_steps} (it counts the warmup), or null for the whole run"
            )
        check_literals(self, "optim")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")

    def resolved_lr_decay_steps(self, total_steps: int | None) -> int:
        """``lr_decay_steps``, or the run's ``total_steps`` optimizer steps
        (``train.steps * train.updates_per_step``) when it is null.

        Raises ``ValueError`` when a decaying schedule cannot be resolved (no ``total_steps``) or
        its warmup does not end before the run does.
        """
        if self.lr_decay_steps is not None:
            return self.lr_decay_steps
        if self.lr_decay_style == "constant":
            # Never decays; Megatron's scheduler still wants a horizon past the warmup.
            return max(total_steps or 0, self.lr_warmup_steps + 1)
        if total_steps is None:
            raise ValueError(
                f"optim.lr_decay_style={self.lr_decay_style!r} with optim.lr_decay_steps=null "
                "decays over the whole run, whose length is not known here: pass the run's "
                "optimizer steps (train.steps * train.updates_per_step) or set optim.lr_decay_steps"
            )
        if total_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"optim.lr_warmup_steps={self.lr_warmup_steps} must end before the run's "
                f"{total_steps} optimizer steps (train.steps * train.updates_per_step), where "
                "optim.lr_decay_steps=null ends the decay; shorten the warmup or set lr_decay_steps"
            )
        return total_steps


@dataclasses.dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm start so RL begins from a policy with non-zero reward."""

    steps: int | None = field(
        None,
        help="SFT optimizer steps before RL (0 = none). null = 300 from a random init (the tiny "
        "task needs it), 0 from a pretrained start (model.hf_checkpoint / model.load).",
    )
    batch_size: int = field(64, help="Examples per SFT step (global, across DP).")
    lr: float = field(3e-3, help="SFT learning rate (the peak, under a schedule).")
    lr_schedule: Literal["constant", "cosine"] = field(
        "constant",
        help="constant: sft.lr every step. cosine: linear warmup over sft.warmup_steps from 0 "
        "to sft.lr, then cosine decay to sft.min_lr at the last step.",
    )
    warmup_steps: int = field(0, help="Linear warmup steps of the cosine schedule.")
    seed: int | None = field(
        None,
        help="Seed of the warm start: the model's random init and the SFT data order. null = "
        "train.seed. Fix it to give every train.seed one base policy, as RL studies start every "
        "seed from one pretrained checkpoint (train.seed then varies RL alone).",
    )
    min_lr: float = field(0.0, help="The cosine schedule's final learning rate.")
    cache: bool = field(
        True,
        help="Reuse a warm start cached under train.cache_dir when its "
        "inputs (model, task, SFT settings, seed) are unchanged.",
    )

    def __post_init__(self):
        if (self.steps is not None and self.steps < 0) or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"sft: need steps >= 0, batch_size >= 1, lr > 0; got {self}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"sft: need warmup_steps >= 0 and 0 <= min_lr <= lr; got warmup_steps="
                f"{self.warmup_steps}, min_lr={self.min_lr}, lr={self.lr}"
            )
        check_literals(self, "sft")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of ``self.steps``."""
        if self.lr_schedule == "constant":
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay = max((self.steps or 1) - self.warmup_steps - 1, 1)
        progress = min((step - self.warmup_steps) / decay, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The loop's shape: how many steps, how big, where outputs go."""

    steps: int = field(40, help="RL steps (each = rollout + update + weight sync).")
    prompts_per_step: int = field(
        16, help="Prompts per step (x rollout.n_samples_per_prompt rows)."
    )
    micro_batch_size: int = field(
        16,
        help="Rows per forward/backward micro-batch per DP rank, padded to the batch's longest "
        "row (not used when max_tokens_per_gpu is set).",
    )
    max_tokens_per_gpu: int | None = field(
        None,
        help="Token budget per micro-batch (slime's name): every pass groups this DP rank's rows, "
        "longest first, into micro-batches of varying row count whose padded size (rows x "
        "their own longest row) stays within it; a row longer than the budget runs alone. Less "
        "padding when lengths vary. null = micro_batch_size rows per micro-batch.",
    )
    updates_per_step: int = field(
        1, help="Optimizer steps per RL step (mini-batches); 1 = strictly on-policy."
    )
    seed: int = field(
        1, help="The run's seed: sft.seed, task.seed and rollout.seed follow it when null."
    )
    output_dir: str = field("runs/tiny_cpu", help="Checkpoints, metrics.jsonl, resolved config.")
    cache_dir: str = field("~/.cache/megatron-rl-fp8", help="Warm-start cache.")
    save_interval: int = field(10, help="Checkpoint every N steps (0 = only at the end).")
    keep_checkpoints: int = field(
        2,
        help="Newest complete checkpoints kept (>= 1); the one `latest` names and the stability "
        "guard's last healthy checkpoint are kept in addition.",
    )
    checkpoint_verify: Literal["sizes", "full"] = field(
        "sizes",
        help="How a resume checks a checkpoint against its manifest. sizes: every file is there "
        "with its size (a stat per file, no data read; misses bytes changed in place, which then "
        "load silently). full: also every file's crc32: one more read of the whole checkpoint, "
        "shared by all ranks (~1.6 GB/s per rank from the page cache; from a cold file system "
        "about as long as the load itself).",
    )
    eval_interval: int = field(10, help="Validation every N steps (0 = only at start and end).")
    eval_prompts: int = field(128, help="Held-out prompts per validation (greedy decoding).")
    log_interval: int = field(1, help="Console line every N steps.")
    exit_after_steps: int | None = field(
        None, help="Stop after this many steps in this process (simulates preemption in tests)."
    )
    pipeline: Literal["sync", "one_step_off"] = field(
        "sync",
        help="sync = each step generates its rollout, then trains on it (on-policy). "
        "one_step_off = the engines generate the next step's rollout from the current weights "
        "while the trainer updates on this one's, so rollout and training overlap and every row "
        "is one policy version old (dedicated engines only; trainer/pipeline.py, "
        "docs/pipelining.md).",
    )
    max_staleness: int = field(
        1,
        help="Policy versions a rollout row may lag the weights it is trained from; older rows "
        "are refused (one_step_off needs >= 1; sync rows lag 0).",
    )

    def __post_init__(self):
        for name in (
            "steps",
            "prompts_per_step",
            "micro_batch_size",
            "updates_per_step",
            "eval_prompts",
            "log_interval",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_interval", "eval_interval", "max_staleness"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(
                f"max_tokens_per_gpu must be >= 1 (or null for micro_batch_size rows per "
                f"micro-batch), got {self.max_tokens_per_gpu}"
            )
        check_literals(self, "train")
        if self.pipeline == "one_step_off" and self.max_staleness < 1:
            raise ValueError(
                "train.pipeline=one_step_off trains on rows one policy version old, which "
                f"train.max_staleness={self.max_staleness} refuses; set train.max_staleness=1 "
                "or train.pipeline=sync"
            )


# Severity order: when several rules fire, the strongest action is taken.
ACTIONS = ("skip", "recalibrate", "bf16", "rollback", "stop")
RULES = ("nonfinite", "entropy", "mismatch", "reward", "garbled", "calib")


@dataclasses.dataclass(kw_only=True)
class GuardConfig:
    """Rules on each step's metrics and the action each one takes (``trainer/guard.py``)."""

    enabled: bool = field(True, help="Check every step's metrics against the rules below.")
    window: int = field(5, help="Healthy steps remembered for the entropy and reward baselines.")
    max_entropy_rise: float | None = field(
        1.0,
        help="Nats train/entropy may rise above its minimum over the window (null = off). A "
        "collapsing policy heads for log(vocab): 3.97 for the tiny model, ~11.9 for Qwen3.",
    )
    max_mismatch: float | None = field(
        None,
        help="Upper limit of fp8/token_mult_prob_error, the mean exp|logp_rollout - logp_train| "
        "(1.0 = identical; healthy FP8 runs stay within a few percent of 1; null = off).",
    )
    reward_collapse_ratio: float | None = field(
        None,
        help="Fires when rollout/reward_mean falls below this fraction of the best reward of the "
        "window (e.g. 0.25; null = off; noisy with few prompts per step).",
    )
    max_garbled_frac: float | None = field(
        None,
        help="Upper limit of rollout/garbled_frac (undecodable, repetitive or answerless "
        "responses; null = off). Set it above the starting model's share.",
    )
    on_nonfinite: Literal["skip", "rollback", "stop"] = field(
        "skip",
        help="Action when the loss or grad norm is NaN/inf (weights that overflow: rollback).",
    )
    on_entropy: Literal["rollback", "bf16", "stop"] = field(
        "rollback", help="Action when entropy rises past max_entropy_rise."
    )
    on_mismatch: Literal["recalibrate", "bf16", "rollback", "stop"] = field(
        "recalibrate", help="Action when the mismatch passes max_mismatch."
    )
    on_reward: Literal["rollback", "stop"] = field(
        "rollback", help="Action when the reward collapses."
    )
    on_garbled: Literal["rollback", "bf16", "stop"] = field(
        "rollback", help="Action when the garbled share passes max_garbled_frac."
    )
    on_calib: Literal["recalibrate", "bf16", "stop"] = field(
        "recalibrate",
        help="Action when a calibration broke its invariant (loss.calib.invariant_tolerance) and "
        "the clip bounds fell back to nominal; 'recalibrate' tries again on the next step's batch.",
    )
    max_consecutive_skips: int = field(
        3, help="Skipped updates in a row before the guard rolls back instead."
    )
    rollback_lr_factor: float = field(
        0.5, help="Each rollback multiplies the learning rate (optim.lr, optim.min_lr) by this."
    )
    max_rollbacks: int = field(3, help="Rollbacks per run; one more event that wants one stops.")
    bf16_steps: int = field(10, help="Steps trained without FP8 after a bf16 action.")

    def __post_init__(self):
        check_literals(self, "guard")
        if self.window < 1:
            raise ValueError(f"guard.window must be >= 1, got {self.window}")
        for name in ("max_entropy_rise", "max_garbled_frac", "reward_collapse_ratio"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"guard.{name} must be a number > 0 or null (off), got {v}")
        if self.max_mismatch is not None and not (
            math.isfinite(self.max_mismatch) and self.max_mismatch > 1
        ):
            raise ValueError(
                f"guard.max_mismatch must be > 1 (1.0 = rollout and training agree exactly) or "
                f"null, got {self.max_mismatch}"
            )
        if self.reward_collapse_ratio is not None and self.reward_collapse_ratio >= 1:
            raise ValueError(
                f"guard.reward_collapse_ratio must be in (0, 1), got {self.reward_collapse_ratio}"
            )
        if not 0 < self.rollback_lr_factor <= 1:
            raise ValueError(
                f"guard.rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}"
            )
        for name in ("max_consecutive_skips", "max_rollbacks", "bf16_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"guard.{name} must be >= 0, got {getattr(self, name)}")

    def actions_in_use(self) -> set[str]:
        """The actions some enabled rule may take (for cross-section checks)."""
        used = {self.on_nonfinite}
        for threshold, action in (
            (self.max_entropy_rise, self.on_entropy),
            (self.max_mismatch, self.on_mismatch),
            (self.reward_collapse_ratio, self.on_reward),
            (self.max_garbled_frac, self.on_garbled),
        ):
            if threshold is not None:
                used.add(action)
        return used if self.enabled else set()
