"""The O(tokens) reference for calibrated clipping, for tests only.

The same bounds as ``loss.calibration.calibrated_clip_bounds`` computed from raw tokens in one
process (``torch.quantile`` and sorted cumulative sums, float64): what an exact all-gather of every
rank's tokens would give. The package's histogram path must agree with it to the bin width.
"""

from __future__ import annotations

import math

import torch

from megatron_rl_fp8.loss.calibration import (
    DEFAULT_LOWER_LIMITS,
    DEFAULT_UPPER_LIMITS,
    Strategy,
    _clamp,
    _token_views,
)
from megatron_rl_fp8.loss.histogram import bin_index, hist_inverse_mass


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
    """Reference for tests: the same bounds from raw tokens, exactly (O(tokens), one process).

    Uses ``torch.quantile`` for the lower bound (and the upper one under ``quantile``) and a sorted
    cumulative sum for the balance; the edge-case rules are those of :func:`bounds_from_histogram`, with token values in place of bin
    edges.
    """
    x8, x16, adv, neg, pos = _token_views(fp8_log_ratio, bf16_log_ratio, advantages, mask)
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
    lower = _clamp(lower, lower_limits)

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
    return lower, _clamp(upper, upper_limits)


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
    x, _, adv, neg, pos = _token_views(log_ratio, log_ratio, advantages, mask)
    x = x.double()

    def share(sel: torch.Tensor, hit: torch.Tensor) -> float:
        n = int(sel.sum())
        return int((sel & hit).sum()) / n if n else math.nan

    return share(neg, x < math.log(lower)), share(pos, x > math.log(upper))


# Plain histograms and quantiles read from them: the building blocks the packed calibration
# histogram (loss/calibration.py) inlines, kept here to test the readers on simple inputs.
def histogram(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    bins: int,
    value_range: tuple[float, float],
) -> torch.Tensor:
    """float64 [bins] histogram of ``values`` (each token adds its weight, or 1).

    Uses ``index_add_`` into a fixed-size buffer rather than ``torch.bincount``, which must find
    the largest index first (a host-device sync on GPU).
    """
    idx = bin_index(values, bins, value_range).flatten()
    src = (
        torch.ones_like(idx, dtype=torch.float64)
        if weights is None
        else weights.flatten().to(torch.float64)
    )
    return torch.zeros(bins, dtype=torch.float64, device=values.device).index_add_(0, idx, src)


def hist_quantile(counts: torch.Tensor, q: float, value_range: tuple[float, float]) -> float:
    """The q-quantile (0 <= q <= 1) of the values counted in ``counts``."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"hist_quantile: q={q} must lie in [0, 1].")
    return hist_inverse_mass(counts, q * float(counts.sum()), value_range)
