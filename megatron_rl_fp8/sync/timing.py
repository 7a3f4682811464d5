"""Where a weight sync's time goes: gather, quantize, transfer, engine load.

The export path is a chain of generators pulled by the consumer (the engine or the sender), one
tensor at a time, so no stage runs on its own. Each stage's time is the time spent inside its
``next()``, which includes the stages upstream of it; a stage's own time is the difference:

    gather   = inside next() of iter_full_params (TP all-gather, PP send/recv)
    quantize = inside next() of the export stream - gather (HF renaming, FP8 quantization, the
               dequantization for servers without FP8 kernels, bucket assembly)
    transfer = the sender's moving of buckets to the engines (the broadcast until it completes
               on the sender; for the tensor transport, building the shared buffers and handles)
    load     = the engines applying them, as the driver sees it: the in-process engine's
               update_weights less the stream it pulls; a fleet's per-bucket replies after the
               broadcast (the tensor transport's update call) and the begin / end calls
    relay    = per-node syncs (``sync/relay.py``): a stage's sending rank broadcasting its
               buckets to the other nodes' relay ranks, which push them to their own engines
               (every node's push is counted, though the nodes push at the same time); with
               its megabytes, and a full sync's (``rollout.delta_sync``: fewer are sent)

GPU: collectives and quantization kernels run asynchronously, so each stage's clock stops after
``torch.cuda.synchronize`` when what it yields lives on a GPU (one synchronize per tensor of
the gather and per bucket of the export; none on CPU). Without it a kernel's time would land in
whichever later stage first waits for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclasses.dataclass
class SyncTimes:
    """Seconds of one sync (or of one sender's part of it) by stage."""

    gather: float = 0.0
    export: float = 0.0  # inside the export stream: gather + quantize
    transfer: float = 0.0
    load: float = 0.0
    relay: float = 0.0  # per-node syncs: a stage's buckets broadcast to other nodes' relay ranks
    relay_mb: float = 0.0  # ... the megabytes those broadcasts carried (less under delta syncs)
    relay_full_mb: float = 0.0  # ... and what they carry as full buckets

    @property
    def quantize(self) -> float:
        return max(0.0, self.export - self.gather)

    def add(self, other: SyncTimes) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def metrics(self) -> dict[str, float]:
        """The parts as metrics; the relay's only in per-node syncs (the rest: always)."""
        relay = (
            {
                "perf/sync_relay_time_s": self.relay,
                "perf/sync_relay_mb": self.relay_mb,
                "perf/sync_relay_full_mb": self.relay_full_mb,
            }
            if self.relay
            else {}
        )
        return {
            "perf/sync_gather_time_s": self.gather,
            "perf/sync_quantize_time_s": self.quantize,
            "perf/sync_transfer_time_s": self.transfer,
            "perf/sync_load_time_s": self.load,
            **relay,
        }


def _on_gpu(item) -> torch.device | None:
    """The CUDA device of the (first) tensor in ``item``: a (name, tensor) pair or a bucket."""
    tensors = getattr(item, "tensors", None)
    if tensors is None:
        tensors = [item] if isinstance(item, tuple) else []
    for _, t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def timed(stream: Iterable[T], times: SyncTimes, stage: str) -> Iterator[T]:
    """``stream``, adding the time spent inside its ``next()`` to ``times.<stage>``."""
    it = iter(stream)
    end = object()
    while True:
        t0 = time.perf_counter()
        item = next(it, end)
        if item is not end:
            device = _on_gpu(item)
            if device is not None:
                torch.cuda.synchronize(device)  # the stage's kernels are done (see above)
        setattr(times, stage, getattr(times, stage) + time.perf_counter() - t0)
        if item is end:
            return
        yield item
