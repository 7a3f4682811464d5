"""``study --slurm`` on the real two-node Slurm: each (arm, seed) of a tiny study is a job of
slurm/train.sbatch, a second call while they run submits nothing, a call after they finished
finds them done, and ``--report-only`` writes the report from the jobs' metrics."""

import json
import os

import pytest
import yaml

from megatron_rl_fp8.cli import main
from tests.slurm.conftest import ROOT

pytestmark = pytest.mark.slurm

TINY = {
    "sft.steps": 5,
    "sft.batch_size": 16,
    "train.steps": 2,
    "train.save_interval": 1,
    "train.prompts_per_step": 4,
    "rollout.n_samples_per_prompt": 4,
    "train.micro_batch_size": 4,
    "train.eval_interval": 0,
    "train.eval_prompts": 8,
}


def test_study_runs_as_slurm_jobs(slurm_cluster, tmp_path, monkeypatch, capsys):
    study = tmp_path / "slurm_study.yaml"
    study.write_text(
        yaml.safe_dump(
            {
                "base": str(ROOT / "examples" / "tiny_cpu.yaml"),
                "overrides": {**TINY, "train.cache_dir": str(tmp_path / "cache")},
                "seeds": [1],
                "arms": {
                    "bf16": {},
                    "fp8": {"fp8.recipe": "blockwise", "rollout.fp8.weight_quant": "blockwise"},
                },
            }
        )
    )
    out = tmp_path / "out"
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    # One node and one CPU rank per job; the job's python is this one.
    env = {"GPUS_PER_NODE": "1", "TRAIN_NODES": "1", "OMP_NUM_THREADS": "1"}
    for key, value in {**env, "PYTHON": os.sys.executable}.items():
        monkeypatch.setenv(key, value)
    argv = ["study", str(study), "--out", str(out), "--slurm"]
    assert main([*argv, "--sbatch=--nodes=1 --gpus-per-node=0"]) == 0
    assert "2 submitted" in capsys.readouterr().out
    jobs = {
        arm: json.loads((out / arm / "seed1" / "study_status.json").read_text())["job"]
        for arm in ("bf16", "fp8")
    }
    assert main(argv) == 0  # while they wait or run: nothing is submitted twice
    assert "2 queued" in capsys.readouterr().out
    for arm, job in jobs.items():
        output = out / arm / "seed1" / f"slurm-{job}.out"
        record = slurm_cluster.wait(int(job), timeout=400, output=output)
        assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output.read_text()[
            -3000:
        ]
        assert record["JobName"] == f"slurm_study.{arm}.s1"
    assert main(argv) == 0
    assert "2 done" in capsys.readouterr().out
    assert main(["study", str(study), "--out", str(out), "--report-only"]) == 0
    report = (out / "report" / "report.md").read_text()
    assert "| fp8 | 1 |" in report and "| bf16 | 1 |" in report
