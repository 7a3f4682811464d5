"""A user's first real run, through the CLI: ``megatron-rl-fp8 train`` with
``model.hf_checkpoint`` (a Qwen3 + BPE tokenizer + chat template folder made by transformers and
tokenizers), a chat-format JSONL task in verl's layout, a user reward function run in the reward
pool; at TP=1 (one process, also interrupted and resumed) and TP=2 (torchrun). Two RL steps.

Checks that hold on any machine: the run starts from the checkpoint (no SFT), every metric is
finite, rewards come from the plugged function (lengths, so groups differ and the update has a
gradient), completions end on the generation config's end ids or at the budget.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8.data.tiny_hf import make_hf_model, write_chat_task
from megatron_rl_fp8.metrics.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hf_model(tiny_hf_model):
    return tiny_hf_model


def _env():
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _overrides(hf_dir, tmp_path, out, tp=1):
    train = write_chat_task(tmp_path / "train.jsonl", 16)
    val = write_chat_task(tmp_path / "val.jsonl", 4, seed=1)
    return [
        f"model.hf_checkpoint={hf_dir}",
        f"parallel.tensor_model_parallel_size={tp}",
        "task.name=gsm8k",
        f"task.train_path={train}",
        f"task.val_path={val}",
        "task.answer_field=reward_model.ground_truth",
        "task.max_prompt_len=40",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "reward.function=tests.reward_plugins:len_reward",
        "reward.num_workers=1",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.updates_per_step=2",
        "train.eval_prompts=4",
        "train.save_interval=0",
        f"train.output_dir={out}",
        f"train.cache_dir={tmp_path / 'cache'}",
    ]


def _train(tmp_path, overrides, tp=1):
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")  # every model field comes from the checkpoint
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        if tp == 2
        else [sys.executable]
    )
    done = subprocess.run(
        [*launcher, "-m", "megatron_rl_fp8", "train", str(config), *overrides],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _check_run(done, out, hf_dir):
    assert f"start weights: {hf_dir}" in done.stdout
    assert "warm start" not in done.stdout  # no SFT from a pretrained model
    lines = read_metrics(out)
    assert [m["step"] for m in lines] == [0, 1, 2]
    for m in lines:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    for m in lines[1:]:
        # len_reward scores the completion's text length: a positive number per sample.
        assert m["rollout/reward_mean"] > 0
        assert 1 <= m["rollout/response_len_mean"] <= 6
        assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0


def test_train_from_hf_checkpoint_at_tp2(hf_model, tmp_path):
    out = tmp_path / "run"
    done = _train(tmp_path, _overrides(hf_model["dir"], tmp_path, out, tp=2), tp=2)
    _check_run(done, out, hf_model["dir"])


@pytest.mark.slow  # the checkpoint start itself is make test's (the TP=2 test above)
def test_train_from_hf_checkpoint_and_resume_ignores_it(hf_model, tmp_path):
    """TP=1, two steps from the HF folder; then the same run interrupted after step 1 and resumed
    with model.hf_checkpoint pointing at another model (same shapes, other weights): a run that
    resumes from its own checkpoint takes its weights from there, so nothing changes."""
    whole = _overrides(hf_model["dir"], tmp_path, tmp_path / "whole")
    _check_run(
        _train(tmp_path, [*whole, "train.save_interval=1"]), tmp_path / "whole", hf_model["dir"]
    )
    other = make_hf_model(tmp_path / "other", seed=1)["dir"]
    parts = _overrides(hf_model["dir"], tmp_path, tmp_path / "parts")
    _train(tmp_path, [*parts, "train.save_interval=1", "train.exit_after_steps=1"])
    done = _train(tmp_path, [*parts, "train.save_interval=1", f"model.hf_checkpoint={other}"])
    assert "start weights" not in done.stdout and "resumed from" in done.stdout

    def strip(lines):
        return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in lines]

    assert strip(read_metrics(tmp_path / "parts")) == strip(read_metrics(tmp_path / "whole"))
