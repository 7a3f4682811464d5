"""Plain histograms and quantiles read from them, for tests only: the building blocks the packed
calibration histogram inlines. The O(tokens) reference of the calibrated bounds and clip shares is
``megatron_rl_fp8.loss.exact`` (the calibration benchmark uses it too).
"""

from __future__ import annotations

import torch

from megatron_rl_fp8.loss.histogram import bin_index, hist_inverse_mass


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
