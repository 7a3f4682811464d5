"""``study --dose-response``: one point per FP8 arm of each study, its noise against its paired
differences from BF16, the clip mode read from the run's config; hand-made runs whose numbers are
known."""

from pathlib import Path

import pytest
import yaml

from megatron_rl_fp8.cli import main
from megatron_rl_fp8.study.dose import clip_mode, dose_points
from tests.unit.test_study_report import write_run

SEEDS = (1, 2, 3)
CALIB = {"enabled": True, "mode": "calibrate", "strategy": "quantile"}
# arm -> (config sections, mismatch, A<0 lower-clip share)
ARMS = {
    "bf16": ({"fp8": {"recipe": None}}, 1.0, 0.010),
    "nominal": (
        {"fp8": {"recipe": "blockwise"}, "loss": {"calib": {"enabled": False}}},
        1.02,
        0.02,
    ),
    "calibrated": ({"fp8": {"recipe": "blockwise"}, "loss": {"calib": CALIB}}, 1.02, 0.011),
    "oracle": (
        {"fp8": {"recipe": "blockwise"}, "loss": {"calib": {**CALIB, "mode": "oracle"}}},
        1.02,
        0.010,
    ),
}


def make_study(root: Path, name: str, scale: float) -> Path:
    base = (Path(__file__).parents[2] / "examples" / "tiny_cpu.yaml").resolve()
    study = root / f"{name}.yaml"
    arms = {a: ({} if a == "bf16" else {"fp8.recipe": "blockwise"}) for a in ARMS}
    study.write_text(yaml.safe_dump({"base": str(base), "seeds": list(SEEDS), "arms": arms}))
    for arm, (config, mismatch, neg) in ARMS.items():
        for seed in SEEDS:
            records = [{"step": 0, "eval/reward_mean": 0.2}]
            for step in range(1, 4):
                records.append(
                    {
                        "step": step,
                        "train/entropy": 1.0,
                        "fp8/token_mult_prob_error": 1 + (mismatch - 1) * scale + 1e-4 * seed,
                        # The lower tail widens with the mismatch: 0.9 for BF16, 0.9 - 0.02 * 3
                        # for FP8 in the "high" study (the seed's term cancels in the pairing).
                        "train/ratio_p01": 0.9 - (mismatch - 1) * scale + 1e-4 * seed,
                        "train/pg_clipfrac_neg_lower": neg * scale + 1e-4 * seed * step,
                    }
                )
            records[-1]["eval/reward_mean"] = 0.3 + 0.01 * seed
            run = write_run(root / "runs" / "studies" / name / arm / f"seed{seed}", records)
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            (run / "checkpoints").mkdir()
    return study


def test_clip_mode():
    assert clip_mode({"fp8": {"recipe": None}}) == "bf16"
    assert clip_mode(ARMS["nominal"][0]) == "nominal"
    assert clip_mode(ARMS["calibrated"][0]) == "calibrated (quantile)"
    assert clip_mode(ARMS["oracle"][0]) == "oracle"


def test_points_and_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    low, high = make_study(tmp_path, "low", 1.0), make_study(tmp_path, "high", 3.0)
    points = {(p["setting"], p["arm"]): p for p in dose_points([low, high])}
    assert set(points) == {(s, a) for s in ("low", "high") for a in ARMS if a != "bf16"}
    p = points[("high", "nominal")]
    assert p["mode"] == "nominal" and p["seeds"] == 3
    assert p["x"]["mean"] == pytest.approx(-0.06)  # paired: ratio p01 - BF16's
    assert p["mismatch"]["mean"] == pytest.approx(1.06 + 2e-4)
    # Paired over seeds: the per-seed terms cancel, so the difference is exact.
    assert p["y"]["neg_lower_clip_share"]["mean"] == pytest.approx((0.02 - 0.010) * 3)
    assert points[("low", "oracle")]["y"]["neg_lower_clip_share"]["mean"] == pytest.approx(0.0)
    assert points[("low", "calibrated")]["mode"] == "calibrated (quantile)"

    out = tmp_path / "dose"
    assert main(["study", "--dose-response", str(low), str(high), "--out", str(out)]) == 0
    assert str(out / "dose_response.md") in capsys.readouterr().out
    md = (out / "dose_response.md").read_text()
    assert md.count("\n| low |") == 3 and md.count("\n| high |") == 3
    assert (out / "dose_response.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study = make_study(tmp_path, "low", 1.0)
    assert main(["study", "--dose-response", "--evidence", str(study)]) == 2
    err = capsys.readouterr().err
    assert "drop --evidence" in err and err.count("\n") == 1
    empty = tmp_path / "empty.yaml"
    empty.write_text(study.read_text())
    assert main(["study", "--dose-response", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "the reference arm 'bf16' has no runs yet" in err and err.count("\n") == 1
