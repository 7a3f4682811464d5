"""The stability guard on the real tiny job, through the CLI: a collapsing learning rate is rolled
back and the run ends healthy; overflowing weights stop the run without ever being checkpointed.

One run directory, three starts (each resumes the previous one's checkpoints; the learning rate is
changed between them, which a resume allows and lists):

1. two healthy steps, a checkpoint after each;
2. ``optim.lr=1e6``: the update of step 3 collapses the policy, step 4 measures it (entropy jumps
   towards log(vocab)), the guard rolls back to step 2's checkpoint (the newest one a later step
   vouched for) with the learning rate times 1e-10, and steps 3-5 replay healthy;
3. the newest checkpoint (step 5) is damaged (a shard truncated), and the run restarted with
   ``optim.lr=1e35 optim.clip_grad=0`` (times the 1e-10 the guard keeps): the start names the
   damage in one line and resumes from step 4; the weights overflow at step 5; the guard may not
   roll back (``guard.max_rollbacks=1`` is used up) and stops with exit code 3, leaving step 4's
   checkpoint as the newest.

What is asserted holds on any machine: the collapse is ~3 nats against a 1-nat threshold, the
healthy replay stays well inside it (the learning rate after the rollback is 1e-4, the tiny
job's own).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from tests.dist_utils import run_distributed
from tests.trainer_utils import trainer_body

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "sft.steps=60",
    "sft.batch_size=32",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "train.save_interval=1",
    "train.eval_interval=0",
    "train.eval_prompts=16",
    "train.keep_checkpoints=1",
    "guard.max_rollbacks=1",
    # After a short SFT little is correct yet; the format bonus gives every group reward variance,
    # so advantages and gradients are non-zero from the first step.
    "reward.format_weight=0.5",
]


def _train(out: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", "examples/tiny_cpu.yaml", *SMALL]
    cmd += [f"train.output_dir={out}", f"train.cache_dir={cache}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cache(tiny_sft_cache):
    """One SFT warm start for every run here and tests/integration/test_pipeline_run.py's guard
    run (it is cached by content, precision excluded)."""
    return tiny_sft_cache


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("iter_*"))


def test_guard_rolls_back_a_collapse_and_stops_overflowing_weights(tmp_path, cache):
    out = tmp_path / "run"
    first = _train(out, cache, "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]

    collapse = _train(out, cache, "train.steps=5", "optim.lr=1e6", "guard.rollback_lr_factor=1e-10")
    assert collapse.returncode == 0, collapse.stderr[-3000:]
    log = collapse.stdout + collapse.stderr
    assert "guard: step 4: entropy: train/entropy" in log, log[-3000:]
    assert "guard: rolled back from step 4 to iter_0000002" in log
    (event,) = [json.loads(line) for line in (out / "guard_events.jsonl").read_text().splitlines()]
    assert (event["step"], event["rule"], event["action"]) == (4, "entropy", "rollback")

    m = {r["step"]: r for r in read_metrics(out)}
    assert sorted(m) == [0, 1, 2, 3, 4, 5]  # replayed steps replaced the rolled-back lines
    baseline = min(m[s]["train/entropy"] for s in (1, 2, 3))
    assert m[3]["guard/rolled_back_from"] == 4.0  # on the first replayed step's line
    for step in (3, 4, 5):  # healthy again: the learning rate is 1e6 * 1e-10
        assert m[step]["train/entropy"] < baseline + 0.5, (step, m[step]["train/entropy"])
        assert m[step]["train/lr"] <= 1e-4 * (1 + 1e-9)
    assert _checkpoints(out) == ["iter_0000004", "iter_0000005"]  # keep 1 + the healthy one

    # The newest checkpoint is damaged before the next start: it falls back to the one before.
    shard = sorted((out / "checkpoints" / "iter_0000005").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    overflow = _train(
        out, cache, "train.steps=8", "optim.lr=1e35", "optim.clip_grad=0", "optim.min_lr=0"
    )
    assert overflow.returncode == 3, overflow.stderr[-3000:]
    (damaged,) = [x for x in overflow.stdout.splitlines() if "iter_0000005 is damaged" in x]
    assert f"{shard.name}: 100 bytes, manifest says" in damaged and "trying iter_0000004" in damaged
    assert "iter_0000004 at step 4" in overflow.stdout
    (line,) = [x for x in overflow.stderr.splitlines() if x.startswith("guard: ")]
    assert line.startswith("guard: stopped at step 5: ") and "max_rollbacks=1" in line, line
    assert "resumes from the last healthy checkpoint, iter_0000004" in line
    # The damaged step-5 checkpoint is gone, no step-5 checkpoint of overflowed weights exists.
    assert _checkpoints(out) == ["iter_0000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    last = read_metrics(out)[-1]
    assert last["step"] == 5 and last["guard/action/stop"] == 1.0
    assert not math.isfinite(last["train/param_norm"])


def test_guard_switches_to_bf16_steps_or_recalibrates_on_mismatch(tmp_path, cache):
    """The FP8 job's rollout-vs-train mismatch (~1.02) against a limit of 1.0001: every step fires.
    bf16: the next step trains without FP8 (nominal bounds). recalibrate: the next step calibrates
    although loss.calib.interval would not. The trainer runs on a rank forked from the test
    server (tests/dist_utils), not through the CLI: the CLI's guard lines are the test above's."""
    fp8 = ["train.steps=2", "guard.max_mismatch=1.0001", "loss.calib.interval=100"]
    fp8 += ["rollout.fp8.quantizer=builtin"]  # modelopt's codes; its ~5 s import spared
    runs = {}
    for action in ("bf16", "recalibrate"):
        out = tmp_path / action
        overrides = [*SMALL, *fp8, f"guard.on_mismatch={action}", "guard.bf16_steps=1"]
        overrides += [f"train.output_dir={out}", f"train.cache_dir={cache}"]
        (metrics,) = run_distributed(
            trainer_body, world_size=1, args=(overrides, ROOT / "examples/tiny_cpu_fp8.yaml")
        )
        lines = (out / "guard_events.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        assert (first["step"], first["rule"], first["action"]) == (1, "mismatch", action)
        runs[action] = {r["step"]: r for r in metrics}
    bf16, recal = runs["bf16"], runs["recalibrate"]
    assert bf16[1]["train/bf16_step"] == 0.0 and bf16[2]["train/bf16_step"] == 1.0
    assert bf16[1]["guard/action/bf16"] == 1.0
    # Nominal bounds: loss.eps_low / eps_high of examples/tiny_cpu.yaml are 0.2 / 0.28.
    assert bf16[2]["calib/lower"] == pytest.approx(0.8) and bf16[2]["calib/upper"] == pytest.approx(
        1.28
    )
    assert "calib/raw_lower" not in bf16[2]  # no calibration in a BF16 step
    assert "calib/raw_lower" in recal[1] and "calib/raw_lower" in recal[2]
    assert recal[2]["train/bf16_step"] == 0.0
