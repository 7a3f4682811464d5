"""RL loss math as pure tensor functions, plus one distributed wrapper.

* :mod:`.ppo`          clipped policy-gradient loss (PPO / GRPO / DAPO) and its aggregation;
* :mod:`.importance`   TIS / MIS weights for the train/rollout mismatch;
* :mod:`.advantages`   GRPO advantages, DAPO dynamic sampling and overlong penalty;
* :mod:`.kl`           per-token KL estimators (k1, k2, k3, low_var_kl) for the reference penalty;
* :mod:`.histogram`    fixed-bin histograms and quantiles read from them;
* :mod:`.calibration`  calibrated clipping for FP8 (the only place that may all-reduce, over a
                       process group passed in by the caller); its knobs in :mod:`.config`;
* :mod:`.thinning`     share-matched clipping: the nominal clip set thinned to BF16's share.

Nothing here imports Megatron, and ``torch.distributed`` is imported only inside
:func:`merged_calibration_histogram` when a group is given, so CPU unit tests reach every function.
"""

from megatron_rl_fp8.loss.advantages import (
    dynamic_sampling_keep_mask,
    grpo_advantages,
    overlong_reward_penalty,
)
from megatron_rl_fp8.loss.calibration import (
    CalibConfig,
    bounds_from_histogram,
    build_calibration_histogram,
    calibrated_clip_bounds,
    clip_shares,
    ema_bounds,
    invariant_violations,
    merged_calibration_histogram,
)
from megatron_rl_fp8.loss.histogram import hist_mass_below
from megatron_rl_fp8.loss.importance import ISCorrectionConfig, importance_weights
from megatron_rl_fp8.loss.kl import KLType, kl_penalty
from megatron_rl_fp8.loss.masked import masked_mean, masked_sum
from megatron_rl_fp8.loss.ppo import aggregate_loss, policy_loss
from megatron_rl_fp8.loss.thinning import (
    keep_fraction,
    salt,
    share_counts,
    thinned_bounds,
    token_ratio,
)

__all__ = [
    "CalibConfig",
    "ISCorrectionConfig",
    "KLType",
    "aggregate_loss",
    "bounds_from_histogram",
    "build_calibration_histogram",
    "calibrated_clip_bounds",
    "clip_shares",
    "dynamic_sampling_keep_mask",
    "ema_bounds",
    "grpo_advantages",
    "hist_mass_below",
    "importance_weights",
    "invariant_violations",
    "keep_fraction",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "merged_calibration_histogram",
    "overlong_reward_penalty",
    "policy_loss",
    "salt",
    "share_counts",
    "thinned_bounds",
    "token_ratio",
]
