"""``study --slurm`` before any Slurm: its bad input is one line, and a run whose last guard
event is a stop counts as stopped (under Slurm torchrun hides the trainer's exit code 3)."""

import json

import pytest
import yaml

from megatron_rl_fp8.cli import main
from megatron_rl_fp8.study.runner import load_study
from tests.unit.test_study_evidence import BASE, Path


@pytest.fixture
def study(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "s.yaml"
    base = (Path(__file__).parents[2] / BASE).resolve()
    path.write_text(yaml.safe_dump({"base": str(base), "seeds": [1], "arms": {"bf16": {}}}))
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sbatch=--nodes=2"], "--sbatch applies to --slurm only"),
        (["--slurm", "--report-only"], "drop --report-only and --jobs"),
    ],
)
def test_bad_flags_are_one_line(study, capsys, extra, message):
    assert main(["study", str(study), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_no_slurm_on_path_is_one_line(study, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["study", str(study), "--slurm"]) == 2
    err = capsys.readouterr().err
    assert "'sbatch' is not on PATH" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_guard_stop_in_the_events_file_is_stopped(study):
    run = load_study(study).runs[0]
    assert run.state() == "new"
    run.path.mkdir(parents=True)
    (run.path / "checkpoints").mkdir()
    assert run.state() == "partial"
    events = [{"step": 3, "rule": "entropy", "action": "rollback"}]
    (run.path / "guard_events.jsonl").write_text("\n".join(map(json.dumps, events)) + "\n")
    assert run.state() == "partial"
    events.append({"step": 5, "rule": "entropy", "action": "stop"})
    (run.path / "guard_events.jsonl").write_text("\n".join(map(json.dumps, events)) + "\n")
    assert run.state() == "stopped"
