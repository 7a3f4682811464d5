"""A mixture-of-experts actor (issue 47, item 1): Megatron-Core's MoE layers (router, token
dispatcher, one SequentialMLP expert per linear pair on the local spec) train on gloo with the
experts in one rank (EP 1) or split over two (EP 2), with the same losses.

Both layouts run on 2 ranks (DP 2), so the rows each rank trains on are the same and only where
the experts live differs: EP 2 sends each token to its experts' rank with the all-to-all
dispatcher (gloo, through the CPU layer's split-size lists) and back. The weights are set from
each tensor's *global* name (an expert's global index is its EP rank's offset plus its local
index), so the two layouts start from the same model. fp32 on the CPU: the expert outputs are
summed in another order after the all-to-all, ~1e-7 relative per step; 3 Adam steps stay far
below the 1e-5 used here. With the load-balancing loss off: it is computed per rank's tokens in
either layout, and is checked to train (finite, moving the router) on its own.
"""

import math
import re
import zlib

import pytest
import torch

from tests.dist_utils import run_distributed

EXPERTS = 4
_LOCAL = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def _set_weights_by_global_name(module, ep_rank: int, local_experts: int) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            m = _LOCAL.match(name)
            if m:
                name = f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(
                0.05 * torch.randn(p.shape, generator=g)
                + (1.0 if name.endswith("norm.weight") else 0.0)
            )


