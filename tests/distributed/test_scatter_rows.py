"""The rollout batch reaches each rank as tensors: every rank gets exactly
``rows_for_rank(batch, its DP rank, DP size)`` from the driver, whatever the layout (DP=2: two
slices; TP=2: both ranks the whole batch), with the dtypes kept."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _batch():
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 50, (8, 7), generator=g),
        "loss_mask": torch.rand(8, 7, generator=g).round(),
        "advantages": torch.randn(8, generator=g),
    }


def _body(rank, world, tp):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.trainer.batch import rows_for_rank
    from megatron_rl_fp8.trainer.collectives import scatter_rows

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=tp), seed=0)
    got = scatter_rows(_batch() if g.is_driver else None, g)
    want = rows_for_rank(_batch(), g.dp_rank, g.dp_size)
    same = sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
    )
    parallel.destroy()
    return same, g.dp_rank, got["input_ids"].shape[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_receives_its_data_parallel_rows(tp):
    out = run_distributed(_body, world_size=2, args=(tp,))
    assert all(same for same, _, _ in out)
    assert [(dp, rows) for _, dp, rows in out] == ([(0, 4), (1, 4)] if tp == 1 else [(0, 8)] * 2)
