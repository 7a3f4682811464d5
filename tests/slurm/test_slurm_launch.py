"""``slurm/train.sbatch`` on a real Slurm: two nodes (n1, n2) on this machine, no GPUs.

The tiny CPU config with ``rollout.engine=local``: both nodes train (TRAIN_NODES=2, one rank per
node), and their torchruns meet at the c10d rendezvous on the first node's NodeAddr. What the
job must show: it completes, the two agents rendezvoused into one world of 2, the metrics are
written, and the run's log directory holds the rendered commands and one log per node.

Values are compared only within the session (resumed == uninterrupted), never to numbers from
another machine (tests/integration/test_tiny_run.py says why).
"""

import math
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from tests.slurm.conftest import submit_train

pytestmark = pytest.mark.slurm

# A few seconds of compute: the job's time goes to starting Python and Megatron (~1 min on 2 cores).
TINY = [
    "rollout.engine=local",
    "sft.steps=5",
    "sft.batch_size=16",
    "train.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    # 16 rows = 2 updates x DP 2 x micro-batch 4.
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "train.eval_prompts=8",
]
JOB_TIMEOUT_S = 300


def _overrides(out, cache, steps: int, save_interval: int) -> list[str]:
    return [
        *TINY,
        f"train.steps={steps}",
        f"train.save_interval={save_interval}",
        f"train.output_dir={out / 'run'}",
        f"train.cache_dir={cache}",
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _log(path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} missing)"


STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory, cache):
    """One 6-step two-node job, checkpointing every step: the first test's subject and the
    preemption test's reference. (job id, its sbatch output, its scheduler record, its dir)"""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    start = time.monotonic()
    job_id, output = submit_train(slurm_cluster, tmp_path, _overrides(tmp_path, cache, STEPS, 1))
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    print(f"slurm job {job_id}: {time.monotonic() - start:.0f} s from sbatch to COMPLETED")
    return job_id, output, job, tmp_path


def test_two_node_local_rollout_run(uninterrupted):
    job_id, output, job, tmp_path = uninterrupted
    text = _log(output)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    assert job["NumNodes"] == "2" and job["Restarts"] == "0"
    assert "train.sbatch: the trainer finished" in text

    # The run's record: the dry-run (layout + commands), the node addresses, one script per
    # step, and one log per trainer node.
    run_dir = tmp_path / "run" / "slurm" / str(job_id) / "restart-0"
    commands = _log(run_dir / "commands.txt")
    assert "placement: local" in commands
    assert "trainer: 2 node(s) (n1,n2): 2 ranks = TP 1 x PP 1 x CP 1 x DP 2" in commands
    # The rendezvous is on n1's NodeAddr (node names do not resolve here).
    assert re.search(r"c10d rendezvous 127\.0\.0\.1:\d+", commands), commands
    nodes = _log(run_dir / "nodes.txt")
    assert "NodeName=n1" in nodes and "NodeName=n2" in nodes
    assert "exec srun --nodes=2" in _log(run_dir / "trainer.sh")
    assert (run_dir / "job.out").resolve() == output.resolve()  # the job's own output, linked
    logs = sorted(run_dir.glob("trainer-*.log"))
    assert [p.name.split("-")[1] for p in logs] == ["0", "1"], [p.name for p in logs]

    # Each node's torchrun agent joined the same rendezvous: group ranks 0 and 1 of a world of 2.
    # c10d ranks agents by (FQDN, pid), not by Slurm's node order: on one host either node may
    # get rank 0 (the driver).
    texts = [_log(p) for p in logs]
    ranks = [re.findall(r"group_rank=(\d+)", t) for t in texts]
    assert sorted(r for found in ranks for r in found) == ["0", "1"], texts[0][-3000:]
    assert all("group_world_size=2" in t for t in texts)
    driver = texts[[found == ["0"] for found in ranks].index(True)]
    assert "(TP=1 PP=1 DP=2)" in driver  # rank 0's actor line: the trainer's world

    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))
    for m in metrics[1:]:
        assert 0.0 <= m["rollout/reward_mean"] <= 1.0 and math.isfinite(m["train/loss"])


