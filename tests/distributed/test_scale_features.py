"""Megatron's scale features on real gloo ranks give the plain layouts' training.

* The distributed optimizer (ZeRO-1: reduce-scattered gradients, Adam state and fp32 main weights
  sharded over DP, all-gathered weights), with and without overlapped gradient reduction and
  parameter gathering, at DP=2 equals plain DDP at DP=2 and one rank: loss, grad norm and weights
  after two Adam steps.
* Sequence parallelism at TP=2 equals TP=2 without it.
* A distributed-optimizer checkpoint (its sharded Adam state through dist_checkpointing) written at
  DP=2 loads at DP=1 and the next step matches the run that went on at DP=2.

Tolerances: the layouts add the same fp32 numbers in different orders (DP sums two half-batch
gradients, SP moves the TP reductions into reduce-scatters / all-gathers and pads the 11-token rows
to 12); that is ~1e-7 relative per reduction, and losses and grad norms agree to 1e-5 relative.
Adam divides each element's update by that element's own gradient magnitude, so an element whose
gradient nearly cancels can move by a good part of lr in one layout and not the other: weights are
compared within lr / 10 = 1e-4 (measured: up to ~1.5e-5).
"""

import pytest
import torch

from tests.dist_utils import run_distributed

VOCAB, ROWS, SEQ, MICRO = 53, 8, 11, 2  # SEQ odd: SP pads it to a multiple of TP


def _batch():
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, SEQ)
    mask[:, :3] = 0  # prompt positions carry no loss
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1), "loss_mask": mask}


def _nll(count):
    def loss(mb, lp):
        # Normalised by the global token count: sums over micro-batches and ranks to the mean.
        return -(lp * mb["loss_mask"]).sum() / count, {}

    return loss


def _train(groups, parallel_cfg, steps, *, actor=None):
    """``steps`` Adam steps on this rank's rows; (actor, [(loss, grad norm)], full weights)."""
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.batch import rows_for_rank
    from megatron_rl_fp8.trainer.config import OptimConfig

    if actor is None:
        parallel.init_model_parallel(parallel_cfg, seed=1)  # the same initial weights each time
        actor = Actor(
            ModelConfig(vocab_size=VOCAB), OptimConfig(lr=1e-3), groups, parallel=parallel_cfg
        )
    batch = _batch()
    count = batch["loss_mask"].sum().item()
    local = rows_for_rank(batch, groups.dp_rank, groups.dp_size)
    history = []
    for _ in range(steps):
        out, grad_norm, applied = actor.train_step(local, MICRO, _nll(count))
        assert applied
        loss = torch.stack([o["loss"] for o in out]).sum()
        torch.distributed.all_reduce(loss, group=groups.dp)
        history.append((loss.item(), grad_norm))
    actor.finish_param_gather()
    return actor, history, _full_weights(actor, groups)


def _full_weights(actor, groups):
    """Every weight at full size (TP shards gathered along their partition dimension)."""
    import torch.distributed as dist

    weights = {}
    for name, p in actor.module.named_parameters():
        w = p.detach().float().clone()  # a copy: training goes on in place
        if getattr(p, "tensor_model_parallel", False) and groups.tp_size > 1:
            parts = [torch.empty_like(w) for _ in range(groups.tp_size)]
            dist.all_gather(parts, w.contiguous(), group=groups.tp)
            w = torch.cat(parts, dim=p.partition_dim)
        weights[name] = w
    return weights


def _dp_configs(world):
    from megatron_rl_fp8.parallel import ParallelConfig

    configs = {
        "ddp": ParallelConfig(),
        "distopt": ParallelConfig(use_distributed_optimizer=True),
        "distopt_overlap": ParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
        ),
    }
    if world == 1:
        del configs["distopt_overlap"]  # nothing to overlap on one rank
    return configs


