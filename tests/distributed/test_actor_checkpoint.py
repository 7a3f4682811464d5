"""Actor checkpoint round trip: model + Adam state restore exactly, so the next step is bit-identical."""

import torch

from tests.dist_utils import run_distributed


def _body(rank, world, ckpt_dir):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer import checkpoint
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=world), seed=1)
    ids = torch.randint(0, 53, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(4, 10)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 40.0, {}

    a = Actor(ModelConfig(vocab_size=53), OptimConfig(lr=1e-3), g)
    for _ in range(3):
        a.train_step(batch, 2, nll)
    checkpoint.save(
        ckpt_dir, "iter_0000003", a.sharded_state_dict(with_optimizer=True), {"step": 3}
    )
    b = Actor(ModelConfig(vocab_size=53), OptimConfig(lr=1e-3), g)
    path = checkpoint.latest(ckpt_dir)
    loaded, state = checkpoint.load(
        path, b.sharded_state_dict(with_optimizer=True, is_loading=True)
    )
    b.load_sharded(loaded)
    a.train_step(batch, 2, nll)
    b.train_step(batch, 2, nll)
    same = all(torch.equal(x, y) for x, y in zip(a.module.parameters(), b.module.parameters()))
    parallel.destroy()
    return same, state["step"], path.name


def test_resume_is_bit_exact_tp1(tmp_path):
    assert run_distributed(_body, world_size=1, args=(str(tmp_path),)) == [
        (True, 3, "iter_0000003")
    ]


def test_resume_is_bit_exact_tp2(tmp_path):
    out = run_distributed(_body, world_size=2, args=(str(tmp_path),))
    assert all(o == (True, 3, "iter_0000003") for o in out)
