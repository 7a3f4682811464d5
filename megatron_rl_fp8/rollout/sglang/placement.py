"""Where a colocated job's SGLang engines go: one on every TP group of GPUs of every node.

In a colocated job (``rollout.placement=colocated``) the trainer's weights, gradients and
optimizer state are offloaded while the engines generate, so rollout, the largest phase of a
step, can use every GPU. ``rollout.sglang.num_engines: 0`` asks for exactly that: each node's
GPUs cut into blocks of ``rollout.sglang.tp_size``, one engine per block, on every node, so
``nodes * (gpus_per_node // tp_size)`` engines. :func:`colocated_engines` is that placement, the
one the launcher starts (``launch/layout.py``), ``plan --time`` predicts (``plan/time.py``:
``Fleet``) and ``scripts/scaling_model.py`` tabulates.

Engines are numbered as the launcher deals them: round-robin over the nodes (engine e on node
e % nodes), engine e taking slot e // nodes of its node, GPUs slot * tp_size onwards, so a node's
engines fill it from GPU 0 and any prefix of the engines spreads evenly over the nodes.

Whether the weight sync can reach such engines is the transport's business
(:func:`check_transport`): the ``distributed`` transport's NCCL broadcast cannot share a GPU
with a sending rank; the ``tensor`` transport (CUDA IPC / shared memory) can, and on several
nodes it syncs per node (``trainer/node_sync.py``): every node's engines get every stage's
weights from a trainer rank of their own node, so an engine may take every GPU of every node.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from megatron_rl_fp8.config_utils import ConfigError


class EngineSettings(Protocol):
    """What of ``rollout.sglang`` (``SGLangConfig``) the count reads."""

    num_engines: int
    tp_size: int


EVERY_TP_GROUP = 0
"""``rollout.sglang.num_engines`` that asks for one engine on every TP group of every node."""

PER_NODE_TRANSPORTS: frozenset[str] = frozenset({"tensor"})
"""Transports by which every node's trainer ranks sync their own node's engines (CUDA IPC on
GPU, shared memory on CPU; ``trainer/node_sync.py``), so that colocated engines on several
nodes need no cross-node broadcast and may take every GPU."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSlot:
    """One engine's place: its node (index in the job) and its first GPU there."""

    index: int
    node_index: int
    base_gpu_id: int
    tp_size: int

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.base_gpu_id, self.base_gpu_id + self.tp_size))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def engines_per_node(*, gpus_per_node: int, engine_tp: int) -> int:
    """Engines on one node with one per TP group: ``gpus_per_node // engine_tp``. Refuses, one
    line naming ``rollout.sglang.tp_size`` and the sizes that work, an engine TP that does not
    fit a node or leaves some of its GPUs without an engine."""
    if gpus_per_node < 1:
        raise ConfigError(f"a node of {gpus_per_node} GPUs holds no engine")
    if engine_tp > gpus_per_node:
        raise ConfigError(
            f"rollout.sglang.tp_size={engine_tp} exceeds the {gpus_per_node} GPUs of a node, and "
            f"an engine runs on one node: set tp_size to one of {_divisors(gpus_per_node)}"
        )
    if gpus_per_node % engine_tp:
        raise ConfigError(
            f"rollout.sglang.num_engines=0 puts an engine on every TP group of a node, but "
            f"rollout.sglang.tp_size={engine_tp} does not divide its {gpus_per_node} GPUs "
            f"({gpus_per_node % engine_tp} would serve no engine): set tp_size to one of "
            f"{_divisors(gpus_per_node)}, or num_engines to a count"
        )
    return gpus_per_node // engine_tp


def colocated_engines(*, nodes: int, gpus_per_node: int, engine_tp: int) -> tuple[EngineSlot, ...]:
    """The engines of a colocated job of ``nodes`` nodes with one per TP group of
    ``engine_tp`` GPUs on every node, in the launcher's order (the module docstring). Pure;
    ConfigError (one line, :func:`engines_per_node`) where the TP size does not tile a node."""
    if nodes < 1:
        raise ConfigError(f"a job of {nodes} nodes holds no engine")
    per_node = engines_per_node(gpus_per_node=gpus_per_node, engine_tp=engine_tp)
    return tuple(
        EngineSlot(index=e, node_index=e % nodes, base_gpu_id=e // nodes * engine_tp,
                   tp_size=engine_tp)
        for e in range(nodes * per_node)
    )  # fmt: skip


def engine_count(sg: EngineSettings, placement: str, *, nodes: int, gpus_per_node: int) -> int:
    """How many engines ``rollout.sglang`` asks for on ``nodes`` nodes of ``gpus_per_node``
    GPUs: ``num_engines``, or with 0 (:data:`EVERY_TP_GROUP`, colocated only) one per TP group
    of every node. The count the launcher places and the planner predicts."""
    if sg.num_engines != EVERY_TP_GROUP:
        return sg.num_engines
    if placement != "colocated":
        raise ConfigError(
            f"rollout.sglang.num_engines=0 (an engine on every TP group of every node) is for "
            f"rollout.placement=colocated, not {placement}: give the dedicated engines a count "
            "(rollout.sglang.num_engines=N)"
        )
    return len(colocated_engines(nodes=nodes, gpus_per_node=gpus_per_node, engine_tp=sg.tp_size))


def check_transport(placement: str, transport: str, *, nodes: int) -> None:
    """Refuse, one line, engines the weight sync's ``transport`` cannot reach: the ``tensor``
    transport (CUDA IPC / shared memory) reaches the sending ranks' node only, so not dedicated
    rollout nodes, nor colocated engines on several nodes unless the transport syncs per node
    (:data:`PER_NODE_TRANSPORTS`). The ``distributed`` transport reaches any node; its rule
    (engines off the sending ranks' GPUs) is ``rollout/sglang/sender.py``'s."""
    if transport == "distributed" or placement == "local":
        return
    if placement == "dedicated":
        raise ConfigError(
            f"rollout.sglang.transport={transport} reaches engines on the senders' node only, and "
            "dedicated rollout nodes are other nodes: set rollout.sglang.transport=distributed"
        )
    if nodes > 1 and transport not in PER_NODE_TRANSPORTS:
        raise ConfigError(
            f"rollout.sglang.transport={transport} reaches engines on the senders' node only, and "
            f"colocated engines on {nodes} nodes are on others too: set "
            f"rollout.sglang.transport to one of {sorted(PER_NODE_TRANSPORTS)} (synced per node) "
            "or distributed"
        )
