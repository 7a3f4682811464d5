"""SGLang's servers as ``megatron-rl-fp8 launch`` starts them (the registry's ``launcher``): what it
refuses, how many nodes dedicated engines need, the GPUs of every engine, the overrides that
attach the trainer, the dry-run's lines about them and the rollout role (``role.py``).

Placement, per ``rollout.placement``:

* ``dedicated``: the engines take GPUs of rollout nodes of their own from GPU 0 (or
  ``rollout.sglang.base_gpu_id``), dealt round-robin over those nodes;
* ``colocated``: every node trains, and the engines take its last GPUs, off the GPUs of the
  weight sync's sending ranks with the distributed transport (``sender.py``: ``Senders``);
  ``rollout.sglang.num_engines: 0`` puts an engine on every TP group of GPUs of every node
  (``placement.py``: ``colocated_engines``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.launching import NodeRole, PlacedEngine, Placement
from megatron_rl_fp8.rollout.sglang import role
from megatron_rl_fp8.rollout.sglang.placement import (
    EVERY_TP_GROUP,
    check_transport,
    colocated_engines,
    engine_count,
)
from megatron_rl_fp8.rollout.sglang.process import resolve_python
from megatron_rl_fp8.rollout.sglang.sender import Senders, engine_gpus_on_node, free_engine_blocks

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

RunConfig = Any
"""``megatron_rl_fp8.config.RunConfig``, the whole run's config (a layer above ``rollout/``)."""


class SGLangLauncher:
    """:class:`~megatron_rl_fp8.rollout.launching.Launcher` for ``rollout.engine: sglang``."""

    def check(self, cfg: RunConfig, *, nodes: int, gpus_per_node: int) -> None:
        r = cfg.rollout
        if r.sglang.engine_urls or r.sglang.router_url:
            raise ConfigError(
                "rollout.sglang.engine_urls / router_url are set, but the launcher starts the "
                "engines and the router itself and passes their URLs to the trainer; remove them"
            )
        check_transport(r.placement, r.sglang.transport, nodes=nodes)
        engine_count(r.sglang, r.placement, nodes=nodes, gpus_per_node=gpus_per_node)

    def nodes_needed(self, cfg: RunConfig, *, gpus_per_node: int, most_per_node: int) -> int:
        sg = cfg.rollout.sglang
        return math.ceil(sg.num_engines / _engines_per_node(sg, gpus_per_node, 0, most_per_node))

    def place(
        self,
        cfg: RunConfig,
        *,
        nodes: tuple[str, ...],
        gpus_per_node: int,
        colocated: bool,
        most_per_node: int,
    ) -> Placement:
        sg = cfg.rollout.sglang
        senders = _senders(cfg, len(nodes), gpus_per_node) if colocated else None
        if sg.num_engines == EVERY_TP_GROUP:
            gpus = _every_tp_group(sg, gpus_per_node, nodes, senders)
        else:
            gpus = _dealt(sg, gpus_per_node, nodes, colocated, senders, most_per_node)
        n, every = len(nodes), sg.num_engines == EVERY_TP_GROUP
        count_note = (
            f"rollout.sglang.num_engines=0: an engine on every TP group of every node, "
            f"{len(gpus) // n} per node x {n} node(s) (rollout/sglang/placement.py)"
            if every
            else ""
        )
        notes = []
        if sg.transport != "distributed":
            notes.append(
                f"weight sync: rollout.sglang.transport={sg.transport} (CUDA IPC / shared memory) "
                "from the sending ranks of each engine's own node; engines may share their GPUs"
            )
        if senders is not None:
            notes.append(
                f"weight sync: sending ranks {', '.join(map(str, senders.ranks))} (one per "
                f"pipeline stage) on GPU(s) {', '.join(map(str, sorted(senders.gpus)))} of their "
                "nodes; no engine there (one NCCL group cannot hold two processes on one GPU)"
            )
        return Placement(
            gpus=tuple(gpus[e] for e in range(len(gpus))),
            tp=sg.tp_size,
            derived_count=every,
            count_note=count_note,
            notes=tuple(notes),
        )

    def check_files(self, cfg: RunConfig) -> None:
        try:
            resolve_python(cfg.rollout.sglang)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None

    def trainer_overrides(
        self, engines: Sequence[PlacedEngine], router_url: str | None, derived_count: bool
    ) -> list[str]:
        urls = _json([e.url for e in engines])
        nodes = _json([e.node for e in engines])
        out = [f"rollout.sglang.engine_urls={urls}", f"rollout.sglang.engine_nodes={nodes}"]
        if derived_count:  # num_engines=0 resolved: the trainer attaches to this many
            out.append(f"rollout.sglang.num_engines={len(engines)}")
        if router_url:
            out.append(f"rollout.sglang.router_url={router_url}")
        return out

    def serve_node(
        self,
        cfg: RunConfig,
        node: NodeRole,
        *,
        colocated: bool,
        restart_count: int,
        log_dir: Path | None,
    ) -> int:
        return role.serve_node(
            cfg, node, colocated=colocated, restart_count=restart_count, log_dir=log_dir
        )


def _json(values: list[str]) -> str:
    """A list as one override value: JSON, which is YAML, without spaces."""
    return json.dumps(values, separators=(",", ":"))


