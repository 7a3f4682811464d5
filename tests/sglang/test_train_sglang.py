"""The tiny job trains with SGLang as its rollout engine, syncing weights every step.

* TP=1 through the CLI, with ``MRF8_SGLANG_FAULT=begin_update``: the server is SIGKILLed where CI
  saw runs die (after a rollout, as the next weight sync begins). The engine relaunches it from
  the complete disk copy of the new version, the run finishes every step, rollout logprobs still
  agree with the trainer's recomputation, and no server process outlives the run.
* PP=2 with a colocated fleet of one engine: each stage's rank broadcasts its own layers.
* DP=2 with two engines behind sglang-router, one SIGKILLed mid-rollout.

``token_mult_prob_error`` = mean exp(|logp_rollout - logp_train|): both sides are fp32 with
the same weights, so it stays within 1e-3 of 1 (a wrong or stale weight gives >> 1.01).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8.metrics.logger import read_metrics
from megatron_rl_fp8.rollout.sglang import FAULT_ENV, server_group_pids
from tests.dist_utils import run_distributed
from tests.trainer_utils import SMALL, trainer_body

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]


def _sglang_args(py, work):
    return [
        "rollout.engine=sglang",
        f"rollout.sglang.python={py}",
        f"rollout.sglang.work_dir={work}",
        "rollout.sglang.startup_timeout_s=300",
    ]


def test_tiny_run_survives_a_killed_server(sglang_py, tmp_path):
    # steps=2: sync 0 launches the server, step 1's sync meets the fault (relaunch), step 2's
    # rollout and the final evaluation run on the relaunched server.
    out, work = tmp_path / "run", tmp_path / "sglang"
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl_fp8",
        "train",
        "examples/tiny_cpu.yaml",
        *SMALL,
        "train.steps=2",
        "train.eval_interval=2",
        f"train.output_dir={out}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "2")
    env[FAULT_ENV] = "begin_update"
    with open(tmp_path / "train.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False
        ).returncode
    text = (tmp_path / "train.log").read_text()
    assert rc == 0, text[-3000:]
    assert "weight update to version 1: /update_weight_version" in text, text[-3000:]
    assert (work / "server-2.log").exists() and not (work / "server-3.log").exists()
    assert server_group_pids(int((work / "server.pid").read_text())) == []  # exit took it along
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)
    assert "eval/reward_mean" in metrics[-1]


def test_pp2_trainer_feeds_a_colocated_engine_from_each_stage(sglang_py, tmp_path):
    # A fleet of one colocated engine (on CPU the memory calls are logged no-ops): each pipeline
    # stage's rank broadcasts its own layers to the engine over a group of its own.
    work = tmp_path / "sglang"
    overrides = [
        *SMALL,
        "train.steps=2",
        "parallel.pipeline_model_parallel_size=2",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
        "rollout.placement=colocated",
    ]
    metrics = run_distributed(trainer_body, world_size=2, args=(overrides,), timeout=900)[0]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)  # both stages' weights arrived intact
    log = (work / "engine0-1.log").read_text()
    senders = set(re.findall(r"group_name=mrf8_sync_pid(\d+)_", log))
    assert len(senders) == 2, senders  # one sending process per stage, the group formed once
    assert not list(work.rglob("*.safetensors"))


def test_dp2_trainer_with_two_engines_behind_a_router_survives_a_killed_engine(
    sglang_py, tmp_path, monkeypatch
):
    # Rollouts: eval at step 0 (1st), steps 1, 2, 3 (2nd-4th), final eval. The 3rd, step 2's, has
    # the second engine SIGKILLed while its requests are in flight.
    monkeypatch.setenv(FAULT_ENV, "generate@3")
    work = tmp_path / "sglang"
    overrides = [
        *SMALL,
        "train.steps=3",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
        "rollout.sglang.num_engines=2",
    ]
    metrics = run_distributed(trainer_body, world_size=2, args=(overrides,), timeout=900)[0]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    _assert_rollout_matches_trainer(metrics)  # every rollout on the weights the trainer had
    one, two, three = metrics[1:]
    # (A CPU engine's start can fail at random, when other processes move the host memory it
    # sizes its KV pool from; it is relaunched then, and counted: hence the differences.)
    assert one["rollout/engines_used"] == 2
    restarts = two["rollout/engine_restarts"] - one["rollout/engine_restarts"]
    assert restarts == 1  # the killed engine; the step finished on the other one
    assert three["rollout/engines_serving"] == 2 and three["rollout/engines_used"] == 2
    assert three["rollout/engine_restarts"] == two["rollout/engine_restarts"]
    assert not list(work.rglob("*.safetensors"))  # no weight copy per step


def _assert_rollout_matches_trainer(metrics):
    for m in metrics[1:]:
        # The trainer names it rollout/... or fp8/... depending on its version; one must exist.
        keys = [k for k in m if k.endswith("token_mult_prob_error")]
        assert keys, sorted(m)
        for k in keys:
            assert abs(m[k] - 1.0) < 1e-3, (k, m[k])
