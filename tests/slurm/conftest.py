"""A real Slurm for the launcher's tests: two slurmd (n1, n2) on this machine, on loopback
(scripts/slurm_local.sh), started once per session and stopped after it.

Marked ``slurm`` and deselected by default: ``make test-slurm``. Needs root (slurmd, munged);
apt-get installs Debian's slurm-wlm and munge if absent. Without root or the packages the tests
are skipped with the reason, not failed.

There is no slurmdbd (no sacct): a job is watched with ``squeue -j`` until it leaves the queue,
then read with ``scontrol show job`` (kept for MinJobAge = 120 s) and from its own files.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sglang.conftest import sglang_py  # noqa: F401 - the SGLang fixture, shared

ROOT = Path(__file__).resolve().parents[2]
SLURM_LOCAL = ROOT / "scripts" / "slurm_local.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
UNAVAILABLE = 3  # scripts/slurm_local.sh: no root, or the packages cannot be installed


@dataclasses.dataclass(frozen=True)
class Cluster:
    dir: Path
    env: dict[str, str]

    def run(self, *argv: str, env: dict[str, str] | None = None, tries: int = 1) -> str:
        """A Slurm client command's stdout. ``tries`` > 1 retries a failed call: on 2 busy cores
        a client has died of SIGPIPE (slurmctld: "Zero Bytes were transmitted") as a job ended."""
        for attempt in range(tries):
            proc = subprocess.run(
                argv, env=env or self.env, cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            if proc.returncode == 0:
                return proc.stdout
            time.sleep(1 + attempt)
        raise AssertionError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a mapping (JobState, ExitCode, Restarts, NodeList ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id), tries=3)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait(self, job_id: int, *, timeout: float, output: Path | None = None) -> dict[str, str]:
        """Poll ``squeue -j`` until the job has left the queue (requeues included); its final
        record. On timeout the job is cancelled and its output shown."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", tries=3).strip():
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id))
                tail = output.read_text()[-3000:] if output and output.exists() else ""
                pytest.fail(f"job {job_id} still queued or running after {timeout:.0f} s\n{tail}")
            time.sleep(1)
        return self.job(job_id)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Cluster:
    if sys.platform != "linux":
        pytest.skip("the local Slurm runs on Linux only")
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/slurm_local.sh runs munged and slurmd as root")
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(
        [str(SLURM_LOCAL), "start", str(state)], capture_output=True, text=True, timeout=300
    )
    if start.returncode == UNAVAILABLE:
        pytest.skip(f"no local Slurm: {start.stderr.strip()}")
    try:
        assert start.returncode == 0, f"scripts/slurm_local.sh start failed:\n{start.stderr}"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["SLURM_CONF"] = str(state / "slurm.conf")
        yield Cluster(dir=state, env=env)
    finally:
        subprocess.run([str(SLURM_LOCAL), "stop", str(state)], capture_output=True, timeout=120)


def submit_train(
    cluster: Cluster,
    out: Path,
    overrides: list[str],
    *,
    config: str = "examples/tiny_cpu.yaml",
    train_nodes: int = 2,
    gpus_per_node: int = 1,
    env: dict[str, str] | None = None,
) -> tuple[int, Path]:
    """``sbatch slurm/train.sbatch CONFIG OVERRIDES`` on both nodes; by default both train, one
    rank each (a CPU cluster: no GPU GRES, GPUS_PER_NODE=1). ``train_nodes=1``: n1 trains, n2
    runs the rollout role; ``gpus_per_node`` is then also the engines a node has room for. The
    job's record goes into the run's directory, ``<train.output_dir>/slurm/<job id>/restart-<n>``.
    ``env``: more of the job's environment. Returns the job id and the job's output file."""
    env = {
        **(env or {}),
        **cluster.env,
        "GPUS_PER_NODE": str(gpus_per_node),
        "TRAIN_NODES": str(train_nodes),
        "PYTHON": sys.executable,
        # Two ranks on the machine's cores: one thread each.
        "OMP_NUM_THREADS": "1",
        # torchrun's agents log their rendezvous ("group_rank=... group_world_size=...").
        "LOGLEVEL": "INFO",
    }
    output = out / "slurm-%j.out"
    job = cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", f"--output={output}",
        str(SBATCH), config, *overrides,
        env=env,
    )  # fmt: skip
    job_id = int(job.strip().split(";")[0])
    return job_id, out / f"slurm-{job_id}.out"
