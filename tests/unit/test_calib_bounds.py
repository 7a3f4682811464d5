"""Calibrated clip bounds: the constructed FP8-bias case, the exact reference, and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    CalibConfig,
    bounds_from_histogram,
    build_calibration_histogram,
    calibrated_clip_bounds,
    ema_bounds,
)
from megatron_rl_fp8.loss.exact import exact_calibrated_clip_bounds

EPS_LOW, EPS_HIGH = 0.2, 0.28
BIN_WIDTH = 4.0 / 4096


def _fp8_biased_batch(b: int = 128, t: int = 512, seed: int = 0, bias: float = -0.05):
    """BF16 log ratios, and FP8 = BF16 + noise with a bias (negative by default) on the
    negative-advantage tokens."""
    g = torch.Generator().manual_seed(seed)
    bf16 = 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.9
    neg = (adv < 0)[:, None].expand(b, t)
    fp8 = bf16 + 0.05 * torch.randn(b, t, generator=g) + bias * neg
    return fp8, bf16, adv, mask


def _exact_stats(log_ratio, adv, mask, lower, upper):
    """Lower-clip share of negative tokens and the balance, counted token by token (float64)."""
    a = adv[:, None].expand_as(log_ratio)[mask].double()
    x = log_ratio[mask].double()
    r = torch.exp(x)
    neg, pos = a < 0, a > 0
    share = (neg & (x < math.log(lower))).sum().item() / neg.sum().item()
    num = (a.abs() * r)[pos & (x <= math.log(upper))].sum().item()
    den = (a.abs() * r)[neg & (x >= math.log(lower))].sum().item()
    return share, num / den


def test_calibration_restores_bf16_clip_share_and_widens_to_the_balance():
    # FP8 ratios of negative tokens shifted up in bulk: more negative update mass than BF16's, so
    # the balance asks for a wider upper bound, which it gets.
    fp8, bf16, adv, mask = _fp8_biased_batch(bias=+0.005)
    nominal = (1 - EPS_LOW, 1 + EPS_HIGH)
    bf16_share, bf16_balance = _exact_stats(bf16, adv, mask, *nominal)
    lower, upper, stats = calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, return_stats=True
    )
    assert upper > nominal[1]
    fp8_share, fp8_balance = _exact_stats(fp8, adv, mask, lower, upper)
    assert fp8_share == pytest.approx(bf16_share, rel=0.05)
    assert fp8_balance == pytest.approx(bf16_balance, rel=0.01)
    assert stats["bf16_balance"] == pytest.approx(bf16_balance, rel=1e-6)
    assert stats["fp8_balance_calibrated"] == pytest.approx(bf16_balance, rel=1e-6)


def test_calibration_restores_bf16_clip_share_and_never_tightens_the_upper_bound():
    fp8, bf16, adv, mask = _fp8_biased_batch()
    nominal = (1 - EPS_LOW, 1 + EPS_HIGH)
    bf16_share, bf16_balance = _exact_stats(bf16, adv, mask, *nominal)
    fp8_share_nominal, _ = _exact_stats(fp8, adv, mask, *nominal)
    assert fp8_share_nominal > 2 * bf16_share > 0  # the FP8 failure mode is visible

    lower, upper, stats = calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, return_stats=True
    )
    assert lower < nominal[0]
    fp8_share, fp8_balance = _exact_stats(fp8, adv, mask, lower, upper)
    assert fp8_share == pytest.approx(bf16_share, rel=0.05)
    # The downward bias shrinks FP8's negative mass (the balance rises above BF16's), so the
    # paper's rule would tighten the upper bound below nominal: the floor holds it there.
    assert upper == nominal[1]
    assert fp8_balance > bf16_balance

    assert stats["bf16_neg_lower_clipfrac"] == pytest.approx(bf16_share, rel=1e-6)
    assert stats["fp8_neg_lower_clipfrac_nominal"] == pytest.approx(fp8_share_nominal, rel=1e-6)
    assert stats["fp8_neg_lower_clipfrac_calibrated"] == pytest.approx(bf16_share, rel=1e-6)
    assert stats["bf16_balance"] == pytest.approx(bf16_balance, rel=1e-6)
    assert stats["hist_bytes"] == 8 * (4 * 4096 + 9)


@pytest.mark.parametrize("strategy", ["balance", "quantile", "shift", "lower_only"])
def test_histogram_bounds_agree_with_exact_reference(strategy):
    fp8, bf16, adv, mask = _fp8_biased_batch(seed=1)
    lower, upper = calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy=strategy
    )
    ref_lower, ref_upper = exact_calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, strategy=strategy
    )
    assert math.log(lower) == pytest.approx(math.log(ref_lower), abs=BIN_WIDTH)
    assert math.log(upper) == pytest.approx(math.log(ref_upper), abs=2 * BIN_WIDTH)
    if strategy == "shift":
        width = math.log((1 + EPS_HIGH) / (1 - EPS_LOW))
        assert math.log(upper) - math.log(lower) == pytest.approx(width, rel=1e-12)
    if strategy == "lower_only":  # the ablation: the lower bound calibrated, the upper nominal
        assert upper == 1 + EPS_HIGH and lower < 1 - EPS_LOW


def test_masked_and_zero_advantage_tokens_are_ignored():
    fp8, bf16, adv, mask = _fp8_biased_batch(b=32, t=256)
    base = calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    junk_fp8 = torch.full((8, 256), -5.0)
    junk_fp8[4:] = float("nan")  # padding may hold NaN
    extra_mask = torch.zeros(8, 256, dtype=torch.bool)
    extra_mask[:4] = True  # response tokens, but with zero advantage
    got = calibrated_clip_bounds(
        torch.cat([fp8, junk_fp8]),
        torch.cat([bf16, junk_fp8]),
        torch.cat([adv, torch.zeros(8)]),
        torch.cat([mask, extra_mask]),
        EPS_LOW,
        EPS_HIGH,
    )
    assert got == base


def test_hist_bytes_do_not_depend_on_token_count():
    sizes = set()
    for b in (4, 64):
        fp8, bf16, adv, mask = _fp8_biased_batch(b=b, t=128)
        sizes.add(
            calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, return_stats=True)[2][
                "hist_bytes"
            ]
        )
    assert sizes == {8 * (4 * 4096 + 9)}


def test_no_negative_tokens_gives_nominal_bounds():
    fp8, bf16, adv, mask = _fp8_biased_batch(b=16, t=64)
    adv = adv.abs() + 0.1
    lower, upper = calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    assert (lower, upper) == pytest.approx((1 - EPS_LOW, 1 + EPS_HIGH))
    assert exact_calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH) == pytest.approx(
        (1 - EPS_LOW, 1 + EPS_HIGH)
    )


def test_no_positive_tokens_keeps_nominal_upper():
    fp8, bf16, adv, mask = _fp8_biased_batch(b=16, t=64)
    lower, upper = calibrated_clip_bounds(fp8, bf16, -adv.abs() - 0.1, mask, EPS_LOW, EPS_HIGH)
    assert lower < 1 - EPS_LOW
    assert upper == pytest.approx(1 + EPS_HIGH)


def test_q_zero_loosens_lower_just_enough_to_clip_nothing():
    g = torch.Generator().manual_seed(2)
    bf16 = 0.02 * torch.randn(16, 64, generator=g)  # no BF16 token near the lower bound
    adv = torch.randn(16, generator=g)
    mask = torch.ones(16, 64, dtype=torch.bool)
    fp8 = bf16.clone()
    fp8[adv < 0, 0] = math.log(0.7)  # FP8 pushes one token per negative sequence below 0.8
    lower, _, stats = calibrated_clip_bounds(
        fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, return_stats=True
    )
    assert stats["bf16_neg_lower_clipfrac"] == 0.0
    assert stats["fp8_neg_lower_clipfrac_nominal"] > 0.0
    assert 0.7 - 1e-3 < lower <= 0.7
    assert exact_calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)[
        0
    ] == pytest.approx(0.7)
    # Without FP8 tokens below the nominal bound either, the nominal bound stays.
    lower, _ = calibrated_clip_bounds(bf16, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    assert lower == pytest.approx(1 - EPS_LOW)


def test_safety_limits_clamp_and_unreachable_balance_unclips_every_positive_token():
    fp8, bf16, adv, mask = _fp8_biased_batch(b=32, t=256)
    neg = (adv < 0)[:, None].expand_as(fp8)
    # A huge FP8 bias on negative tokens would push the lower bound far below 0.5.
    lower, _ = calibrated_clip_bounds(fp8 - 1.0 * neg, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    assert lower == 0.5
    # FP8 positive ratios far smaller than BF16's: no upper bound reaches the BF16 balance. The
    # answer unclips every positive token (never below nominal) instead of jumping to the limit.
    shifted = fp8 - 1.5 * ~neg
    pos_max = math.exp(float(shifted[(adv > 0)[:, None].expand_as(fp8) & mask.bool()].max()))
    _, upper = calibrated_clip_bounds(
        shifted, bf16, adv, mask, EPS_LOW, EPS_HIGH, upper_limits=(1.01, 1.6)
    )
    assert upper == 1 + EPS_HIGH and pos_max < upper
    assert (
        exact_calibrated_clip_bounds(
            shifted, bf16, adv, mask, EPS_LOW, EPS_HIGH, upper_limits=(1.01, 1.6)
        )[1]
        == 1 + EPS_HIGH
    )
    # Positive ratios spread past nominal (x2), negative ones inflated (+1 in log) so the BF16
    # balance is out of reach: the bound is the bin edge just above the largest positive ratio.
    pos_t = (adv > 0)[:, None].expand_as(fp8) & mask.bool()
    spread = torch.where(neg, bf16 + 1.0, 2 * bf16)
    pos_max = math.exp(float(spread[pos_t].max()))
    assert 1 + EPS_HIGH < pos_max < 3.0
    _, upper = calibrated_clip_bounds(spread, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    exact = exact_calibrated_clip_bounds(spread, bf16, adv, mask, EPS_LOW, EPS_HIGH)[1]
    assert exact == pytest.approx(pos_max)
    bin_width = 4.0 / 4096
    assert pos_max <= upper <= pos_max * math.exp(bin_width) * (1 + 1e-9)


def test_out_of_range_tokens_are_counted_not_dropped():
    fp8, bf16, adv, mask = _fp8_biased_batch(b=8, t=64)
    fp8[0, :] = 10.0
    packed = build_calibration_histogram(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH)
    _, _, stats = bounds_from_histogram(packed, EPS_LOW, EPS_HIGH)
    n_valid = mask.sum().item()
    assert stats["num_neg_tokens"] + stats["num_pos_tokens"] == n_valid
    assert stats["fp8_out_of_range_frac"] == pytest.approx(mask[0].sum().item() / n_valid)
    with pytest.raises(ValueError, match="bins"):
        bounds_from_histogram(packed, EPS_LOW, EPS_HIGH, bins=1024)


def test_calib_config_validation_and_solver_kwargs():
    cfg = CalibConfig(strategy="shift", bins=1024, lower_limits=[0.6, 0.95])
    assert cfg.lower_limits == (0.6, 0.95)
    fp8, bf16, adv, mask = _fp8_biased_batch(b=8, t=64)
    got = calibrated_clip_bounds(fp8, bf16, adv, mask, EPS_LOW, EPS_HIGH, **cfg.solver_kwargs())
    assert math.log(got[1] / got[0]) == pytest.approx(math.log(1.28 / 0.8))
    for kwargs, name in [
        ({"interval": 0}, "interval"),
        ({"strategy": "median"}, "strategy"),
        ({"mode": "always"}, "mode"),
        ({"invariant_tolerance": 0.0}, "invariant_tolerance"),
        ({"bins": 4}, "bins"),
        ({"log_ratio_range": (0.5, 2.0)}, "log_ratio_range"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"lower_limits": (0.9, 1.2)}, "lower_limits"),
        ({"upper_limits": (0.9, 1.2)}, "upper_limits"),
        ({"log_ratio_range": (-0.5, 2.0)}, "log_ratio_range"),
        # Off, no shadow runs: an "oracle" arm was silently nominal FP8 in a study.
        ({"mode": "oracle", "enabled": False}, "mode='oracle' needs enabled=true"),
    ]:
        with pytest.raises(ValueError, match=f"CalibConfig.{name}"):
            CalibConfig(**kwargs)
    with pytest.raises(ValueError, match="eps_low"):
        calibrated_clip_bounds(fp8, bf16, adv, mask, 1.2, EPS_HIGH)


def test_ema_bounds():
    assert ema_bounds(None, (0.7, 1.3), 0.9) == (0.7, 1.3)
    assert ema_bounds((0.8, 1.2), (0.6, 1.4), 0.5) == pytest.approx((0.7, 1.3))
    assert ema_bounds((0.8, 1.2), (0.6, 1.4), 0.0) == pytest.approx((0.6, 1.4))
