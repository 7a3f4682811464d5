"""benchmarks/bench_pipeline.py: its jobs' overrides are a valid run config for both settings, the
steps it times, and the pinned interpreter it hands the engine (a real child process)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from megatron_rl_fp8.config import load_config
from tests.scripts import load_script

bench = load_script("benchmarks/bench_pipeline.py")

ARGS = argparse.Namespace(steps=10, prompts=32, samples=8, max_new_tokens=8, updates=2)


@pytest.mark.parametrize("setting", bench.SETTINGS)
def test_each_job_is_a_valid_dedicated_sglang_run(setting, tmp_path):
    overrides = bench.overrides(ARGS, setting, tmp_path, sys.executable, tmp_path / "out")
    cfg = load_config(str(bench.ROOT / "examples/tiny_cpu_fp8.yaml"), overrides)
    cfg.validate()
    assert cfg.train.pipeline == setting and cfg.rollout.placement == "dedicated"
    assert cfg.rollout.engine == "sglang" and cfg.train.save_interval == 0


def test_timed_steps_leave_out_warmup_evaluation_and_checkpoints():
    lines = [{"step": s, "perf/step_time_s": 1.0} for s in range(6)]
    lines[3]["perf/eval_time_s"] = 0.5
    lines[4]["perf/checkpoint_time_s"] = 0.2
    assert [m["step"] for m in bench.timed_steps(lines, warmup=1)] == [2, 5]
    assert bench.summary(bench.timed_steps(lines, warmup=1))["step"] == 1.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity calls")
def test_the_engine_python_runs_pinned_to_its_core_with_one_thread(tmp_path):
    core = min(os.sched_getaffinity(0))
    python = bench.pinned_python(sys.executable, core, tmp_path)
    out = subprocess.run(
        [
            python,
            "-c",
            "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [f"[{core}]", "1"]
