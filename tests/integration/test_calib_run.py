"""Calibrated clipping in the real tiny full-FP8 job, 2 steps each (one spawned rank, the three
runs in it one after another): the sign-wise ``quantile`` rule, the invariant's fallback to the
nominal bounds with its guard event, the oracle mode, the share mode thinning the nominal clip set
to BF16's share, calibration under delayed scaling leaving the amax histories as the update
will find them, and delayed scales held for a step (``fp8.scales_per_step``).

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
# Narrow nominal bounds put enough tokens of the small batch past them for the shares to differ.
NARROW = [
    "loss.eps_low=0.05",
    "loss.eps_high=0.05",
    "fp8.recipe=nvfp4",
    "train.prompts_per_step=64",
    "rollout.n_samples_per_prompt=8",
    "sft.steps=200",
]
RUNS = {
    "quantile": ["loss.calib.mode=calibrate", "loss.calib.strategy=quantile"],
    # BF16 clips the A>0 tokens past 1.01 at the nominal bounds; the limits force the calibrated
    # upper bound to >= 2.9, where FP8 clips none: the A>0 share is broken on purpose.
    "violation": [
        "loss.calib.mode=calibrate",
        "loss.eps_high=0.01",
        "loss.calib.upper_limits=[2.9,3.0]",
        "loss.calib.invariant_tolerance=0.001",
    ],
    "oracle": ["loss.calib.mode=oracle"],
    # Step 1's first update trains pi_old itself (every ratio 1, nothing clipped), so the two runs
    # reach the calibrated mini-batch with the same weights and differ only in its clip.
    "share": ["loss.calib.mode=share", *NARROW],
    "nominal": ["loss.calib.enabled=false", *NARROW],
}
# Delayed scaling: every calibration's FP8 pass must leave the amax histories as it found them,
# so a run that calibrates at every step records exactly as many amaxes as one that never does.
DELAYED = ["fp8.recipe=tensorwise_delayed", "fp8.format=hybrid", "loss.calib.mode=calibrate"]
MOVING = "fp8.scales_per_step=false"  # the scales move within a step (TE did before 2026-12-07)
RUNS |= {
    "delayed_calibrated": [*DELAYED, MOVING, "loss.calib.interval=1"],
    "delayed_nominal": [*DELAYED, MOVING, "loss.calib.enabled=false"],
    # fp8.scales_per_step's default ('auto') on the emulation: the step's passes keep its first
    # scales and still record their amaxes.
    "delayed_per_step": [*DELAYED, "loss.calib.enabled=false"],
}
# Share mode calibrating at every step, stopped after step 2 and resumed: the counts, the pooling
# window (a minimum no calibration reaches, so step 3 pools every calibration before it) and the
# seeded rounding must come back as they were (compared with 3 uninterrupted steps).
SHARE_3 = [
    "loss.calib.mode=share",
    *NARROW,
    "loss.calib.interval=1",
    "loss.calib.share_min_tokens=100000",
    "train.steps=3",
]
RUNS |= {
    "share_3_steps": SHARE_3,
    "share_resumed": [[*SHARE_3, "train.save_interval=1", "train.exit_after_steps=2"], SHARE_3],
}


def _runs(rank, world_size, runs: dict, tmp: str, cache: str):
    out = {}
    for name, overrides in runs.items():
        d = Path(tmp) / name
        # A list of override lists: the runs one after another in one output directory.
        for part in overrides if isinstance(overrides[0], list) else [overrides]:
            part = [*COMMON, *part, f"train.output_dir={d}", f"train.cache_dir={cache}"]
            out[name] = _run_with_amax_counts(part)
    return out


def _run_with_amax_counts(overrides):
    """The run's metrics and, per FP8 linear and operand role, how many amaxes its delayed-scaling
    history recorded."""
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.metrics.logger import read_metrics
    from megatron_rl_fp8.models.fp8 import fp8_scaling_state
    from megatron_rl_fp8.trainer.loop import Trainer

    cfg = load_config(FP8, overrides)
    trainer = Trainer(cfg)
    try:
        trainer.run()
        counts = {
            (name, role): s["num_updates"]
            for name, roles in fp8_scaling_state(trainer.actor.module).items()
            for role, s in roles.items()
        }
    finally:
        trainer.close()
        parallel.destroy()
    return read_metrics(cfg.train.output_dir), counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_sft_cache):
    tmp = tmp_path_factory.mktemp("calib_runs")
    # Eleven short runs in one rank: ~4 min on CI's 2 cores, so the hang guard is wider than the
    # default 300 s (a loaded machine took 243 s).
    (got,) = run_distributed(
        _runs, world_size=1, args=(RUNS, str(tmp), str(tiny_sft_cache)), timeout=900
    )
    metrics = {name: {r["step"]: r for r in m} for name, (m, _) in got.items()}
    return tmp, metrics, {name: counts for name, (_, counts) in got.items()}


def test_quantile_rule_clips_bf16s_share_on_both_signs(runs):
    _, m, _ = runs
    s1, s2 = m["quantile"][1], m["quantile"][2]
    assert s1["calib/fallback"] == 0.0 and "guard/rule/calib" not in s1
    for sign in ("neg_lower", "pos_upper"):
        bf16 = s1[f"calib/bf16_{sign}_clipfrac"]
        fp8 = s1[f"calib/fp8_{sign}_clipfrac_calibrated"]
        assert math.isfinite(bf16) and fp8 == pytest.approx(bf16, abs=1e-9), sign
    # The first calibration is used as it is (no EMA yet), by step 1's later update and step 2.
    assert (s2["calib/lower"], s2["calib/upper"]) == (s1["calib/raw_lower"], s1["calib/raw_upper"])
    assert "calib/raw_lower" not in s2  # loss.calib.interval=5: step 2 does not calibrate


def test_a_calibration_that_breaks_the_invariant_falls_back_to_nominal_with_a_guard_event(runs):
    tmp, m, _ = runs
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
    _, m, _ = runs
    for step in (1, 2):
        s = m["oracle"][step]
        assert s["perf/shadow_time_s"] > 0, step
        assert "calib/raw_lower" not in s, step  # nothing calibrated
        assert (s["calib/lower"], s["calib/upper"]) == pytest.approx((0.8, 1.28)), step
        assert math.isfinite(s["train/loss"]) and s["train/skipped_updates"] == 0.0, step


def test_calibrating_under_delayed_scaling_leaves_the_amax_histories_alone(runs):
    _, m, counts = runs
    assert all("calib/raw_lower" in m["delayed_calibrated"][step] for step in (1, 2))
    # Both runs record the same amaxes: the calibrations' extra FP8 passes recorded none (before
    # the fix each added one per linear and mini-batch, and the update then clipped the FP8
    # ratios of other scales than the ones calibrated on).
    assert (
        counts["delayed_calibrated"] and counts["delayed_calibrated"] == counts["delayed_nominal"]
    )
    assert not counts["quantile"]  # blockwise keeps no history


def test_scales_per_step_records_every_amax_and_changes_the_steps_scales(runs):
    _, m, counts = runs
    # Held scales still let every pass record: the histories fill as in the unheld run.
    assert counts["delayed_per_step"] and counts["delayed_per_step"] == counts["delayed_nominal"]
    held, moving = m["delayed_per_step"], m["delayed_nominal"]
    assert all(math.isfinite(held[step]["train/loss"]) for step in (1, 2))
    # Same rollouts at step 1 (same weights, seed and rollout quantizer); the update's log ratios
    # differ because its scales do: before any history every pass of step 1 takes its own amax.
    assert held[1]["rollout/reward_mean"] == moving[1]["rollout/reward_mean"]
    assert held[1]["train/ratio_mean"] != moving[1]["train/ratio_mean"]


def test_share_mode_clips_bf16s_count_at_the_nominal_bounds(runs):
    _, m, _ = runs
    s1, s2 = m["share"][1], m["share"][2]
    n1 = m["nominal"][1]
    assert s1["calib/fallback"] == 0.0
    for step in (1, 2):  # the bounds in use stay nominal; the clip set is thinned instead
        assert (m["share"][step]["calib/lower"], m["share"][step]["calib/upper"]) == (0.95, 1.05)
    for sign in ("neg_lower", "pos_upper"):
        bf16, fp8 = s1[f"calib/bf16_{sign}_clipfrac"], s1[f"calib/fp8_{sign}_clipfrac_nominal"]
        keep = s1[f"calib/keep_{sign}"]
        assert keep == pytest.approx(min(1.0, bf16 / fp8) if fp8 > 0 else 1.0), sign
        assert s1[f"calib/fp8_{sign}_clipfrac_calibrated"] == pytest.approx(min(bf16, fp8)), sign
    # The update thinned: with the same weights on the same mini-batch it clips no more of either
    # sign than the nominal run (how many fewer depends on the rows' rounding and this machine's
    # rollouts; tests/unit/test_clip_thinning.py checks the count).
    assert min(s1["calib/keep_neg_lower"], s1["calib/keep_pos_upper"]) < 1
    for sign in ("neg_lower", "pos_upper"):
        assert s1[f"train/pg_clipfrac_{sign}"] <= n1[f"train/pg_clipfrac_{sign}"], sign
    # Step 2 does not calibrate (interval 5) and clips with the fractions step 1 measured.
    assert "calib/bf16_neg_lower_clipfrac" not in s2 and math.isfinite(s2["train/loss"])
    for sign in ("neg_lower", "pos_upper"):
        assert s2[f"calib/keep_{sign}"] == s1[f"calib/keep_{sign}"], sign


def test_share_mode_resumes_to_the_uninterrupted_run(runs):
    _, m, _ = runs
    full, resumed = m["share_3_steps"], m["share_resumed"]
    assert sorted(resumed) == [0, 1, 2, 3] == sorted(full)
    # The carried state matters: some fraction below 1 was in use.
    assert any(
        min(full[s]["calib/keep_neg_lower"], full[s]["calib/keep_pos_upper"]) < 1 for s in (2, 3)
    )
    for step in (1, 2, 3):  # same machine, same kernels: bit for bit but the timings
        drop = ("perf/",)
        a = {k: v for k, v in full[step].items() if not k.startswith(drop)}
        b = {k: v for k, v in resumed[step].items() if not k.startswith(drop)}
        assert a == b, step
