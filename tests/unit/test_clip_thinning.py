"""Share-matched clipping (``loss/thinning.py``, ``loss.calib.mode=share``) against direct counts.

The property, over 1,000 random batches (bulk shifts of +-2%, noise, skewed advantages, empty
signs): keep fractions computed on a batch's calibration histogram, applied to the same batch, clip
in each row floor(keep * n + u) of its n tokens past the nominal bound (u its hash offset), so each
sign's count is BF16's (FP8's where that is smaller) to within the rows' rounding, and that
rounding is unbiased: summed over the batches the thinned count equals the target to within a few
standard deviations of the rounding noise. Rows decide alone: any split into micro-batches clips
the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    build_calibration_histogram,
    clip_shares,
    invariant_violations,
    keep_fraction,
    policy_loss,
    salt,
    share_counts,
    thinned_bounds,
    token_ratio,
)
from megatron_rl_fp8.loss.config import CalibConfig, PolicyLossConfig
from megatron_rl_fp8.trainer.calibrator import WINDOW_CAP, ClipCalibrator, pooled_counts

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


def _labels(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 53, x.shape, generator=gen)


def _clipped(x8, adv, mask, labels, keep, salt_):
    """(A<0 clipped, A>0 clipped) masks under the thinned per-row bounds."""
    r = token_ratio(x8, torch.zeros_like(x8), mask)
    low, high = thinned_bounds(
        r, adv, mask, labels, clip_low=LOW, clip_high=HIGH, keep=keep, salt_=salt_
    )
    a = adv[:, None]
    return mask & (a < 0) & (r < low), mask & (a > 0) & (r > high)


def test_thinned_clip_counts_are_bf16s_on_both_signs_over_1000_random_batches():
    gen = torch.Generator().manual_seed(0)
    thinned_any = 0
    err = {"neg": 0.0, "pos": 0.0}
    var = {"neg": 0.0, "pos": 0.0}
    for b in range(1000):
        x8, x16, adv, mask = _batch(gen)
        labels = _labels(x8, gen)
        packed = build_calibration_histogram(x8, x16, adv, mask, EPS_LOW, EPS_HIGH)
        bf16_neg, fp8_neg, bf16_pos, fp8_pos = share_counts(packed, 4096)
        keep = (keep_fraction(bf16_neg, fp8_neg), keep_fraction(bf16_pos, fp8_pos))
        neg, pos = _clipped(x8, adv, mask, labels, keep, salt(1, b, 1))
        r = token_ratio(x8, torch.zeros_like(x8), mask)
        for name, got, k, target, past in (
            ("neg", neg, keep[0], min(bf16_neg, fp8_neg), mask & (adv[:, None] < 0) & (r < LOW)),
            ("pos", pos, keep[1], min(bf16_pos, fp8_pos), mask & (adv[:, None] > 0) & (r > HIGH)),
        ):
            n_row = past.sum(dim=-1).double()
            per_row = got.sum(dim=-1).double()
            # Each row clips floor(keep * n + u) of its own past tokens: within one of keep * n.
            assert ((per_row - k * n_row).abs() < 1 + 1e-9).all(), name
            assert (got <= past).all(), name  # never a token the nominal bound leaves alone
            err[name] += float(per_row.sum()) - target
            frac = (k * n_row) % 1
            var[name] += float((frac * (1 - frac)).sum())
        thinned_any += keep[0] < 1 or keep[1] < 1
        # The invariant on the thinned shares, with the rows' rounding allowed for.
        shares = clip_shares(packed, LOW, HIGH)
        n_neg = int((mask & (adv[:, None] < 0)).sum())
        n_pos = int((mask & (adv[:, None] > 0)).sum())
        shares["fp8_neg_lower_clipfrac_calibrated"] = int(neg.sum()) / n_neg if n_neg else math.nan
        shares["fp8_pos_upper_clipfrac_calibrated"] = int(pos.sum()) / n_pos if n_pos else math.nan
        rows = x8.shape[0]
        assert not invariant_violations(shares, 0.01 + rows / max(min(n_neg, n_pos), 1))
    assert thinned_any > 500  # most batches had FP8 clip more than BF16 on some sign
    for name in err:  # unbiased: the summed error is within 4 standard deviations of 0
        assert abs(err[name]) <= 4 * math.sqrt(var[name]) + 1, (name, err[name], var[name])


def test_the_kept_clips_are_each_rows_most_extreme_and_lose_their_gradient():
    gen = torch.Generator().manual_seed(1)
    lp = (torch.randn(8, 16, generator=gen) * 0.3).requires_grad_()
    old, adv, mask = torch.zeros(8, 16), torch.tensor([-1.0, 1.0] * 4), torch.ones(8, 16)
    labels = _labels(lp, gen)
    r = token_ratio(lp, old, mask)
    neg = (adv < 0)[:, None].expand(8, 16)
    past = neg & (r < LOW)
    low, high = thinned_bounds(
        r, adv, mask, labels, clip_low=LOW, clip_high=HIGH, keep=(0.5, 1.0), salt_=3
    )
    assert low.shape == high.shape == (8, 1)
    kept = neg & (r < low)
    for row in range(8):
        if kept[row].any() and (past[row] & ~kept[row]).any():  # the lowest ratios stay clipped
            assert r[row][kept[row]].max() < r[row][past[row] & ~kept[row]].min()
    assert 0 < int(kept.sum()) < int(past.sum())
    assert torch.allclose(high, torch.tensor(HIGH))  # keep 1 leaves the nominal bound
    loss, m = policy_loss(lp, old, adv, mask, clip_low=low, clip_high=high)
    loss.backward()
    assert (lp.grad[kept] == 0).all() and (lp.grad[past & ~kept] != 0).all()
    assert float(m["pg_clipfrac_neg_lower"]) == pytest.approx(float(kept.sum() / neg.sum()))


def test_rows_decide_alone_so_any_micro_batch_split_or_trim_clips_the_same_tokens():
    gen = torch.Generator().manual_seed(2)
    x8, _, adv, mask = _batch(gen)
    x8, adv, mask = torch.cat([x8] * 3), torch.cat([adv] * 3), torch.cat([mask] * 3)
    labels = _labels(x8, gen)
    whole = _clipped(x8, adv, mask, labels, (0.4, 0.6), 11)
    for cut in (1, x8.shape[0] // 2, x8.shape[0] - 1):
        parts = [
            _clipped(x8[rows], adv[rows], mask[rows], labels[rows], (0.4, 0.6), 11)
            for rows in (slice(0, cut), slice(cut, None))
        ]
        for i in range(2):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[i]), cut
    # A micro-batch trimmed after its longest response gives each row the same offset.
    longest = int(mask.any(dim=0).nonzero().max()) + 1
    trimmed = _clipped(x8[:, :longest], adv, mask[:, :longest], labels[:, :longest], (0.4, 0.6), 11)
    assert torch.equal(trimmed[0], whole[0][:, :longest])


def test_rounding_is_unbiased_where_a_row_holds_one_clipped_token():
    """One A>0 token past the bound in each of 4,000 distinct rows, keep 0.3: about 30% stay
    clipped (binomial: 1,200 +- 4 sd of 29)."""
    gen = torch.Generator().manual_seed(4)
    r = torch.ones(4000, 4)
    r[:, 0] = 2.0
    labels = torch.randint(0, 53, (4000, 4), generator=gen)
    adv, mask = torch.ones(4000), torch.ones(4000, 4)
    _, high = thinned_bounds(
        r, adv, mask, labels, clip_low=LOW, clip_high=HIGH, keep=(1.0, 0.3), salt_=5
    )
    clipped = int((r[:, 0:1] > high).sum())
    assert abs(clipped - 1200) < 4 * 29, clipped


def test_keep_fraction_and_bad_inputs():
    assert keep_fraction(3, 12) == 0.25
    assert keep_fraction(5, 2) == 1.0  # never clips more than nominal
    assert keep_fraction(0, 0) == 1.0 and keep_fraction(0, 4) == 0.0
    one = torch.ones(2, 3)
    with pytest.raises(ValueError, match="keep_pos=1.5"):
        thinned_bounds(
            one, one[:, 0], one, one.long(), clip_low=LOW, clip_high=HIGH, keep=(1.0, 1.5), salt_=0
        )
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
    bounds, (kept, _), stats, violated = cal._share(packed, 1)
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
    _, (kept, _), _, _ = cal._share(packed, 2)
    assert kept[2] == pytest.approx(
        [0.5 * counts[0], 50 + 0.5 * counts[1], *(0.5 * c for c in counts[2:])]
    )
    assert kept[1] == counts
    # A smoothed history far from this batch: the A<0 sign falls back to nominal (keep 1), and the
    # next calibration's EMA keeps that calibration's ratio as it is.
    assert stats["bf16_neg_lower_clipfrac"] > 0.02  # so that clipping nothing breaks it
    cal.kept = {1: [0.0, 1000.0, counts[2], counts[3]]}
    _, (kept2, _), stats2, violated2 = cal._share(packed, 1)
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


def test_the_salt_follows_seed_step_and_position():
    cal = _calibrator()
    keep, a = cal.share(1, seed=1, step=5)
    assert keep == (1.0, 1.0) and a == cal.share(1, seed=1, step=5)[1]
    assert len({a, cal.share(1, seed=1, step=6)[1], cal.share(2, seed=1, step=5)[1]}) == 3
    assert a != cal.share(1, seed=2, step=5)[1]


def test_a_calibration_where_fp8_clips_nothing_keeps_the_fraction_it_had():
    """No FP8 clip of a sign on the calibration batch is no evidence: that sign's counts (and
    keep fraction) stay, where they used to reset to keep 1 without the EMA."""
    cal = _calibrator()
    cal.loss_cfg.calib.ema_decay = 0.0
    gen = torch.Generator().manual_seed(3)
    x16 = torch.randn(32, 16, generator=gen) * 0.3
    adv, mask = torch.tensor([-1.0, 1.0] * 16), torch.ones(32, 16, dtype=torch.bool)
    informative = build_calibration_histogram(x16 - 0.1, x16, adv, mask, EPS_LOW, EPS_HIGH)
    _, (cal.kept, _), first, _ = cal._share(informative, 1)
    assert 0 < first["keep_neg_lower"] < 1
    quiet = torch.zeros(32, 16)  # ratio 1 everywhere: nothing past either bound
    _, (kept, _), stats, violated = cal._share(
        build_calibration_histogram(quiet, quiet, adv, mask, EPS_LOW, EPS_HIGH), 1
    )
    assert not violated and kept == cal.kept
    assert stats["keep_neg_lower"] == first["keep_neg_lower"]
    assert stats["keep_pos_upper"] == first["keep_pos_upper"]


def test_a_share_run_resumed_from_calibrated_bounds_clips_at_the_nominal_ones():
    """A run saved under ``mode: calibrate`` (the default before 2026-12-07) and resumed under the
    share mode keeps its calibration count but not its bounds: the share mode thins the nominal
    clip set, and the bounds it carried would clip with both until the next calibration."""
    state = {"lower": 0.7, "upper": 1.4, "count": 3, "requested": False}
    cal = _calibrator()
    cal.load_state_dict(state)
    assert (cal.lower, cal.upper) == pytest.approx((LOW, HIGH)) and cal.count == 3
    assert cal.keep() == (1.0, 1.0)  # no fractions carried: the whole clip set until calibrated


def test_pooled_counts_go_back_until_fp8_reaches_the_minimum_per_sign():
    # Newest first: (BF16 A<0, FP8 A<0, BF16 A>0, FP8 A>0) of three calibrations.
    window = [[5.0, 9.0, 1.0, 0.0], [4.0, 6.0, 0.0, 2.0], [7.0, 7.0, 3.0, 3.0]]
    # A<0 stops at the newest (9 >= 4); A>0 needs the first two (0, then 2 < 4) and the third.
    assert pooled_counts(window, 4) == [5.0, 9.0, 4.0, 5.0]
    # A minimum never reached sums the whole window; 1 stops at the first FP8 clip.
    assert pooled_counts(window, 100) == [16.0, 22.0, 4.0, 5.0]
    assert pooled_counts(window, 1) == [5.0, 9.0, 1.0, 2.0]
    # BF16 past FP8's pooled count is cut to it: this position cannot clip more than FP8 holds.
    assert pooled_counts([[5.0, 2.0, 3.0, 0.0], [1.0, 0.0, 1.0, 2.0]], 2) == [2.0, 2.0, 2.0, 2.0]


def _pooling_calibrator(min_tokens: int = 4):
    calib = CalibConfig(mode="share", ema_decay=0.0, share_min_tokens=min_tokens)
    return ClipCalibrator(PolicyLossConfig(eps_high=EPS_HIGH, calib=calib), fp8_training=True)


def test_a_pooling_calibration_counts_bf16_clips_where_fp8_clipped_none():
    """share_min_tokens: the batch where only BF16 clipped an A>0 token counts (the no-evidence
    rule passes over it); the window and the counts travel in checkpoints; a violated sign
    starts its pooling afresh."""
    gen = torch.Generator().manual_seed(3)
    x16 = torch.randn(32, 16, generator=gen) * 0.3
    adv, mask = torch.tensor([-1.0, 1.0] * 16), torch.ones(32, 16, dtype=torch.bool)
    # FP8 ratios pushed out on both signs (down for A<0 rows, up for A>0): FP8 clips more of each.
    x8 = x16 + 0.1 * adv[:, None]
    first = build_calibration_histogram(x8, x16, adv, mask, EPS_LOW, EPS_HIGH)
    c1 = share_counts(first, 4096)
    assert c1[1] >= 4 and 0 < c1[3] < 4 * 32  # both signs clipped; A<0 past the minimum
    # BF16 clips one A>0 token, FP8 none (its ratio 1), nothing of A<0.
    x16b, x8b = torch.zeros(32, 16), torch.zeros(32, 16)
    x16b[1, 0] = 1.0
    second = build_calibration_histogram(x8b, x16b, adv, mask, EPS_LOW, EPS_HIGH)
    assert share_counts(second, 4096) == [0.0, 0.0, 1.0, 0.0]
    cal = _pooling_calibrator(min_tokens=int(c1[3]) + 1)  # A>0 never reaches it: pools both
    _, (cal.kept, cal.window), _, _ = cal._share(first, 1)
    _, (kept, window), stats, violated = cal._share(second, 1)
    assert not violated and window[1] == [[0.0, 0.0, 1.0, 0.0], c1]
    # A<0: the newest batch has no FP8 clip, so the older one counts too; A>0: both, BF16's
    # extra token included, up to FP8's count.
    assert c1[2] + 1.0 < c1[3]
    assert kept[1] == [c1[0], c1[1], c1[2] + 1.0, c1[3]]
    assert stats["keep_pos_upper"] == pytest.approx((c1[2] + 1.0) / c1[3])
    cal.kept, cal.window = kept, window
    restored = _pooling_calibrator(min_tokens=int(c1[3]) + 1)
    restored.load_state_dict(cal.state_dict())
    assert (restored.kept, restored.window) == (cal.kept, cal.window)
    # A history far from the batch, pooled (a minimum the batch alone does not reach), breaks
    # A<0's invariant: the counts and the whole window of that sign are zeroed, so the next
    # calibration pools that batch alone.
    cal.loss_cfg.calib.share_min_tokens = 10**6
    cal.window = {1: [[0.0, 1000.0, 0.0, 0.0]]}
    cal.kept = {1: [0.0, 1000.0, 0.0, 0.0]}
    _, (kept, window), stats, violated = cal._share(first, 1)
    assert "neg_lower" in violated and stats["keep_neg_lower"] == 1.0
    assert all(c[:2] == [0.0, 0.0] for c in window[1])
    cal.kept, cal.window = kept, window
    _, (kept, _), _, _ = cal._share(first, 1)
    assert kept[1][:2] == c1[:2]


def test_the_window_is_capped_and_pooling_refuses_an_ema():
    cal = _pooling_calibrator(min_tokens=10**9)
    quiet = torch.zeros(4, 4)
    adv, mask = torch.tensor([-1.0, 1.0] * 2), torch.ones(4, 4, dtype=torch.bool)
    packed = build_calibration_histogram(quiet, quiet, adv, mask, EPS_LOW, EPS_HIGH)
    for _ in range(WINDOW_CAP + 5):
        _, (cal.kept, cal.window), _, _ = cal._share(packed, 2)
    assert len(cal.window[2]) == WINDOW_CAP
    with pytest.raises(ValueError, match="share_min_tokens=4 pools calibrations.*ema_decay=0.5"):
        CalibConfig(share_min_tokens=4, ema_decay=0.5)
    with pytest.raises(ValueError, match="share_min_tokens=2 pools the share mode's.*'oracle'"):
        CalibConfig(share_min_tokens=2, mode="oracle")
    with pytest.raises(ValueError, match="share_min_tokens=-1 must be >= 0"):
        CalibConfig(share_min_tokens=-1)
