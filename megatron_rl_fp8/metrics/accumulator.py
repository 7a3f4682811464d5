"""Sum / max / min accumulation of per-micro-batch metrics on the device, reduced over a process
group and read to the host once.

Per-token metrics are accumulated as token-weighted *sums* (so micro-batches and data-parallel
ranks combine into exact token means when divided by the summed token count at the end); a few
are extremes (``ratio_max``, ``ratio_min``) and combine with max / min instead, and a few are
fixed-bin histograms (``vectors``, e.g. the importance ratio's), summed bin by bin.

Values stay where they were made (a GPU's memory, as 0-d float64 tensors): adding one costs no
synchronisation, where a ``.item()`` per metric per micro-batch would cost one each.
:meth:`MetricAccumulator.reduce` packs everything into one float64 vector, all-reduces it (one
collective per kind: sums and histograms, maxima, minima) and reads it to the host in one copy.
Float64 throughout, in the order the values were added: the sums are the ones Python floats
would give.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Totals:
    """The host-side result of :meth:`MetricAccumulator.reduce`."""

    sums: dict[str, float]
    maxima: dict[str, float]
    minima: dict[str, float]
    vectors: dict[str, torch.Tensor]  # float64, on the CPU


def _f64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


class MetricAccumulator:
    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.minima: dict[str, torch.Tensor] = {}
        self.vectors: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor | float) -> None:
        v = _f64(value)
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def add_vector(self, key: str, values: torch.Tensor) -> None:
        """Add ``values`` (a 1-D tensor of fixed length per key) element-wise."""
        v = _f64(values)
        self.vectors[key] = self.vectors[key] + v if key in self.vectors else v

    def max(self, key: str, value: torch.Tensor | float) -> None:
        v = _f64(value)
        self.maxima[key] = torch.maximum(self.maxima[key], v) if key in self.maxima else v

    def min(self, key: str, value: torch.Tensor | float) -> None:
        v = _f64(value)
        self.minima[key] = torch.minimum(self.minima[key], v) if key in self.minima else v

    def reduce(self, group=None, device=None) -> Totals:
        """Every rank's accumulator in ``group`` combined (collective when ``group`` is given;
        ``device`` is the backend's: NCCL reduces CUDA tensors only), read to the host in one
        copy. Keys are packed sorted, so every rank packs them in the same order."""
        out = Totals({}, {}, {}, {})
        # (this accumulator's table, the result's, the reduction); sums and histograms share one.
        tables = [
            (self.sums, out.sums, dist.ReduceOp.SUM),
            (self.vectors, out.vectors, dist.ReduceOp.SUM),
            (self.maxima, out.maxima, dist.ReduceOp.MAX),
            (self.minima, out.minima, dist.ReduceOp.MIN),
        ]
        parts = {op: [] for _, _, op in tables}
        for mine, _, op in tables:
            parts[op] += [mine[k].reshape(-1) for k in sorted(mine)]
        if device is None:  # where the values are (a Python float added is a CPU scalar)
            found = [t.device for ts in parts.values() for t in ts if t.device.type != "cpu"]
            device = found[0] if found else torch.device("cpu")
        flat = []
        for op, ts in parts.items():
            vec = torch.cat([t.to(device, torch.float64) for t in ts]) if ts else torch.zeros(0)
            if group is not None and ts:
                dist.all_reduce(vec, op=op, group=group)
            flat.append(vec.to(device, torch.float64))
        host = torch.cat(flat).cpu()  # the one read
        values = host.tolist()
        offset = 0
        for mine, theirs, _ in tables:
            for k in sorted(mine):
                n = mine[k].numel()
                theirs[k] = host[offset : offset + n] if theirs is out.vectors else values[offset]
                offset += n
        return out
