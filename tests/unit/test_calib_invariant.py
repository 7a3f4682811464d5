"""The sign-wise calibration rule and the invariant every calibration is checked against.

``quantile`` must make FP8 clip, on each advantage sign, the share of tokens BF16 clips at the
nominal bounds, to within the mass of the histogram bin a bound falls in (the histogram's
resolution), over random batches that shift, widen and skew the FP8 ratios; ``balance`` may widen
the upper bound but never tighten it; :func:`invariant_violations` names the signs on which
calibrated bounds do harm. Shares are counted token by token in float64 (loss/exact.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    bounds_from_histogram,
    build_calibration_histogram,
    calibrated_clip_bounds,
    clip_shares,
    invariant_violations,
)
from megatron_rl_fp8.loss.config import DEFAULT_LOWER_LIMITS, DEFAULT_UPPER_LIMITS
from megatron_rl_fp8.loss.exact import exact_calibrated_clip_bounds, exact_clip_shares
from megatron_rl_fp8.loss.histogram import bin_index

EPS_LOW, EPS_HIGH = 0.2, 0.28
NOMINAL = (1 - EPS_LOW, 1 + EPS_HIGH)
BINS, RANGE = 4096, (-2.0, 2.0)
CASES = 1000


def _random_batch(g: torch.Generator):
    """One batch of the property test: BF16 log ratios of a random spread, FP8 = BF16 + noise +
    a bulk shift per advantage sign of up to +-2% in ratio, advantages skewed towards one sign
    (sometimes all of one sign, sometimes with zeros), a random share of padding."""

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    b = int(torch.randint(2, 25, (), generator=g))
    t = int(torch.randint(4, 49, (), generator=g))
    bf16 = uniform(0.02, 0.3) * torch.randn(b, t, generator=g)
    p_pos = [0.0, 0.05, 0.3, 0.5, 0.7, 0.95, 1.0][int(torch.randint(0, 7, (), generator=g))]
    sign = torch.where(torch.rand(b, generator=g) < p_pos, 1.0, -1.0)
    adv = sign * torch.empty(b).exponential_(generator=g)  # skewed magnitudes
    adv[torch.rand(b, generator=g) < 0.1] = 0.0
    pos = (adv > 0)[:, None]
    shift = torch.where(pos, uniform(-0.02, 0.02), uniform(-0.02, 0.02))
    fp8 = bf16 + uniform(0.0, 0.1) * torch.randn(b, t, generator=g) + shift
    mask = torch.rand(b, t, generator=g) < uniform(0.3, 1.0)
    return fp8, bf16, adv, mask


def _bin_share(log_ratio, adv, mask, bound: float, negative: bool) -> float:
    """Share of one sign's tokens that fall in the histogram bin holding ``log(bound)``."""
    sel = mask.bool() & ((adv < 0) if negative else (adv > 0))[:, None]
    n = int(sel.sum())
    if n == 0:
        return 0.0
    k = bin_index(torch.tensor([math.log(bound)]), BINS, RANGE)
    return int((bin_index(log_ratio[sel], BINS, RANGE) == k).sum()) / n


def test_quantile_matches_bf16_clip_share_on_both_signs_over_random_batches():
    g = torch.Generator().manual_seed(0)
    checked = {"neg": 0, "pos": 0}
    clamped = 0
    for case in range(CASES):
        fp8, bf16, adv, mask = _random_batch(g)
        packed = build_calibration_histogram(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
        lower, upper, stats = bounds_from_histogram(packed, EPS_LOW, EPS_HIGH, strategy="quantile")
        # A safety limit binds only on batches of a few tokens (3 of these 1000), where the
        # clamped bound still falls between the same two tokens: the shares match all the same.
        clamped += lower in DEFAULT_LOWER_LIMITS or upper in DEFAULT_UPPER_LIMITS
        bf16_neg, bf16_pos = exact_clip_shares(bf16, adv, mask, *NOMINAL)
        fp8_neg, fp8_pos = exact_clip_shares(fp8, adv, mask, lower, upper)
        for sign, want, got, bound in (
            ("neg", bf16_neg, fp8_neg, lower),
            ("pos", bf16_pos, fp8_pos, upper),
        ):
            if math.isnan(want):  # no token of this sign: nothing to match
                assert math.isnan(got), case
                continue
            tol = _bin_share(fp8, adv, mask, bound, negative=sign == "neg") + 1e-12
            assert abs(got - want) <= tol, (case, sign, got, want, tol)
            checked[sign] += 1
        # The invariant, read from the histogram as the trainer reads it, holds at any tolerance
        # (the histogram's own shares are matched exactly).
        assert invariant_violations(clip_shares(packed, lower, upper), 1e-9) == [], case
        assert stats["fp8_pos_upper_clipfrac_calibrated"] == pytest.approx(
            stats["bf16_pos_upper_clipfrac"], abs=1e-9, nan_ok=True
        )
    # Each sign was matched in most batches; the all-one-sign batches (2 in 7) cover empty signs.
    assert min(checked.values()) > 0.7 * CASES
    assert clamped < 0.01 * CASES


def test_balance_never_tightens_below_nominal_over_random_batches():
    g = torch.Generator().manual_seed(1)
    for case in range(CASES // 4):
        fp8, bf16, adv, mask = _random_batch(g)
        _, upper = calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
        assert upper >= NOMINAL[1], case
        ref = exact_calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)[1]
        assert ref >= NOMINAL[1], case


def test_a_bulk_shift_of_positive_ratios_no_longer_pulls_the_upper_bound_into_the_bulk():
    """What the paper's balance did on the shipped study (the upper bound at 1.00-1.09, clipping
    up to 40% of the A>0 tokens): a +2% bulk shift of the positive FP8 ratios. ``balance`` now
    holds the nominal bound; ``quantile`` clips BF16's share of positive tokens."""
    g = torch.Generator().manual_seed(3)
    b, t = 256, 64
    bf16 = 0.05 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    fp8 = bf16 + 0.01 * torch.randn(b, t, generator=g) + 0.02 * (adv > 0)[:, None]
    _, bf16_pos = exact_clip_shares(bf16, adv, mask, *NOMINAL)
    for strategy in ("balance", "quantile"):
        lower, upper = calibrated_clip_bounds(
            fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy=strategy
        )
        _, fp8_pos = exact_clip_shares(fp8, adv, mask, lower, upper)
        assert upper >= NOMINAL[1], strategy
        assert fp8_pos <= bf16_pos + 0.01, strategy
    ref = exact_calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy="quantile")
    got = calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy="quantile")
    assert math.log(got[1]) == pytest.approx(math.log(ref[1]), abs=2 * 4.0 / BINS)


