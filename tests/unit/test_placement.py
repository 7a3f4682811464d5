"""Colocated placement (megatron_rl_fp8/rollout/sglang/placement.py): an engine on every TP
group of GPUs of every node, its refusals, the transport that must reach it, and the planner's
engine count."""

from __future__ import annotations

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.plan.memory import World
from megatron_rl_fp8.plan.time import planned_fleet
from megatron_rl_fp8.rollout.sglang import placement
from megatron_rl_fp8.rollout.sglang.placement import (
    check_transport,
    colocated_engines,
    engine_count,
    engines_per_node,
)

Q32B = EXAMPLES_DIR / "qwen3_32b_dapo_math_fp8.yaml"


def test_one_engine_per_tp_group_on_every_node_dealt_round_robin():
    slots = colocated_engines(nodes=2, gpus_per_node=8, engine_tp=4)
    assert [(s.index, s.node_index, s.base_gpu_id) for s in slots] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 4),
        (3, 1, 4),
    ]
    assert slots[3].gpus == (4, 5, 6, 7)
    # Every GPU of every node serves exactly one engine.
    for nodes, g, tp in ((1, 8, 1), (3, 8, 2), (4, 8, 8), (2, 4, 2), (1, 1, 1)):
        slots = colocated_engines(nodes=nodes, gpus_per_node=g, engine_tp=tp)
        assert len(slots) == nodes * (g // tp)
        taken = sorted((s.node_index, x) for s in slots for x in s.gpus)
        assert taken == [(n, x) for n in range(nodes) for x in range(g)]


@pytest.mark.parametrize(
    "g, tp, needle",
    [
        (8, 3, "rollout.sglang.tp_size=3 does not divide its 8 GPUs (2 would serve no engine): set "
               "tp_size to one of 1, 2, 4, 8, or num_engines to a count"),
        (8, 16, "rollout.sglang.tp_size=16 exceeds the 8 GPUs of a node"),
        (6, 4, "set tp_size to one of 1, 2, 3, 6"),
    ],
)  # fmt: skip
def test_a_tp_size_that_does_not_tile_a_node_is_refused_in_one_line(g, tp, needle):
    with pytest.raises(ConfigError) as e:
        colocated_engines(nodes=2, gpus_per_node=g, engine_tp=tp)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        engines_per_node(gpus_per_node=g, engine_tp=tp)


def _sglang(num_engines: int, tp: int = 4):
    cfg = load_config(Q32B, ["model.hf_checkpoint=null", f"rollout.sglang.tp_size={tp}"])
    cfg.rollout.sglang.num_engines = num_engines  # 0 without the config's own check
    return cfg


def test_engine_count_is_the_placement_with_zero_and_the_count_otherwise():
    sg = _sglang(0).rollout.sglang
    assert engine_count(sg, "colocated", nodes=2, gpus_per_node=8) == 4
    assert engine_count(sg, "colocated", nodes=4, gpus_per_node=8) == 8
    assert engine_count(_sglang(3).rollout.sglang, "colocated", nodes=2, gpus_per_node=8) == 3
    with pytest.raises(ConfigError, match="is for rollout.placement=colocated, not dedicated"):
        engine_count(sg, "dedicated", nodes=2, gpus_per_node=8)


def test_the_tensor_transport_reaches_colocated_engines_on_every_node(monkeypatch):
    # Per node on several (trainer/node_sync.py), directly on one; never dedicated nodes.
    for nodes in (1, 2, 4):
        check_transport("colocated", "tensor", nodes=nodes)
        check_transport("colocated", "distributed", nodes=nodes)
    with pytest.raises(ConfigError, match="dedicated rollout nodes are other nodes"):
        check_transport("dedicated", "tensor", nodes=2)
    # A transport that does not sync per node reaches one node only.
    monkeypatch.setattr(placement, "PER_NODE_TRANSPORTS", frozenset())
    check_transport("colocated", "tensor", nodes=1)
    with pytest.raises(ConfigError, match="colocated engines on 2 nodes"):
        check_transport("colocated", "tensor", nodes=2)


def test_the_planner_counts_the_launchers_engines():
    """plan --time's fleet: one TP 4 engine per 4 GPUs of the world with num_engines=0."""
    cfg = _sglang(0)
    for nodes, engines in ((1, 2), (2, 4), (4, 8)):
        assert planned_fleet(cfg, World(nodes=nodes))[0].engines == engines
    assert planned_fleet(_sglang(1), World(nodes=2))[0].engines == 1


def test_plan_time_of_the_32b_example_runs_engines_on_all_16_gpus(capsys):
    """`plan examples/qwen3_32b_dapo_math_fp8.yaml --nodes 2 --time --gpu H200`: 4 TP 4 engines,
    rollout a quarter of one engine's (the example before it used num_engines=0)."""

    def rollout_s(*more: str) -> tuple[float, str]:
        args = ["plan", str(Q32B), *more, "--nodes", "2", "--time", "--gpu", "H200"]
        assert cli.main(args) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.strip().startswith("rollout (generation)"))
        return float(line.split()[2]), out

    every, out = rollout_s()
    assert "rollout: 4 engine(s) (rollout.sglang.num_engines=0: one per TP group" in out
    assert "the engines use 16 of the 16 GPUs" in out
    assert "would refuse" not in out  # the launcher places them: synced per node
    one, _ = rollout_s("rollout.sglang.num_engines=1")
    assert every == pytest.approx(one / 4, rel=0.02)


def test_nodes_sharing_an_address_give_their_engines_different_ports():
    """Two slurmd on one host (the local test cluster): the engines of both nodes listen on one
    address, so each takes the next port of that address; on distinct hosts the slots repeat."""
    from megatron_rl_fp8.launch.layout import plan_layout
    from megatron_rl_fp8.launch.slurm import SlurmEnv

    cfg = load_config(Q32B, ["model.hf_checkpoint=null"])
    env = SlurmEnv(nodes=("n1", "n2"), gpus_per_node=8, job_id=0)
    shared = plan_layout(cfg, env, addrs={"n1": "127.0.0.1", "n2": "127.0.0.1"}).engines
    apart = plan_layout(cfg, env, addrs={"n1": "10.0.0.1", "n2": "10.0.0.2"}).engines
    assert [e.node for e in shared] == ["n1", "n2", "n1", "n2"]
    assert len({e.url for e in shared}) == 4
    assert [e.port for e in apart] == [apart[0].port, apart[0].port, apart[2].port, apart[2].port]
    assert sorted(e.port for e in shared) == sorted({e.port for e in shared})
