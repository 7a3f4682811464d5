"""Actor checkpoint round trip: model + Adam state + lr schedule restore exactly, so the next step
is bit-identical (with a warmup + cosine schedule: a schedule restarted at step 0 would differ).
Also with bf16 parameters (Megatron's mixed-precision optimizer with fp32 main weights: every
parameter must be bf16 for it to checkpoint, norms included; a float32 norm failed on the H200)."""

import math

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank, world, ckpt_dir, dtype="float32"):
    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=world), seed=1)
    ids = torch.randint(0, 53, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(4, 10)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 40.0, {}

    def optim(lr):
        return OptimConfig(
            lr=lr, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=1e-4, lr_decay_steps=8
        )

    model = ModelConfig(vocab_size=53, params_dtype=dtype)
    a = Actor(model, optim(1e-3), g)
    dtypes = {p.dtype for p in a.module.parameters()}
    for _ in range(3):
        a.train_step(batch, 2, nll)
    checkpoint.save(
        ckpt_dir,
        "iter_0000003",
        a.sharded_state_dict(with_optimizer=True),
        {"step": 3, "opt_param_scheduler": a.lr_schedule_state_dict()},
    )

    def restored(lr):
        actor = Actor(model, optim(lr), g)
        loaded, state = checkpoint.load(
            checkpoint.latest(ckpt_dir),
            actor.sharded_state_dict(with_optimizer=True, is_loading=True),
        )
        actor.load_sharded(loaded)
        actor.load_lr_schedule_state_dict(state["opt_param_scheduler"])
        return actor, state

    b, state = restored(1e-3)
    # The run's config decides the schedule, the checkpoint its position (step 3 of 8).
    c, _ = restored(2e-3)
    lrs = [(a.lr, b.lr, c.lr)]
    # Two steps: the first uses the lr restored with Adam's param groups, the second the schedule's.
    for _ in range(2):
        a.train_step(batch, 2, nll)
        b.train_step(batch, 2, nll)
    lrs.append((a.lr, b.lr))
    same = all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters()))
    parallel.destroy()
    return same, state["step"], checkpoint.latest(ckpt_dir).name, lrs, dtypes


def _cosine(lr, n):
    # Warmup over steps 0..2, then cosine down to min_lr=1e-4 at step 8.
    return 1e-4 + (lr - 1e-4) * 0.5 * (1 + math.cos(math.pi * (n - 2) / 6))


def _check(out):
    same, step, name, ((lr_a, lr_b, lr_c), (lr_a5, lr_b5)), _ = out
    assert (same, step, name) == (True, 3, "iter_0000003")
    assert lr_a == lr_b == pytest.approx(_cosine(1e-3, 3), rel=1e-12)
    assert lr_c == pytest.approx(_cosine(2e-3, 3), rel=1e-12)
    assert lr_a5 == lr_b5 == pytest.approx(_cosine(1e-3, 5), rel=1e-12)


def test_resume_is_bit_exact_tp1(tmp_path):
    (out,) = run_distributed(_body, world_size=1, args=(str(tmp_path),))
    _check(out)


def test_resume_is_bit_exact_tp2(tmp_path):
    for out in run_distributed(_body, world_size=2, args=(str(tmp_path),)):
        _check(out)


def test_resume_is_bit_exact_with_bf16_parameters(tmp_path):
    (out,) = run_distributed(_body, world_size=1, args=(str(tmp_path), "bfloat16"))
    _check(out)
    assert out[-1] == {torch.bfloat16}


def _delayed_body(rank, world, ckpt_dir, pp):
    """Two ranks, emulated tensorwise_delayed FP8: at DP=2 each rank's amax histories come from
    its own data, at PP=2 from its own layers; either way they differ between ranks and each
    rank's checkpoint file must bring back its own."""
    from megatron_rl_fp8 import checkpoint, parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.fp8 import fp8_scaling_state
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(pipeline_model_parallel_size=pp), seed=1)
    # DP: other data on each rank (the histories' amaxes differ); PP: the stages share a batch.
    gen = torch.Generator().manual_seed(0 if pp > 1 else rank)
    ids = torch.randint(0, 53, (4, 10), generator=gen)
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(4, 10)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 40.0, {}

    fp8 = FP8Config(recipe="tensorwise_delayed", amax_history_len=4, backend="emulate")

    def actor():
        return Actor(ModelConfig(vocab_size=53), OptimConfig(lr=1e-2), g, fp8=fp8)

    a = actor()
    for _ in range(3):
        a.train_step(batch, 2, nll)
    state = a.rank_state()
    checkpoint.save(ckpt_dir, "iter_0000003", a.sharded_state_dict(with_optimizer=True), {},
                    rank_state=state)  # fmt: skip
    files = sorted(p.name for p in (checkpoint.latest(ckpt_dir) / checkpoint.RANK_STATE).iterdir())

    def restored(rank_state=True):
        b = actor()
        loaded, _ = checkpoint.load(
            checkpoint.latest(ckpt_dir), b.sharded_state_dict(with_optimizer=True, is_loading=True)
        )
        b.load_sharded(loaded)
        if rank_state:
            b.load_rank_state(loaded[checkpoint.RANK_STATE])
        return b

    b, fresh = restored(), restored(rank_state=False)
    elsewhere = actor()  # a checkpoint written at another layout restores nothing
    moved = {**state, "layout": {**state["layout"], "dp_size": 4}}
    elsewhere.load_rank_state(moved)
    for _ in range(2):
        for x in (a, b, fresh):
            x.train_step(batch, 2, nll)

    def equal(x, y):
        return all(torch.equal(p, q) for p, q in zip(x.module.parameters(), y.module.parameters()))

    histories = state["fp8_scaling"]
    out = {
        "files": files,
        "linears": len(histories),
        "updates": {r["num_updates"] for roles in histories.values() for r in roles.values()},
        "history": next(iter(histories.values()))["input"]["history"],
        "resumed": equal(a, b),
        "afresh": equal(a, fresh),
        "elsewhere": fp8_scaling_state(elsewhere.module),
    }
    parallel.destroy()
    return out


@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "pp2"])
def test_fp8_delayed_scaling_histories_resume_per_rank(tmp_path, pp):
    outs = run_distributed(_delayed_body, world_size=2, args=(str(tmp_path), pp))
    for out in outs:
        assert out["files"] == ["0.pt", "1.pt"]
        assert out["linears"] > 0 and out["updates"] == {6}  # 3 steps x 2 micro-batches
        assert out["resumed"], "resumed with its histories: bit-exact"
        assert not out["afresh"], "restarting the histories changes the next steps"
        assert out["elsewhere"] == {}
    assert not torch.equal(outs[0]["history"], outs[1]["history"])