def _values(m: dict) -> dict:
    # Timings differ between any two runs; everything else is computed, not measured.
    return {k: v for k, v in m.items() if not k.startswith("perf/")}


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, uninterrupted, tmp_path, cache):
    """Preemption as Slurm delivers it (``--signal=B:USR1@120``: to the batch shell, which
    forwards it to the trainer's srun, torchrun, the ranks): every rank finishes its step,
    checkpoints and exits ``megatron_rl_fp8.launch.REQUEUE_EXIT_CODE``; the script requeues; the
    requeued job resumes and finishes with each step logged once, equal to an uninterrupted
    run."""
    steps = STEPS
    ref_dir, pre_dir = uninterrupted[3], tmp_path / "preempted"
    pre_dir.mkdir()
    expected = {m["step"]: _values(m) for m in read_metrics(ref_dir / "run")}
    assert sorted(expected) == list(range(steps + 1))

    job_id, output = submit_train(
        slurm_cluster, pre_dir, _overrides(pre_dir, cache, steps, save_interval=1)
    )
    # Signal once step 2 is logged and checkpointed: the trainer is then inside step 3.
    latest = pre_dir / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (latest.exists() and latest.read_text().strip() >= "iter_0000002"):
        assert time.monotonic() < deadline, _log(output)[-3000:]
        time.sleep(0.1)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    # Slurm holds a requeued batch job for ~2 min (BeginTime); release it once it is back.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (job := slurm_cluster.job(job_id))["Restarts"] == "0" or job["JobState"] != "PENDING":
        assert job["JobState"] in ("RUNNING", "COMPLETING", "PENDING"), _log(output)[-3000:]
        assert time.monotonic() < deadline, _log(output)[-3000:]
        time.sleep(0.5)
    # Not in the same second as the requeue: slurmd revoked the first run's credential then, and
    # compares in whole seconds, so a relaunch within it is refused ("Job credential revoked":
    # FAILED 1:0, the script never runs). Slurm's own hold is what avoids it on a cluster.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while _job_pids(job_id, "n1") or _job_pids(job_id, "n2"):
        assert time.monotonic() < deadline, "the first run's processes outlived its requeue"
        time.sleep(0.5)
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+2")
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    text = _log(output)
    reason = f"{text[-3000:]}\nscontrol: {job.get('Reason')}"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), reason
    assert job["Restarts"] == "1", reason
    assert f"requeueing job {job_id}" in text
    # The step in flight when USR1 came (3) was finished and checkpointed, so the requeued job
    # resumes after it. (Without the handler the ranks die in step 3: it resumes at 2.) torchrun
    # does not pass the ranks' REQUEUE_EXIT_CODE on: the script requeues on "failed after USR1".
    restart = pre_dir / "run" / "slurm" / str(job_id) / "restart-1"
    resumed = "".join(_log(p) for p in restart.glob("trainer-*.log"))
    at = re.search(r"resumed from \S+ at step (\d+)", resumed)
    assert at and int(at.group(1)) >= 3, resumed[-3000:]

    metrics = read_metrics(pre_dir / "run")
    assert [m["step"] for m in metrics] == list(range(steps + 1))  # none lost, none twice
    # Same machine, same layout: the preempted run is the uninterrupted run, bit for bit.
    for m in metrics:
        assert _values(m) == expected[m["step"]], m["step"]


def _job_pids(job_id: int, node: str) -> list[int]:
    """Every process of job ``job_id`` on Slurm node ``node`` (by the environment Slurm gives
    its tasks; slurmd and slurmstepd themselves carry none of it)."""
    pids = []
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want <= env:
            pids.append(int(proc.name))
    return pids


def test_trainer_node_death_fails_the_job_and_the_next_submission_resumes(
    slurm_cluster, uninterrupted, tmp_path, cache
):
    """A trainer node dies mid-run (every process of the job on n2 SIGKILLed, as a crash leaves
    it; slurmd stays up): the job fails with the script's one line pointing at the trainer's
    logs, and the same sbatch line submitted again resumes from the latest checkpoint and
    finishes equal to the uninterrupted run."""
    ref_dir, out = uninterrupted[3], tmp_path / "node-death"
    out.mkdir()
    expected = {m["step"]: _values(m) for m in read_metrics(ref_dir / "run")}
    overrides = _overrides(out, cache, STEPS, save_interval=1)
    job_id, output = submit_train(slurm_cluster, out, overrides)
    latest = out / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (latest.exists() and latest.read_text().strip() >= "iter_0000002"):
        assert time.monotonic() < deadline, _log(output)[-3000:]
        time.sleep(0.1)
    victims = _job_pids(job_id, "n2")
    assert victims, "no process of the job on n2"
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    text = _log(output)
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", text[-3000:]
    assert "train.sbatch: the trainer step failed" in text and "requeue" not in text, text[-3000:]
    done = [m["step"] for m in read_metrics(out / "run")]
    assert max(done) < STEPS, "the node died after the run had finished"

    job_id, output = submit_train(slurm_cluster, out, overrides)
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    text = _log(output)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    record = out / "run" / "slurm" / str(job_id) / "restart-0"
    resumed = "".join(_log(p) for p in record.glob("trainer-*.log"))
    assert re.search(r"resumed from \S+ at step [2-9]", resumed), resumed[-3000:]
    metrics = read_metrics(out / "run")
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # none lost, none twice
    for m in metrics:
        assert _values(m) == expected[m["step"]], m["step"]
