"""The study report: per-run statistics, t intervals, paired vs Welch differences, and the files."""

import json
import math

import pytest
import yaml

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.study.report import (
    difference,
    interval,
    study_numbers,
    t_quantile,
    welch,
    write_study_report,
)

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 30: 2.042, 100: 1.984}


def write_run(path, records, guard=None, events=0):
    """A run directory: ``records`` as metrics.jsonl lines (non-finite values written as the
    logger writes them, as strings), config.yaml with ``guard``, ``events`` guard events."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for rec in records:
            enc = {
                k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                for k, v in rec.items()
            }
            f.write(json.dumps(enc) + "\n")
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": 0}, "guard": guard or {}}))
    if events:
        lines = [
            json.dumps({"step": i + 1, "rule": "entropy", "action": "rollback", "evidence": ""})
            for i in range(events)
        ]
        (path / "guard_events.jsonl").write_text("\n".join(lines) + "\n")
    return path


def simple_run(path, final, mismatch=None, entropy=(2.0, 2.0, 2.0, 2.0), events=0):
    """Eval 0.1 at step 0 and ``final`` at step 4; four train steps with ``entropy``."""
    records = [{"step": 0, "eval/reward_mean": 0.1}]
    for step, h in enumerate(entropy, start=1):
        rec = {"step": step, "train/entropy": h, "rollout/reward_mean": 0.5}
        if mismatch is not None:
            rec["fp8/token_mult_prob_error"] = mismatch
        records.append(rec)
    records[-1]["eval/reward_mean"] = final
    return write_run(path, records, events=events)


# -- the t quantile and intervals ----------------------------------------------------------------
@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_known_values(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], abs=1e-3)
    assert t_quantile(0.025, df) == pytest.approx(-T975[df], abs=1e-3)


def test_t_quantile_fractional_df_hand_computed():
    # Closed forms: df = 1 is Cauchy, tan(pi (q - 1/2)); df = 2 is (2q - 1) sqrt(2 / (4q(1-q))).
    for q in (0.6, 0.9, 0.975):
        assert t_quantile(q, 1.0) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-12)
        two = (2 * q - 1) * math.sqrt(2 / (4 * q * (1 - q)))
        assert t_quantile(q, 2.0) == pytest.approx(two, rel=1e-12)
    # Fractional df sit between their integer neighbours (Welch's df are fractional).
    assert t_quantile(0.975, 2.0) > t_quantile(0.975, 2.5) > t_quantile(0.975, 3.0)
    with pytest.raises(ValueError, match="df > 0"):
        t_quantile(0.975, 0.0)


def test_interval_hand_computed():
    iv = interval([1.0, 2.0, None, 3.0])  # None: a seed without the value
    half = 4.302652729749461 / math.sqrt(3)  # sd = 1
    assert iv == pytest.approx({"n": 3, "mean": 2.0, "lo": 2.0 - half, "hi": 2.0 + half})
    assert interval([5.0]) == {"n": 1, "mean": 5.0, "lo": None, "hi": None}
    assert interval([None, None]) == {"n": 0, "mean": None, "lo": None, "hi": None}


def test_welch_hand_computed():
    # Equal variances 0.01 and n = 3 each: df = (2v)^2 / (2 v^2 / 2) = 4, se = sqrt(2 * 0.01 / 3).
    w = welch([0.6, 0.7, 0.8], [0.5, 0.6, 0.7])
    half = 2.7764451051977934 * math.sqrt(0.02 / 3)
    assert w["mean"] == pytest.approx(0.1) and w["df"] == pytest.approx(4.0)
    assert (w["lo"], w["hi"]) == pytest.approx((0.1 - half, 0.1 + half))
    one = welch([0.6], [0.5, 0.6])
    assert one["mean"] == pytest.approx(0.05) and one["lo"] is None
    assert welch([0.6, 0.6], [0.5, 0.5])["lo"] == pytest.approx(0.1)  # no spread: exact


def test_difference_paired_only_with_the_same_seeds():
    ref = {0: 0.5, 1: 0.6, 2: 0.7}
    paired = difference({0: 0.45, 1: 0.5, 2: 0.7}, ref)  # diffs -0.05, -0.1, 0: sd 0.05
    half = 4.302652729749461 * 0.05 / math.sqrt(3)
    assert paired["test"] == "paired" and paired["n"] == 3
    assert (paired["mean"], paired["lo"], paired["hi"]) == pytest.approx(
        (-0.05, -0.05 - half, -0.05 + half)
    )
    assert difference({0: 0.6, 1: 0.7, 3: 0.8}, ref)["test"] == "welch"  # another seed set
    # Same seeds, but one shared seed with the value: no pairs to estimate a spread on.
    sparse = difference({0: 0.6, 1: None, 2: None}, {0: 0.5, 1: 0.6, 2: None})
    assert sparse["test"] == "welch" and sparse["n"] == 1 and sparse["n_ref"] == 2


# -- per-run statistics --------------------------------------------------------------------------
def detailed_run(path, guard=None, events=0):
    entropy = [2.0, 1.5, 2.0, 2.8]  # running min 2.0, 1.5, 1.5, 1.5: rises 0, 0, 0.5, 1.3
    records = [{"step": 0, "eval/reward_mean": 0.2, "sft/final_loss": 2.0}]
    for step in range(1, 5):
        records.append(
            {
                "step": step,
                "train/entropy": entropy[step - 1],
                "train/pg_clipfrac_neg_lower": 0.1 * step,
                "train/pg_clipfrac_pos_upper": 0.01,
                "train/ratio_p50": math.nan if step == 3 else 1.0 + 0.01 * step,
                "rollout/garbled_frac": 0.0,
            }
        )
    records[2]["eval/reward_mean"] = 0.4
    records[4]["eval/reward_mean"] = 0.3
    return write_run(path, records, guard=guard, events=events)


def one_run_stats(path):
    return study_numbers({"a": {0: path}}, "a")["arms"]["a"]["runs"]["0"]


def test_run_stats_hand_computed(tmp_path):
    s = one_run_stats(detailed_run(tmp_path / "r", events=2))
    assert s["final_accuracy"] == pytest.approx(0.3)
    assert s["best_accuracy"] == pytest.approx(0.4)
    assert s["start_accuracy"] == pytest.approx(0.2) and s["sft_loss"] == 2.0
    # Trapezoids (2 - 0)(0.2 + 0.4)/2 + (4 - 2)(0.4 + 0.3)/2 = 1.3, over 4 steps.
    assert s["accuracy_auc"] == pytest.approx(1.3 / 4)
    assert s["max_entropy_rise"] == pytest.approx(1.3)
    assert s["entropy_rule_step"] == 4  # 1.3 > 1.0 (the default limit); 0.5 at step 3 is not
    assert s["neg_lower_clip_share"] == pytest.approx(0.25)
    assert s["pos_upper_clip_share"] == pytest.approx(0.01)
    assert s["ratio_p50"] == pytest.approx((1.01 + 1.02 + 1.04) / 3)  # the nan step is missing
    assert s["garbled_share"] == 0.0
    assert s["token_mult_prob_error"] is None and s["ratio_p01"] is None  # never logged
    assert s["useful_tokens_per_s"] is None
    assert s["guard_events"] == 2 and s["steps"] == 4


@pytest.mark.parametrize(
    "guard, step",
    [
        ({"max_entropy_rise": 0.4}, 3),
        ({"max_entropy_rise": None}, 4),
        ({"max_entropy_rise": 2.0}, None),
    ],
)
def test_entropy_rule_step_follows_the_config(tmp_path, guard, step):
    assert one_run_stats(detailed_run(tmp_path / "r", guard=guard))["entropy_rule_step"] == step


def test_run_without_eval_or_events(tmp_path):
    path = write_run(
        tmp_path / "r", [{"step": 1, "train/entropy": 3.0}, {"step": 2, "eval/reward_mean": 0.5}]
    )
    s = one_run_stats(path)
    assert s["final_accuracy"] == s["best_accuracy"] == s["start_accuracy"] == 0.5
    assert s["accuracy_auc"] is None and s["sft_loss"] is None
    assert s["max_entropy_rise"] == 0.0 and s["entropy_rule_step"] is None
    assert s["guard_events"] == 0 and s["steps"] == 2


# -- the study -----------------------------------------------------------------------------------
@pytest.fixture
def study(tmp_path):
    """bf16 (reference) and fp8 on seeds 0-2 (paired); fp8_cal on seeds 0, 1, 3 (Welch)."""
    finals = {"bf16": [0.5, 0.6, 0.7], "fp8": [0.45, 0.5, 0.7], "fp8_cal": [0.6, 0.7, 0.8]}
    seeds = {"bf16": [0, 1, 2], "fp8": [0, 1, 2], "fp8_cal": [0, 1, 3]}
    arms = {}
    for arm, values in finals.items():
        arms[arm] = {}
        for seed, final in zip(seeds[arm], values):
            # fp8 seed 2 lost its mismatch metric; bf16 never logs it.
            mismatch = None if arm == "bf16" or (arm == "fp8" and seed == 2) else 1.01 + 0.01 * seed
            path = tmp_path / "runs" / f"{arm}_s{seed}"
            arms[arm][seed] = simple_run(path, final, mismatch, events=1 if arm == "fp8" else 0)
    return arms


def test_study_numbers(study):
    nums = study_numbers(study, "bf16")
    assert nums["reference"] == "bf16" and "Welch" in nums["statistic"]
    assert list(nums["arms"]) == ["bf16", "fp8", "fp8_cal"]
    bf16, fp8, cal = (nums["arms"][a] for a in ("bf16", "fp8", "fp8_cal"))
    assert bf16["seeds"] == [0, 1, 2] and bf16["diff"] == {}
    assert bf16["stats"]["final_accuracy"] == pytest.approx(interval([0.5, 0.6, 0.7]))
    assert fp8["diff"]["final_accuracy"] == pytest.approx(
        difference({0: 0.45, 1: 0.5, 2: 0.7}, {0: 0.5, 1: 0.6, 2: 0.7})
    )
    assert fp8["diff"]["final_accuracy"]["test"] == "paired"
    assert cal["diff"]["final_accuracy"]["test"] == "welch"
    assert cal["diff"]["final_accuracy"]["df"] == pytest.approx(4.0)
    # Missing data: fp8's mismatch over the 2 seeds that have it; bf16 has none to compare with.
    mis = fp8["stats"]["token_mult_prob_error"]
    assert mis["n"] == 2 and mis["mean"] == pytest.approx(1.015)
    assert bf16["stats"]["token_mult_prob_error"] == {"n": 0, "mean": None, "lo": None, "hi": None}
    assert fp8["diff"]["token_mult_prob_error"]["mean"] is None
    assert (
        fp8["stats"]["guard_events"]["mean"] == 1.0 and bf16["stats"]["guard_events"]["mean"] == 0.0
    )
    assert cal["stats"]["entropy_rule_step"]["n"] == 0  # never fired


def test_write_study_report(study, tmp_path):
    out = tmp_path / "out" / "report"
    report = write_study_report(study, "bf16", out, "FP8 study")
    assert report == out / "report.md"
    numbers = json.loads((out / "study.json").read_text())
    assert numbers == study_numbers(study, "bf16")
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 150_000
    assert not list(out.glob("*.tmp"))
    text = report.read_text()
    assert text.startswith("# FP8 study\n") and "95% Student-t" in text
    assert "![curves](curves.png)" in text
    final = numbers["arms"]["fp8_cal"]["stats"]["final_accuracy"]
    assert f"{final['mean']:.3f} [{final['lo']:.3f}, {final['hi']:.3f}]" in text
    d = numbers["arms"]["fp8"]["diff"]["guard_events"]  # 1 - 0 on every seed: excludes 0
    assert f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}] *" in text
    assert "| fp8_cal | 3 | 0.800 |" in text  # the per-run table: arm, seed, final accuracy
    for skipped in ("train/pg_clipfrac_neg_lower", "train/pg_clipfrac_pos_upper"):
        assert f"`{skipped}`" in text.split("Skipped panels")[1]
    assert "`eval/reward_mean`" not in text.split("Skipped panels")[1]


def test_bad_input_is_a_config_error(study, tmp_path):
    with pytest.raises(ConfigError, match="reference arm 'fp16'"):
        study_numbers(study, "fp16")
    broken = tmp_path / "runs" / "empty"
    broken.mkdir()
    study["fp8"][7] = broken
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"arm 'fp8' seed 7: .*empty.* has no metrics.jsonl"):
        write_study_report(study, "bf16", out, "t")
    assert not out.exists()  # checked before anything is written
