"""``slurm/train.sbatch`` with SGLang rollout nodes: dedicated placement on the real local Slurm.

n1 trains (TRAIN_NODES=1, two ranks: DP 2); n2 runs the rollout role (``launch --role rollout
--node-index 1``): two SGLang CPU engines and the sglang-router in front of them. The trainer
attaches to them by URL and syncs its weights to them by broadcast every step. What the job must
show: it completes, the rollout node's engines and router came up, every rollout used both
engines on the weights the trainer had (``token_mult_prob_error`` within 1e-3 of 1: both sides
fp32, so a stale or wrong weight gives >> 1.01), and no engine or router outlives the job.

Marked ``slurm`` and ``sglang``: ``make test-slurm`` runs it when an SGLang python is there
(MRF8_SGLANG_PYTHON, or .venv-sglang from scripts/install_sglang_cpu.sh); skipped otherwise.
"""

import time

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from megatron_rl_fp8.rollout.sglang import FAULT_ENV, server_group_pids

pytestmark = [pytest.mark.slurm, pytest.mark.sglang]

STEPS = 2
ENGINES = 2
JOB_TIMEOUT_S = 480  # engines ready and SFT done ~80 s after sbatch here; 2 steps after that


def _tiny_job(sglang_py, tmp_path) -> list[str]:
    """SGLang CPU engines and a few seconds of compute: a short SFT warm start, ``STEPS`` RL
    steps of 16 rows, no evaluation, no checkpoint; the run in ``tmp_path / "run"``."""
    return [
        "rollout.engine=sglang",
        f"rollout.sglang.python={sglang_py}",
        # CPU engines on a small box: each sizes its KV pool from host memory.
        "rollout.sglang.mem_fraction_static=0.3",
        "rollout.sglang.max_total_tokens=8192",
        "rollout.sglang.startup_timeout_s=300",
        "sft.steps=5",
        "sft.batch_size=16",
        f"train.steps={STEPS}",
        "train.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "train.eval_interval=0",
        "train.eval_prompts=8",
        "train.save_interval=0",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
    ]


def _log(path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} missing)"


def test_dedicated_rollout_node_runs_sglang_engines_and_router(slurm_cluster, sglang_py, tmp_path):
    from tests.slurm.conftest import submit_train

    run = tmp_path / "run"
    overrides = [
        "rollout.placement=dedicated",
        f"rollout.sglang.num_engines={ENGINES}",
        *_tiny_job(sglang_py, tmp_path),
        # 16 rows = 2 updates x DP 2 x micro-batch 4.
        "train.micro_batch_size=4",
    ]
    start = time.monotonic()
    # Two "GPUs" per node: the trainer's 2 ranks on n1, one engine per slot on n2.
    job_id, output = submit_train(
        slurm_cluster, tmp_path, overrides, train_nodes=1, gpus_per_node=ENGINES
    )
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    print(f"slurm job {job_id}: {time.monotonic() - start:.0f} s from sbatch to COMPLETED")

    run_dir = run / "slurm" / str(job_id) / "restart-0"
    text = _log(output)
    rollout_logs = sorted(run_dir.glob("rollout-1-*.log"))
    rollout = "".join(_log(p) for p in rollout_logs)
    trainer = "".join(_log(p) for p in run_dir.glob("trainer-*.log"))
    detail = f"{text[-2000:]}\n--- rollout:\n{rollout[-3000:]}\n--- trainer:\n{trainer[-3000:]}"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), detail
    assert "train.sbatch: the trainer finished" in text, detail

    commands = _log(run_dir / "commands.txt")
    assert "placement: dedicated" in commands
    assert "trainer: 1 node(s) (n1): 2 ranks" in commands, commands
    assert "rollout: 2 engine(s) x TP 1 on n2; router http://127.0.0.1:" in commands, commands

    # n2's rollout role: both engines and the router answered /health.
    assert len(rollout_logs) == 1, [p.name for p in run_dir.iterdir()]
    assert "rollout node 1: engines 0 http://127.0.0.1:" in rollout, rollout[-3000:]
    ready = next(
        line for line in rollout.splitlines() if line.startswith("rollout node 1: engines")
    )
    assert ", 1 http://127.0.0.1:" in ready and " ready; router http://127.0.0.1:" in ready, ready

    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(STEPS + 1)), detail
    for m in metrics[1:]:
        assert m["rollout/engines_used"] == ENGINES, (m["step"], m["rollout/engines_used"])
        keys = [k for k in m if k.endswith("token_mult_prob_error")]
        assert keys, sorted(m)
        for k in keys:  # the synced weights reached the engines on the other node intact
            assert abs(m[k] - 1.0) < 1e-3, (m["step"], k, m[k])

    # The role's processes (each its own process group, pid = pgid): none outlives the job.
    node = run / "sglang" / "node1"
    pid_files = sorted(p.name for p in node.glob("*.pid"))
    assert pid_files == ["engine0.pid", "engine1.pid", "router.pid"], pid_files
    for name in pid_files:
        pid = int((node / name).read_text())
        assert server_group_pids(pid) == [], (name, pid)