def test_quantile_with_q_plus_zero_unclips_every_positive_token_as_the_lower_rule_mirrors():
    g = torch.Generator().manual_seed(4)
    bf16 = 0.02 * torch.randn(16, 32, generator=g)  # no BF16 token near 1.28
    adv = torch.randn(16, generator=g)
    mask = torch.ones(16, 32, dtype=torch.bool)
    fp8 = bf16.clone()
    fp8[adv > 0, 0] = math.log(1.4)  # FP8 pushes one token per positive sequence past 1.28
    _, upper, stats = calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy="quantile", return_stats=True
    )
    assert stats["bf16_pos_upper_clipfrac"] == 0.0
    assert stats["fp8_pos_upper_clipfrac_nominal"] > 0.0
    assert 1.4 <= upper < 1.4 * math.exp(4.0 / BINS) + 1e-9
    assert exact_calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy="quantile"
    )[1] == pytest.approx(1.4)
    _, upper = calibrated_clip_bounds(bf16, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy="quantile")
    assert upper == pytest.approx(NOMINAL[1])  # nothing past nominal: nominal stays


def _shares(bf16, cal, nominal, bf16_pos=0.01, cal_pos=0.01, nominal_pos=0.01):
    return {
        "bf16_neg_lower_clipfrac": bf16,
        "fp8_neg_lower_clipfrac_calibrated": cal,
        "fp8_neg_lower_clipfrac_nominal": nominal,
        "bf16_pos_upper_clipfrac": bf16_pos,
        "fp8_pos_upper_clipfrac_calibrated": cal_pos,
        "fp8_pos_upper_clipfrac_nominal": nominal_pos,
    }


def test_invariant_violations_name_the_signs_calibration_made_worse():
    assert invariant_violations(_shares(0.01, 0.015, 0.03), 0.01) == []  # within tolerance
    assert invariant_violations(_shares(0.01, 0.05, 0.02), 0.01) == ["neg_lower"]
    # Past the tolerance but closer to BF16 than nominal: calibration helped, no violation.
    assert invariant_violations(_shares(0.01, 0.05, 0.08), 0.01) == []
    # The balance failure: 40% of the positive tokens clipped against BF16's 1%.
    got = invariant_violations(_shares(0.01, 0.01, 0.02, 0.01, 0.40, 0.012), 0.01)
    assert got == ["pos_upper"]
    nan = math.nan
    assert invariant_violations(_shares(nan, nan, nan, 0.01, 0.5, 0.01), 0.01) == ["pos_upper"]


def test_clip_shares_read_from_the_histogram_match_the_token_counts():
    g = torch.Generator().manual_seed(5)
    fp8, bf16, adv, mask = _random_batch(g)
    while not ((adv > 0).any() and (adv < 0).any()):
        fp8, bf16, adv, mask = _random_batch(g)
    packed = build_calibration_histogram(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    s = clip_shares(packed, 0.9, 1.1)
    assert (s["bf16_neg_lower_clipfrac"], s["bf16_pos_upper_clipfrac"]) == pytest.approx(
        exact_clip_shares(bf16, adv, mask, *NOMINAL)
    )
    assert (s["fp8_neg_lower_clipfrac_nominal"], s["fp8_pos_upper_clipfrac_nominal"]) == (
        pytest.approx(exact_clip_shares(fp8, adv, mask, *NOMINAL))
    )
    neg, pos = exact_clip_shares(fp8, adv, mask, 0.9, 1.1)
    assert s["fp8_neg_lower_clipfrac_calibrated"] == pytest.approx(
        neg, abs=_bin_share(fp8, adv, mask, 0.9, True) + 1e-12
    )
    assert s["fp8_pos_upper_clipfrac_calibrated"] == pytest.approx(
        pos, abs=_bin_share(fp8, adv, mask, 1.1, False) + 1e-12
    )
