"""Context parallelism's data path on 2 real gloo ranks, with Megatron's CP groups (CP = 2).

Megatron's CP attention exists only in Transformer Engine (its local attention asserts CP == 1),
which CPU boxes cannot install, so CP = 2 == CP = 1 on a model runs only where TE does
(tests/gpu). What CP changes in the trainer itself is tested here, on the loss function and
metric reduction the update uses:

* each rank's share of a micro-batch (Megatron's load-balanced chunks) gathers back to the whole;
* the policy loss (PPO clip + KL term) of each CP rank's tokens, normalised by the global count,
  sums over the CP ranks to the whole micro-batch's loss, and so do its gradients;
* the step's metrics (token means, extremes, ratio quantiles from the merged histograms), reduced
  over DP x CP, are the whole micro-batch's.

Tolerances: the same per-token float32 values summed in two groupings (~1e-7 relative).
"""

import math

import pytest
import torch

from tests.dist_utils import run_distributed

ROWS, SEQ = 3, 16


def _micro_batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ)
    for row, (start, end) in enumerate([(2, 16), (5, 11), (1, 7)]):
        mask[row, start:end] = 1
    old = -torch.rand(ROWS, SEQ, generator=g) * 3
    return {
        "input_ids": torch.randint(0, 50, (ROWS, SEQ), generator=g),
        "labels": torch.randint(0, 50, (ROWS, SEQ), generator=g),
        "loss_mask": mask,
        "old_logprobs": old,
        "rollout_logprobs": old + 0.01 * torch.randn(ROWS, SEQ, generator=g),
        "ref_logprobs": old + 0.1 * torch.randn(ROWS, SEQ, generator=g),
        "advantages": torch.tensor([1.0, -0.5, 0.25]),
    }, old + 0.3 * torch.randn(ROWS, SEQ, generator=g)  # the current policy's logprobs


def _body(rank, world):
    """Both aggregations in one spawn: {agg: (shares ok, losses, gradients, metrics)}."""
    from megatron_rl_fp8 import parallel

    g = parallel.initialize(parallel.ParallelConfig(context_parallel_size=2), seed=1)
    assert (g.cp_size, g.cp_rank, g.dp_size) == (2, rank, 1)
    out = {agg: _check(g, rank, agg) for agg in ("token-mean", "seq-mean-token-sum")}
    parallel.destroy()
    return out


def _check(g, rank, agg):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.metrics.accumulator import MetricAccumulator
    from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
    from megatron_rl_fp8.trainer.context_parallel import cp_positions, gather_from_cp, split_for_cp
    from megatron_rl_fp8.trainer.update import PolicyUpdate
    from megatron_rl_fp8.trainer.update_metrics import account, reduce

    cfg = load_config("examples/tiny_cpu.yaml", [f"loss.agg={agg}", "loss.kl_coef=0.1"])
    mb, current = _micro_batch()
    mask = mb["loss_mask"]
    if agg == "token-mean":
        counts = {"global_token_count": mask.sum().item()}
    else:
        counts = {"global_seq_count": float((mask.sum(-1) > 0).sum())}

    # Each rank's share, and back.
    local = split_for_cp(mb, g.cp_size, g.cp_rank)
    positions = cp_positions(SEQ, 2, rank)
    shares_ok = torch.equal(local["position_ids"][0], positions) and torch.equal(
        gather_from_cp(local["old_logprobs"], g.cp, g.cp_size), mb["old_logprobs"]
    )

    def run(groups, batch, logprobs):
        """The update's loss and metrics for ``batch`` on ``groups``: (loss, grad of the
        logprobs, the driver's metrics)."""
        update = PolicyUpdate(cfg, None, groups, ClipCalibrator(cfg.loss, fp8_training=False))
        logprobs = logprobs.clone().requires_grad_(True)
        loss, metrics = update._token_loss(counts, 0.8, 1.28)(batch, logprobs)
        loss.backward()
        acc = MetricAccumulator()
        # The old-logprob pass counts the whole sequences' tokens on CP rank 0 (it sees them
        # gathered; PolicyUpdate.old_logprobs): the denominator of the token means.
        acc.add("n_tokens", mask.sum().item() if groups.cp_rank == 0 else 0.0)
        account([{"loss": loss.detach(), **metrics}], acc, applied=True)
        return loss.detach(), logprobs.grad, reduce(acc, groups, cfg.train.updates_per_step)

    # The whole micro-batch on one rank (no collective: a one-rank view of the groups).
    one = parallel.Groups(None, None, None, 0, 1, 0, 1, 0, 1, True, True, device=g.device)
    full_loss, full_grad, full_metrics = run(one, mb, current)
    # This CP rank's tokens; the loss and gradients summed over CP, the metrics over DP x CP.
    loss, grad, metrics = run(
        g, {k: v for k, v in local.items() if k != "position_ids"}, current[:, positions]
    )
    torch.distributed.all_reduce(loss, group=g.cp)
    whole_grad = torch.zeros_like(full_grad)
    whole_grad[:, positions] = grad
    torch.distributed.all_reduce(whole_grad, group=g.cp)
    return shares_ok, (full_loss, loss), (full_grad, whole_grad), (full_metrics, metrics)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_body, world_size=2)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_cp_split_gives_the_whole_loss_gradients_and_metrics(ranks, agg):
    ranks = [r[agg] for r in ranks]
    for rank, (shares_ok, (full, split), (full_grad, grad), _) in enumerate(ranks):
        assert shares_ok, rank
        torch.testing.assert_close(split, full, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, full_grad, rtol=1e-6, atol=1e-8)
    full_metrics, metrics = ranks[0][3]  # the driver's
    assert metrics.keys() == full_metrics.keys()
    assert full_metrics["train/response_tokens"] == 14 + 6 + 6
    assert full_metrics["train/kl"] > 0 and full_metrics["train/pg_clipfrac"] > 0
    for key, value in full_metrics.items():
        assert math.isclose(metrics[key], value, rel_tol=1e-6, abs_tol=1e-7), key
    assert ranks[1][3][1] == {}  # metrics go to the driver only
