"""Gather Megatron tensor-parallel shards and pipeline stages into full tensors on one rank.

How each parameter is split across TP ranks (Megatron's column/row-parallel convention):

* column-parallel (split along output rows, dim 0): ``linear_qkv`` (weight and bias), ``linear_fc1``,
  the vocab-parallel ``word_embeddings`` and ``output_layer``;
* row-parallel (split along input columns, dim 1): ``linear_proj``, ``linear_fc2``;
* everything else (norms) is replicated.

Two layouts need care: a TP shard of the SwiGLU ``linear_fc1`` holds [gate_r; up_r], so the full
tensor is [gate_0..gate_n; up_0..up_n], not a plain concatenation; a shard of ``linear_qkv`` holds
whole query groups, so concatenating shards keeps the per-group interleave intact.

Under pipeline parallelism each stage numbers its layers from 0; ``layer_number`` on every layer is
the global (1-based) index, which we use to write global names. Tensors travel stage -> destination
one at a time (bounded memory: at most one full tensor in flight per rank).

Mixture-of-experts layers hold ``num_experts / EP`` experts per rank of an expert-parallel group
(Megatron's ``local_expert_indices``); each expert's linears are split over the expert
tensor-parallel group as a dense MLP's over TP. Global names number experts globally, in the
local spec's form ``mlp.experts.local_experts.<e>.linear_fc1.weight`` (Transformer Engine's
grouped MLP names the same tensors ``mlp.experts.linear_fc1.weight<j>``). The replica that gathers
the dense weights (DP rank 0, CP rank 0) holds the experts of EP rank 0 only; the other ranks of
its expert-parallel groups (expert-data-parallel rank 0) take part in each expert's gather
(``experts_only``): every expert linear is gathered over the expert TP group, then over the EP
group, in parameter order, so the streams stay in step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# A layer's expert linear, local spec (SequentialMLP) or Transformer Engine's grouped MLP.
_LOCAL_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)
_GLOBAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """Where a mixture-of-experts model's experts live: ``ep`` splits the experts over ranks,
    ``etp`` splits each expert's linears (None: one rank)."""

    ep: object = None
    etp: object = None


