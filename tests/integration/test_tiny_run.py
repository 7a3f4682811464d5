"""The tiny CPU job end to end through the CLI: golden metrics, and kill -9 + restart resumes.

It runs the full-FP8 variant (examples/tiny_cpu_fp8.yaml: FP8 rollout weights, emulated blockwise
FP8 training, calibrated clipping every 2 steps), so the golden values pin the whole pipeline and
the restart must restore the calibrated clip bounds as well as weights, optimizer and data.

Golden values live in tests/assets/tiny_golden.json; regenerate with
``UPDATE_GOLDEN=1 pytest tests/integration/test_tiny_run.py`` after an intended numerics change.
fp32 on CPU is deterministic for a fixed torch build and thread count, so the SFT loss and the
step-0 evaluation must match tightly (1e-5 relative); later steps sample tokens, and a reduction-order
change upstream may flip one sample, so they get 1e-3 relative (and rewards, being multiples of
1/rows, exactly one sample's worth).
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics

GOLDEN = Path(__file__).resolve().parent.parent / "assets" / "tiny_golden.json"
ROWS = 8 * 4
OVERRIDES = [
    "sft.steps=100", "sft.batch_size=32", "train.steps=6", "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16", "train.save_interval=3",
    "train.eval_interval=3", "train.eval_prompts=32", "optim.lr=3e-4", "loss.calib.interval=2",
]
KEYS = ["sft/final_loss", "eval/reward_mean", "rollout/reward_mean", "train/loss", "train/entropy",
        "train/grad_norm", "fp8/token_mult_prob_error", "calib/lower", "calib/upper"]


def _cmd(out: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_rl_fp8", "train", "examples/tiny_cpu_fp8.yaml", *OVERRIDES,
            f"train.output_dir={out}", f"train.cache_dir={cache}"]


def _env():
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("full")
    subprocess.run(_cmd(out, cache), cwd=ROOT, env=_env(), check=True, capture_output=True)
    return {m["step"]: m for m in read_metrics(out)}


def _close(a, b, key):
    if a is None or b is None:
        return a == b
    if key.endswith("reward_mean"):
        return abs(a - b) <= 1.0 / ROWS + 1e-9
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6)


def test_golden_metrics(uninterrupted):
    picked = {str(s): {k: uninterrupted[s][k] for k in KEYS if k in uninterrupted[s]}
              for s in (0, 3, 6)}
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(picked, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(picked)
    for step, values in golden.items():
        assert set(values) == set(picked[step]), step
        for key, want in values.items():
            got = picked[step][key]
            if step == "0":
                assert math.isclose(got, want, rel_tol=1e-5), (step, key, got, want)
            else:
                assert _close(got, want, key), (step, key, got, want)


def test_kill_and_restart_resumes_without_duplicates(tmp_path, cache, uninterrupted):
    out = tmp_path / "run"
    latest = out / "checkpoints" / "latest"
    proc = subprocess.Popen(_cmd(out, cache), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() == "iter_0000003":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = [m["step"] for m in read_metrics(out)]
    assert 3 in killed_at

    done = subprocess.run(_cmd(out, cache), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    metrics = read_metrics(out)
    steps = [m["step"] for m in metrics]
    assert steps == list(range(7)), steps  # nothing lost, nothing duplicated
    for m in metrics:
        ref = uninterrupted[m["step"]]
        for key in KEYS:
            if key in ref:
                assert _close(m.get(key), ref[key], key), (m["step"], key, m.get(key), ref[key])