def _two_ranks_body(rank, world, ckpt_dir):
    """DP=2: each data-parallel configuration, the distributed optimizer's checkpoint and the
    step after it; then, in the same processes, TP=2 with and without sequence parallelism."""
    from megatron.core import parallel_state

    from megatron_rl_fp8 import checkpoint, parallel

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    results = {}
    for name, cfg in _dp_configs(world).items():
        actor, history, weights = _train(g, cfg, 2)
        results[name] = (history, weights)
        if name == "distopt":
            checkpoint.save(
                ckpt_dir, "iter_0000002", actor.sharded_state_dict(with_optimizer=True), {"step": 2}
            )
            results["distopt_step3"] = _train(g, cfg, 1, actor=actor)[1:]
    parallel_state.destroy_model_parallel()
    tp2 = parallel.ParallelConfig(tensor_model_parallel_size=2)
    g = parallel.init_model_parallel(tp2, seed=1)
    for sp in (False, True):
        cfg = parallel.ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp)
        results[f"tp2_sp={sp}"] = _train(g, cfg, 2)[1:]
    parallel.destroy()
    return results


def _one_rank_body(rank, world, ckpt_dir):
    """One rank: the data-parallel configurations' reference, then the DP=2 distributed-optimizer
    checkpoint loaded here (DP=1) and the third step taken."""
    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    results = {name: _train(g, cfg, 2)[1:] for name, cfg in _dp_configs(world).items()}
    cfg = parallel.ParallelConfig(use_distributed_optimizer=True)
    actor = Actor(ModelConfig(vocab_size=VOCAB), OptimConfig(lr=1e-3), g, parallel=cfg)
    loaded, state = checkpoint.load(
        checkpoint.latest(ckpt_dir), actor.sharded_state_dict(with_optimizer=True, is_loading=True)
    )
    actor.load_sharded(loaded)
    results["resume"] = (
        state["step"],
        _full_weights(actor, g),
        *_train(g, cfg, 1, actor=actor)[1:],
    )
    parallel.destroy()
    return results


def _assert_same(a, b, what):
    (hist_a, weights_a), (hist_b, weights_b) = a, b
    for (loss_a, gn_a), (loss_b, gn_b) in zip(hist_a, hist_b, strict=True):
        assert loss_a == pytest.approx(loss_b, rel=1e-5), (what, "loss", loss_a, loss_b)
        assert gn_a == pytest.approx(gn_b, rel=1e-5), (what, "grad norm", gn_a, gn_b)
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        diff = (weights_a[k] - weights_b[k]).abs().max().item()
        assert diff <= 1e-4, f"{what}: {k} differs by {diff:.3g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the two ranks' results, the one rank's): one spawn each for every test here."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    two = run_distributed(_two_ranks_body, world_size=2, args=(ckpt,))
    one = run_distributed(_one_rank_body, world_size=1, args=(ckpt,))[0]
    return two, one


def test_distributed_optimizer_matches_ddp_and_one_rank(runs):
    ranks, one_rank = runs
    dp2 = ranks[0]
    for name in ("distopt", "distopt_overlap"):
        _assert_same(dp2[name], dp2["ddp"], f"{name} vs DDP at DP=2")
        # Both ranks hold the same (all-gathered) weights.
        _assert_same(ranks[1][name], dp2[name], f"{name} rank 1 vs rank 0")
    _assert_same(dp2["ddp"], one_rank["ddp"], "DP=2 vs one rank")
    _assert_same(dp2["distopt"], one_rank["distopt"], "distributed optimizer DP=2 vs one rank")


def test_distributed_optimizer_checkpoint_loads_at_another_dp_size(runs):
    """The DP=2 checkpoint (Adam state sharded over two ranks) loads on one rank."""
    (dp2, _), one_rank = runs
    step, restored, history, weights = one_rank["resume"]
    assert step == 2
    for k, w in dp2["distopt"][1].items():
        assert torch.equal(restored[k], w), k
    _assert_same((history, weights), dp2["distopt_step3"], "step 3 after a DP=2 -> DP=1 resume")


def test_sequence_parallel_matches_tp2(runs):
    (tp_rank0, _), _ = runs
    _assert_same(tp_rank0["tp2_sp=True"], tp_rank0["tp2_sp=False"], "SP vs no SP at TP=2")
