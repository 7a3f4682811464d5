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

KEYS = (
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "train/pg_clipfrac",
    "rollout/reward_mean",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_sft_cache):
    cache = tiny_sft_cache  # SMALL's warm start: tests/integration/test_calib_run.py's too
    out = tmp_path_factory.mktemp("tp1")
    metrics = run_distributed(
        trainer_body,
        world_size=1,
        args=(SMALL + [f"train.output_dir={out}", f"train.cache_dir={cache}"],),
    )[0]
    return cache, {m["step"]: m for m in metrics}


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tensor_model_parallel_size=2"],
        [],  # 2 ranks, TP=PP=1 -> DP=2
        ["parallel.pipeline_model_parallel_size=2"],
    ],
)
def test_first_step_matches_one_rank(reference, tmp_path, layout):
    cache, ref = reference
    metrics = run_distributed(
        trainer_body,
        world_size=2,
        args=(SMALL + layout + [f"train.output_dir={tmp_path}", f"train.cache_dir={cache}"],),
    )[0]
    got = {m["step"]: m for m in metrics}
    assert got[0]["eval/reward_mean"] == ref[0]["eval/reward_mean"]
    for key in KEYS:
        a, b = got[1][key], ref[1][key]
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (layout, key, a, b)


# Full FP8 with calibrated clipping (the default share mode) at every step and DAPO dynamic
# sampling (format bonus and overlong shaping give the barely-trained policy's groups some reward
# variance to keep). Blockwise FP8 groups are per token (1x128 activations) and per weight tile, so
# splitting the batch over DP ranks or the layers over PP stages quantizes exactly what one rank
# does: the calibration histograms, merged over the DP group (or computed on the last stage), must
# give the 1-rank clip shares and keep fractions. They are read from 4096 bins over log ratios in
# (-2, 2); identical inputs give identical bins, so the tolerance is the same 1e-4 as the loss.
FP8 = [
    "fp8.recipe=blockwise",
    "rollout.fp8.weight_quant=blockwise",
    "loss.calib.interval=1",
    "loss.dynamic_sampling=true",
    "reward.format_weight=0.5",
    "loss.overlong_buffer=4",
]
FP8_KEYS = KEYS + (
    "calib/lower",
    "calib/upper",
    "calib/bf16_neg_lower_clipfrac",
    "calib/fp8_neg_lower_clipfrac_nominal",
    "calib/bf16_pos_upper_clipfrac",
    "calib/keep_neg_lower",
    "calib/keep_pos_upper",
    "fp8/token_mult_prob_error",
)


@pytest.fixture(scope="module")
def fp8_reference(reference, tmp_path_factory):
    cache, _ = reference
    out = tmp_path_factory.mktemp("fp8_1rank")
    metrics = run_distributed(
        trainer_body,
        world_size=1,
        args=(SMALL + FP8 + [f"train.output_dir={out}", f"train.cache_dir={cache}"],),
    )[0]
    return {m["step"]: m for m in metrics}


@pytest.mark.parametrize(
    "layout", [[], ["parallel.pipeline_model_parallel_size=2"]], ids=["dp2", "pp2"]
)
def test_fp8_calibration_matches_one_rank(reference, fp8_reference, tmp_path, layout):
    cache, _ = reference
    metrics = run_distributed(
        trainer_body,
        world_size=2,
        args=(SMALL + FP8 + layout + [f"train.output_dir={tmp_path}", f"train.cache_dir={cache}"],),
    )[0]
    got, ref = {m["step"]: m for m in metrics}[1], fp8_reference[1]
    assert ref["calib/hist_bytes"] == got["calib/hist_bytes"] == 8 * (4 * 4096 + 9)
    assert ref["rollout/sampling_rounds"] == got["rollout/sampling_rounds"] >= 1
    for key in FP8_KEYS:
        assert math.isclose(got[key], ref[key], rel_tol=1e-4, abs_tol=1e-6), (layout, key)


# Every loss aggregation through the trainer. The seq-mean modes divide by the global count of
# sequences (not tokens) of the mini-batch, so DP=2 must still give the 1-rank loss; and they
# weight tokens differently from token-mean, so the loss must differ from the reference's.
# Both seq-mean modes share that denominator; how each weighs tokens inside a sequence is
# aggregate_loss's, checked against float64 in tests/unit/test_loss_ppo.py. So token-sum is `slow`
# (make test-all) to keep the default suite within its time budget.
@pytest.mark.parametrize(
    "agg", [pytest.param("seq-mean-token-sum", marks=pytest.mark.slow), "seq-mean-token-mean"]
)
def test_loss_aggregation_modes_match_one_rank(reference, tmp_path, agg):
    cache, token_mean = reference
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"dp{world}"
        metrics = run_distributed(
            trainer_body,
            world_size=world,
            args=(
                SMALL + [f"loss.agg={agg}", f"train.output_dir={out}", f"train.cache_dir={cache}"],
            ),
        )[0]
        runs[world] = {m["step"]: m for m in metrics}[1]
    for key in KEYS:
        assert math.isclose(runs[2][key], runs[1][key], rel_tol=1e-4, abs_tol=1e-6), (agg, key)
    assert math.isfinite(runs[1]["train/loss"])
    assert runs[1]["rollout/reward_mean"] == token_mean[1]["rollout/reward_mean"]
    assert not math.isclose(runs[1]["train/loss"], token_mean[1]["train/loss"], rel_tol=1e-3)
