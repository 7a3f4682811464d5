"""Which node runs what, on which ports, and whether the run can start there at all.

Roles (``rollout.placement``):

* ``dedicated``: the first ``TRAIN_NODES`` nodes run the trainer (one torchrun per node, one rank
  per GPU); the others run the engine servers, and the first of them also the router (when there
  is more than one engine). Unset, ``TRAIN_NODES`` is every node the engines do not need.
* ``colocated``: every node runs the trainer and engines on GPUs they share (the engines release
  their memory while the trainer trains); the router runs on the first node.
* an engine that runs in the trainer (``rollout.engine=local``): every node trains, nothing else
  runs.

Which GPUs the engines take, what they refuse and how the trainer attaches to them is the
engine's own (its registered spec's ``launcher``: ``rollout/launching.py``; SGLang's is
``rollout/sglang/launcher.py``). Engines are dealt round-robin over their nodes (engine e on
rollout node e % R), so a colocated run spreads their memory evenly. Ports come from the job id
(:class:`Ports`): every process of the job computes the same ones without talking to the others,
and two jobs that share a node (rare: most clusters give jobs whole nodes) collide only when their
ids agree modulo 100.

:func:`check_run` is everything that can refuse a run before a process starts, each refusal one
line naming the setting and the fix: the trainer's GPUs against the parallel layout (the config's
own :meth:`RunConfig.validate`), the files it reads, and the memory planner's verdict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.launch.slurm import SlurmEnv
from megatron_rl_fp8.plan.memory import Estimate, World, estimate
from megatron_rl_fp8.rollout.launching import NodeRole, PlacedEngine, Placement, url_host
from megatron_rl_fp8.rollout.registry import ENGINES, EngineSpec, engine_spec

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig

Role = Literal["dedicated", "colocated", "local"]

PORT_FIRST = 10000
PORT_BLOCK = 200
PORT_BLOCKS = 100
"""A job's ports are one block of PORT_BLOCK in [PORT_FIRST, PORT_FIRST + PORT_BLOCK *
PORT_BLOCKS) = [10000, 30000): below Linux's ephemeral range (32768-60999), where the kernel
picks the source ports of outgoing connections and could be holding ours."""
ENGINE_PORT_OFFSET = 10
ENGINE_PORT_STRIDE = 10
"""Engines listen 10 ports apart: room for the helper ports a server may open next to its own
(some SGLang versions do)."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Every node's role in one job, with the addresses and ports the roles find each other by."""

    env: SlurmEnv
    placement: Role
    addrs: Mapping[str, str]
    train_nodes: tuple[str, ...]
    rollout_nodes: tuple[str, ...]
    engines: tuple[PlacedEngine, ...]
    ports: Ports
    train_nodes_derived: bool = False
    servers: Placement | None = None
    """The engine's own account of its servers (their TP size, a derived count, notes)."""
    attach: tuple[str, ...] = ()
    """The overrides that attach the trainer to the engines and router, as their launcher words
    them (``Launcher.trainer_overrides``)."""

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
    spec = engine_spec(cfg.rollout.engine)
    placement = _placement(cfg, spec, env)
    n_train = _train_node_count(placement, cfg, spec, env, train_nodes)
    if placement == "local":
        rollout: tuple[str, ...] = ()
    elif placement == "colocated":
        rollout = env.nodes
    else:
        rollout = env.nodes[n_train:]
    addrs = dict(addrs) if addrs is not None else {n: n for n in env.nodes}
    ports = Ports.for_job(env.job_id)
    servers = None
    if rollout:
        servers = spec.launcher().place(
            cfg,
            nodes=rollout,
            gpus_per_node=env.gpus_per_node,
            colocated=placement == "colocated",
            most_per_node=MAX_ENGINES_PER_NODE,
        )
    layout = Layout(
        env=env,
        placement=placement,
        addrs=addrs,
        train_nodes=env.nodes[:n_train],
        rollout_nodes=rollout,
        engines=_at_ports(cfg, spec, env, rollout, addrs, ports, servers) if servers else (),
        ports=ports,
        train_nodes_derived=train_nodes is None and placement == "dedicated",
        servers=servers,
    )
    if not layout.engines:
        return layout
    attach = spec.launcher().trainer_overrides(
        layout.engines, layout.router_url, servers.derived_count
    )
    return dataclasses.replace(layout, attach=tuple(attach))


def _placement(cfg: RunConfig, spec: EngineSpec, env: SlurmEnv) -> Role:
    if spec.in_process:
        return "local"
    if spec.launcher is None:
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine} has no launcher (its EngineSpec.launcher), so "
            "megatron-rl-fp8 launch cannot start its servers; start them yourself or pick an "
            "engine the launcher knows"
        )
    spec.launcher().check(cfg, nodes=len(env.nodes), gpus_per_node=env.gpus_per_node)
    return cfg.rollout.placement


