"""Calibrated clip bounds over 2 real gloo ranks equal the single-process bounds on all the data."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.loss import calibrated_clip_bounds
from tests.dist_utils import run_distributed

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _data(b: int = 64, t: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bf16 = 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.9
    fp8 = bf16 + 0.05 * torch.randn(b, t, generator=g) - 0.05 * (adv < 0)[:, None]
    return fp8, bf16, adv, mask


# (strategy, rows on rank 0)
CASES = [("balance", 32), ("quantile", 32), ("shift", 32), ("balance", 7)]


def _calibrate_on_shards(rank, world_size, data, cases):
    import torch.distributed as dist

    fp8, bf16, adv, mask = data
    out = []
    for strategy, split in cases:
        shard = slice(0, split) if rank == 0 else slice(split, fp8.shape[0])
        out.append(
            calibrated_clip_bounds(
                fp8[shard],
                bf16[shard],
                adv[shard],
                mask[shard],
                EPS_LOW,
                EPS_HIGH,
                strategy=strategy,
                group=dist.group.WORLD,
                return_stats=True,
            )
        )
    return out


def test_two_rank_bounds_match_single_process_on_union():
    data = _data()
    # One spawn for all cases: starting gloo ranks costs seconds on a small CPU box.
    rank0, rank1 = run_distributed(_calibrate_on_shards, world_size=2, args=(data, CASES))
    for (strategy, split), (l0, u0, s0), (l1, u1, s1) in zip(CASES, rank0, rank1):
        assert (l0, u0) == (l1, u1), (strategy, split)  # identical on every rank, bit for bit
        assert s0 == s1
        lower, upper, stats = calibrated_clip_bounds(
            *data, EPS_LOW, EPS_HIGH, strategy=strategy, return_stats=True
        )
        assert l0 == pytest.approx(lower, rel=1e-9)
        assert u0 == pytest.approx(upper, rel=1e-9)
        assert s0["num_neg_tokens"] == stats["num_neg_tokens"]
        assert s0["hist_bytes"] == stats["hist_bytes"]
        assert lower < 1 - EPS_LOW  # the biased FP8 data did move the bound