def test_colocated_engine_on_each_node_synced_per_node(slurm_cluster, sglang_py, tmp_path):
    """Both nodes train (one rank each, PP 2: each node holds one stage) and serve (one engine
    each, ``num_engines=0``: one per TP group of every node). ``transport=tensor`` on two nodes
    is a per-node sync: each stage's sender relays its buckets to the other node's rank, and
    every node's rank hands both stages' weights to its own node's engine over shared memory.

    ``MRF8_SGLANG_FAULT=generate@2`` SIGKILLs n2's engine during step 1's rollout (the 1st
    generation is step 0's evaluation): step 1 finishes on n1's, n2's rollout role relaunches
    it, and step 1's sync waits for it and syncs it from n2's rank: step 2 uses both."""
    from tests.slurm.conftest import submit_train

    run = tmp_path / "run"
    overrides = [
        "rollout.placement=colocated",
        "rollout.sglang.num_engines=0",
        "rollout.sglang.transport=tensor",
        "parallel.pipeline_model_parallel_size=2",
        *_tiny_job(sglang_py, tmp_path),
        # 16 rows = 2 updates x DP 1 x micro-batch 8.
        "train.micro_batch_size=8",
    ]
    start = time.monotonic()
    fault = {FAULT_ENV: "generate@2"}
    job_id, output = submit_train(slurm_cluster, tmp_path, overrides, train_nodes=2, env=fault)
    job = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S, output=output)
    print(f"slurm job {job_id}: {time.monotonic() - start:.0f} s from sbatch to COMPLETED")

    run_dir = run / "slurm" / str(job_id) / "restart-0"
    text = _log(output)
    rollout = "".join(_log(p) for p in sorted(run_dir.glob("rollout-*.log")))
    trainer = "".join(_log(p) for p in run_dir.glob("trainer-*.log"))
    detail = f"{text[-2000:]}\n--- rollout:\n{rollout[-3000:]}\n--- trainer:\n{trainer[-3000:]}"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), detail

    commands = _log(run_dir / "commands.txt")
    assert "placement: colocated" in commands, commands
    assert 'rollout.sglang.engine_nodes=["n1","n2"]' in commands, commands

    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(STEPS + 1)), detail
    one, two = metrics[1:]
    assert one["rollout/engines_used"] >= 1 and two["rollout/engines_used"] == 2, metrics
    assert two["rollout/engine_restarts"] == 1, two  # n2's engine, back after its relaunch
    assert "engine1 (http://127.0.0.1:" in rollout and ") exited; relaunching it" in rollout
    for m in metrics[1:]:
        assert m["perf/sync_relay_time_s"] > 0, m  # each stage's buckets crossed to the other node
        keys = [k for k in m if k.endswith("token_mult_prob_error")]
        assert keys, sorted(m)
        for k in keys:  # both stages' weights reached each node's engine intact
            assert abs(m[k] - 1.0) < 1e-3, (m["step"], k, m[k])
    for k in (0, 1):  # each node's engine; the sync never formed a broadcast group
        node = run / "sglang" / f"node{k}"
        assert "mrf8_sync" not in "".join(_log(p) for p in node.glob("engine*.log"))
        for pid_file in node.glob("*.pid"):
            assert server_group_pids(int(pid_file.read_text())) == [], pid_file
