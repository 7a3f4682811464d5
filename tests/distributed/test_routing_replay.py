"""Rollout routing replay (issue 47, item 5; ``models/routing_replay.py``).

* Through the trainer: the in-process engine returns each token's experts; with the engine's
  routers the trainer's own (same weights, fp32), replaying changes nothing, bit for bit. With
  the engine's routers perturbed (as FP8 rollout kernels perturb them at scale, only more: the
  tiny model's FP8 rollout flips 0.1-0.7% of routes), the trainer's routers disagree on a few
  percent of routes, and replaying the engine's reproduces its log-probs better than free
  routing, at EP 1 and EP 2 alike.
* In the actor: routes drawn at random (nothing like the routers' own) replay the same in a
  plain forward / backward, under full activation recomputation (recomputed forwards take
  their micro-batch's routes again) and through a 2-stage pipeline (1F1B: several forwards
  before the first backward).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL

MOE = ["model.num_experts=4", "model.moe_topk=2", "model.moe_ffn_hidden_size=64"]


def _engine_body(rank, world, overrides, noise):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.trainer import startup
    from megatron_rl_fp8.trainer.batch import build_rl_batch, rows_for_rank
    from megatron_rl_fp8.trainer.collectives import broadcast_object
    from megatron_rl_fp8.trainer.loop import Trainer

    trainer = Trainer(load_config(None, list(overrides)))
    try:
        startup.resume_or_start(trainer)
        trainer.engines.sync(version=1)
        completions = None
        if trainer.is_driver:
            g = torch.Generator().manual_seed(0)
            for layer in trainer.engine.model.model.layers:
                w = layer.mlp.gate.weight
                w.data += noise * w.std() * torch.randn(w.shape, generator=g)
            prompts = [trainer.train_data[i]["prompt_ids"] for i in range(16)]
            completions = trainer.engine.generate(prompts, n=4, max_new_tokens=8, temperature=1.0)
            assert all(
                c.routed_experts.shape == (len(c.prompt_ids) + len(c.response_ids) - 1, 2, 2)
                for c in completions
            )
        completions = broadcast_object(completions, trainer.groups.driver_rank)
        batch = build_rl_batch(completions, torch.zeros(len(completions)), pad_id=0)
        local = rows_for_rank(batch, trainer.groups.dp_rank, trainer.groups.dp_size)
        out = {}
        for mode in ("measure", "replay"):
            trainer.actor.routing_replay = mode
            lp = trainer.actor.compute_logprobs(local, 8, count_routes=True)["logprobs"]
            mask = local["loss_mask"]
            gap = ((lp - local["rollout_logprobs"]).abs() * mask).sum().item()
            out[mode] = (lp, gap, mask.sum().item(), trainer.actor.moe_metrics())
    finally:
        trainer.close()
        parallel.destroy()
    return out


def _through_the_engine(tmp_path, ep: int, noise: float):
    overrides = (
        SMALL
        + MOE
        + [
            "sft.steps=20",
            "rollout.routing_replay=measure",
            f"parallel.expert_model_parallel_size={ep}",
            f"train.output_dir={tmp_path / f'ep{ep}'}",
            f"train.cache_dir={tmp_path / 'cache'}",  # one warm start for every run
        ]
    )
    return run_distributed(_engine_body, world_size=2, args=(overrides, noise), timeout=600)


def _mean_gap(ranks, mode) -> float:
    return sum(r[mode][1] for r in ranks) / sum(r[mode][2] for r in ranks)


def test_replaying_the_routers_own_routes_changes_nothing(tmp_path):
    for r in _through_the_engine(tmp_path, 1, noise=0.0):
        assert r["measure"][3] == {"moe/routing_mismatch": 0.0}
        assert torch.equal(r["measure"][0], r["replay"][0])


def test_replayed_routes_reproduce_the_engines_logprobs_better_than_free_routing(tmp_path):
    one = _through_the_engine(tmp_path, 1, noise=0.3)
    two = _through_the_engine(tmp_path, 2, noise=0.3)
    mismatch = one[0]["measure"][3]["moe/routing_mismatch"]
    assert 0.005 < mismatch < 0.2  # the perturbed engine routes some tokens elsewhere
    free, replayed = _mean_gap(one, "measure"), _mean_gap(one, "replay")
    # Measured: 0.0056 free, 0.0022 replayed (the rest: the gates' weights, from each side's
    # own scores of the same experts).
    assert replayed < 0.7 * free, (free, replayed)
    # EP 2 replays alike: each rank's routers get their tokens' routes wherever the experts are.
    for a, b in zip(one, two):
        for mode in ("measure", "replay"):
            assert torch.allclose(a[mode][0], b[mode][0], rtol=0, atol=1e-5)
            assert a[mode][3] == b[mode][3]


def _actor_body(rank, world, pp, recompute):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.memory import MemoryConfig
    from megatron_rl_fp8.models.routing_replay import ROUTES, encode_routes
    from megatron_rl_fp8.sync.gather import global_names
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    cfg = parallel.ParallelConfig(pipeline_model_parallel_size=pp)
    g = parallel.initialize(cfg, seed=1)
    model = ModelConfig(vocab_size=53, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32)
    memory = MemoryConfig(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ) if recompute else None  # fmt: skip
    actor = Actor(
        model, OptimConfig(lr=1e-3), g, memory=memory, parallel=cfg, routing_replay="replay"
    )
    with torch.no_grad():  # the same weights at every layout: drawn by each tensor's global name
        names = global_names(actor.module)
        for name, p in actor.module.named_parameters():
            seed = zlib.crc32(names[name].encode())
            p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
            if name.endswith("norm.weight"):
                p.add_(1.0)
    actor.params_changed()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 53, (8, 12), generator=gen)
    # Two distinct experts per token and layer, at random.
    routes = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8 * 12 * 2)])
    batch = {
        "input_ids": ids,
        "labels": torch.roll(ids, -1, 1),
        "loss_mask": torch.ones(8, 12),
        ROUTES: encode_routes(routes.reshape(8, 12, 2, 2)),
    }

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / batch["loss_mask"].sum(), {}

    free = actor.compute_logprobs({k: v for k, v in batch.items() if k != ROUTES}, 2)
    lp = actor.compute_logprobs(batch, 2)
    out, grad_norm, _ = actor.train_step(batch, 2, nll)
    loss = sum(o["loss"].item() for o in out) if out else None
    parallel.destroy()
    if not g.is_last_stage:
        return None
    return lp["logprobs"], free["logprobs"], loss, grad_norm


@pytest.mark.parametrize("pp, recompute", [(1, True), (2, False), (2, True)])
def test_recomputed_and_pipelined_forwards_replay_their_micro_batchs_routes(pp, recompute):
    ref_lp, ref_free, ref_loss, ref_norm = run_distributed(
        _actor_body, world_size=1, args=(1, False), timeout=600
    )[0]
    assert not torch.allclose(ref_lp, ref_free, atol=1e-3)  # the random routes are replayed
    lp, _, loss, grad_norm = [
        r for r in run_distributed(_actor_body, world_size=pp, args=(pp, recompute)) if r
    ][0]
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-6)
    assert math.isclose(loss, ref_loss, rel_tol=1e-6)
    assert math.isclose(grad_norm, ref_norm, rel_tol=1e-5)


def test_a_moe_run_replays_its_rollouts_routes(tmp_path):
    """`train` with ``rollout.routing_replay=replay``, EP 2, FP8 rollout and full recomputation: the
    routes travel from the engine through the batch into every pass, and the step reports how
    often the trainer's routers disagreed."""
    from tests.trainer_utils import trainer_body

    overrides = (
        SMALL
        + MOE
        + [
            "sft.steps=20",
            "train.steps=2",
            "rollout.routing_replay=replay",
            "rollout.fp8.weight_quant=blockwise",
            "parallel.expert_model_parallel_size=2",
            "memory.recompute_granularity=full",
            "memory.recompute_method=uniform",
            "memory.recompute_num_layers=1",
            f"train.output_dir={tmp_path / 'run'}",
            f"train.cache_dir={tmp_path / 'cache'}",
        ]
    )
    metrics = run_distributed(trainer_body, world_size=2, args=(overrides,), timeout=600)[0]
    steps = [m for m in metrics if "train/loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert 0.0 <= m["moe/routing_mismatch"] < 0.05 and math.isfinite(m["train/loss"])
