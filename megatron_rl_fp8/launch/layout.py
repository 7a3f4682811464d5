"""Which node runs what, on which ports, and whether the run can start there at all.

Roles (``rollout.placement``):

* ``dedicated``: the first ``TRAIN_NODES`` nodes run the trainer (one torchrun per node, one rank
  per GPU); the others run the SGLang engines, and the first of them also the sglang-router
  (when there is more than one engine). Unset, ``TRAIN_NODES`` is every node the engines do not
  need.
* ``colocated``: every node runs the trainer and engines on its last GPUs (SGLang releases their
  memory while the trainer trains), off the GPUs of the weight sync's sending ranks with the
  distributed transport (``rollout/sglang/sender.py``: ``Senders``); the router runs on the
  first node. ``rollout.sglang.num_engines: 0`` puts an engine on every TP group of GPUs of
  every node (``rollout/sglang/placement.py``: ``colocated_engines``).
* ``rollout.engine=local`` samples inside the trainer: every node trains, nothing else runs.

Engines are dealt round-robin over their nodes (engine e on rollout node e % R), so a colocated
run spreads their memory evenly. Ports come from the job id (:class:`Ports`): every process of
the job computes the same ones without talking to the others, and two jobs that share a node
(rare: most clusters give jobs whole nodes) collide only when their ids agree modulo 100.

:func:`check_run` is everything that can refuse a run before a process starts, each refusal one
line naming the setting and the fix: the trainer's GPUs against the parallel layout (the config's
own :meth:`RunConfig.validate`), the files it reads, and the memory planner's verdict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch.slurm import SlurmEnv
from megatron_rl_fp8.plan.memory import Estimate, World, estimate
from megatron_rl_fp8.rollout.registry import engine_spec
from megatron_rl_fp8.rollout.sglang.placement import (
    EVERY_TP_GROUP,
    check_transport,
    colocated_engines,
    engine_count,
)
from megatron_rl_fp8.rollout.sglang.process import resolve_python
from megatron_rl_fp8.rollout.sglang.sender import Senders, engine_gpus_on_node, free_engine_blocks

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

Placement = Literal["dedicated", "colocated", "local"]

PORT_FIRST = 10000
PORT_BLOCK = 200
PORT_BLOCKS = 100
"""A job's ports are one block of PORT_BLOCK in [PORT_FIRST, PORT_FIRST + PORT_BLOCK *
PORT_BLOCKS) = [10000, 30000): below Linux's ephemeral range (32768-60999), where the kernel
picks the source ports of outgoing connections and could be holding ours."""
ENGINE_PORT_OFFSET = 10
ENGINE_PORT_STRIDE = 10
"""Engines listen 10 ports apart: room for the helper ports some SGLang versions open next to
``--port``."""


@dataclasses.dataclass(frozen=True)
class Ports:
    """The job's ports: rendezvous and router at the start of its block, then the engines."""

    base: int

    @classmethod
    def for_job(cls, job_id: int) -> Ports:
        return cls(PORT_FIRST + (job_id % PORT_BLOCKS) * PORT_BLOCK)

    @property
    def rdzv(self) -> int:
        return self.base

    @property
    def router(self) -> int:
        return self.base + 1

    def engine(self, slot: int) -> int:
        """Port of the ``slot``-th engine of a node."""
        return self.base + ENGINE_PORT_OFFSET + slot * ENGINE_PORT_STRIDE


MAX_ENGINES_PER_NODE = (PORT_BLOCK - ENGINE_PORT_OFFSET) // ENGINE_PORT_STRIDE


