"""Importance-ratio monitoring: quantiles and outlier shares of pi_theta / pi_old per step.

The ratio's spread is the first thing to move when training and rollout numerics disagree (FP8)
or the policy moves too far per step. Quantiles need every token; instead each rank bins its
tokens' log ratios into the same fixed bins (``loss/histogram.py``), the bins are summed over the
data-parallel group with the step's other metrics, and the quantiles are read back from the sum:
O(bins) traffic, exact totals, and each quantile within one bin width (0.025 in log ratio, 2.5%
in ratio) of the exact one wherever the tokens are dense. Log ratios outside the range are
counted in the edge bins, so a quantile at +-3 means "at least this far out".
"""

from __future__ import annotations

import math

import torch

from megatron_rl_fp8.loss.histogram import bin_index, hist_inverse_mass

LOG_RATIO_RANGE = (-3.0, 3.0)  # ratio 0.05 .. 20
BINS = 240
QUANTILES = {"p01": 0.01, "p50": 0.50, "p99": 0.99}


def log_ratio_histogram(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Counts of the masked tokens' log ratios in ``BINS`` fixed bins over ``LOG_RATIO_RANGE``."""
    values = log_ratio.detach().float()
    # Weights instead of boolean indexing: no data-dependent shape, so no host sync on a GPU.
    # NaN would land in an arbitrary bin; a non-finite loss is the guard's business, not this one.
    keep = mask.bool() & ~values.isnan()
    idx = bin_index(torch.where(keep, values, 0.0), BINS, LOG_RATIO_RANGE)
    counts = torch.bincount(idx.flatten(), weights=keep.flatten().double(), minlength=BINS)
    return counts.to(torch.float64)


def ratio_stats(hist: torch.Tensor) -> dict[str, float]:
    """``ratio_p01`` / ``ratio_p50`` / ``ratio_p99`` (ratios, not logs) from a summed histogram.

    Empty histogram (no response tokens): no entries.
    """
    total = float(hist.sum())
    if total <= 0:
        return {}
    return {
        f"ratio_{name}": math.exp(hist_inverse_mass(hist, q * total, LOG_RATIO_RANGE))
        for name, q in QUANTILES.items()
    }
