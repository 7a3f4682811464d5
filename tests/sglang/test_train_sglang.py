"""The tiny job trains with SGLang as its rollout engine, syncing weights every step.

* PP=2 with one colocated engine: each stage's rank broadcasts its own layers, and the phases come
  in the colocated order (trainer offloaded and KV cache resumed around every generation, the
  engine's memory released before the trainer takes its own back, weights resumed for the sync).
  With ``MRF8_SGLANG_FAULT=begin_update@2`` the engine is SIGKILLed where CI saw runs die (after
  a rollout, as the next sync begins): it is relaunched on placeholder weights and both stages
  send the sync again; the run finishes every step and no process outlives it.
* DP=2 with two engines behind sglang-router, one SIGKILLed mid-rollout.
* A per-node sync: PP=2 on two "nodes" (``SLURMD_NODENAME`` n1 and n2, one rank each), a
  colocated engine on each, ``transport=tensor``: each node's rank relays its stage's buckets to
  the other and pushes both stages' to its own node's engine over shared memory.
* A delta receiver: one trainer rank on n1, the fleet's second engine on n3 (no trainer rank),
  fed by ``megatron-rl-fp8 receiver`` beside it, which takes each sync as a delta over TCP.
* A tiny Qwen3-MoE at expert parallelism 2: every sync gathers the experts from both ranks.
* ``train.pipeline=one_step_off`` with one dedicated engine, SIGKILLed while it generates the
  next step's rollout during an update: that rollout is lost, the engine relaunched and synced
  with the step's weights, and the next step generates its own (lag 0) before the pipeline
  goes on (lag 1).

``token_mult_prob_error`` = mean exp(|logp_rollout - logp_train|): both sides are fp32 with
the same weights, so it stays within 1e-3 of 1 (a wrong or stale weight gives >> 1.01).
"""

import json
import re
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


def _pp2_colocated(py, tmp_path, work):
    """A 2-step PP=2 run of the small job with colocated SGLang engines in ``work``."""
    return [
        *SMALL,
        "train.steps=2",
        "parallel.pipeline_model_parallel_size=2",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(py, work),
        "rollout.placement=colocated",
    ]


def test_pp2_trainer_feeds_a_colocated_engine_from_each_stage_and_resends_a_failed_sync(
    sglang_py, tmp_path, monkeypatch
):
    # A fleet of one colocated engine (on CPU the memory calls are logged no-ops): each pipeline
    # stage's rank broadcasts its own layers to the engine over a group of its own. Sync 0 is the
    # first begin_update, step 1's sync the second: the engine dies there.
    monkeypatch.setenv(FAULT_ENV, "begin_update@2")
    work = tmp_path / "sglang"
    overrides = [
        *_pp2_colocated(sglang_py, tmp_path, work),
    ]
    metrics, events = run_distributed(colocated_body, world_size=2, args=(overrides,), timeout=900)[
        0
    ]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)  # both stages' weights arrived intact, twice
    for m in metrics[1:]:  # both stages' senders' parts reach the driver, inside the sync
        parts = [m[f"perf/sync_{p}_time_s"] for p in ("gather", "quantize", "transfer", "load")]
        assert min(parts) >= 0 and m["perf/sync_transfer_time_s"] > 0, m
        assert sum(parts) <= m["perf/sync_time_s"], m
    assert metrics[2]["rollout/engine_restarts"] >= 1
    # Step 0: sync, evaluate; steps 1 and 2: rollout, train, sync (step 1's twice); step 2
    # evaluates too. The KV cache is resumed only once released, the weights only before a sync;
    # an engine relaunched by the failed sync starts holding everything, and joins released.
    generate = ["offload", "resume kv_cache", "generate"]
    train = [*generate, "release weights+kv_cache", "reload", "train", "resume weights"]
    evaluate = ["release kv_cache", "reload"]
    assert events == [
        "sync",
        *generate[0:1] + generate[2:],
        *evaluate,
        *train,
        "sync",
        "sync",  # the failed sync, sent again
        "release kv_cache",  # the relaunched engine joins the others' released KV cache
        *train,
        "sync",
        *generate,
        *evaluate,
    ], events
    assert server_group_pids(int((work / "engine0.pid").read_text())) == []  # gone with the run
    # The first engine and the last relaunch (a CPU start can also fail at random: see below).
    launches = max(int(p.stem.split("-")[1]) for p in work.glob("engine0-*.log"))
    assert launches >= 2
    for launch in (1, launches):
        log = (work / f"engine0-{launch}.log").read_text()
        senders = set(re.findall(r"group_name=mrf8_sync_pid(\d+)_", log))
        assert len(senders) == 2, senders  # one sending process per stage
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