def url_host(addr: str) -> str:
    """An address as the host part of a URL or endpoint (IPv6 in brackets)."""
    return f"[{addr}]" if ":" in addr else addr


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine:
    """One SGLang engine: where it runs and where the trainer reaches it."""

    index: int
    node: str
    node_index: int
    addr: str
    gpus: tuple[int, ...]
    port: int

    @property
    def url(self) -> str:
        return f"http://{url_host(self.addr)}:{self.port}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Every node's role in one job, with the addresses and ports the roles find each other by."""

    env: SlurmEnv
    placement: Placement
    addrs: Mapping[str, str]
    train_nodes: tuple[str, ...]
    rollout_nodes: tuple[str, ...]
    engines: tuple[Engine, ...]
    ports: Ports
    train_nodes_derived: bool = False
    senders: Senders | None = None
    """The weight sync's sending ranks the engines keep off (colocated, distributed transport)."""
    every_tp_group: bool = False
    """``rollout.sglang.num_engines=0``: an engine on every TP group of every node."""

    @property
    def trainer_gpus(self) -> int:
        return len(self.train_nodes) * self.env.gpus_per_node

    @property
    def rdzv_endpoint(self) -> str:
        """torchrun's c10d rendezvous: the first trainer node's address."""
        return f"{url_host(self.addrs[self.train_nodes[0]])}:{self.ports.rdzv}"

    @property
    def router_node(self) -> str | None:
        """The router's node; None with one engine (the trainer calls it directly) or none."""
        return self.rollout_nodes[0] if len(self.engines) > 1 else None

    @property
    def router_url(self) -> str | None:
        node = self.router_node
        return None if node is None else f"http://{url_host(self.addrs[node])}:{self.ports.router}"

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def node_index(self, node: str) -> int:
        return self.env.nodes.index(node)


def plan_layout(
    cfg: RunConfig,
    env: SlurmEnv,
    *,
    addrs: Mapping[str, str] | None = None,
    train_nodes: int | None = None,
) -> Layout:
    """The roles of ``env``'s nodes for the run ``cfg``. ``train_nodes``: TRAIN_NODES (None =
    derived). ``addrs``: each node's address (None = the names). Raises ConfigError, one line,
    for a split that cannot work (no trainer node, engines that do not fit)."""
    placement = _placement(cfg, env)
    n_train = _train_node_count(placement, cfg, env, train_nodes)
    if placement == "local":
        rollout: tuple[str, ...] = ()
    elif placement == "colocated":
        rollout = env.nodes
    else:
        rollout = env.nodes[n_train:]
    addrs = dict(addrs) if addrs is not None else {n: n for n in env.nodes}
    ports = Ports.for_job(env.job_id)
    senders = _senders(cfg, env, placement)
    engines = (
        _place_engines(cfg.rollout.sglang, env, rollout, addrs, ports, placement, senders)
        if rollout
        else ()
    )
    return Layout(
        env=env,
        placement=placement,
        addrs=addrs,
        train_nodes=env.nodes[:n_train],
        rollout_nodes=rollout,
        engines=engines,
        ports=ports,
        train_nodes_derived=train_nodes is None and placement == "dedicated",
        senders=senders,
        every_tp_group=bool(engines) and cfg.rollout.sglang.num_engines == EVERY_TP_GROUP,
    )


def _placement(cfg: RunConfig, env: SlurmEnv) -> Placement:
    r = cfg.rollout
    if engine_spec(r.engine).in_process:
        return "local"
    if r.sglang.engine_urls or r.sglang.router_url:
        raise ConfigError(
            "rollout.sglang.engine_urls / router_url are set, but the launcher starts the "
            "engines and the router itself and passes their URLs to the trainer; remove them"
        )
    n = len(env.nodes)
    check_transport(r.placement, r.sglang.transport, nodes=n)
    engine_count(r.sglang, r.placement, nodes=n, gpus_per_node=env.gpus_per_node)
    return r.placement