def tp_partition_dim(name: str) -> int | None:
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from its TP shards (in TP-rank order)."""
    dim = tp_partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def split_tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Inverse of :func:`merge_tp_shards`: this TP rank's shard of a full tensor."""
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def global_names(module: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name with global layer numbering (and global expert numbering,
    in the local spec's form)."""
    layers = getattr(getattr(module, "decoder", None), "layers", [])
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    experts = {
        i: getattr(layer.mlp, "local_expert_indices", None) for i, layer in enumerate(layers)
    }
    out = {}
    for name, _ in module.named_parameters():
        m = _LOCAL_LAYER.match(name)
        if m:
            i, rest = int(m.group(1)), name[m.end() :]
            e = _LOCAL_EXPERT.match(rest)
            if e:
                local = int(e.group(1) or e.group(4))
                linear = e.group(2) or e.group(3)
                rest = f"mlp.experts.local_experts.{experts[i][local]}.{linear}.weight"
            name_g = f"decoder.layers.{offsets[i]}.{rest}"
        else:
            name_g = name
        out[name] = name_g
    return out


def expert_index(name: str) -> int | None:
    """The global expert index of a global name, None for a dense tensor."""
    m = _GLOBAL_EXPERT.match(name)
    return int(m.group(2)) if m else None


def _renumber_expert(name: str, index: int) -> str:
    m = _GLOBAL_EXPERT.match(name)
    return f"{m.group(1)}{index}{m.group(3)}"


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _tied_output_duplicate(module, name: str) -> bool:
    # With tied embeddings the last stage holds a copy of the word embeddings as output_layer when
    # PP > 1; the first stage's embedding is the one we export.
    return name == "output_layer.weight" and getattr(
        module, "share_embeddings_and_output_weights", False
    )


@torch.no_grad()
def iter_full_params(
    model,
    *,
    tp_group=None,
    pp_group=None,
    dst_global_rank: int = 0,
    experts: ExpertGroups | None = None,
    experts_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global Megatron name, full tensor) on ``dst_global_rank``; other ranks yield nothing.

    Every rank of the TP x PP grid of the destination must call this (collective). Ranks in other
    data-parallel replicas must not (they hold identical weights), except, for a
    mixture-of-experts model split by ``experts.ep``, the other ranks of the destination replica's
    expert-parallel groups, which call it with ``experts_only`` (they hold the other experts).
    """
    module = unwrap(model)
    tp_size = _size(tp_group)
    pp_size = _size(pp_group)
    experts = experts or ExpertGroups()
    ep_size, etp_size = _size(experts.ep), _size(experts.etp)
    names = global_names(module)
    params = dict(module.named_parameters())
    local = [(names[n], p) for n, p in params.items() if not _tied_output_duplicate(module, n)]
    device = next(iter(params.values())).device
    # Where an EP rank's copy of a local expert sits in the global numbering: its offset.
    stride = module.config.num_moe_experts // ep_size if ep_size > 1 else 0
    ep_rank = dist.get_rank(experts.ep) if ep_size > 1 else 0

    def out_names(name: str) -> list[str]:
        """The names a local tensor becomes: one, or one per EP rank for an expert linear."""
        e = expert_index(name)
        if e is None or ep_size == 1:
            return [name]
        first = e - ep_rank * stride
        return [_renumber_expert(name, first + r * stride) for r in range(ep_size)]

    def full_shape(name: str, p: torch.Tensor) -> list[int]:
        shape, dim = list(p.shape), tp_partition_dim(name)
        if dim is not None:
            shape[dim] *= etp_size if expert_index(name) is not None else tp_size
        return shape

    def full_on_this_stage(name: str, p: torch.Tensor) -> list[torch.Tensor]:
        """The full tensors of ``out_names(name)``, on this rank (its TP group's gather); an
        expert's copies from every EP rank only on expert TP rank 0 (the one that sends)."""
        expert = expert_index(name) is not None
        group, size = (experts.etp, etp_size) if expert else (tp_group, tp_size)
        full = p.detach()
        if size > 1 and tp_partition_dim(name) is not None:
            shards = [torch.empty_like(full) for _ in range(size)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = merge_tp_shards(name, shards)
        if not expert or ep_size == 1:
            return [full]
        if etp_size > 1 and dist.get_rank(experts.etp) != 0:
            return []
        copies = [torch.empty_like(full) for _ in range(ep_size)]
        dist.all_gather(copies, full.contiguous(), group=experts.ep)
        return copies

    if experts_only:  # an EP peer of the gathering replica: its experts' gathers, in order
        for name, p in local:
            if expert_index(name) is not None:
                full_on_this_stage(name, p)
        return

    me = dist.get_rank() if dist.is_initialized() else 0
    if pp_size == 1:
        for name, p in local:
            fulls = full_on_this_stage(name, p)
            if me == dst_global_rank:
                yield from zip(out_names(name), fulls)
        return

    pp_ranks = dist.get_process_group_ranks(pp_group)
    for src in pp_ranks:
        # The source stage announces its tensors (names, full shape, dtype), then sends them one
        # by one.
        meta = [
            [(out_names(n), full_shape(n, p), p.dtype) for n, p in local] if me == src else None
        ]
        dist.broadcast_object_list(meta, src=src, group=pp_group)
        for i, (outs, shape, dtype) in enumerate(meta[0]):
            if me == src:
                fulls = full_on_this_stage(*local[i])
            if src == dst_global_rank:
                if me == dst_global_rank:
                    yield from zip(outs, fulls)
                continue
            for k, name in enumerate(outs):
                if me == src:
                    if tp_group is None or dist.get_rank(tp_group) == 0:
                        dist.send(fulls[k].contiguous(), dst=dst_global_rank)
                elif me == dst_global_rank:
                    # Received on the parameters' device: NCCL moves CUDA tensors only.
                    buf = torch.empty(shape, dtype=dtype, device=device)
                    # The destination's PP group holds the TP-rank-0 rank of every stage: src.
                    dist.recv(buf, src=src)
                    yield name, buf


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1
