"""TP=2 and DP=2 give the 1-rank first-step loss (2 real gloo ranks running the whole trainer).

All layouts start from the same SFT warm start: the 1-rank run writes it to the cache and the
others load it through dist_checkpointing, resharded. Rollouts come from the same engine weights
and seed, so the batches are identical; what differs is the order of floating-point reductions
(TP splits the GEMM reductions and the vocab softmax; DP sums micro-batch gradients across ranks).
That is ~1e-7 relative in fp32; after one Adam step (updates_per_step=2 makes the second mini-batch
see the updated policy) it stays far below 1e-4, the tolerance used here.
"""

import math

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL, trainer_body

KEYS = ("train/loss", "train/entropy", "train/grad_norm", "train/pg_clipfrac", "rollout/reward_mean")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("tp1")
    metrics = run_distributed(trainer_body, world_size=1,
                              args=(SMALL + [f"train.output_dir={out}", f"train.cache_dir={cache}"],))[0]
    return cache, {m["step"]: m for m in metrics}


@pytest.mark.parametrize("layout", [
    ["parallel.tensor_model_parallel_size=2"],
    [],  # 2 ranks, TP=PP=1 -> DP=2
    ["parallel.pipeline_model_parallel_size=2"],
])
def test_first_step_matches_one_rank(reference, tmp_path, layout):
    cache, ref = reference
    metrics = run_distributed(trainer_body, world_size=2,
                              args=(SMALL + layout + [f"train.output_dir={tmp_path}",
                                                      f"train.cache_dir={cache}"],))[0]
    got = {m["step"]: m for m in metrics}
    assert got[0]["eval/reward_mean"] == ref[0]["eval/reward_mean"]
    for key in KEYS:
        a, b = got[1][key], ref[1][key]
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (layout, key, a, b)
