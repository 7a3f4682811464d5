"""``study --evidence``: the calibration evidence table over studies, from hand-made run dirs whose
differences are known: a rule that matches BF16's clip shares and keeps nominal's accuracy is
``ok``; one that clips A>0 tokens more than BF16 and loses accuracy is named for both; nominal FP8
with an A<0 excess is shown departing from BF16."""

from pathlib import Path

import pytest
import yaml

from megatron_rl_fp8.cli import main
from megatron_rl_fp8.study.evidence import evidence_table, study_evidence, verdict
from tests.unit.test_study_report import write_run

BASE = "examples/tiny_cpu.yaml"
SEEDS = (1, 2, 3)
# arm -> (final accuracy offset, A<0 lower-clip share, A>0 upper-clip share), per seed noise added
ARMS = {
    "bf16": (0.00, 0.010, 0.003),
    "fp8_nominal": (0.00, 0.018, 0.003),
    "fp8_good": (0.01, 0.010, 0.003),
    "fp8_bad": (-0.08, 0.010, 0.040),
}


def make_study(tmp_path, monkeypatch, name="ev", arms=ARMS):
    root = tmp_path / "proj"
    root.mkdir(exist_ok=True)
    monkeypatch.chdir(root)
    base = (Path(__file__).parents[2] / BASE).resolve()
    study = root / f"{name}.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "base": str(base),
                "seeds": list(SEEDS),
                "overrides": {"train.steps": 4},
                "reference": "bf16",
                "arms": {a: ({} if a == "bf16" else {"fp8.recipe": "blockwise"}) for a in arms},
            }
        )
    )
    for arm, (acc, neg, pos) in arms.items():
        for seed in SEEDS:
            noise = 0.0005 * seed  # the same per seed in every arm: paired differences are exact
            records = [{"step": 0, "eval/reward_mean": 0.2}]
            for step in range(1, 5):
                records.append(
                    {
                        "step": step,
                        "train/entropy": 1.0,
                        "train/pg_clipfrac_neg_lower": neg + noise + 1e-4 * step * (seed - 2),
                        "train/pg_clipfrac_pos_upper": pos + noise - 1e-4 * step * (seed - 2),
                    }
                )
            records[-1]["eval/reward_mean"] = 0.3 + acc + 0.01 * seed + 0.002 * (seed - 2) * acc
            run = write_run(root / "runs" / "studies" / name / arm / f"seed{seed}", records)
            (run / "checkpoints" / "iter_0000004").mkdir(parents=True)  # finished
    return study


def test_rows_and_verdicts(tmp_path, monkeypatch):
    rows = {r["arm"]: r for r in study_evidence(make_study(tmp_path, monkeypatch), "fp8_nominal")}
    assert set(rows) == {"fp8_nominal", "fp8_good", "fp8_bad"}
    assert rows["fp8_good"]["verdict"] == "ok"
    assert rows["fp8_good"]["vs_nominal"]["final_accuracy"]["mean"] == pytest.approx(0.01)
    assert (
        rows["fp8_bad"]["verdict"]
        == "final acc. below nominal; acc. AUC below nominal; A>0 clip share != BF16"
    )
    assert rows["fp8_nominal"]["vs_nominal"] is None
    assert rows["fp8_nominal"]["verdict"] == "A<0 clip share != BF16"
    assert rows["fp8_nominal"]["vs_bf16"]["neg_lower_clip_share"]["mean"] == pytest.approx(0.008)


def test_table_and_cli(tmp_path, monkeypatch, capsys):
    study = make_study(tmp_path, monkeypatch)
    table = evidence_table([study])
    assert table.count("\n| ev |") == 3 and "(nominal)" in table
    assert main(["study", "--evidence", str(study)]) == 0
    assert capsys.readouterr().out == table


def test_too_few_seeds_decide_nothing():
    one_seed = {"mean": -0.1, "lo": None, "hi": None}
    ok = {"mean": 0.0, "lo": -0.01, "hi": 0.01}
    clips = {"neg_lower_clip_share": ok, "pos_upper_clip_share": ok}
    assert verdict({"final_accuracy": one_seed}, clips) == "?"
    assert verdict({"final_accuracy": ok}, clips) == "ok"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--evidence", "--nominal", "fp8_x"], "has no arm 'fp8_x' (the nominal arm)"),
        (["--evidence", "--jobs", "2"], "drop --out, --jobs and --report-only"),
        ([], "2 study files given"),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, argv, message):
    study = str(make_study(tmp_path, monkeypatch))
    extra = [study] if not argv else []
    assert main(["study", study, *extra, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_nominal_without_runs(tmp_path, monkeypatch, capsys):
    study = make_study(tmp_path, monkeypatch, arms={k: ARMS[k] for k in ("bf16", "fp8_good")})
    data = yaml.safe_load(study.read_text())
    data["arms"]["fp8_nominal"] = {"loss.calib.enabled": False}
    study.write_text(yaml.safe_dump(data))
    assert main(["study", "--evidence", str(study)]) == 2
    assert "the nominal arm 'fp8_nominal' has no runs yet" in capsys.readouterr().err


def test_an_unfinished_run_is_named_in_its_rows(tmp_path, monkeypatch):
    """Read mid-study, a row says how many of the runs it compares have not finished: a nominal
    run still at step 2 shows in the nominal row and in every row compared with nominal."""
    study = make_study(tmp_path, monkeypatch)
    run = Path("runs/studies/ev/fp8_nominal/seed2/checkpoints")
    (run / "iter_0000004").rename(run / "iter_0000002")
    rows = {r["arm"]: r for r in study_evidence(study, "fp8_nominal")}
    assert {a: r["unfinished"] for a, r in rows.items()} == {
        "fp8_nominal": 1,
        "fp8_good": 1,
        "fp8_bad": 1,
    }
    table = evidence_table([study])
    assert table.count("| 3 (1 unfinished) |") == 3 and "the row is not the study's result" in table
    (run / "iter_0000002").rename(run / "iter_0000004")
    assert "unfinished" not in evidence_table([study])
