"""Process groups: torch.distributed (gloo on CPU, NCCL on GPU) and Megatron ``parallel_state``.

This is the edge of the system that touches Megatron's global parallel state; everything deeper gets
process groups passed in (``Groups``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl_fp8.config_utils import field


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How the actor is sharded. data_parallel size = world size / (TP * PP)."""

    tensor_model_parallel_size: int = field(1, help="TP degree (splits every linear layer).")
    pipeline_model_parallel_size: int = field(1, help="PP degree (splits the layer stack).")
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", help="torch.distributed backend; auto = nccl with CUDA, gloo otherwise."
    )
    context_parallel_size: int = field(
        1,
        help="CP degree (splits every sequence over ranks; attention exchanges keys/values). "
        "Needs Transformer Engine's attention on GPU.",
    )
    sequence_parallel: bool = field(
        False,
        help="Megatron sequence parallelism: norms, dropout and the residual stream split along "
        "the sequence over the TP ranks (activations / TP outside the linears). Needs TP > 1.",
    )
    use_distributed_optimizer: bool = field(
        False,
        help="Shard the fp32 main weights and Adam state over the data-parallel ranks (ZeRO-1): "
        "gradients are reduce-scattered, updated weights all-gathered.",
    )
    overlap_grad_reduce: bool = field(
        False,
        help="Start each gradient bucket's reduction as soon as its backward is done, "
        "overlapping communication with the rest of the backward pass.",
    )
    overlap_param_gather: bool = field(
        False,
        help="With the distributed optimizer: gather updated weights bucket by bucket during the "
        "next forward pass instead of right after the step.",
    )
    expert_model_parallel_size: int = field(
        1,
        help="EP degree (MoE models): each rank of an expert-parallel group holds "
        "model.num_experts / EP experts; tokens travel to their experts' ranks. The EP ranks "
        "come from the data-parallel ones: DP x CP must be a multiple of it.",
    )
    timeout_minutes: int = field(30, help="Collective timeout.")

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "timeout_minutes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1 (it "
                "splits the sequence over the TP ranks); set it to false or raise TP"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "parallel.overlap_param_gather needs parallel.use_distributed_optimizer=true "
                "(only the distributed optimizer gathers weights)"
            )

    def expert_layout_problem(self, dp: int) -> str | None:
        """Why EP does not fit ``dp`` data-parallel ranks (its groups are made of the DP x CP
        ranks), or None."""
        ep, cp = self.expert_model_parallel_size, self.context_parallel_size
        if (dp * cp) % ep:
            return (
                f"parallel.expert_model_parallel_size={ep} must divide the data-parallel x "
                f"context-parallel ranks ({dp} x {cp}): the expert-parallel groups are made of them"
            )
        return None

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: TP * PP * CP (data parallelism multiplies it)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


@dataclasses.dataclass
class Groups:
    """The process groups (and this rank's coordinates) the trainer passes around explicitly."""

    tp: object
    pp: object
    dp: object
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    is_first_stage: bool
    is_last_stage: bool
    # Global rank that holds the rollout engine and writes logs (rank 0).
    driver_rank: int = 0
    # Global rank of (tp 0, dp 0) on the last pipeline stage: where step metrics are produced.
    last_stage_rank: int = 0
    # Where this rank's model, batches and collective buffers live: the current CUDA device when
    # there is one (NCCL only moves CUDA tensors), the host otherwise (gloo).
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # This process's global rank.
    rank: int = 0
    # Context parallelism: the ranks that split one sequence. Gradients and token statistics
    # (calibration histograms, metrics) reduce over dp_cp = DP x CP; rows split over DP only.
    cp: object = None
    cp_rank: int = 0
    cp_size: int = 1
    dp_cp: object = None
    # Mixture-of-experts models: the expert-parallel group (the experts split over its ranks), the
    # expert tensor-parallel group (each expert's linears split, as TP splits a dense MLP's), and
    # this rank's place among the copies of the experts (expert data parallelism).
    ep: object = None
    ep_rank: int = 0
    ep_size: int = 1
    etp: object = None
    expert_dp_rank: int = 0

    def __post_init__(self):
        if self.dp_cp is None:
            self.dp_cp = self.dp

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    @property
    def gathers_weights(self) -> bool:
        """In the replica whose weights a sync gathers (DP rank 0, CP rank 0: the others hold
        the same weights)."""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def gathers_experts_only(self) -> bool:
        """Outside that replica but holding experts it lacks: another rank of its
        expert-parallel groups (expert-data-parallel rank 0), which joins each expert's gather."""
        return self.ep_size > 1 and self.expert_dp_rank == 0 and not self.gathers_weights