def test_pipelined_run_survives_an_engine_killed_during_an_update(sglang_py, tmp_path, monkeypatch):
    # Generations: step 0's eval (1st); step 1's own rollout (2nd, before its update); step 2's,
    # launched as step 1's update begins (3rd): the engine is SIGKILLed with its requests in
    # flight, while the trainer updates. Then step 2's own (4th), step 3's in the background
    # (5th), the final eval (6th).
    monkeypatch.setenv(FAULT_ENV, "generate@3")
    work = tmp_path / "sglang"
    overrides = [
        *SMALL,
        "train.steps=3",
        "train.pipeline=one_step_off",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
    ]
    metrics = run_distributed(trainer_body, world_size=1, args=(overrides,), timeout=900)[0]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    one, two, three = metrics[1:]
    # Step 1 and step 2 generated their own rollouts (step 2's in flight was lost), step 3
    # trained on the one generated during step 2's update, one version behind.
    assert [m["rollout/staleness_max"] for m in (one, two, three)] == [0, 0, 1]
    # Versions: step 1's rows by the first sync's weights, step 2's (regenerated) and step 3's by
    # the weights synced after step 1.
    v = one["rollout/policy_version"]
    assert [two["rollout/policy_version"], three["rollout/policy_version"]] == [v + 1, v + 1]
    for m in (one, two):  # lag-0 rows: the rollout's logprobs are the trainer's recomputation
        assert abs(m["fp8/token_mult_prob_error_lag0"] - 1.0) < 1e-3, m
    assert (
        "fp8/token_mult_prob_error_lag1" in three and "fp8/token_mult_prob_error_lag0" not in three
    )
    assert two["perf/pipeline/overlap_time_s"] > 0  # step 3's rollout ran beside step 2's update
    assert three["rollout/engine_restarts"] >= 1
    assert server_group_pids(int((work / "engine0.pid").read_text())) == []  # gone with the run
    assert len(list(work.glob("engine0-*.log"))) >= 2  # the first launch and the relaunch


def test_per_node_sync_feeds_each_nodes_engine_from_its_own_rank(sglang_py, tmp_path):
    work = tmp_path / "sglang"
    overrides = [
        *_pp2_colocated(sglang_py, tmp_path, work),
        "rollout.sglang.transport=tensor",
        "rollout.sglang.num_engines=2",
        "rollout.delta_sync=true",  # issue 48: the relay carries what changed since the last sync
    ]
    (metrics, engines, pushed_by_n1), pushed_by_n2 = run_distributed(
        two_node_body, world_size=2, args=(overrides,), timeout=900
    )
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)  # both engines hold both stages' weights, exactly
    for m in metrics[1:]:
        assert m["perf/sync_relay_time_s"] > 0, m  # each stage's buckets crossed to the other node
        assert m["rollout/engines_used"] == 2, m
    # The first sync is full; the next a delta, applied on n2 (exact: the check above).
    one, two = metrics[1:]
    assert one["perf/sync_relay_mb"] >= 0.99 * one["perf/sync_relay_full_mb"]
    assert two["perf/sync_relay_mb"] < two["perf/sync_relay_full_mb"], two
    # Each node's rank pushed to its own node's engine only.
    (url1, node1), (url2, node2) = engines
    assert (node1, node2) == ("n1", "n2")
    assert (pushed_by_n1, pushed_by_n2) == ([url1], [url2])
    for i in range(2):  # no distributed-transport group was ever formed
        assert "mrf8_sync" not in (work / f"engine{i}-1.log").read_text()


def _remote_receiver_body(rank, world_size, overrides, log):
    """``trainer_body`` on n1 with the fleet's second engine placed on n3, served by a delta
    receiver process (``megatron-rl-fp8 receiver``) started here."""
    import os

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.trainer.loop import Trainer
    from tests.delta_utils import start_receiver

    os.environ["SLURMD_NODENAME"] = "n1"
    proc, port = start_receiver(0, Path(log))
    trainer = Trainer(
        load_config(None, [*overrides, f"rollout.delta_receivers=[n3=127.0.0.1:{port}]"])
    )
    trainer.engine.engines[1].node = "n3"
    try:
        trainer.run()
    finally:
        trainer.close()
        parallel.destroy()
        proc.kill()
    return read_metrics(trainer.cfg.train.output_dir)


def test_a_delta_receiver_feeds_an_engine_no_trainer_rank_reaches(sglang_py, tmp_path):
    """Issue 48: the engine on n3 gets every sync from the receiver beside it (the first in
    full, the next as a delta over TCP) and samples with exactly the trainer's weights."""
    work = tmp_path / "sglang"
    overrides = [
        *SMALL,
        "train.steps=2",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
        "rollout.sglang.transport=tensor",
        "rollout.sglang.num_engines=2",
        "rollout.delta_sync=true",
        "rollout.delta_verify_every=1",
    ]
    log = tmp_path / "receiver.log"
    metrics = run_distributed(
        _remote_receiver_body, world_size=1, args=(overrides, str(log)), timeout=900
    )[0]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)  # both engines hold the trainer's weights, exactly
    for m in metrics[1:]:
        assert m["rollout/engines_used"] == 2, m
    one, two = metrics[1:]
    assert two["perf/sync_relay_mb"] < two["perf/sync_relay_full_mb"], two
    text = log.read_text()
    assert "stage 0 version 0 (full)" in text and "(delta from 0)" in text, text[-2000:]