def _engines_per_node(
    sg: SGLangConfig, gpus_per_node: int, default_base: int, most_per_node: int
) -> int:
    """Whole engines one node holds: its GPUs from the first engine GPU on, / tp_size."""
    if sg.tp_size > gpus_per_node:
        raise ConfigError(
            f"rollout.sglang.tp_size={sg.tp_size} exceeds the {gpus_per_node} GPUs of a node, and "
            "an engine runs on one node: lower rollout.sglang.tp_size"
        )
    base = default_base if sg.base_gpu_id is None else sg.base_gpu_id
    fit = max(gpus_per_node - base, 0) // sg.tp_size
    if fit < 1:
        raise ConfigError(
            f"rollout.sglang.base_gpu_id={base} leaves no room for a TP {sg.tp_size} engine on a "
            f"node of {gpus_per_node} GPUs; set rollout.sglang.base_gpu_id=null"
        )
    return min(fit, most_per_node)


def _every_tp_group(
    sg: SGLangConfig, gpus_per_node: int, nodes: tuple[str, ...], senders: Senders | None
) -> dict[int, tuple[int, ...]]:
    """``num_engines=0``: ``placement.colocated_engines``' GPUs per engine; refused where
    ``base_gpu_id`` moves them or an engine would share a GPU with a sending rank of the
    distributed transport (the tensor transport may share one)."""
    g, tp = gpus_per_node, sg.tp_size
    if sg.base_gpu_id not in (None, 0):
        raise ConfigError(
            "rollout.sglang.num_engines=0 puts an engine on every TP group of a node from GPU 0, "
            f"but rollout.sglang.base_gpu_id={sg.base_gpu_id}: set rollout.sglang.base_gpu_id="
            "null, or num_engines to a count"
        )
    slots = colocated_engines(nodes=len(nodes), gpus_per_node=g, engine_tp=tp)
    avoid = senders.gpus if senders is not None else {}
    clash = next(((s, x) for s in slots for x in s.gpus if x in avoid), None)
    if clash is not None:
        (s, x), fit = clash, len(free_engine_blocks(g, tp, avoid)) * len(nodes)
        instead = f", or rollout.sglang.num_engines={fit} (off those GPUs)" if fit else ""
        raise ConfigError(
            f"rollout.sglang.num_engines=0 puts engine {s.index} on GPU {x} of "
            f"{nodes[s.node_index]}, where {senders.describe(x)}, and the weight sync's NCCL "
            "group (rollout.sglang.transport=distributed) cannot hold two processes on one GPU: "
            "set rollout.sglang.transport=tensor (CUDA IPC may share a GPU; synced per node on "
            f"several){instead}"
        )
    return {s.index: s.gpus for s in slots}


def _dealt(
    sg: SGLangConfig,
    gpus_per_node: int,
    nodes: tuple[str, ...],
    colocated: bool,
    senders: Senders | None,
    most_per_node: int,
) -> dict[int, tuple[int, ...]]:
    """``sg.num_engines`` engines' GPUs, each node's by ``engine_gpus_on_node`` (the fleet's
    rule too); refuse if they do not fit, or if one would share a GPU of ``senders``."""
    g, tp = gpus_per_node, sg.tp_size
    per_node = _engines_per_node(sg, g, 0, most_per_node)
    if sg.num_engines > per_node * len(nodes):
        base = (
            "" if sg.base_gpu_id is None else f" from rollout.sglang.base_gpu_id={sg.base_gpu_id}"
        )
        raise ConfigError(
            f"rollout.sglang.num_engines={sg.num_engines} x rollout.sglang.tp_size={tp} = "
            f"{sg.num_engines * tp} GPUs do not fit on the {len(nodes)} rollout node(s) "
            f"({per_node} engine(s) of {g} GPUs{base} each): lower num_engines or give the "
            "rollout more nodes (a smaller TRAIN_NODES, or more nodes)"
        )
    # Dedicated rollout nodes start at GPU 0; colocated ones at their last GPUs (base None).
    base = sg.base_gpu_id if sg.base_gpu_id is not None or colocated else 0
    gpus: dict[int, tuple[int, ...]] = {}
    for i, node in enumerate(nodes):
        here = list(range(i, sg.num_engines, len(nodes)))  # this node's engines, by slot
        try:
            placed = engine_gpus_on_node(
                here, tp_size=tp, gpus_per_node=g, senders=senders, base_gpu_id=base, node=node
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        gpus.update(zip(here, placed))
    return gpus


def _senders(cfg: RunConfig, nodes: int, gpus_per_node: int) -> Senders | None:
    """The sending ranks colocated engines must keep off (``sender.py``: every pipeline stage's
    sending rank, on its GPU of any trainer node) with the distributed transport, whose NCCL
    group cannot hold two processes on one GPU. None with the tensor transport (CUDA IPC may
    share a GPU)."""
    if cfg.rollout.sglang.transport != "distributed":
        return None
    return Senders(
        world_size=nodes * gpus_per_node,  # colocated: every node trains
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        gpus_per_node=gpus_per_node,
    )


LAUNCHER = SGLangLauncher()
"""The one instance the spec holds (``spec.py``)."""