def check_context_parallel(cp_size: int, *, use_te: bool) -> None:
    """Megatron splits attention over CP ranks only in Transformer Engine's attention; its local
    spec (CPU, or GPUs without TE) asserts CP == 1 deep inside the model build."""
    if cp_size > 1 and not use_te:
        raise ValueError(
            f"parallel.context_parallel_size={cp_size} needs Transformer Engine's attention on "
            "GPUs (Megatron's local attention has no context parallelism; without TE, or with "
            "fp8.backend torch or emulate, set it to 1 and use memory.recompute_* or "
            "train.max_tokens_per_gpu for long sequences)"
        )


def free_port() -> int:

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_name() -> str:
    """The node this process runs on, as the launcher names the nodes it places engines on:
    Slurm's node name (``SLURMD_NODENAME``, set in every job step; two nodes may share a host,
    as on the local test cluster), else the host name."""

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def local_gpu(local_rank: int, device_count: int, backend: str) -> int:
    """The GPU of the rank with torchrun's ``local_rank`` on a node of ``device_count`` visible
    GPUs. Under NCCL two ranks of one communicator may not share a GPU (nccl ``src/init.cc``:
    "Duplicate GPU detected", at the first collective), so more ranks than GPUs is refused here
    in one line; gloo ranks may share (they wrap round)."""
    if backend == "nccl" and local_rank >= device_count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node shows {device_count} GPU(s): NCCL cannot put "
            "two ranks on one GPU; start at most one rank per GPU (torchrun --nproc-per-node) "
            "or check CUDA_VISIBLE_DEVICES"
        )
    return local_rank % device_count


_OWN_ENV: list[str] = []  # variables initialize() set for a single-process group


def initialize(cfg: ParallelConfig, *, seed: int) -> Groups:
    """Init torch.distributed (from torchrun env or single process) and Megatron parallel_state."""

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        from megatron_rl_fp8.parallel import cpu_compat  # lazy: it imports Megatron-Core

        cpu_compat.enable()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if use_cuda:
        # One GPU per rank (torchrun's LOCAL_RANK); before any collective or CUDA allocation.
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_gpu(local, torch.cuda.device_count(), backend))
    if not dist.is_initialized():
        rank, world = world_from_env()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world > 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is unset: launch with torchrun")
            os.environ["MASTER_PORT"] = str(free_port())
            _OWN_ENV.append("MASTER_PORT")
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(minutes=cfg.timeout_minutes)
        )
    return init_model_parallel(cfg, seed=seed)


def init_model_parallel(cfg: ParallelConfig, *, seed: int) -> Groups:
    """Megatron parallel_state + RNG tracker on an already initialised torch.distributed."""
    # lazy: Megatron-Core takes ~1 s to import and loading a config (ParallelConfig) needs none
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if world % cfg.model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {cfg.model_parallel_size}"
        )
    problem = cfg.expert_layout_problem(world // cfg.model_parallel_size)
    if problem:
        raise ValueError(problem)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            context_parallel_size=cfg.context_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return current_groups()


def current_groups() -> Groups:
    from megatron.core import parallel_state as ps  # lazy: Megatron-Core, as above

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    # Megatron's default order "tp-cp-ep-dp-pp" puts PP outermost: the last stage's (tp0, dp0)
    # rank is (pp_size - 1) * (world / pp_size).
    last_stage_rank = (pp_size - 1) * (dist.get_world_size() // pp_size)
    return Groups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=pp_group,
        dp=ps.get_data_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp_size,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        is_first_stage=ps.is_pipeline_first_stage(),
        is_last_stage=ps.is_pipeline_last_stage(),
        last_stage_rank=last_stage_rank,
        device=current_device(),
        rank=dist.get_rank(),
        cp=ps.get_context_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        ep=ps.get_expert_model_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_group(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
    )


def current_device() -> torch.device:
    """The device this rank computes on: ``cuda:<current>`` with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def destroy() -> None:
    from megatron.core import parallel_state as ps  # lazy: Megatron-Core, as above

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # A port this process chose for itself is not for the processes it starts later (they would
    # inherit it and find it taken) nor for its next group.
    while _OWN_ENV:
        os.environ.pop(_OWN_ENV.pop(), None)
