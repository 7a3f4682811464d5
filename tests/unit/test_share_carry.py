"""scripts/share_carry.py: the share mode replayed on per-step shares, by hand."""

import pytest

from tests.scripts import load_script

sc = load_script("scripts/share_carry.py")


def test_a_steady_keep_fraction_carries_exactly():
    b, f = [0.01] * 40, [0.02] * 40
    for every, decay in [(1, 0.0), (20, 0.5), (5, 0.8)]:
        assert sc.replay(b, f, every, decay) == pytest.approx(0.0, abs=1e-15)


def test_a_falling_keep_fraction_carried_over_clips_more_than_bf16():
    # k(t) = b / f falls from 1 to 0.5 over 40 steps while FP8 clips 2%: a keep measured at a
    # calibration is too high until the next, so the carried share exceeds BF16's.
    f = [0.02] * 40
    b = [0.02 * (1 - 0.5 * t / 39) for t in range(40)]
    assert sc.replay(b, f, 1, 0.0) == pytest.approx(0.0, abs=1e-15)  # in-sample
    stale = sc.replay(b, f, 20, 0.0)
    # Steps 0-19 use k(0) = 1, steps 20-39 use k(20): the mean of (k(c) - k(t)) * f by hand.
    want = sum((b[0 if t < 20 else 20] / 0.02 - b[t] / 0.02) * 0.02 for t in range(40)) / 40
    assert stale == pytest.approx(want, rel=1e-12) and stale > 0
    assert sc.replay(b, f, 20, 0.5) > stale  # smoothing remembers older, higher keeps


def test_keep_fraction_and_trend_helpers():
    assert sc.keep_fraction(0.0, 0.0) == 1.0 and sc.keep_fraction(3.0, 2.0) == 1.0
    assert sc.keep_fraction(1.0, 4.0) == 0.25
    assert sc.slope_per_100([1.0, None, 3.0, 4.0]) == pytest.approx(100.0)
    assert sc.autocorrelation([1.0, 2.0, 1.0, 2.0, 1.0, 2.0], 2) == pytest.approx(1.0)


def test_a_pooled_keep_fraction_sums_every_calibration_by_hand():
    # Calibrations at steps 0 and 2 (every 2): pooled keep (0.01 + 0.03) / (0.02 + 0.04) = 2/3
    # from step 2 on; steps 0-1 carry step 0's 0.5.
    b, f = [0.01, 0.01, 0.03, 0.03], [0.02, 0.02, 0.04, 0.04]
    want = ((0.5 * 0.02 - 0.01) * 2 + (2 / 3 * 0.04 - 0.03) * 2) / 4
    assert sc.replay(b, f, 2, None) == pytest.approx(want, rel=1e-12)
    assert sc.replay([0.01] * 10, [0.02] * 10, 3, None) == pytest.approx(0.0, abs=1e-15)
