"""Share-matched clipping (``loss/thinning.py``, ``loss.calib.mode=share``) against direct counts.

The property: keep fractions computed on a batch's calibration histogram, applied to the same batch
split into micro-batches, clip each sign's BF16 count at the nominal bounds (FP8's where that is
smaller), to within the one token the float rounding of ``keep * n`` may move, over 1,000 random
batches (bulk shifts of +-2%, noise, skewed advantages, empty signs).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    ClipThinner,
    build_calibration_histogram,
    clip_shares,
    invariant_violations,
    keep_fraction,
    policy_loss,
    share_counts,
    token_ratio,
)
from megatron_rl_fp8.loss.calib_config import CalibConfig
from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
from megatron_rl_fp8.trainer.config import PolicyLossConfig

EPS_LOW, EPS_HIGH = 0.2, 0.28
LOW, HIGH = 1 - EPS_LOW, 1 + EPS_HIGH


def _batch(gen: torch.Generator):
    b, t = (
        int(torch.randint(4, 40, (1,), generator=gen)),
        int(torch.randint(1, 24, (1,), generator=gen)),
    )
    spread = float(torch.rand((), generator=gen)) * 0.4
    x16 = torch.randn(b, t, generator=gen, dtype=torch.float64) * spread
    shift = float(torch.rand((), generator=gen)) * 0.04 - 0.02  # a bulk shift of +-2%
    noise = float(torch.rand((), generator=gen)) * 0.2
    x8 = x16 + math.log1p(shift) + torch.randn(b, t, generator=gen, dtype=torch.float64) * noise
    skew = float(torch.rand((), generator=gen))
    adv = torch.randn(b, generator=gen, dtype=torch.float64) + (skew - 0.5) * 2
    case = int(torch.randint(0, 4, (1,), generator=gen))
    if case == 1:
        adv = adv.abs() + 0.1  # no A<0 token
    elif case == 2:
        adv = -adv.abs() - 0.1  # no A>0 token
    mask = torch.rand(b, t, generator=gen) < 0.9
    return x8.float(), x16.float(), adv.float(), mask


def _thinned_counts(x8, adv, mask, keep, gen):
    """(A<0 clipped, A>0 clipped) over the batch split into random micro-batches."""
    offsets = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
    thinner = ClipThinner(keep, (offsets[0], offsets[1]))
    cuts = sorted(set(torch.randint(1, x8.shape[0], (3,), generator=gen).tolist()))
    neg = pos = 0
    for rows in torch.tensor_split(torch.arange(x8.shape[0]), cuts):
        r = token_ratio(x8[rows], torch.zeros_like(x8[rows]), mask[rows])
        a, m = adv[rows], mask[rows]
        low, high = thinner.bounds(r, a, m, LOW, HIGH)
        neg += int((m & (a[:, None] < 0) & (r < low)).sum())
        pos += int((m & (a[:, None] > 0) & (r > high)).sum())
    return neg, pos


def test_thinned_clip_counts_are_bf16s_on_both_signs_over_1000_random_batches():
    gen = torch.Generator().manual_seed(0)
    thinned_any = 0
    for _ in range(1000):
        x8, x16, adv, mask = _batch(gen)
        packed = build_calibration_histogram(x8, x16, adv, mask, EPS_LOW, EPS_HIGH)
        bf16_neg, fp8_neg, bf16_pos, fp8_pos = share_counts(packed, 4096)
        keep = (keep_fraction(bf16_neg, fp8_neg), keep_fraction(bf16_pos, fp8_pos))
        neg, pos = _thinned_counts(x8, adv, mask, keep, gen)
        assert abs(neg - min(bf16_neg, fp8_neg)) <= 1, (neg, bf16_neg, fp8_neg)
        assert abs(pos - min(bf16_pos, fp8_pos)) <= 1, (pos, bf16_pos, fp8_pos)
        thinned_any += keep[0] < 1 or keep[1] < 1
        # The invariant on the thinned shares: never a violation.
        shares = clip_shares(packed, LOW, HIGH)
        n_neg = int((mask & (adv[:, None] < 0)).sum())
        n_pos = int((mask & (adv[:, None] > 0)).sum())
        shares["fp8_neg_lower_clipfrac_calibrated"] = neg / n_neg if n_neg else math.nan
        shares["fp8_pos_upper_clipfrac_calibrated"] = pos / n_pos if n_pos else math.nan
        assert not invariant_violations(shares, 0.01 + 1.0 / max(min(n_neg, n_pos), 1))
    assert thinned_any > 500  # most batches had FP8 clip more than BF16 on some sign


def test_the_kept_clips_are_the_most_extreme_ratios_and_lose_their_gradient():
    gen = torch.Generator().manual_seed(1)
    lp = (torch.randn(8, 16, generator=gen) * 0.3).requires_grad_()
    old, adv, mask = torch.zeros(8, 16), torch.tensor([-1.0, 1.0] * 4), torch.ones(8, 16)
    r = token_ratio(lp, old, mask)
    neg = (adv < 0)[:, None].expand(8, 16)
    past = neg & (r < LOW)
    low, high = ClipThinner((0.5, 1.0), (0.0, 0.0)).bounds(r, adv, mask, LOW, HIGH)
    kept = neg & (r < low)
    assert int(kept.sum()) == int(past.sum()) // 2
    assert r[kept].max() < r[past & ~kept].min()  # the lowest ratios stay clipped
    assert float(high) == pytest.approx(HIGH)  # keep 1 leaves the nominal bound (in float32)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=low, clip_high=high)
    loss.backward()
    assert (lp.grad[kept] == 0).all() and (lp.grad[past & ~kept] != 0).all()
    assert float(m["pg_clipfrac_neg_lower"]) == pytest.approx(float(kept.sum() / neg.sum()))


def test_rounding_is_unbiased_where_a_micro_batch_holds_under_one_clipped_token():
    """One token past the bound per micro-batch, keep 0.3: over seeded offsets it stays clipped
    in 30% of the micro-batches (the carry makes it exact over every run of 10)."""
    r = torch.tensor([[2.0, 1.0]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    gen = torch.Generator().manual_seed(2)
    clipped = 0
    for _ in range(100):
        thinner = ClipThinner((1.0, 0.3), tuple(torch.rand(2, generator=gen).tolist()))
        for _ in range(10):
            _, high = thinner.bounds(r, adv, mask, LOW, HIGH)
            clipped += int(r[0, 0] > high)
    assert clipped == 300


def test_keep_fraction_and_bad_keeps():
    assert keep_fraction(3, 12) == 0.25
    assert keep_fraction(5, 2) == 1.0  # never clips more than nominal
    assert keep_fraction(0, 0) == 1.0 and keep_fraction(0, 4) == 0.0
    with pytest.raises(ValueError, match="keep_pos=1.5"):
        ClipThinner((1.0, 1.5), (0.0, 0.0))
    with pytest.raises(ValueError, match="mode='shares'.*'share'"):
        CalibConfig(mode="shares")


def _calibrator():
    cfg = PolicyLossConfig(eps_high=EPS_HIGH, calib=CalibConfig(mode="share", ema_decay=0.5))
    return ClipCalibrator(cfg, fp8_training=True)


def test_share_calibration_smooths_counts_pools_positions_and_falls_back_on_a_violation():
    cal = _calibrator()
    assert cal.keep() == (1.0, 1.0)  # nothing calibrated yet: the nominal clip set
    gen = torch.Generator().manual_seed(3)
    x16 = torch.randn(32, 16, generator=gen) * 0.3  # BF16 clips ~23% of each sign
    x8 = x16 - 0.1  # FP8 ratios shifted low: more A<0 clips than BF16
    adv, mask = torch.tensor([-1.0, 1.0] * 16), torch.ones(32, 16, dtype=torch.bool)
    packed = build_calibration_histogram(x8, x16, adv, mask, EPS_LOW, EPS_HIGH)
    counts = share_counts(packed, 4096)
    bounds, kept, stats, violated = cal._share(packed, 1)
    assert bounds == pytest.approx((LOW, HIGH)) and not violated and kept == {1: counts}
    assert stats["fp8_neg_lower_clipfrac_calibrated"] == pytest.approx(
        stats["bf16_neg_lower_clipfrac"]
    )
    assert 0 < stats["keep_neg_lower"] < 1
    cal.kept = kept
    assert cal.keep() == (stats["keep_neg_lower"], stats["keep_pos_upper"])
    # A second position pools its counts with the first; the EMA is per position.
    cal.kept[2] = [0.0, 100.0, 0.0, 0.0]
    assert cal.keep()[0] == pytest.approx(counts[0] / (counts[1] + 100.0))
    _, kept, _, _ = cal._share(packed, 2)
    assert kept[2] == pytest.approx(
        [0.5 * counts[0], 50 + 0.5 * counts[1], *(0.5 * c for c in counts[2:])]
    )
    assert kept[1] == counts
    # A smoothed history far from this batch: the A<0 sign falls back to nominal (keep 1), and the
    # next calibration's EMA keeps that calibration's ratio as it is.
    assert stats["bf16_neg_lower_clipfrac"] > 0.02  # so that clipping nothing breaks it
    cal.kept = {1: [0.0, 1000.0, counts[2], counts[3]]}
    _, kept2, stats2, violated2 = cal._share(packed, 1)
    assert violated2 == ["neg_lower"] and stats2["keep_neg_lower"] == 1.0
    # What broke it is reported: the smoothed fraction's share, more than 0.01 below BF16's.
    assert stats2["fp8_neg_lower_clipfrac_calibrated"] < stats["bf16_neg_lower_clipfrac"] - 0.01
    assert cal.kept[1][:2] == [0.0, 1000.0]  # the state changes only when the result is applied
    cal.kept = kept2
    _, _, stats3, _ = cal._share(packed, 1)
    assert stats3["keep_neg_lower"] == pytest.approx(stats["keep_neg_lower"])
    # Checkpoints carry the counts; an older state without them loads as never calibrated.
    restored = _calibrator()
    restored.load_state_dict(cal.state_dict())
    assert restored.kept == cal.kept
    old = {k: v for k, v in cal.state_dict().items() if k != "kept"}
    restored.load_state_dict(old)
    assert restored.kept == {}


def test_thinner_offsets_follow_seed_step_position_and_rank():
    cal = _calibrator()
    a = cal.thinner(1, seed=1, step=5, rank=0).carry
    assert [float(x) for x in a] == [float(x) for x in cal.thinner(1, seed=1, step=5, rank=0).carry]
    assert [float(x) for x in a] != [float(x) for x in cal.thinner(1, seed=1, step=6, rank=0).carry]
    assert [float(x) for x in a] != [float(x) for x in cal.thinner(1, seed=1, step=5, rank=1).carry]
