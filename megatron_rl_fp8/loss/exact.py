"""The O(tokens) reference for calibrated clipping.

The same bounds as ``loss.calibration.calibrated_clip_bounds`` computed from raw tokens in one
process (``torch.quantile`` and sorted cumulative sums, float64): what an exact all-gather of every
rank's tokens would give. The package's histogram path must agree with it to the bin width (the
unit tests hold it to that), and ``benchmarks/bench_calibration.py`` times it against the
histogram all-reduce. The trainer never calls it: its memory and traffic grow with the tokens.
"""

from __future__ import annotations

import math

import torch

from megatron_rl_fp8.loss.calibration import (
    DEFAULT_LOWER_LIMITS,
    DEFAULT_UPPER_LIMITS,
    Strategy,
    clamp_to,
    token_views,
)


@torch.no_grad()
def exact_calibrated_clip_bounds(
    fp8_log_ratio: torch.Tensor,
    bf16_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    strategy: Strategy = "balance",
    lower_limits: tuple[float, float] = DEFAULT_LOWER_LIMITS,
    upper_limits: tuple[float, float] = DEFAULT_UPPER_LIMITS,
) -> tuple[float, float]:
    """The bounds of :func:`~.calibration.calibrated_clip_bounds` from raw tokens, exactly.

    Uses ``torch.quantile`` for the lower bound (and the upper one under ``quantile``) and a sorted
    cumulative sum for the balance; the edge-case rules are those of :func:`bounds_from_histogram`, with token values in place of bin
    edges.
    """
    x8, x16, adv, neg, pos = token_views(fp8_log_ratio, bf16_log_ratio, advantages, mask)
    x8, x16, abs_a = x8.double(), x16.double(), adv.abs().double()
    log_lower, log_upper = math.log1p(-eps_low), math.log1p(eps_high)
    nominal_lower, nominal_upper = 1.0 - eps_low, 1.0 + eps_high

    neg_x8 = x8[neg]
    if neg_x8.numel() == 0:
        lower = nominal_lower
    else:
        q = float((x16[neg] < log_lower).double().mean())
        lower = (
            min(nominal_lower, math.exp(float(neg_x8.min())))
            if q == 0
            else math.exp(float(torch.quantile(neg_x8, q)))
        )
    lower = clamp_to(lower, lower_limits)

    w8 = abs_a * torch.exp(x8)
    w16 = abs_a * torch.exp(x16)
    bf16_neg_unclipped = float(w16[neg & (x16 >= log_lower)].sum())
    if strategy == "shift":
        upper = lower * nominal_upper / nominal_lower
    elif strategy == "lower_only" or not bool(pos.any()):
        upper = nominal_upper
    elif strategy == "quantile":
        pos_x8 = x8[pos]
        q_plus = float((x16[pos] > log_upper).double().mean())
        upper = (
            max(nominal_upper, math.exp(float(pos_x8.max())))
            if q_plus == 0
            else math.exp(float(torch.quantile(pos_x8, 1.0 - q_plus)))
        )
    elif bf16_neg_unclipped == 0:
        upper = nominal_upper
    else:
        balance = float(w16[pos & (x16 <= log_upper)].sum()) / bf16_neg_unclipped
        target = balance * float(w8[neg & (x8 >= math.log(lower))].sum())
        order = torch.argsort(x8[pos])
        cum = torch.cumsum(w8[pos][order], dim=0)
        if target >= float(cum[-1]):
            upper = max(nominal_upper, math.exp(float(x8[pos].max())))
        else:
            target_t = torch.tensor([target], dtype=cum.dtype, device=cum.device)
            k = int(torch.searchsorted(cum, target_t))
            upper = max(nominal_upper, math.exp(float(x8[pos][order][k])))
    return lower, clamp_to(upper, upper_limits)


@torch.no_grad()
def exact_clip_shares(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    lower: float,
    upper: float,
) -> tuple[float, float]:
    """(share of A<0 tokens with r < lower, share of A>0 tokens with r > upper), token by token
    in float64; NaN for a sign without tokens."""
    x, _, adv, neg, pos = token_views(log_ratio, log_ratio, advantages, mask)
    x = x.double()

    def share(sel: torch.Tensor, hit: torch.Tensor) -> float:
        n = int(sel.sum())
        return int((sel & hit).sum()) / n if n else math.nan

    return share(neg, x < math.log(lower)), share(pos, x > math.log(upper))