def _body(rank, world, ep, fp8, aux, z=0.0):
    from megatron.core import parallel_state as ps

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.batch import rows_for_rank
    from megatron_rl_fp8.trainer.config import OptimConfig

    cfg = parallel.ParallelConfig(expert_model_parallel_size=ep)
    g = parallel.initialize(cfg, seed=1)
    model = ModelConfig(
        vocab_size=53, num_experts=EXPERTS, moe_topk=2, moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=aux, moe_z_loss_coeff=z,
    )  # fmt: skip
    fp8_cfg = FP8Config(recipe="blockwise", backend="emulate") if fp8 else None
    actor = Actor(model, OptimConfig(lr=1e-3), g, fp8_cfg, parallel=cfg)
    local = EXPERTS // ep
    _set_weights_by_global_name(actor.module, ps.get_expert_model_parallel_rank(), local)
    actor.params_changed()
    experts = sum(
        n.startswith("decoder.layers.0.") and ".local_experts." in n and "fc1" in n
        for n, _ in actor.module.named_parameters()
    )
    router = next(p for n, p in actor.module.named_parameters() if n.endswith("router.weight"))
    router0 = router.detach().clone()

    ids = torch.randint(0, 53, (8, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "loss_mask": torch.ones(8, 12)}
    batch["loss_mask"][:, -1] = 0

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / batch["loss_mask"].sum(), {}

    from megatron_rl_fp8.models.fp8 import emulated_linears

    fp8_experts = sum(".local_experts." in n for n, _, _ in emulated_linears(actor.module))
    losses = []
    for _ in range(3):
        with actor.counting_experts():
            outs, _, _ = actor.train_step(rows_for_rank(batch, g.dp_rank, g.dp_size), 2, nll)
        loss = torch.tensor([sum(o["loss"].item() for o in outs)], dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=g.dp)
        losses.append(loss.item())
    moved = (router.detach() - router0).abs().max().item()
    routed = actor.expert_load.counts.sum(dim=1).tolist()  # this rank's tokens x top-k, per layer
    load = actor.moe_metrics()
    parallel.destroy()
    return {
        "routed": routed,
        "load": load,
        "losses": losses,
        "local_experts": experts,
        "router_moved": moved,
        "router_norm": router.detach().norm().item(),
        "fp8_expert_linears": fp8_experts,
    }


def _run(ep, *, fp8=False, aux=0.0, z=0.0):
    return run_distributed(_body, world_size=2, args=(ep, fp8, aux, z), timeout=600)[0]


def test_expert_parallel_trains_as_one_rank_of_experts():
    one, two = _run(1), _run(2)
    assert (one["local_experts"], two["local_experts"]) == (EXPERTS, EXPERTS // 2)
    assert one["losses"][0] > one["losses"][-1]  # it trains
    for a, b in zip(one["losses"], two["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (one["losses"], two["losses"])


def test_expert_load_is_counted_per_layer_over_every_rank():
    """The routers' token counts (models/expert_load.py): each rank routes its own 4 rows x 12
    tokens to 2 experts, in each of 3 steps, at either EP; the moe/ metrics bracket the mean."""
    one, two = _run(1), _run(2)
    for r in (one, two):
        assert r["routed"] == [3 * 4 * 12 * 2] * 2
        assert r["load"]["moe/load_max_over_mean"] >= 1.0 >= r["load"]["moe/load_min_over_mean"]
        assert r["load"]["moe/load_min_over_mean"] >= 0.0
    # Same routing in both layouts, up to the fp32 summation order of EP 2's all-to-all (~1e-7
    # per step): a near-tie may route one token differently after a step on another CPU, which
    # moves a ratio by 1/144 (144 tokens per expert on average); allow a few.
    assert one["load"] == pytest.approx(two["load"], abs=0.03)


def test_fp8_experts_with_expert_parallelism():
    """Emulated blockwise FP8 on every expert linear (the router stays in full precision). The
    forward quantizes per token and per weight tile, so the first loss is the same in both
    layouts. The weight gradient quantizes activations in 128-token groups along the tokens,
    and EP changes which tokens share a group (an expert gets both DP ranks' tokens in one
    GEMM): the next step's loss moves by a regrouping of FP8's rounding, far less than FP8
    itself moves it from full precision (measured here: 2.7e-4 against 7.4e-3)."""
    ref, one, two = _run(1), _run(1, fp8=True), _run(2, fp8=True)
    # 2 layers x 4 experts x 2 linears in EP 1; half of them per rank in EP 2.
    assert (one["fp8_expert_linears"], two["fp8_expert_linears"]) == (16, 8)
    assert math.isclose(one["losses"][0], two["losses"][0], rel_tol=1e-6)
    assert one["losses"][0] != ref["losses"][0]  # FP8 is on
    assert abs(two["losses"][1] - one["losses"][1]) < abs(one["losses"][1] - ref["losses"][1])


def _idle_body(rank, world, recipe):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    model = ModelConfig(vocab_size=53, num_experts=EXPERTS, moe_topk=2, moe_ffn_hidden_size=32)
    fp8 = FP8Config(recipe=recipe, backend="emulate")
    actor = Actor(model, OptimConfig(lr=1e-3), g, fp8)
    with torch.no_grad():  # equal router logits: every token goes to the same top-2 experts
        for n, p in actor.module.named_parameters():
            if n.endswith("router.weight"):
                p.zero_()
    actor.params_changed()
    ids = torch.randint(0, 53, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "loss_mask": torch.ones(4, 12)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / batch["loss_mask"].sum(), {}

    with actor.counting_experts():
        outs, grad_norm, applied = actor.train_step(batch, 4, nll)
    idle = int((actor.expert_load.counts == 0).sum())
    parallel.destroy()
    return sum(o["loss"].item() for o in outs), grad_norm, applied, idle


@pytest.mark.parametrize("recipe", ["tensorwise_delayed", "rowwise"])
def test_fp8_experts_that_receive_no_tokens(recipe):
    """An expert no token was routed to multiplies an empty input; tensorwise and rowwise FP8
    have no amax of no values, so that GEMM runs unquantized (models/fp8.py)."""
    loss, grad_norm, applied, idle = run_distributed(_idle_body, world_size=1, args=(recipe,))[0]
    assert idle >= 2 * 2  # 2 of the 4 experts idle in both layers
    assert applied and math.isfinite(loss) and math.isfinite(grad_norm)


def test_the_load_balancing_loss_trains_the_router():
    r = _run(2, aux=0.01)
    assert all(math.isfinite(x) for x in r["losses"]) and r["router_moved"] > 0


def test_the_z_loss_keeps_the_router_logits_small():
    """``model.moe_z_loss_coeff``: Megatron's router z-loss (the squared log-sum-exp of the
    logits) pulls the router's weights in; a large coefficient makes that visible in 3 steps."""
    free, z = _run(2), _run(2, z=1.0)
    assert math.isfinite(z["losses"][-1]) and z["router_norm"] < free["router_norm"]


def _shadow_body(rank, world, ep):
    from megatron.core import parallel_state as ps

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    cfg = parallel.ParallelConfig(expert_model_parallel_size=ep)
    g = parallel.initialize(cfg, seed=1)
    model = ModelConfig(vocab_size=53, num_experts=EXPERTS, moe_topk=2, moe_ffn_hidden_size=32)
    actors = {
        name: Actor(model, OptimConfig(), g, fp8_cfg, parallel=cfg)
        for name, fp8_cfg in (
            ("bf16", None),
            ("fp8", FP8Config(recipe="blockwise", backend="emulate")),
        )
    }
    for actor in actors.values():
        _set_weights_by_global_name(
            actor.module, ps.get_expert_model_parallel_rank(), EXPERTS // ep
        )
        actor.params_changed()
    ids = torch.randint(0, 53, (4, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    plain = actors["bf16"].compute_logprobs(batch, 2)["logprobs"]
    fp8 = actors["fp8"].compute_logprobs(batch, 2)["logprobs"]
    with actors["fp8"].full_precision():
        shadow = actors["fp8"].compute_logprobs(batch, 2)["logprobs"]
    parallel.destroy()
    return plain, fp8, shadow


@pytest.mark.parametrize("ep", [1, 2])
def test_the_bf16_shadow_pass_covers_the_experts(ep):
    """Calibration's BF16 shadow forward (``Actor.full_precision``) switches FP8 off in the
    expert linears too: the FP8 actor's shadow log-probs are the full-precision actor's bit for
    bit, at EP 1 and EP 2, while its FP8 ones differ."""
    for plain, fp8, shadow in run_distributed(_shadow_body, world_size=2, args=(ep,)):
        assert torch.equal(shadow, plain)
        assert not torch.equal(fp8, plain)
