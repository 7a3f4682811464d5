"""Calibrated clipping in the real tiny full-FP8 job, 2 steps each (one spawned rank, the three
runs in it one after another): the sign-wise ``quantile`` rule, the invariant's fallback to the
nominal bounds with its guard event, and the oracle mode.

What is asserted holds on any machine: the quantile rule matches the histogram's own shares (to
float rounding), the forced violation compares BF16's share of A>0 tokens past 1.01 (about half
of them in this batch) with FP8's 0 against a tolerance of 0.001, and the oracle's bounds are the
nominal ones by construction.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL

ROOT = Path(__file__).resolve().parents[2]
FP8 = ROOT / "examples/tiny_cpu_fp8.yaml"
COMMON = [*SMALL, "train.steps=2", "rollout.fp8.quantizer=builtin"]  # modelopt's import spared
RUNS = {
    "quantile": ["loss.calib.strategy=quantile"],
    # BF16 clips the A>0 tokens past 1.01 at the nominal bounds; the limits force the calibrated
    # upper bound to >= 2.9, where FP8 clips none: the A>0 share is broken on purpose.
    "violation": [
        "loss.eps_high=0.01",
        "loss.calib.upper_limits=[2.9,3.0]",
        "loss.calib.invariant_tolerance=0.001",
    ],
    "oracle": ["loss.calib.mode=oracle"],
}


def _runs(rank, world_size, runs: dict, tmp: str):
    from tests.trainer_utils import trainer_body

    out = {}
    for name, overrides in runs.items():
        d = Path(tmp) / name
        overrides = [*COMMON, *overrides, f"train.output_dir={d}", f"train.cache_dir={tmp}/cache"]
        out[name] = trainer_body(rank, world_size, overrides, FP8)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calib_runs")
    (got,) = run_distributed(_runs, world_size=1, args=(RUNS, str(tmp)))
    return tmp, {name: {r["step"]: r for r in metrics} for name, metrics in got.items()}


def test_quantile_rule_clips_bf16s_share_on_both_signs(runs):
    _, m = runs
    s1, s2 = m["quantile"][1], m["quantile"][2]
    assert s1["calib/fallback"] == 0.0 and "guard/rule/calib" not in s1
    for sign in ("neg_lower", "pos_upper"):
        bf16 = s1[f"calib/bf16_{sign}_clipfrac"]
        fp8 = s1[f"calib/fp8_{sign}_clipfrac_calibrated"]
        assert math.isfinite(bf16) and fp8 == pytest.approx(bf16, abs=1e-9), sign
    # The first calibration is used as it is (no EMA yet), by step 1's later update and step 2.
    assert (s2["calib/lower"], s2["calib/upper"]) == (s1["calib/raw_lower"], s1["calib/raw_upper"])
    assert "calib/raw_lower" not in s2  # loss.calib.interval=20: step 2 does not calibrate


def test_a_calibration_that_breaks_the_invariant_falls_back_to_nominal_with_a_guard_event(runs):
    tmp, m = runs
    s1, s2 = m["violation"][1], m["violation"][2]
    assert s1["calib/bf16_pos_upper_clipfrac"] > 0.01, s1["calib/bf16_pos_upper_clipfrac"]
    assert s1["calib/raw_upper"] >= 2.9
    assert s1["calib/fallback"] == 1.0 and s1["calib/invariant_violated/pos_upper"] == 1.0
    assert (s1["calib/lower"], s1["calib/upper"]) == pytest.approx((0.8, 1.01))
    assert s1["guard/rule/calib"] == 1.0 and s1["guard/action/recalibrate"] == 1.0
    (event,) = [
        json.loads(x) for x in (tmp / "violation" / "guard_events.jsonl").read_text().splitlines()
    ][:1]
    assert (event["step"], event["rule"], event["action"]) == (1, "calib", "recalibrate")
    assert "pos_upper" in event["evidence"] and "invariant_tolerance" in event["evidence"]
    assert "calib/raw_lower" in s2  # the recalibrate action: step 2 calibrates again


def test_oracle_decides_every_clip_with_the_bf16_shadow_at_the_nominal_bounds(runs):
    _, m = runs
    for step in (1, 2):
        s = m["oracle"][step]
        assert s["perf/shadow_time_s"] > 0, step
        assert "calib/raw_lower" not in s, step  # nothing calibrated
        assert (s["calib/lower"], s["calib/upper"]) == pytest.approx((0.8, 1.28)), step
        assert math.isfinite(s["train/loss"]) and s["train/skipped_updates"] == 0.0, step
