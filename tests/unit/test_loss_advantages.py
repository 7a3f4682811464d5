"""GRPO advantages and DAPO reward-side helpers against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    dynamic_sampling_keep_mask,
    grpo_advantages,
    overlong_reward_penalty,
)


def _hand_grpo(rewards, g, norm_std, unbiased, eps=1e-6):
    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        mean = sum(grp) / g
        var = sum((x - mean) ** 2 for x in grp) / (g - 1 if unbiased else g)
        for x in grp:
            out.append((x - mean) / (math.sqrt(var) + eps) if norm_std else x - mean)
    return out


@pytest.mark.parametrize("norm_std", [True, False])
@pytest.mark.parametrize("unbiased", [False, True])
def test_grpo_advantages_match_hand(norm_std, unbiased):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0]
    got = grpo_advantages(
        torch.tensor(rewards, dtype=torch.float64), 4, norm_std=norm_std, unbiased=unbiased
    )
    assert got.tolist() == pytest.approx(_hand_grpo(rewards, 4, norm_std, unbiased), rel=1e-12)
    assert got[4:8].abs().max().item() == 0.0  # identical rewards -> zero advantage


def test_grpo_group_of_one_is_zero_not_nan():
    got = grpo_advantages(torch.tensor([1.0, 0.0, 3.0]), 1)
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_grpo_bad_group_size_raises():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(10), 4)


def test_dynamic_sampling_drops_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert dynamic_sampling_keep_mask(rewards, 3).tolist() == [False, True, False]


def test_overlong_penalty_is_dapo_piecewise_linear():
    lengths = torch.tensor([0, 60, 80, 90, 100, 150])
    got = overlong_reward_penalty(lengths, max_len=100, buffer_len=20, penalty_factor=2.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -1.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_reward_penalty(lengths, max_len=100, buffer_len=200)
