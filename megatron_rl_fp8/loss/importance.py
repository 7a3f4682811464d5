"""Train/rollout mismatch correction: truncated (TIS) and masked (MIS) importance sampling.

The rollout engine samples tokens from pi_rollout (FP8 SGLang), but the PPO objective assumes they
came from pi_old (the trainer's own forward on the same weights). Kernels, precision and batching
differ, so the two disagree token by token. The off-policy correction reweights each token's loss by

    w = pi_old / pi_rollout = exp(old_log_prob - rollout_log_prob)

at one of three levels:

* ``token``:      one weight per token (unbiased per token, lowest variance);
* ``sequence``:   the product over the response, exp(sum_t log w_t) (unbiased for the sequence, high
                  variance on long responses);
* ``geometric``:  the geometric mean exp(mean_t log w_t), a length-normalised sequence weight.

and made safe in one of two modes:

* ``truncate`` (TIS): clamp the weight from above at ``cap``; keeps every token, bounds the
                     variance;
* ``mask`` (MIS):    zero the weight of tokens (or whole sequences) whose weight leaves
                     [``mask_low``, ``mask_high``]; in-range weights are kept as they are.

The weights are constants for the gradient (detached): they correct the sampling distribution, they
are not part of the policy being optimised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.loss.masked import masked_mean

ISLevel = Literal["token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]

# exp() of a float32 overflows above ~88; sequence-level sums of log weights reach that on long
# responses. Clamping the log weight first keeps the weights finite; both modes then cut them
# anyway.
_MAX_LOG_WEIGHT = 20.0


@dataclass(kw_only=True)
class ISCorrectionConfig:
    """How to turn rollout/trainer log-prob mismatch into per-token loss weights."""

    level: ISLevel = field(
        default="token",
        help="Granularity of the weight: 'token', 'sequence' (product over the "
        "response) or 'geometric' (geometric mean over the response).",
    )
    mode: ISMode = field(
        default="truncate",
        help="'truncate' clamps weights above at `cap` (TIS); 'mask' zeroes weights "
        "outside [mask_low, mask_high] (MIS).",
    )
    cap: float = field(
        default=2.0,
        help="Upper clamp of the weight in 'truncate' mode (TIS uses ~2).",
    )
    mask_low: float = field(
        default=0.5,
        help="Smallest weight kept in 'mask' mode.",
    )
    mask_high: float = field(
        default=2.0,
        help="Largest weight kept in 'mask' mode.",
    )

    def __post_init__(self) -> None:
        check_literals(self, "ISCorrectionConfig")
        if not self.cap > 0:
            raise ValueError(
                f"ISCorrectionConfig.cap={self.cap!r} must be > 0 (e.g. 2.0): it is the largest "
                "weight a token may receive."
            )
        if not 0 <= self.mask_low < 1 < self.mask_high:
            raise ValueError(
                f"ISCorrectionConfig.mask_low={self.mask_low!r}, mask_high={self.mask_high!r} must "
                "satisfy 0 <= mask_low < 1 < mask_high (e.g. 0.5 and 2.0) so on-policy tokens "
                "(weight 1) are kept."
            )


def importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    config: ISCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights pi_old / pi_rollout, truncated or masked per ``config``.

    Args:
        old_log_prob: [B, T] trainer log-probs of the sampled tokens under pi_old.
        rollout_log_prob: [B, T] log-probs reported by the rollout engine for the same tokens.
        mask: [B, T] response mask (bool or float, 1 = response token).
        config: level and mode, see the module docstring.

    Returns:
        ``(weights, metrics)``: weights [B, T] float, detached, zero on padding; metrics are
        detached 0-d tensors: ``is_weight_mean`` (after truncation/masking, over response tokens),
        ``is_raw_weight_mean`` and ``is_modified_frac`` (share of response tokens whose weight was
        truncated or masked).
    """
    mask_f = mask.to(old_log_prob.dtype)
    # masked_fill, not a multiply: padding may hold NaN / -inf log-probs and NaN * 0 is NaN.
    log_w = (old_log_prob - rollout_log_prob).detach().masked_fill(~mask.bool(), 0.0)
    if config.level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
    elif config.level == "geometric":
        seq_len = mask_f.sum(dim=-1, keepdim=True).clamp_min(1.0)
        log_w = (log_w.sum(dim=-1, keepdim=True) / seq_len).expand_as(log_w)
    raw = torch.exp(log_w.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT))

    if config.mode == "truncate":
        modified = raw > config.cap
        weights = raw.clamp(max=config.cap)
    else:
        modified = (raw < config.mask_low) | (raw > config.mask_high)
        weights = torch.where(modified, torch.zeros_like(raw), raw)
    weights = weights * mask_f

    metrics = {
        "is_weight_mean": masked_mean(weights, mask_f).detach(),
        "is_raw_weight_mean": masked_mean(raw, mask_f).detach(),
        "is_modified_frac": masked_mean(modified.to(mask_f.dtype), mask_f).detach(),
    }
    return weights, metrics
