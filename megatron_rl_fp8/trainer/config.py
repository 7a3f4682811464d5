"""Knobs of the RL loop: optimisation, policy loss, warm start, checkpointing."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import field
from megatron_rl_fp8.loss.calib_config import CalibConfig
from megatron_rl_fp8.loss.importance import ISCorrectionConfig


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Megatron optimizer settings (Adam)."""

    lr: float = field(1e-4, help="Learning rate.")
    weight_decay: float = field(0.0, help="Decoupled weight decay.")
    adam_beta1: float = field(0.9, help="Adam beta1.")
    adam_beta2: float = field(0.999, help="Adam beta2.")
    adam_eps: float = field(1e-8, help="Adam epsilon.")
    clip_grad: float = field(1.0, help="Global gradient-norm clip (0 disables).")

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")


@dataclasses.dataclass(kw_only=True)
class PolicyLossConfig:
    """The clipped policy-gradient objective (GRPO by default)."""

    eps_low: float = field(0.2, help="Lower clip: ratio bound 1 - eps_low.")
    eps_high: float = field(0.2, help="Upper clip: ratio bound 1 + eps_high (DAPO uses 0.28).")
    clip_c: float | None = field(None, help="Dual-clip constant (> 1) for negative advantages.")
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = field(
        "token-mean", help="Loss aggregation; token-mean counts tokens across all DP ranks."
    )
    norm_adv_by_std: bool = field(True, help="GRPO: divide group-centred rewards by group std.")
    is_correction: ISCorrectionConfig | None = field(
        None,
        help="TIS/MIS: reweight token losses by pi_old / pi_rollout (null = off; the "
        "mismatch is logged either way).",
    )
    calib: CalibConfig = field(
        default_factory=CalibConfig,
        help="Calibrated clipping (FP8 training only): clip bounds matched to a BF16 shadow pass "
        "every calib.interval steps, smoothed by EMA in between.",
    )
    dynamic_sampling: bool = field(
        False,
        help="DAPO: drop prompt groups whose rewards are all equal and sample more prompts "
        "until the batch is full.",
    )
    max_sampling_rounds: int = field(
        4,
        help="DAPO: most rollout rounds per step when refilling; if the batch is still short, "
        "dropped groups fill it (zero advantage) and rollout/dynamic_fill_frac says so.",
    )
    overlong_buffer: int = field(
        0,
        help="DAPO soft overlong punishment: responses longer than rollout.max_new_tokens - "
        "overlong_buffer lose reward linearly (0 = off).",
    )
    overlong_penalty: float = field(1.0, help="DAPO: reward lost at rollout.max_new_tokens.")

    def __post_init__(self):
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(
                "overlong_buffer and overlong_penalty must be >= 0, got "
                f"{self.overlong_buffer} and {self.overlong_penalty}"
            )
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.clip_c is not None and self.clip_c <= 1:
            raise ValueError(f"clip_c must be > 1 (or null to disable), got {self.clip_c}")


@dataclasses.dataclass(kw_only=True)
class SFTConfig:
    """Supervised warm start so RL begins from a policy with non-zero reward."""

    steps: int = field(300, help="SFT optimizer steps (0 = start RL from random init).")
    batch_size: int = field(64, help="Examples per SFT step (global, across DP).")
    lr: float = field(3e-3, help="SFT learning rate.")
    cache: bool = field(
        True,
        help="Reuse a warm start cached under train.cache_dir when its "
        "inputs (model, task, SFT settings, seed) are unchanged.",
    )

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"sft: need steps >= 0, batch_size >= 1, lr > 0; got {self}")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The loop's shape: how many steps, how big, where outputs go."""

    steps: int = field(40, help="RL steps (each = rollout + update + weight sync).")
    prompts_per_step: int = field(
        16, help="Prompts per step (x rollout.n_samples_per_prompt rows)."
    )
    micro_batch_size: int = field(16, help="Rows per forward/backward micro-batch per DP rank.")
    updates_per_step: int = field(
        1, help="Optimizer steps per RL step (mini-batches); 1 = strictly on-policy."
    )
    seed: int = field(1, help="Model init and everything else not seeded elsewhere.")
    output_dir: str = field("runs/tiny_cpu", help="Checkpoints, metrics.jsonl, resolved config.")
    cache_dir: str = field("~/.cache/megatron-rl-fp8", help="Warm-start cache.")
    save_interval: int = field(10, help="Checkpoint every N steps (0 = only at the end).")
    eval_interval: int = field(10, help="Validation every N steps (0 = only at start and end).")
    eval_prompts: int = field(128, help="Held-out prompts per validation (greedy decoding).")
    log_interval: int = field(1, help="Console line every N steps.")
    exit_after_steps: int | None = field(
        None, help="Stop after this many steps in this process (simulates preemption in tests)."
    )

    def __post_init__(self):
        for name in (
            "steps",
            "prompts_per_step",
            "micro_batch_size",
            "updates_per_step",
            "eval_prompts",
            "log_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_interval", "eval_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
