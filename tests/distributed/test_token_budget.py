"""Micro-batches by token budget (``train.max_tokens_per_gpu``) train exactly what fixed
micro-batches train: same logprobs, loss, grad norm and weights after 2 optimizer steps.

The losses are normalised by the global token count, so only the order of floating-point sums
differs (micro-batches of other shapes, gradients accumulated in another order): ~1e-7 relative in
fp32 for logprobs, losses and gradients, compared at 1e-5. Weights are compared to a tenth of one
Adam step (lr / 10 = 1e-4): Adam divides each gradient element by its own magnitude, so an element
whose gradient nearly cancels (~adam_eps) moves by a good part of lr in a direction that ~1e-8 of
reduction-order noise can change (measured here: up to 1e-5). The second step's loss and grad norm,
which see the updated weights, are the tight check on them.

One rank by default; in make test-all also 2 ranks, where the budget sends micro-batches of varying
shape through the pipeline's p2p (PP=2) and gives the data-parallel ranks different micro-batch
counts (DP=2: 2 on rank 0, 3 on rank 1), with and without overlapped gradient reduction.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

BUDGET = 40  # tokens: micro-batches of 1 x 22, 2 x 20 and 5 x 8 on one rank
FIXED_ROWS = 2  # micro_batch_size: 4 micro-batches of 2 x 24


def _batch():
    from megatron_rl_fp8.rollout.base import Completion
    from megatron_rl_fp8.trainer.batch import build_rl_batch

    g = torch.Generator().manual_seed(0)
    comps = []
    for i, n_response in enumerate([3, 18, 2, 7, 1, 12, 4, 20]):
        n_prompt = 2 + i % 3
        ids = torch.randint(1, 53, (n_prompt + n_response,), generator=g).tolist()
        comps.append(
            Completion(
                prompt_ids=ids[:n_prompt],
                response_ids=ids[n_prompt:],
                response_logprobs=[0.0] * n_response,
                finished=True,
            )
        )
    return build_rl_batch(comps, torch.randn(8, generator=g), pad_id=0)


def _body(rank, world, layout, overlap_grad_reduce=False):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.batch import rows_for_rank
    from megatron_rl_fp8.trainer.config import OptimConfig

    cfg = parallel.ParallelConfig(**layout, overlap_grad_reduce=overlap_grad_reduce)
    g = parallel.initialize(cfg, seed=1)
    full = _batch()
    count = full["loss_mask"].sum()  # the global token count, as update.global_loss_count
    local = rows_for_rank(full, g.dp_rank, g.dp_size)

    def token_loss(mb, lp):
        mask = mb["loss_mask"]
        ratio = torch.exp(lp - mb["old_logprobs"])
        return -(ratio * mb["advantages"].unsqueeze(-1) * mask).sum() / count, {}

    out = {}
    for mode, max_tokens in (("fixed", None), ("budget", BUDGET)):
        torch.manual_seed(1)
        actor = Actor(ModelConfig(vocab_size=53), OptimConfig(lr=1e-3), g, parallel=cfg)
        batch = dict(local)
        old = actor.compute_logprobs(batch, FIXED_ROWS, max_tokens=max_tokens)
        batch["old_logprobs"] = old["logprobs"] if old else torch.zeros_like(batch["loss_mask"])
        steps = []
        for _ in range(2):
            outs, grad_norm, applied = actor.train_step(
                batch, FIXED_ROWS, token_loss, max_tokens=max_tokens
            )
            assert applied
            steps.append((sum(o["loss"].item() for o in outs), len(outs), grad_norm))
            if len(steps) == 1:
                grads = [p.main_grad.clone() for p in actor.module.parameters()]
        out[mode] = {
            "grads": grads,
            "old": {k: v * batch["loss_mask"] for k, v in old.items()} if old else None,
            "steps": steps,
            "params": [p.detach().clone() for p in actor.module.parameters()],
        }
    parallel.destroy()
    return out


def _check(out, micro_batches):
    fixed, budget = out["fixed"], out["budget"]
    if fixed["old"] is not None:  # the last pipeline stage
        for k in ("logprobs", "entropy"):
            torch.testing.assert_close(budget["old"][k], fixed["old"][k], rtol=1e-5, atol=1e-6)
        assert [s[1] for s in budget["steps"]] == [micro_batches] * 2
        for (loss_f, _, norm_f), (loss_b, _, norm_b) in zip(fixed["steps"], budget["steps"]):
            assert loss_b == pytest.approx(loss_f, rel=1e-5, abs=1e-7)
            assert norm_b == pytest.approx(norm_f, rel=1e-5)
    assert fixed["steps"][0][2] > 0
    for a, b in zip(budget["grads"], fixed["grads"]):  # after the first step's backward
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(budget["params"], fixed["params"]):  # after 2 Adam steps
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_token_budget_equals_fixed_micro_batches_one_rank():
    (out,) = run_distributed(_body, world_size=1, args=({},))
    _check(out, micro_batches=3)


# ~40 s on 2 cores (two spawned ranks importing Megatron): make test-all.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "overlap", "micro_batches"),
    [
        ({"pipeline_model_parallel_size": 2}, False, [3, 3]),
        ({}, False, [2, 3]),
        # Buckets reduce in the last micro-batch's backward: once per rank, whatever its count.
        ({}, True, [2, 3]),
    ],
    ids=["pp2", "dp2", "dp2-overlap-grad-reduce"],
)
def test_token_budget_equals_fixed_micro_batches_two_ranks(layout, overlap, micro_batches):
    outs = run_distributed(_body, world_size=2, args=(layout, overlap))
    for out, n in zip(outs, micro_batches):
        _check(out, micro_batches=n)
