"""One-step off-policy pipelining (``train.pipeline=one_step_off``) on the tiny job, through the
CLI: the full-FP8 variant with calibrated clipping and DAPO dynamic sampling, whose rollouts the in-process engine generates
in a thread of the driver while the trainer updates.

* the rows' policy versions: step 1 trains on its own rollout (lag 0), every later step on the
  one generated during the step before (lag 1), and calibration works unchanged;
* resume == uninterrupted, bit for bit (the held rollout is saved with the checkpoint);
* a guard rollback while a rollout is in flight drops it and replays from the checkpoint's;
* rows past ``train.max_staleness`` are refused in one line; colocated engines are refused.

As in test_tiny_run.py, the checks are same-run identities or hold on any machine.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import read_metrics
from megatron_rl_fp8.trainer.pipeline import staleness_refusal
from tests.integration.test_guard_run import SMALL as GUARD_RUN

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
FP8_RUN = [
    "examples/tiny_cpu_fp8.yaml",
    "sft.steps=100",
    "sft.batch_size=32",
    f"train.steps={STEPS}",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "train.save_interval=3",
    "train.eval_interval=3",
    "train.eval_prompts=32",
    "optim.lr=3e-4",
    "loss.calib.interval=2",
    "train.pipeline=one_step_off",
    # DAPO: the background rollout samples more rounds where groups carry no signal.
    "loss.dynamic_sampling=true",
    "loss.max_sampling_rounds=3",
]


def _train(out: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", *args]
    cmd += [f"train.output_dir={out}", f"train.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, tiny_sft_cache):
    out = tmp_path_factory.mktemp("pipelined")
    done = _train(out, tiny_sft_cache, *FP8_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_steps_train_on_the_rollout_of_the_step_before(pipelined):
    from megatron_rl_fp8.metrics.step_time import OTHER, PHASES, STEP

    m = {r["step"]: r for r in read_metrics(pipelined)}
    assert sorted(m) == list(range(STEPS + 1))
    assert (m[1]["rollout/staleness_max"], m[1]["rollout/policy_version"]) == (0.0, 0.0)
    assert "fp8/token_mult_prob_error_lag0" in m[1]
    for step in range(2, STEPS + 1):
        # Sampled during step - 1, by the weights of step - 2; trained from those of step - 1.
        assert m[step]["rollout/staleness_mean"] == m[step]["rollout/staleness_max"] == 1.0
        assert m[step]["rollout/policy_version"] == step - 2
        # Every row is of lag 1: its mismatch is the step's (FP8 numerics and a version apart:
        # Adam moves every weight by about the learning rate, so it can be large on this model).
        lag1 = m[step]["fp8/token_mult_prob_error_lag1"]
        assert lag1 > 1.0 and lag1 == m[step]["fp8/token_mult_prob_error"], step
        assert "fp8/token_mult_prob_error_lag0" not in m[step]
    for step in range(1, STEPS + 1):
        s = m[step]
        # The phases on the trainer's clock add up; the rollout beside the update is not one.
        phases = [s[k] for _, k in PHASES if k in s]
        assert math.isclose(sum(phases) + s[OTHER], s[STEP], rel_tol=1e-9), step
        if step < STEPS:  # the last step launches nothing
            ran = s["perf/pipeline/rollout_time_s"]
            assert 0 < s["perf/pipeline/overlap_time_s"] <= ran + 1e-9, step
            assert s["perf/pipeline/rollout_generate_time_s"] <= ran
        else:
            assert not any(k.startswith("perf/pipeline/") for k in s), step
        # Calibration every 2 steps (the BF16 shadow pass and the bounds), as without pipelining.
        if step % 2 == 1:
            assert s["perf/shadow_time_s"] > 0 and "calib/lower" in s, step
            assert 0.5 < s["calib/lower"] < 1.0 < s["calib/upper"] < 1.5, step
        assert 1 <= s["rollout/sampling_rounds"] <= 3, step
    assert m[STEPS]["eval/reward_mean"] >= 0


def test_with_weights_that_do_not_move_it_is_the_synchronous_run(tmp_path, tiny_sft_cache):
    # At lr 1e-30 no weight changes (each update is far below half an ulp): the rollout made
    # beside step k's update is then the one step k + 1 would make itself, and the pipelined
    # run must equal the synchronous one in every value but the rows' versions.
    frozen = [*FP8_RUN, "train.steps=3", "optim.lr=1e-30", "optim.min_lr=0"]
    runs = {}
    for pipeline in ("sync", "one_step_off"):
        out = tmp_path / pipeline
        done = _train(out, tiny_sft_cache, *frozen, f"train.pipeline={pipeline}")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[pipeline] = read_metrics(out)

    def values(m):
        versions = ("staleness", "policy_version", "_lag")
        return {
            k: v
            for k, v in m.items()
            if not k.startswith("perf/") and not any(s in k for s in versions)
        }

    sync, piped = runs["sync"], runs["one_step_off"]
    assert [values(m) for m in piped] == [values(m) for m in sync]
    assert [m.get("rollout/staleness_max") for m in piped] == [None, 0.0, 1.0, 1.0]
    assert [m.get("rollout/staleness_max") for m in sync] == [None, 0.0, 0.0, 0.0]


def test_resume_equals_the_uninterrupted_run(pipelined, tmp_path, tiny_sft_cache):
    out = tmp_path / "run"
    first = _train(out, tiny_sft_cache, *FP8_RUN, "train.exit_after_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    # The step-3 checkpoint holds step 4's rollout, generated during step 3.
    rank0 = out / "checkpoints" / "iter_0000003" / "rank_state" / "0.pt"
    held = torch.load(rank0, weights_only=True)["rollout"]["held"]
    assert held["step"] == 4 and held["version"].unique().tolist() == [2]
    second = _train(out, tiny_sft_cache, *FP8_RUN)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr

    def values(m):
        return {k: v for k, v in m.items() if not k.startswith("perf/")}

    want = {m["step"]: values(m) for m in read_metrics(pipelined)}
    got = [values(m) for m in read_metrics(out)]
    assert [m["step"] for m in got] == list(range(STEPS + 1))
    for m in got:
        assert m == want[m["step"]], m["step"]


@pytest.mark.slow  # the rollback itself is make test's: tests/integration/test_guard_run.py
def test_a_guard_rollback_drops_the_rollout_in_flight(tmp_path, tiny_sft_cache):
    # tests/integration/test_guard_run.py's collapse, pipelined: step 3's update collapses the
    # policy, step 4 measures it while step 5's rollout is generated from the collapsed weights.
    small = ["examples/tiny_cpu.yaml", *GUARD_RUN, "train.pipeline=one_step_off"]
    out = tmp_path / "run"
    # Stopped after step 2 of 5, its checkpoint holds step 3's rollout (made by step 1's weights).
    first = _train(out, tiny_sft_cache, *small, "train.steps=5", "train.exit_after_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    collapse = _train(
        out,
        tiny_sft_cache,
        *small,
        "train.steps=5",
        "optim.lr=1e6",
        "guard.rollback_lr_factor=1e-10",
    )
    assert collapse.returncode == 0, collapse.stderr[-3000:]
    assert "guard: rolled back from step 4 to iter_0000002" in collapse.stdout + collapse.stderr
    (event,) = [json.loads(x) for x in (out / "guard_events.jsonl").read_text().splitlines()]
    assert (event["step"], event["action"]) == (4, "rollback")
    m = {r["step"]: r for r in read_metrics(out)}
    assert sorted(m) == [0, 1, 2, 3, 4, 5]
    # The replay trains on the checkpoint's rollout (made by step 1's weights), then on rollouts
    # of the restored weights: none of the collapsed ones.
    assert m[3]["guard/rolled_back_from"] == 4.0
    assert [m[s]["rollout/policy_version"] for s in (3, 4, 5)] == [1.0, 2.0, 3.0]
    baseline = min(m[s]["train/entropy"] for s in (1, 2))
    for step in (3, 4, 5):
        assert m[step]["train/entropy"] < baseline + 0.5, step
        assert m[step]["rollout/staleness_max"] == 1.0


def test_rows_past_the_staleness_bound_are_refused(pipelined, tmp_path, tiny_sft_cache):
    # The pipelined run's last checkpoint holds no rollout (nothing follows the last step); its
    # step-3 one holds step 4's. Resumed strictly on-policy, those rows are one version too old.
    out = tmp_path / "run"
    shutil.copytree(pipelined / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "latest").write_text("iter_0000003\n")
    shutil.rmtree(out / "checkpoints" / "iter_0000006")
    done = _train(out, tiny_sft_cache, *FP8_RUN, "train.pipeline=sync", "train.max_staleness=0")
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if "max_staleness" in x]
    assert "step 4: 32 of 32 rollout rows were sampled by policy version 2, 1 behind" in line


def test_the_staleness_rule():
    assert staleness_refusal(5, [4, 4, 3], now=4, max_staleness=1) is None
    why = staleness_refusal(5, [4, 2, 2], now=4, max_staleness=1)
    assert why.startswith("step 5: 2 of 3 rollout rows were sampled by policy version 2, 2 behind")


def test_colocated_engines_cannot_pipeline():
    cfg = load_config(
        None,
        ["rollout.engine=sglang", "rollout.placement=colocated", "train.pipeline=one_step_off"],
    )
    with pytest.raises(ConfigError, match="rollout.placement=dedicated or train.pipeline=sync"):
        cfg.validate(1, this_machine=False)
    with pytest.raises(ValueError, match="train.max_staleness=0 refuses"):
        load_config(None, ["train.pipeline=one_step_off", "train.max_staleness=0"])
