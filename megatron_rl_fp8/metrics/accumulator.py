"""Sum / max / min accumulation of per-micro-batch metrics, reduced over a process group.

Per-token metrics are accumulated as token-weighted *sums* (so micro-batches and data-parallel
ranks combine into exact token means when divided by the summed token count at the end); a few
are extremes (``ratio_max``, ``ratio_min``) and combine with max / min instead, and a few are
fixed-bin histograms (``vectors``, e.g. the importance ratio's), summed bin by bin. One accumulator
holds all four kinds and reduces them with one float64 all-reduce for the sums and histograms and
one per extreme.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MetricAccumulator:
    def __init__(self):
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}
        self.vectors: dict[str, torch.Tensor] = {}

    def add_vector(self, key: str, values: torch.Tensor) -> None:
        """Add ``values`` (a 1-D tensor of fixed length per key) element-wise, in float64 on the
        host: one device-to-host copy per call."""
        values = values.detach().to("cpu", torch.float64)
        self.vectors[key] = self.vectors[key] + values if key in self.vectors else values

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
        keys, vkeys = sorted(self.sums), sorted(self.vectors)
        scalars = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        vec = torch.cat([scalars, *(self.vectors[k] for k in vkeys)]).to(device)
        dist.all_reduce(vec, group=group)
        vec = vec.cpu()
        self.sums = dict(zip(keys, vec[: len(keys)].tolist()))
        offset = len(keys)
        for k in vkeys:
            n = self.vectors[k].numel()
            self.vectors[k] = vec[offset : offset + n]
            offset += n
        for table, op in ((self.maxima, dist.ReduceOp.MAX), (self.minima, dist.ReduceOp.MIN)):
            for k in sorted(table):
                t = torch.tensor([table[k]], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=op, group=group)
                table[k] = t.item()
