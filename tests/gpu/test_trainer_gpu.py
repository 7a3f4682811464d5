"""The trainer on a CUDA GPU (marked ``gpu``; skipped without CUDA): the tiny job through the CLI,
as a user starts it, in BF16 and in full FP8 (Transformer Engine where installed, the emulation
otherwise).

What the CPU suite cannot see is checked here: the model is moved to the GPU before the DDP wrap,
batches, logprobs and every collective buffer (NCCL moves CUDA tensors only) live there, the
parameters are bfloat16 (``model.params_dtype=auto``) with fp32 main parameters in the optimizer,
and the in-process rollout engine samples on the GPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "sft.steps=100",
    "train.steps=4",
    "train.eval_interval=2",
    "train.eval_prompts=32",
    "train.save_interval=2",
    "loss.calib.interval=2",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: pytest -m gpu)")
@pytest.mark.parametrize("config", ["examples/tiny_cpu.yaml", "examples/tiny_cpu_fp8.yaml"])
def test_tiny_job_trains_on_cuda(tmp_path, config):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl_fp8",
        "train",
        config,
        *SHORT,
        f"train.output_dir={out}",
        f"train.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "bfloat16 on cuda" in log, log[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(5))
    for m in metrics[1:]:
        assert all(v is None or math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        # bf16 engine vs bf16 trainer (different kernels), or FP8 rollout vs FP8 training.
        assert 1.0 <= m["fp8/token_mult_prob_error"] < 1.1, m["fp8/token_mult_prob_error"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
