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
"""

from __future__ import annotations

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
    """Local parameter name -> name with global layer numbering."""
    layers = getattr(getattr(module, "decoder", None), "layers", [])
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    out = {}
    for name, _ in module.named_parameters():
        m = _LOCAL_LAYER.match(name)
        if m:
            name_g = f"decoder.layers.{offsets[int(m.group(1))]}." + name[m.end() :]
        else:
            name_g = name
        out[name] = name_g
    return out


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
    model, *, tp_group=None, pp_group=None, dst_global_rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global Megatron name, full tensor) on ``dst_global_rank``; other ranks yield nothing.

    Every rank of the TP x PP grid of the destination must call this (collective). Ranks in other
    data-parallel replicas must not (they hold identical weights).
    """
    module = unwrap(model)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    pp_size = dist.get_world_size(pp_group) if pp_group is not None else 1
    names = global_names(module)
    params = dict(module.named_parameters())
    local = [(names[n], p) for n, p in params.items() if not _tied_output_duplicate(module, n)]
    device = next(iter(params.values())).device

    def full_on_this_stage(name: str, p: torch.Tensor) -> torch.Tensor:
        if tp_size == 1 or tp_partition_dim(name) is None:
            return p.detach()
        shards = [torch.empty_like(p) for _ in range(tp_size)]
        dist.all_gather(shards, p.detach().contiguous(), group=tp_group)
        return merge_tp_shards(name, shards)

    me = dist.get_rank() if dist.is_initialized() else 0
    if pp_size == 1:
        for name, p in local:
            full = full_on_this_stage(name, p)
            if me == dst_global_rank:
                yield name, full
        return

    pp_ranks = dist.get_process_group_ranks(pp_group)
    for src in pp_ranks:
        # The source stage announces its tensors (name, shape, dtype), then sends them one by one.
        meta = [[(n, tuple(p.shape), p.dtype) for n, p in local] if me == src else None]
        dist.broadcast_object_list(meta, src=src, group=pp_group)
        for i, (name, shape, dtype) in enumerate(meta[0]):
            if me == src:
                full = full_on_this_stage(name, local[i][1])
            if src == dst_global_rank:
                if me == dst_global_rank:
                    yield name, full
                continue
            if me == src:
                if tp_group is None or dist.get_rank(tp_group) == 0:
                    dist.send(full.contiguous(), dst=dst_global_rank)
            elif me == dst_global_rank:
                buf_shape = list(shape)
                dim = tp_partition_dim(name)
                if dim is not None:
                    buf_shape[dim] *= tp_size
                # Received on the parameters' device: NCCL moves CUDA tensors only.
                buf = torch.empty(buf_shape, dtype=dtype, device=device)
                # The destination's PP group holds the TP-rank-0 rank of every stage: that is src.
                dist.recv(buf, src=src)
                yield name, buf
