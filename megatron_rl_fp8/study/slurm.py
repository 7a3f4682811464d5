"""``megatron-rl-fp8 study STUDY.yaml --slurm``: every (arm, seed) as a job of the project's Slurm
launcher, for the arms no single machine runs (the paper's are 8B-32B jobs).

Each unfinished run is submitted as ``sbatch slurm/train.sbatch <run>/study_config.yaml`` (the
run's frozen, fully resolved config, as a local study runs it), named ``<study>.<arm>.s<seed>``,
its Slurm output in the run's directory; ``--sbatch`` adds the cluster's flags (nodes, GPUs,
partition, account) and the environment travels as for any ``sbatch`` (``PYTHON``,
``TRAIN_NODES``, ... : slurm/train.sbatch's header). The job checkpoints, requeues on preemption
and resumes like any run of the launcher. The command returns once every run is submitted;
running it again submits only what is neither finished nor still in the queue (a failed or
cancelled job's run resumes from its checkpoints), and ``--report-only`` writes the same report
from the runs' metrics at any time. Each run's ``study_status.json`` holds its last job id.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.study.runner import RUN_CONFIG, RUN_STATUS, Study, read_status
from megatron_rl_fp8.utils.fs import atomic_write_text

SBATCH_SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"


def _command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(
            f"study --slurm: {name!r} is not on PATH; run it on a Slurm login node (or drop "
            "--slurm to run the study on this machine)"
        )
    return path


def queued_jobs() -> set[str]:
    """Ids of the jobs Slurm still has (pending, running, requeued) that this user can see."""
    out = subprocess.run(
        [_command("squeue"), "--noheader", "--format=%i"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise ConfigError(f"study --slurm: squeue failed: {out.stderr.strip()[:200]}")
    return {line.split("_")[0].strip() for line in out.stdout.splitlines() if line.strip()}


def submit_study(study: Study, sbatch_args: str = "", *, echo=print) -> dict[str, int]:
    """Submit every run that is neither finished nor queued; returns the count per outcome
    (``done``, ``stopped``, ``queued``: already in Slurm's queue, ``submitted``)."""
    script = SBATCH_SCRIPT
    if not script.is_file():
        raise ConfigError(f"study --slurm: the launcher script {script} is missing")
    extra = shlex.split(sbatch_args)
    sbatch = _command("sbatch")
    queue = queued_jobs()
    counts: dict[str, int] = {}
    for run in study.runs:
        state = run.state()
        job = str(read_status(run.path).get("job", ""))
        if state in ("done", "stopped"):
            outcome = state
        elif job and job in queue:
            outcome = "queued"
        else:
            run.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run.path / RUN_CONFIG, run.config.to_yaml())
            cmd = [
                sbatch,
                "--parsable",
                f"--job-name={study.name}.{run.arm}.s{run.seed}",
                f"--output={run.path / 'slurm-%j.out'}",
                *extra,
                str(script),
                str(run.path / RUN_CONFIG),
            ]
            # From the project's root: the script finds .venv/bin/python there (or $PYTHON).
            done = subprocess.run(
                cmd, capture_output=True, text=True, cwd=script.parents[1], check=False
            )
            if done.returncode:
                raise ConfigError(
                    f"study --slurm: sbatch refused {run.label}: {done.stderr.strip()[:300]} "
                    f"(command: {shlex.join(cmd)})"
                )
            job = done.stdout.strip().split(";")[0]
            status = {"state": "submitted", "job": job}
            atomic_write_text(run.path / RUN_STATUS, json.dumps(status) + "\n")
            echo(f"study: {run.label}: submitted as job {job}")
            outcome = "submitted"
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts
