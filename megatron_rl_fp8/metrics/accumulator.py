"""Sum / max / min accumulation of per-micro-batch metrics, reduced over a process group.

Per-token metrics are accumulated as token-weighted *sums* (so micro-batches and data-parallel
ranks combine into exact token means when divided by the summed token count at the end); a few
are extremes (``ratio_max``, ``ratio_min``) and combine with max / min instead. One accumulator
holds all three kinds and reduces them with one float64 all-reduce for the sums and one per
extreme.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MetricAccumulator:
    def __init__(self):
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, value), value)

    def min(self, key: str, value: float) -> None:
        self.minima[key] = min(self.minima.get(key, value), value)

    def all_reduce(self, group, device) -> None:
        """Combine every rank's accumulator in ``group`` in place (collective; ``device`` is the
        backend's: NCCL reduces CUDA tensors only). Sums go in one float64 vector, sorted by key
        so every rank packs them in the same order."""
        keys = sorted(self.sums)
        vec = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(vec, group=group)
        self.sums = dict(zip(keys, vec.tolist()))
        for table, op in ((self.maxima, dist.ReduceOp.MAX), (self.minima, dist.ReduceOp.MIN)):
            for k in sorted(table):
                t = torch.tensor([table[k]], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=op, group=group)
                table[k] = t.item()
