"""Per-step monitoring metrics: garbled-output shares, importance-ratio quantiles and outliers."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import policy_loss
from megatron_rl_fp8.metrics.accumulator import MetricAccumulator
from megatron_rl_fp8.metrics.garbled import garbled_stats, is_repetitive
from megatron_rl_fp8.metrics.ratios import BINS, LOG_RATIO_RANGE, log_ratio_histogram, ratio_stats
from megatron_rl_fp8.reward.verifiers import arithmetic_format


def test_garbled_signs_and_their_union():
    texts = ["42<eos>", "4\ufffd2", "1 1 1 1 1 1 1 1", "no number here", "17"]
    ids = [[5, 6, 2], [5, 9, 6], [1, 0] * 4, [7, 8, 9, 10, 11, 12], [1, 7]]
    stats = garbled_stats(texts, ids, arithmetic_format)
    assert stats == {
        "rollout/undecodable_frac": 1 / 5,
        "rollout/repetitive_frac": 1 / 5,
        "rollout/no_answer_frac": 3 / 5,  # the undecodable, the repetitive and the wordy one
        "rollout/garbled_frac": 3 / 5,
    }
    assert "rollout/no_answer_frac" not in garbled_stats(texts, ids, None)
    assert garbled_stats([], []) == {}


def test_repetition_needs_enough_ngrams():
    assert not is_repetitive([1, 2, 1, 2, 1])  # shorter than 2n: too short to call a loop
    assert not is_repetitive([1, 2, 1, 2, 1, 2])  # 4 trigrams, 2 distinct: exactly half
    assert is_repetitive([1, 2, 1, 2, 1, 2, 1])  # 5 trigrams, 2 distinct
    assert not is_repetitive([1, 2, 3, 4, 5, 6])


def test_ratio_quantiles_match_exact_quantiles_within_one_bin():
    gen = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(4, 500, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(4, 500, generator=gen) > 0.2
    # Two "ranks" histogram their halves; the sum is what the DP all-reduce produces.
    hist = log_ratio_histogram(log_ratio[:2], mask[:2]) + log_ratio_histogram(
        log_ratio[2:], mask[2:]
    )
    assert hist.sum() == mask.sum()
    stats = ratio_stats(hist)
    values = log_ratio[mask]
    width = (LOG_RATIO_RANGE[1] - LOG_RATIO_RANGE[0]) / BINS
    for name, q in (("ratio_p01", 0.01), ("ratio_p50", 0.5), ("ratio_p99", 0.99)):
        exact = torch.quantile(values, q).item()
        assert abs(math.log(stats[name]) - exact) <= width
    assert ratio_stats(torch.zeros(BINS)) == {}


def test_outlier_shares_in_the_policy_loss():
    old = torch.zeros(1, 5)
    new = torch.log(torch.tensor([[3.0, 0.4, 1.0, 1.5, 2.5]]))
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    _, m = policy_loss(new, old, torch.ones(1), mask, clip_low=0.8, clip_high=1.2)
    assert m["ratio_above_2"].item() == pytest.approx(1 / 4)  # 2.5 is padding
    assert m["ratio_below_half"].item() == pytest.approx(1 / 4)


def test_accumulator_vectors_sum_and_stay_separate_from_scalars():
    acc = MetricAccumulator()
    acc.add("n", 2.0)
    acc.add_vector("h", torch.tensor([1.0, 0.0]))
    acc.add_vector("h", torch.tensor([0.5, 2.0]))
    totals = acc.reduce()
    assert totals.sums == {"n": 2.0} and totals.vectors["h"].tolist() == [1.5, 2.0]
