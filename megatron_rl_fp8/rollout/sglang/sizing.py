"""SGLang's engines as the planner sizes them (the registry's ``fleet``, ``trainer_gpu_share`` and
``launched_beside_trainer`` hooks): how many servers of which TP a run starts, how much of a GPU
each takes, and what a colocated fleet holds on the trainer's GPUs. Pure arithmetic on the
config; importing it imports no torch and no SGLang."""

from __future__ import annotations

from megatron_rl_fp8.rollout.registry import Fleet, GpuShare, Hosts
from megatron_rl_fp8.rollout.sglang.placement import EVERY_TP_GROUP, engine_count

GB = 1e9

CUDA_CONTEXT_GB = 0.5
"""One CUDA primary context of another process (an SGLang TP rank) on a trainer GPU: a few hundred
MB under CUDA 12's lazy module loading, driver- and GPU-dependent; not measured here."""

SELF_SIZED_FRACTION = {"dedicated": 0.85, "colocated": 0.3}
"""The share of a GPU the planner assumes where ``mem_fraction_static`` is unset and SGLang sizes
itself (most of a GPU of its own; a colocated engine must leave the trainer room)."""


def fleet(cfg, hosts: Hosts) -> Fleet:
    """``rollout.sglang``'s engines on ``hosts``: ``num_engines``, or with 0 one per TP group of
    every node (``placement.py``), as the launcher places them."""
    s = cfg.sglang
    frac = s.mem_fraction_static
    if frac is None:
        frac = SELF_SIZED_FRACTION[cfg.placement]
    engines = engine_count(s, cfg.placement, nodes=hosts.nodes, gpus_per_node=hosts.gpus_per_node)
    every = s.num_engines == EVERY_TP_GROUP
    return Fleet(
        engines=engines,
        tp=s.tp_size,
        placement=cfg.placement,
        mem_fraction=frac,
        count_setting="rollout.sglang.num_engines",
        tp_setting="rollout.sglang.tp_size",
        memory_setting="rollout.sglang.mem_fraction_static",
        count_note="rollout.sglang.num_engines=0: one per TP group of every node" if every else "",
    )


def _on_trainer_gpus(cfg, hosts: Hosts) -> bool:
    return hosts.on_gpu and cfg.sglang.device != "cpu" and cfg.placement == "colocated"


def trainer_gpu_share(cfg, hosts: Hosts) -> tuple[GpuShare, ...]:
    """A colocated engine's ``mem_fraction_static`` of the GPU it shares with a trainer rank, and
    (``transport=tensor``) the CUDA contexts its TP processes open on the sending rank's GPU;
    both rows at 0 where the engines have GPUs of their own or run on the CPU."""
    if not _on_trainer_gpus(cfg, hosts):
        return (GpuShare("SGLang", 0.0), GpuShare("IPC contexts", 0.0))
    s = cfg.sglang
    n = engine_count(s, cfg.placement, nodes=hosts.nodes, gpus_per_node=hosts.gpus_per_node)
    gpus = f"{n * s.tp_size} of the {hosts.size} GPUs"
    if s.mem_fraction_static is None:
        engine = GpuShare(
            "SGLang",
            0.0,
            f"SGLang runs on {gpus} but rollout.sglang.mem_fraction_static is unset (SGLang sizes "
            "itself, most of a GPU): its share is not counted; set it to plan a colocated run",
        )
    else:
        engine = GpuShare(
            "SGLang",
            s.mem_fraction_static * hosts.gpu_memory_gb * GB,
            "rollout.placement=colocated: the engines use "
            f"{gpus} (num_engines x tp_size) next to a trainer rank; the table is for one of "
            "those, counting the engine's share although it is released while the trainer trains",
        )
    return (engine, _ipc_contexts(s, n, hosts))


def _ipc_contexts(s, engines: int, hosts: Hosts) -> GpuShare:
    """``transport=tensor``: every engine TP process on the sending rank's node but the one on
    its GPU opens that GPU's memory by CUDA IPC (torch's ``rebuild_cuda_tensor`` opens the handle
    under the owner's device guard), and with it a CUDA context there, kept while the engine
    lives: ``CUDA_CONTEXT_GB`` each, on the sending rank's GPU (rank 0's, or each node's relay
    rank's in a per-node sync; an estimate, not measured here)."""
    if s.transport != "tensor":
        return GpuShare("IPC contexts", 0.0)
    on_node = -(-engines // hosts.nodes)  # engines go round-robin over the nodes: node 0 has most
    others = max(on_node * s.tp_size - 1, 0)
    if not others:
        return GpuShare("IPC contexts", 0.0)
    return GpuShare(
        "IPC contexts",
        others * CUDA_CONTEXT_GB * GB,
        f"rollout.sglang.transport=tensor: {others} engine TP processes open a CUDA context "
        f"(~{CUDA_CONTEXT_GB:g} GB each) on the GPU that hands them the weights (counted here; "
        "transport=distributed sends over NCCL instead)",
    )


def launched_beside_trainer(cfg, hosts: Hosts) -> bool:
    """The launcher starts the engines on the trainer's GPUs: colocated, on GPUs, and not engines
    the run attaches to by URL."""
    return _on_trainer_gpus(cfg, hosts) and not cfg.sglang.engine_urls
