"""The tool-use job with SGLang generating every turn (issue 46): the same turn loop as on the
in-process engine, each later turn sent from the exact ids so far with its trajectory's own
token limit (SGLang refuses a request whose input plus max_new_tokens passes the model's
context, and the tiny model's context is 48).

Both sides compute in fp32 from the same weights, so the engine's log-probs of the sampled tokens
and the trainer's agree (``token_mult_prob_error`` within 1e-3 of 1); an
inserted token counted with its 0.0 placeholder would move it far more.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from tests.integration.test_tools_run import RUN as TOOLS_RUN

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]
RUN = [*TOOLS_RUN, "rollout.engine=sglang", "rollout.sglang.startup_timeout_s=300"]


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """The job's SFT warm start, built once by a one-step run on the in-process engine. A run
    builds its warm start after its engines have started, and an idle SGLang CPU server keeps a
    core busy: built beside one, the 150 SFT steps took ~10 min on 2 cores instead of ~30 s."""
    cache, out = tmp_path_factory.mktemp("tools_sft_cache"), tmp_path_factory.mktemp("warm")
    done = _train(
        *TOOLS_RUN, "train.steps=1", f"train.output_dir={out}", f"train.cache_dir={cache}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cache


@pytest.mark.parametrize("pipeline", ["sync", "one_step_off"])
def test_a_tool_using_run_with_sglang_engines(pipeline, sglang_py, warm_cache, tmp_path):
    out = tmp_path / "run"
    done = _train(
        *RUN,
        f"train.pipeline={pipeline}",
        f"rollout.sglang.python={sglang_py}",
        f"rollout.sglang.work_dir={tmp_path / 'sg'}",
        f"train.output_dir={out}",
        f"train.cache_dir={warm_cache}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded cached SFT policy" in done.stdout
    steps = [m for m in read_metrics(out) if m["step"] >= 1]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/tool_used_frac"] > 0 and m["rollout/turns_mean"] > 1
        assert 0 < m["rollout/inserted_token_frac"] < 0.5
        assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float))
    if pipeline == "sync":  # pipelined rows are one policy version old
        assert all(abs(m["fp8/token_mult_prob_error"] - 1) < 1e-3 for m in steps)
    else:
        assert all(m["fp8/rollout_train_kl"] < 0.05 for m in steps)
    assert 0 <= steps[-1]["eval/tool_used_frac"] <= 1
