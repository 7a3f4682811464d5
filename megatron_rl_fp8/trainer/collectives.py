"""The trainer's collectives beyond Megatron's: small Python objects (stats, bounds, decisions)
and the rollout batch, which reaches each data-parallel rank as its own rows, as tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.batch import rows_for_rank


def broadcast_object(obj, src: int):
    """``obj`` from global rank ``src`` on every rank (the default group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def scatter_rows(batch: dict[str, torch.Tensor] | None, groups: Groups) -> dict[str, torch.Tensor]:
    """This rank's rows of the driver's ``batch`` (``None`` on every other rank), on its device:
    ``rows_for_rank(batch, dp_rank, dp_size)``, which every rank of that data-parallel rank (its
    TP, PP and CP ranks) receives. One scatter per tensor from the driver; only the rows' shapes
    and dtypes travel as a Python object."""
    g = groups
    world = dist.get_world_size()
    me = torch.tensor([g.dp_rank], device=g.device)
    dp_of = [torch.empty_like(me) for _ in range(world)]
    dist.all_gather(dp_of, me)  # global rank -> its DP rank (the driver needs every one)
    slices = None
    layout = None
    if g.is_driver:
        slices = [rows_for_rank(batch, d, g.dp_size) for d in range(g.dp_size)]
        layout = {k: (v.dtype, tuple(v.shape)) for k, v in slices[0].items()}
    layout = broadcast_object(layout, g.driver_rank)
    out = {}
    for key, (dtype, shape) in layout.items():
        out[key] = torch.empty(shape, dtype=dtype, device=g.device)
        parts = None
        if g.is_driver:
            # Contiguous row slices, one per DP rank: views, no copies (on CPU).
            by_dp = [s[key].to(g.device).contiguous() for s in slices]
            parts = [by_dp[int(d)] for d in dp_of]
        dist.scatter(out[key], parts, src=g.driver_rank)
    return out
