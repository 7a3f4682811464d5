"""The KL penalty against the frozen reference, through the real trainer (tiny run, gloo ranks).

The reference (random init + SFT warm start here) is the policy at RL step 0, so with one update
per step the first update sees pi_theta == pi_ref: the same weights through the same forward, a
KL of 0 up to float rounding. Step 2's update sees the policy after one optimizer step: a small
but clearly nonzero KL. Three runs (the budget is ~1 minute on 2 cores):

* one rank, uninterrupted: KL ~0 at step 1, > 0 and finite at step 2;
* one rank stopped after step 1 (it saved the reference snapshot and a checkpoint), then resumed
  at TP=2: its step 2 must give the uninterrupted run's KL. That checks both that a resume
  restores the reference (one re-copied from the resumed actor would give ~0 instead) and that
  TP=2 computes the 1-rank KL from the same (resharded) weights. Only the reduction order differs:
  ~1e-6 absolute in fp32 logprobs, against log ratios of ~0.1 here (KL ~5e-3 ~ E[(log r)^2] / 2),
  so ~2e-5 relative in the KL (1.7e-6 seen): the layout tests' 1e-4 holds.
"""

import math

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL, trainer_body

KL = SMALL + [
    "loss.kl_coef=0.1",
    "train.updates_per_step=1",
    "train.steps=2",
    "train.save_interval=1",
    "train.eval_interval=0",
]


def _run(world, out, cache, extra=()):
    overrides = KL + list(extra) + [f"train.output_dir={out}", f"train.cache_dir={cache}"]
    metrics = run_distributed(trainer_body, world_size=world, args=(overrides,))[0]
    return {m["step"]: m for m in metrics}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, cache):
    return _run(1, tmp_path_factory.mktemp("tp1"), cache)


def test_kl_is_zero_at_the_first_update_and_grows(one_rank):
    first, second = one_rank[1]["train/kl"], one_rank[2]["train/kl"]
    # Per-token low_var_kl of identical logprobs is exactly 0; allow fp32 rounding.
    assert abs(first) < 1e-7, first
    # One Adam step at lr=1e-4 moves every weight by ~1e-4: a KL of ~5e-3 here; 1e-4 leaves a
    # wide margin for other machines, far above the rounding bound of step 1.
    assert math.isfinite(second) and second > 1e-4, second
    assert math.isfinite(one_rank[2]["train/loss"])


def test_resume_at_tp2_restores_the_reference(one_rank, tmp_path, cache):
    stopped = _run(1, tmp_path, cache, ["train.exit_after_steps=1"])
    assert stopped[1]["train/kl"] == one_rank[1]["train/kl"]
    assert (tmp_path / "reference" / "latest").is_file()
    resumed = _run(2, tmp_path, cache, ["parallel.tensor_model_parallel_size=2"])
    for key in ("train/kl", "train/loss"):
        assert math.isclose(resumed[2][key], one_rank[2][key], rel_tol=1e-4), (
            key,
            resumed[2][key],
            one_rank[2][key],
        )
