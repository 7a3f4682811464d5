"""The trainer's offload during a colocated rollout (``trainer/offload.py``) on a real actor.

Two gloo ranks (DP=2), bf16 weights (so Megatron's mixed-precision optimizer keeps fp32 main
weights, as on GPUs), plain DDP and the distributed optimizer, with a KL reference model. After
one Adam step:

* ``offload()`` empties every storage under the weights, DDP's buffers, the main weights, the Adam
  state and the reference's weights, and reports exactly their bytes (each storage once: views
  into DDP's buffers and the main weights' shards are not counted twice); a second call moves
  nothing.
* ``reload()`` gives every one of those tensors back bit for bit (gradients included); with
  ``keep_grads=False`` the gradient buffers come back zeroed and the rest bit for bit.
* The next training step (after both cycles) gives bit-identical loss, grad norm, weights, main
  weights and Adam state to the same step of an actor that never offloaded: same process, same
  kernels, same order, so equality is exact, not a tolerance.

The tensors checked are listed here from Megatron's own attributes, not from the module's walk.
"""

import pytest
import torch

from tests.dist_utils import run_distributed

VOCAB, ROWS, SEQ, MICRO = 53, 8, 11, 2


def _batch():
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, SEQ)
    mask[:, :3] = 0
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1), "loss_mask": mask}


def _state(actor, reference=None) -> dict[str, torch.Tensor]:
    """Everything the offload must bring back, by name, read from Megatron's attributes."""
    out = {f"param/{n}": p for n, p in actor.module.named_parameters()}
    for i, buffer in enumerate(actor.model.buffers):  # DDP's list of contiguous buffers
        out[f"grad_data/{i}"] = buffer.grad_data
        if buffer.param_data is not None:  # the distributed optimizer's weight buffer
            out[f"param_data/{i}"] = buffer.param_data
    (opt,) = actor.optimizer.chained_optimizers
    mains = getattr(opt, "shard_fp32_from_float16_groups", None) or opt.fp32_from_float16_groups
    for gi, group in enumerate(mains):
        for j, p in enumerate(group):
            out[f"main/{gi}/{j}"] = p
    for k, state in enumerate(opt.optimizer.state.values()):
        for key, v in state.items():
            out[f"adam/{k}/{key}"] = v
    if reference is not None:
        out.update({f"ref/{n}": p for n, p in reference.model.named_parameters()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().reshape(-1).view(torch.uint8)


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(_bits(a[k]), _bits(b[k]))]


def _step(actor, groups, batch, count):
    from megatron_rl_fp8.trainer.batch import rows_for_rank

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / count, {}

    out, grad_norm, applied = actor.train_step(
        rows_for_rank(batch, groups.dp_rank, groups.dp_size), MICRO, nll
    )
    assert applied
    return torch.stack([o["loss"] for o in out]).sum().item(), grad_norm


def _one_layout(groups, cfg) -> dict:
    import time

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig
    from megatron_rl_fp8.trainer.offload import TrainerOffload
    from megatron_rl_fp8.trainer.reference import Reference

    model_cfg = ModelConfig(vocab_size=VOCAB, params_dtype="bfloat16")
    batch = _batch()
    count = batch["loss_mask"].sum().item()

    def build():
        parallel.init_model_parallel(cfg, seed=1)  # the same initial weights each time
        return Actor(model_cfg, OptimConfig(lr=1e-3), groups, parallel=cfg)

    actor = build()
    reference = Reference(actor)
    reference.copy_from(actor)
    steps = [_step(actor, groups, batch, count)]
    state = _state(actor, reference)
    before = {k: v.detach().clone() for k, v in state.items()}
    storages = {}
    for t in state.values():
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    r = {
        "expected_bytes": sum(storages.values()),
        "main_weights": sum(k.startswith("main/") for k in state),
    }

    # Cycle 1: everything copied.
    offload = TrainerOffload(actor, reference)
    t0 = time.perf_counter()
    r["offloaded"] = offload.offload()
    r["not_emptied"] = [k for k, t in state.items() if t.untyped_storage().nbytes() != 0]
    r["second_offload"] = offload.offload()
    offload.reload()
    offload.reload()  # nothing offloaded: a no-op
    r["cycle_s"] = time.perf_counter() - t0
    r["changed_by_cycle"] = _differ(before, state)
    r["metrics"] = offload.metrics()

    # Cycle 2: gradients dropped, back zeroed.
    dropping = TrainerOffload(actor, reference, keep_grads=False)
    r["offloaded_dropping"] = dropping.offload()
    dropping.reload()
    grads = [k for k in state if k.startswith("grad_data/")]
    r["grads_zero"] = all(not state[k].any() for k in grads)
    r["changed_by_drop"] = _differ(
        {k: v for k, v in before.items() if k not in grads},
        {k: v for k, v in state.items() if k not in grads},
    )

    steps.append(_step(actor, groups, batch, count))
    after = {k: v for k, v in _state(actor).items()}

    plain = build()  # the same two steps, never offloaded
    plain_steps = [_step(plain, groups, batch, count) for _ in range(2)]
    r["steps"], r["plain_steps"] = steps, plain_steps
    r["differs_from_plain"] = _differ(after, _state(plain))
    return r


def _body(rank, world):
    from megatron_rl_fp8 import parallel

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    results = {
        "ddp": _one_layout(g, parallel.ParallelConfig()),
        "distopt": _one_layout(g, parallel.ParallelConfig(use_distributed_optimizer=True)),
    }
    parallel.destroy()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_body, world_size=2)


LAYOUTS = ("ddp", "distopt")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_empties_each_storage_once(ranks, layout):
    for r in (rank[layout] for rank in ranks):
        assert r["main_weights"] > 0  # bf16: Megatron keeps fp32 main weights to move
        assert r["not_emptied"] == []
        assert r["offloaded"] == r["expected_bytes"]
        assert r["second_offload"] == 0
        # Dropped gradients are freed all the same.
        assert r["offloaded_dropping"] == r["expected_bytes"]
        assert r["metrics"]["perf/offloaded_gb"] == r["expected_bytes"] / 1e9


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reload_restores_every_tensor_bit_for_bit(ranks, layout):
    for r in (rank[layout] for rank in ranks):
        assert r["changed_by_cycle"] == []
        assert r["grads_zero"]
        assert r["changed_by_drop"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_after_reload_matches_training_without(ranks, layout):
    for r in (rank[layout] for rank in ranks):
        assert r["steps"] == r["plain_steps"]  # loss and grad norm, exactly
        assert r["differs_from_plain"] == []


def test_distributed_optimizer_moves_less(ranks):
    """Its main weights and Adam state are DP shards: a DP=2 rank holds about half of them."""
    ddp, distopt = ranks[0]["ddp"]["offloaded"], ranks[0]["distopt"]["offloaded"]
    assert distopt < 0.75 * ddp
