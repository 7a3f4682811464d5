"""A rollout engine from outside the package trains the tiny job (issue 45 item 2).

``tests/recording_engine.py`` registers itself through ``rollout.engine=package.module:SPEC``; no
module of the package names it. Through the CLI, synchronous and one-step-off pipelined, its run
must equal the same run on ``local`` in every value (it is the local engine with its calls noted),
and its notes show the trainer drove it through the rollout contract: one sync per step plus the
first, generation for every step and evaluation, a clean shutdown.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from tests.recording_engine import CALLS

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
RUN = [
    "examples/tiny_cpu.yaml",
    "sft.steps=100",
    "sft.batch_size=32",
    f"train.steps={STEPS}",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "train.save_interval=0",
    "train.eval_interval=3",
    "train.eval_prompts=16",
]
RECORDING = "rollout.engine=tests.recording_engine:RECORDING"


def _train(out: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", *RUN, *args]
    cmd += [f"train.output_dir={out}", f"train.cache_dir={cache}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _values(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


# Pipelined, the plugin engine is the slow tier's (the pipeline itself is make test's:
# tests/integration/test_pipeline_run.py).
@pytest.mark.parametrize("pipeline", ["sync", pytest.param("one_step_off", marks=pytest.mark.slow)])
def test_an_engine_registered_from_outside_trains_as_local_does(pipeline, tmp_path, tiny_sft_cache):
    runs = {}
    for name, engine in (("local", "rollout.engine=local"), ("recording", RECORDING)):
        out = tmp_path / name
        done = _train(out, tiny_sft_cache, engine, f"train.pipeline={pipeline}")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = out
    assert _values(read_metrics(runs["recording"])) == _values(read_metrics(runs["local"]))
    assert not (runs["local"] / CALLS).exists()

    calls = [json.loads(line) for line in (runs["recording"] / CALLS).read_text().splitlines()]
    kinds = [c["call"] for c in calls]
    # One sync before the first rollout and one after every update, each begun and ended.
    assert [c["version"] for c in calls if c["call"] == "begin_sync"] == list(range(STEPS + 1))
    assert kinds.count("end_sync") == STEPS + 1
    sampled = [c for c in calls if c["call"] == "generate" and not c["greedy"]]
    evaluated = [c for c in calls if c["call"] == "generate" and c["greedy"]]
    assert len(sampled) >= STEPS and all(c["n"] == 4 for c in sampled)
    assert len(evaluated) == 2  # before the first step and at the last (eval_interval=3)
    assert kinds[-1] == "shutdown"


def test_a_bad_engine_plugin_is_one_line(tmp_path):
    for value, says in (
        ("tests.recording_engine:NOPE", "has no attribute 'NOPE'"),
        ("tests.recording_engine:CALLS", "is a str, not an EngineSpec"),
        ("vllm", "is not a registered engine (local, sglang"),
    ):
        cmd = [sys.executable, "-m", "megatron_rl_fp8", "config", *RUN, f"rollout.engine={value}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "rollout.engine" in lines[0] and says in lines[0], lines
