"""Expert load of a mixture-of-experts actor: how many tokens each MoE layer's router sent to each
expert during the update's forward passes, and the step metrics made from it.

Forward hooks on Megatron's routers (``TopKRouter``, whose forward returns the routing map
[tokens, experts]) add each map's column sums into a [layers, experts] float64 table while
:meth:`ExpertLoad.counting` is open (the trainer opens it around an optimizer step; recomputed
forwards count again, which scales every expert alike and leaves the ratios unchanged). Routing is
dropless (no capacity factor), so no token is dropped and no dropped-token metric is kept.

:meth:`ExpertLoad.metrics` sums the tables over every rank (each layer lives on one pipeline
stage; the data-parallel and context-parallel ranks route their own tokens; tensor-parallel ranks
route the same ones, or their own sequence slices under sequence parallelism) and gives, for the
worst layer, the busiest expert's and the idlest expert's load over the mean: 1.0 and 1.0 for a
perfectly balanced router.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


class ExpertLoad:
    def __init__(self, module: torch.nn.Module, num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter  # lazy: MoE actors only

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._on = False
        for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
            router.register_forward_hook(self._hook(router))

    def _hook(self, router):
        def count(_module, _inputs, output) -> None:
            if self._on:
                routing_map = output[1]
                load = routing_map.reshape(-1, routing_map.shape[-1]).sum(dim=0)
                self.counts[router.layer_number - 1] += load.to("cpu", torch.float64)

        return count

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def metrics(self, *, device: torch.device, counts_here: bool) -> dict[str, float]:
        """``moe/load_max_over_mean`` and ``moe/load_min_over_mean`` of the worst layer since the
        last call (collective over all ranks); ``counts_here``: whether this rank's tokens are
        its own (not a tensor-parallel copy of another rank's). Resets the table."""
        table = (self.counts if counts_here else torch.zeros_like(self.counts)).to(
            device, copy=True
        )
        dist.all_reduce(table)
        self.counts.zero_()
        table = table.cpu()
        routed = table.sum(dim=1) > 0
        if not routed.any():
            return {}
        table = table[routed]
        mean = table.mean(dim=1)
        return {
            "moe/load_max_over_mean": (table.max(dim=1).values / mean).max().item(),
            "moe/load_min_over_mean": (table.min(dim=1).values / mean).min().item(),
        }
