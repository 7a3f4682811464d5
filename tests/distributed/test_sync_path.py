"""The trainer's weight sync runs the one export path (``sync.buckets.export_for_rollout``), the
function ``benchmarks/bench_sync.py`` measures: the buckets the engine receives equal, name for name,
bucket for bucket and bit for bit, what that function makes from the same weights. Checked with
FP8 rollout weights (codes + scales), and at TP=2 (where the gather runs first)."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL


def _body(rank, world, overrides):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.sync.buckets import export_for_rollout
    from megatron_rl_fp8.sync.gather import iter_full_params
    from megatron_rl_fp8.trainer.loop import Trainer

    trainer = Trainer(load_config(None, list(overrides)))
    try:
        received = []
        if trainer.is_driver:
            real = trainer.engine.update_weights

            def capture(buckets, *, version):
                buckets = list(buckets)
                received.extend(
                    [(b.index, [(n, t.clone()) for n, t in b.tensors]) for b in buckets]
                )
                real(iter(buckets), version=version)

            trainer.engine.update_weights = capture
        trainer.engines.sync(version=1)
        g = trainer.groups
        full = iter_full_params(
            trainer.actor.model, tp_group=g.tp, pp_group=g.pp, dst_global_rank=g.driver_rank
        )
        options = trainer.engine.export_options if trainer.is_driver else {}
        expected = [
            (b.index, list(b.tensors))
            for b in export_for_rollout(full, trainer.cfg.model, trainer.cfg.rollout.fp8, **options)
        ]
        version = trainer.engine.weight_version() if trainer.is_driver else None
    finally:
        trainer.close()
        parallel.destroy()
    if rank != 0:
        return None
    assert len(received) == len(expected) > 0
    for (i, got), (j, want) in zip(received, expected):
        assert i == j and [n for n, _ in got] == [n for n, _ in want]
        for (n, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    return version, sum(t.dtype == torch.float8_e4m3fn for _, ts in received for _, t in ts)


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_sync_sends_the_export_function_output(tmp_path, tp):
    overrides = SMALL + [
        "sft.steps=0",
        "rollout.fp8.weight_quant=blockwise",
        f"parallel.tensor_model_parallel_size={tp}",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path}",
    ]
    version, fp8_tensors = run_distributed(_body, world_size=tp, args=(overrides,))[0]
    assert version == 1 and fp8_tensors == 14  # 7 linears x 2 layers arrive as e4m3 codes