def _train_node_count(
    placement: Placement, cfg: RunConfig, env: SlurmEnv, train_nodes: int | None
) -> int:
    n = len(env.nodes)
    if train_nodes is not None and train_nodes < 1:
        raise ConfigError(f"TRAIN_NODES={train_nodes}: the trainer needs at least one node")
    if placement != "dedicated":
        why = {
            "local": f"rollout.engine={cfg.rollout.engine} samples inside the trainer",
            "colocated": "rollout.placement=colocated runs trainer and engines on every node",
        }[placement]
        if train_nodes not in (None, n):
            raise ConfigError(
                f"TRAIN_NODES={train_nodes} but {why}, so all {n} nodes train; unset TRAIN_NODES "
                "or use rollout.engine=sglang with rollout.placement=dedicated"
            )
        return n
    if train_nodes is None:
        sg = cfg.rollout.sglang
        need = math.ceil(sg.num_engines / _engines_per_node(sg, env.gpus_per_node, 0))
        if need >= n:
            raise ConfigError(
                f"the {sg.num_engines} engine(s) of rollout.sglang.num_engines x tp_size "
                f"{sg.tp_size} need {need} of the {n} node(s), leaving none for the trainer: add "
                "nodes, lower rollout.sglang.num_engines, or use rollout.placement=colocated"
            )
        return n - need
    if train_nodes >= n:
        raise ConfigError(
            f"TRAIN_NODES={train_nodes} leaves none of the {n} node(s) for the SGLang engines "
            "(rollout.placement=dedicated): set TRAIN_NODES below the node count, or use "
            "rollout.placement=colocated"
        )
    return train_nodes


def _engines_per_node(sg: SGLangConfig, gpus_per_node: int, default_base: int) -> int:
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
    return min(fit, MAX_ENGINES_PER_NODE)


def _place_engines(
    sg: SGLangConfig,
    env: SlurmEnv,
    nodes: tuple[str, ...],
    addrs: Mapping[str, str],
    ports: Ports,
    placement: Placement,
    senders: Senders | None,
) -> tuple[Engine, ...]:
    """The engines on ``nodes``, dealt round-robin (engine e on node e % R, port slot e // R,
    or the next free one of its address where nodes share an address):
    one on every TP group of every node with ``num_engines=0`` (:func:`_every_tp_group`), else
    ``num_engines`` of them (:func:`_dealt`)."""
    if sg.num_engines == EVERY_TP_GROUP:
        gpus = _every_tp_group(sg, env, nodes, senders)
    else:
        gpus = _dealt(sg, env, nodes, placement, senders)
    r = len(nodes)
    # A port slot per engine of an address: nodes that share one (two slurmd on one host, as on
    # the local test cluster) must not give their engines the same port.
    seen: dict[str, int] = {}
    slots = []
    for e in range(len(gpus)):
        addr = addrs[nodes[e % r]]
        slots.append(seen.get(addr, 0))
        seen[addr] = slots[-1] + 1
    if max(seen.values(), default=0) > MAX_ENGINES_PER_NODE:
        addr = max(seen, key=seen.get)
        raise ConfigError(
            f"{seen[addr]} engines would listen on {addr} (nodes that share that address), more "
            f"than the {MAX_ENGINES_PER_NODE} a job's ports allow: lower "
            "rollout.sglang.num_engines or raise rollout.sglang.tp_size"
        )
    return tuple(
        Engine(
            index=e,
            node=nodes[e % r],
            node_index=env.nodes.index(nodes[e % r]),
            addr=addrs[nodes[e % r]],
            gpus=gpus[e],
            port=ports.engine(slots[e]),
        )
        for e in range(len(gpus))
    )


def _every_tp_group(
    sg: SGLangConfig, env: SlurmEnv, nodes: tuple[str, ...], senders: Senders | None
) -> dict[int, tuple[int, ...]]:
    """``num_engines=0``: ``rollout/sglang/placement.colocated_engines``' GPUs per
    engine; refused where ``base_gpu_id`` moves them or an engine would share a GPU with a
    sending rank of the distributed transport (the tensor transport may share one)."""
    g, tp = env.gpus_per_node, sg.tp_size
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
    env: SlurmEnv,
    nodes: tuple[str, ...],
    placement: Placement,
    senders: Senders | None,
) -> dict[int, tuple[int, ...]]:
    """``sg.num_engines`` engines' GPUs, each node's by ``engine_gpus_on_node`` (the fleet's
    rule too); refuse if they do not fit, or if one would share a GPU of ``senders``."""
    g, tp = env.gpus_per_node, sg.tp_size
    per_node = _engines_per_node(sg, g, 0)
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
    base = sg.base_gpu_id if sg.base_gpu_id is not None or placement == "colocated" else 0
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


