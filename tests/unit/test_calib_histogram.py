"""Histogram quantiles against torch.quantile, on light- and heavy-tailed data."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.loss import hist_mass_below
from megatron_rl_fp8.loss.histogram import bin_index, hist_inverse_mass
from tests.calib_reference import hist_quantile, histogram

RANGE = (-2.0, 2.0)
BINS = 4096
WIDTH = (RANGE[1] - RANGE[0]) / BINS
QS = [0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999]


def _samples(kind: str, n: int = 200_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "normal":
        x = 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "student_t":
        # Student-t with 3 degrees of freedom: normal / sqrt(chi2_3 / 3).
        chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).square().sum(0)
        x = 0.1 * torch.randn(n, generator=g, dtype=torch.float64) / (chi2 / 3).sqrt()
    else:
        u = torch.rand(n, generator=g, dtype=torch.float64)
        x = 0.1 * torch.tan(torch.pi * (u - 0.5))  # Cauchy, scale 0.1
    # Clip just inside the range: the mass piles up in one bin, a worst case for interpolation.
    return x.clamp(RANGE[0] + 0.05, RANGE[1] - 0.05)


@pytest.mark.parametrize("kind", ["normal", "student_t", "cauchy"])
def test_quantiles_within_one_bin_of_torch_quantile(kind):
    x = _samples(kind)
    counts = histogram(x, None, BINS, RANGE)
    assert counts.sum().item() == x.numel()
    exact = torch.quantile(x, torch.tensor(QS, dtype=torch.float64))
    for q, ref in zip(QS, exact.tolist()):
        assert hist_quantile(counts, q, RANGE) == pytest.approx(ref, abs=WIDTH)


def test_mass_below_inverts_quantile_and_matches_counts():
    x = _samples("normal")
    counts = histogram(x, None, BINS, RANGE)
    for q in QS:
        v = hist_quantile(counts, q, RANGE)
        assert hist_mass_below(counts, v, RANGE) == pytest.approx(q * x.numel(), rel=1e-9)
    # Exactly at a bin edge, the mass below is an exact count.
    edge = RANGE[0] + 2000 * WIDTH
    assert hist_mass_below(counts, edge, RANGE) == (x < edge).sum().item()


def test_weighted_histogram_sums_weights_per_bin():
    x = torch.tensor([-0.5, -0.5, 0.1, 1.9])
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    h = histogram(x, w, 4, RANGE)  # bins [-2,-1), [-1,0), [0,1), [1,2]
    assert h.tolist() == [0.0, 3.0, 3.0, 4.0]


def test_out_of_range_values_clamp_into_edge_bins():
    x = torch.tensor([-100.0, -2.0, 2.0, 100.0, float("inf"), float("-inf")])
    assert bin_index(x, 8, RANGE).tolist() == [0, 0, 7, 7, 7, 0]


def test_inverse_mass_ends_and_empty():
    h = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="empty"):
        hist_inverse_mass(h, 0.0, RANGE)
    h[2], h[5] = 1.0, 3.0  # bins [-1,-0.5) and [0.5, 1)
    assert hist_inverse_mass(h, 0.0, RANGE) == -1.0
    assert hist_inverse_mass(h, 4.0, RANGE) == 1.0
    assert hist_inverse_mass(h, 2.5, RANGE) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="q="):
        hist_quantile(h, 1.5, RANGE)