def test_a_moe_trainer_with_expert_parallelism_feeds_an_sglang_engine(sglang_py, tmp_path):
    """Issue 47: a tiny Qwen3-MoE (4 experts, top-2) trained at EP 2 on two ranks, its experts
    gathered from both ranks at every sync, served by SGLang's CPU engine (a full-precision MoE
    runs SGLang's native expert loop on a CPU without AMX: layers/quantization/unquant.py,
    ``forward_cpu``); the engine's log-probs are the trainer's."""
    work = tmp_path / "sglang"
    overrides = [
        *SMALL,
        "train.steps=2",
        "model.num_experts=4",
        "model.moe_topk=2",
        "model.moe_ffn_hidden_size=64",
        "parallel.expert_model_parallel_size=2",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.cache_dir={tmp_path / 'cache'}",
        *_sglang_args(sglang_py, work),
    ]
    metrics = run_distributed(trainer_body, world_size=2, args=(overrides,), timeout=900)[0]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    _assert_rollout_matches_trainer(metrics)  # every expert arrived, from both ranks
    assert all(m["moe/load_max_over_mean"] >= 1.0 for m in metrics[1:])
    served = json.loads((work / "model" / "config.json").read_text())
    assert served["architectures"] == ["Qwen3MoeForCausalLM"]
    assert served.get("num_experts", served.get("num_local_experts")) == 4  # transformers 5: local


def two_node_body(rank, world_size, overrides):
    """``trainer_body`` on two nodes of one host: rank r on node n<r+1> (``SLURMD_NODENAME``, as
    Slurm sets it), the driver's second engine placed on n2 (what the launcher's
    ``rollout.sglang.engine_nodes`` says of the engines it starts). Returns the engines each
    rank's pushes went to, and on the driver first the metrics and each engine's (url, node)."""
    import os

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.rollout.sglang.sender import WeightSender
    from megatron_rl_fp8.trainer.loop import Trainer

    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    pushed: set[str] = set()
    push = WeightSender.push

    def noting_push(self, plan, buckets, **kwargs):
        pushed.update(url for url, _ in plan.engines)
        return push(self, plan, buckets, **kwargs)

    WeightSender.push = noting_push
    trainer = Trainer(load_config(None, list(overrides)))
    engines = None
    if rank == 0:
        trainer.engine.engines[1].node = "n2"
        engines = [(e.url, e.node) for e in trainer.engine.engines]
    try:
        trainer.run()
    finally:
        trainer.close()
        parallel.destroy()
    if rank == 0:
        return read_metrics(trainer.cfg.train.output_dir), engines, sorted(pushed)
    return sorted(pushed)


def colocated_body(rank, world_size, overrides):
    """``trainer_body`` that also records, on the driver, the colocated phases in order: the
    engine's memory calls (as the fleet records them), its syncs and generations, the trainer's
    offloads and updates."""
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.trainer.loop import Trainer

    trainer = Trainer(load_config(None, list(overrides)))
    events: list[str] = []
    if rank == 0:
        fleet = trainer.engine

        def note(name):
            return lambda *args, **kwargs: events.append(name)

        fleet.memory_calls = _Noted(
            lambda call, tags, engines: events.append(f"{call.split('_')[0]} {'+'.join(tags)}")
        )
        fleet.begin_sync = _Recorded(fleet.begin_sync, note("sync"))
        fleet.generate = _Recorded(fleet.generate, note("generate"))
        trainer.policy_update = _Recorded(trainer.policy_update, note("train"))
        trainer.offload.offload = _Recorded(trainer.offload.offload, note("offload"))
        trainer.offload.reload = _Recorded(trainer.offload.reload, note("reload"))
    try:
        trainer.run()
    finally:
        trainer.close()
        parallel.destroy()
    return (read_metrics(trainer.cfg.train.output_dir), events) if rank == 0 else None


class _Noted(list):
    """A list that calls ``note(*item)`` on every item appended (the fleet appends each memory
    call it makes to ``memory_calls``, in order)."""

    def __init__(self, note):
        super().__init__()
        self._note = note

    def append(self, item):
        self._note(*item)
        super().append(item)


class _Recorded:
    """``inner`` (a callable) that calls ``note`` with the same arguments first; its attributes
    pass through (the trainer reads the policy update's)."""

    def __init__(self, inner, note):
        self._inner, self._note = inner, note

    def __call__(self, *args, **kwargs):
        self._note(*args, **kwargs)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _assert_rollout_matches_trainer(metrics):
    for m in metrics[1:]:
        # The trainer names it rollout/... or fp8/... depending on its version; one must exist.
        keys = [k for k in m if k.endswith("token_mult_prob_error")]
        assert keys, sorted(m)
        for k in keys:
            assert abs(m[k] - 1.0) < 1e-3, (k, m[k])
