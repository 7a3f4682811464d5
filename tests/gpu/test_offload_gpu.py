"""The trainer's offload on a GPU (marked ``gpu``; skipped without CUDA): bf16 weights and the
distributed optimizer, as colocated runs train. ``offload()`` gives the CUDA caching allocator
back at least the bytes it reports, through pinned host buffers, and ``reload()`` brings every
weight, DDP buffer, fp32 main weight and Adam moment back bit for bit; a step after it trains.
(Bit-identical steps against an actor that never offloaded are checked on the CPU,
``tests/distributed/test_offload.py``: cuBLAS and atomics do not promise run-to-run equality.)"""

import pytest
import torch

from tests.distributed.test_offload import VOCAB, _batch, _differ, _state, _step

pytestmark = pytest.mark.gpu


def _body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig
    from megatron_rl_fp8.trainer.offload import TrainerOffload

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    cfg = parallel.ParallelConfig(use_distributed_optimizer=True)
    actor = Actor(ModelConfig(vocab_size=VOCAB), OptimConfig(lr=1e-3), g, parallel=cfg)
    batch = _batch()
    count = batch["loss_mask"].sum().item()
    _step(actor, g, batch, count)
    state = _state(actor)
    before = {k: v.detach().clone() for k, v in state.items()}
    dtypes = {str(p.dtype) for p in actor.module.parameters()}
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    offload = TrainerOffload(actor)
    moved = offload.offload()
    freed = allocated - torch.cuda.memory_allocated()
    pinned = all(e.host.is_pinned() for e in offload._entries)
    offload.reload()
    changed = _differ(before, state)
    _, grad_norm = _step(actor, g, batch, count)
    parallel.destroy()
    return dtypes, moved, freed, pinned, changed, grad_norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: pytest -m gpu)")
def test_offload_frees_gpu_memory_and_reload_restores_it():
    from tests.dist_utils import run_distributed

    dtypes, moved, freed, pinned, changed, grad_norm = run_distributed(_body, world_size=1)[0]
    assert dtypes == {"torch.bfloat16"}  # Megatron keeps fp32 main weights to move too
    assert moved > 0 and freed >= moved  # the allocator rounds blocks up, never down
    assert pinned
    assert changed == []
    assert torch.isfinite(torch.tensor(grad_norm))