def _train_node_count(
    placement: Role, cfg: RunConfig, spec: EngineSpec, env: SlurmEnv, train_nodes: int | None
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
                f"or use rollout.engine={_server_engines()} with rollout.placement=dedicated"
            )
        return n
    if train_nodes is None:
        need = spec.launcher().nodes_needed(
            cfg, gpus_per_node=env.gpus_per_node, most_per_node=MAX_ENGINES_PER_NODE
        )
        if need >= n:
            count, tp = _settings(cfg, spec, env)
            raise ConfigError(
                f"the engines of {count} x {tp} need {need} of the {n} node(s), leaving none for "
                f"the trainer: add nodes, lower {count}, or use rollout.placement=colocated"
            )
        return n - need
    if train_nodes >= n:
        raise ConfigError(
            f"TRAIN_NODES={train_nodes} leaves none of the {n} node(s) for the engines "
            "(rollout.placement=dedicated): set TRAIN_NODES below the node count, or use "
            "rollout.placement=colocated"
        )
    return train_nodes


def _server_engines() -> str:
    """The registered engines the launcher starts servers for (``sglang``, or ``a|b``)."""
    return "|".join(name for name, s in ENGINES.items() if name == s.name and s.launcher)


def _settings(cfg: RunConfig, spec: EngineSpec, env: SlurmEnv) -> tuple[str, str]:
    """The settings behind the engine count and TP size, with their values, for an error."""
    if spec.fleet is None:
        return "the engine count", "the engines' TP size"
    from_hosts = spec.fleet(cfg.rollout, World(gpus_per_node=env.gpus_per_node).hosts)
    return (
        f"{from_hosts.count_setting}={from_hosts.engines}",
        f"{from_hosts.tp_setting}={from_hosts.tp}",
    )


def _at_ports(
    cfg: RunConfig,
    spec: EngineSpec,
    env: SlurmEnv,
    nodes: tuple[str, ...],
    addrs: Mapping[str, str],
    ports: Ports,
    servers: Placement,
) -> tuple[PlacedEngine, ...]:
    """The engines the spec placed on ``nodes`` (engine e on node e % R), each at a port slot of
    its node's address (the next free one where nodes share an address)."""
    r = len(nodes)
    # A port slot per engine of an address: nodes that share one (two slurmd on one host, as on
    # the local test cluster) must not give their engines the same port.
    seen: dict[str, int] = {}
    slots = []
    for e in range(len(servers.gpus)):
        addr = addrs[nodes[e % r]]
        slots.append(seen.get(addr, 0))
        seen[addr] = slots[-1] + 1
    if max(seen.values(), default=0) > MAX_ENGINES_PER_NODE:
        addr = max(seen, key=seen.get)
        count, tp = _settings(cfg, spec, env)
        raise ConfigError(
            f"{seen[addr]} engines would listen on {addr} (nodes that share that address), more "
            f"than the {MAX_ENGINES_PER_NODE} a job's ports allow: lower {count} or raise {tp}"
        )
    return tuple(
        PlacedEngine(
            index=e,
            node=nodes[e % r],
            node_index=env.nodes.index(nodes[e % r]),
            addr=addrs[nodes[e % r]],
            gpus=gpus,
            port=ports.engine(slots[e]),
        )
        for e, gpus in enumerate(servers.gpus)
    )


def node_role(layout: Layout, k: int) -> NodeRole:
    """Node ``k``'s engines and whether it runs the router; ConfigError when it runs neither."""
    nodes = layout.env.nodes
    if not 0 <= k < len(nodes):
        raise ConfigError(
            f"--node-index {k}: the job has {len(nodes)} node(s), indices 0..{len(nodes) - 1}"
        )
    node = nodes[k]
    engines = tuple(e for e in layout.engines if e.node == node)
    router = layout.router_node == node
    if not engines and not router:
        engine_nodes = sorted({e.node_index for e in layout.engines}) or ["none"]
        raise ConfigError(
            f"node {k} ({node}) runs no rollout role in this layout (placement "
            f"{layout.placement}; rollout nodes: {', '.join(map(str, engine_nodes))}); check "
            "--node-index and --train-nodes"
        )
    return NodeRole(
        node_index=k,
        node=node,
        addr=layout.addrs[node],
        engines=engines,
        router_port=layout.ports.router if router else None,
        worker_urls=tuple(layout.engine_urls),
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
    check_paths(cfg)
    if layout.engines:
        engine_spec(cfg.rollout.engine).launcher().check_files(cfg)
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


def check_paths(cfg: RunConfig) -> None:
    """The files the run reads that the config's own checks leave to later: the prompt files
    (read when the trainer builds its datasets, minutes into a large job; the engine's launcher
    checks its servers' own, ``check_files``). ``load_config`` has checked model.hf_checkpoint and
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