def _senders(cfg: RunConfig, env: SlurmEnv, placement: Placement) -> Senders | None:
    """The sending ranks engines must keep off (``rollout/sglang/sender.py``: every pipeline
    stage's sending rank, on its GPU of any trainer node): colocated with the distributed
    transport, whose NCCL group cannot hold two processes on one GPU. None otherwise: dedicated
    rollout nodes hold no trainer rank, and the tensor transport (CUDA IPC) may share a GPU."""
    if placement != "colocated" or cfg.rollout.sglang.transport != "distributed":
        return None
    g = env.gpus_per_node
    return Senders(
        world_size=len(env.nodes) * g,  # colocated: every node trains
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        gpus_per_node=g,
    )


def check_run(
    cfg: RunConfig,
    layout: Layout,
    *,
    config_name: str,
    gpu_memory_gb: float = 80.0,
    spec: Literal["te", "local"] = "te",
) -> Estimate:
    """Refuse, with one line, a run that cannot start on ``layout``; otherwise return the memory
    planner's estimate for a trainer GPU. ``cfg`` is the config the trainer will load (with the
    engine URLs the launcher gives it)."""
    _check_trainer_ranks(cfg, layout)
    check_paths(cfg, needs_sglang=bool(layout.engines))
    return _check_memory(cfg, layout, config_name, gpu_memory_gb, spec)


def _check_trainer_ranks(cfg: RunConfig, layout: Layout) -> None:
    """The config's own cross-section rules at the trainer's world size (TP x PP x CP x DP, the
    batch split over DP, the layer split over PP), prefixed with where that size comes from."""
    try:
        cfg.validate(layout.trainer_gpus, this_machine=False)
    except ConfigError as e:
        raise ConfigError(
            f"{len(layout.train_nodes)} trainer node(s) x {layout.env.gpus_per_node} GPUs = "
            f"{layout.trainer_gpus} ranks: {e}"
        ) from None


def check_paths(cfg: RunConfig, *, needs_sglang: bool) -> None:
    """The files the run reads that the config's own checks leave to later: the prompt files
    (read when the trainer builds its datasets, minutes into a large job) and the SGLang
    interpreter of the rollout nodes. ``load_config`` has checked model.hf_checkpoint and
    model.load already, ``RunConfig.validate`` model.ref_checkpoint (when the KL term uses it)."""
    for name, path in (
        ("task.train_path", cfg.task.train_path),
        ("task.val_path", cfg.task.val_path),
        ("tokenizer.path", cfg.tokenizer.path),
    ):
        if path is not None and not Path(path).expanduser().exists():
            raise ConfigError(
                f"{name}={path!r} does not exist here; give a path every node can read (a shared "
                "filesystem), relative to the directory you submit from"
            )
    if needs_sglang:
        try:
            resolve_python(cfg.rollout.sglang)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None


def _check_memory(
    cfg: RunConfig, layout: Layout, config_name: str, gpu_memory_gb: float, spec: str
) -> Estimate:
    nodes, g = len(layout.train_nodes), layout.env.gpus_per_node
    world = World(gpus_per_node=g, nodes=nodes, gpu_memory_gb=gpu_memory_gb)
    est = estimate(cfg, world, spec=spec)
    if not est.fits:
        raise ConfigError(
            f"memory: the planner puts a trainer GPU's peak at {est.peak / 1e9:.1f} GB, "
            f"{-est.margin_gb:.1f} GB over its {gpu_memory_gb:g} GB (--gpu-memory-gb); "
            f"`megatron-rl-fp8 plan {config_name} --nodes {nodes} --gpus-per-node {g} "
            f"--gpu-memory-gb {gpu_memory_gb:g}` lists layouts that fit"
        )
    return est
