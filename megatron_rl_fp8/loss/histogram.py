"""Fixed-bin histograms over a known range, and reading quantiles back from them.

Why fixed bins: histograms built with the same edges on every data-parallel rank merge by plain
addition, so one all-reduce of O(bins) numbers gives the global distribution whatever the token
count or the rank count. Exact quantiles would need every token on one rank (O(tokens) traffic).

Conventions used throughout:

* ``bins`` equal-width bins cover ``value_range = (lo, hi)``; bin k is ``[lo + k*w, lo + (k+1)*w)``.
* Values outside the range (and ``hi`` itself) are clamped into the first / last bin, so every token
  is counted once and totals stay exact; only quantiles that fall in an edge bin lose accuracy.
  Choose the range so the bounds you care about lie well inside it.
* Inside a bin, mass is assumed spread uniformly, so the cumulative mass is piecewise linear and
  both directions (value -> mass below it, mass -> value) interpolate linearly. Against an exact
  quantile the error is at most one bin width where the data are dense enough that neighbouring
  order statistics share a bin.

The reading functions take a 1-D float64 tensor on the CPU and return Python floats: they run once
per calibration on a few thousand numbers, after the (single) device-to-host copy.
"""

from __future__ import annotations

import torch


def bin_index(values: torch.Tensor, bins: int, value_range: tuple[float, float]) -> torch.Tensor:
    """Bin of each value (int64, same shape), out-of-range values clamped into the edge bins."""
    lo, hi = value_range
    scaled = (values - lo) * (bins / (hi - lo))
    # Clamp in floating point first: casting a huge or infinite float to int64 is undefined. After
    # the clamp every value is >= 0, where the truncating cast equals floor.
    return scaled.clamp_(0, bins - 1).long()


def _width(weights: torch.Tensor, value_range: tuple[float, float]) -> float:
    lo, hi = value_range
    return (hi - lo) / weights.numel()


def hist_mass_below(weights: torch.Tensor, x: float, value_range: tuple[float, float]) -> float:
    """Total weight of the histogram below ``x``, interpolated linearly inside x's bin."""
    lo, _ = value_range
    bins = weights.numel()
    pos = min(max((x - lo) / _width(weights, value_range), 0.0), float(bins))
    k = min(int(pos), bins - 1)
    before = float(weights[:k].sum())
    return before + (pos - k) * float(weights[k])


def hist_inverse_mass(
    weights: torch.Tensor, target: float, value_range: tuple[float, float]
) -> float:
    """The value x whose mass below equals ``target`` (inverse of :func:`hist_mass_below`).

    The cumulative mass is flat across empty bins, so the inverse is not unique there; this
    returns the smallest such x, except at the ends: ``target <= 0`` gives the left edge of the
    first non-empty bin and ``target >= total`` the right edge of the last non-empty bin, i.e. the
    tightest interval that still holds all the mass. Raises on an empty histogram.
    """
    lo, _ = value_range
    w = _width(weights, value_range)
    nonzero = torch.nonzero(weights > 0).flatten()
    if nonzero.numel() == 0:
        raise ValueError("hist_inverse_mass: the histogram is empty; there is no value to return.")
    cum = torch.cumsum(weights, dim=0)
    if target <= 0:
        return lo + int(nonzero[0]) * w
    if target >= float(cum[-1]):
        return lo + (int(nonzero[-1]) + 1) * w
    # First bin whose cumulative mass reaches the target; it is non-empty because the previous
    # cumulative value is strictly below the target.
    k = int(torch.searchsorted(cum, torch.tensor([target], dtype=cum.dtype, device=cum.device)))
    before = float(cum[k]) - float(weights[k])
    return lo + (k + (target - before) / float(weights[k])) * w
