"""A pipeline stage's export stream, relayed from its sending rank to other trainer ranks (the
per-node weight sync: each node's relay rank hands its own node's engines every stage's layers).

    relay(buckets, src=..., group=..., device=...)

is collective over ``group``. On ``src`` it yields ``buckets`` unchanged, each one after
broadcasting it; on every other member it yields the buckets received, equal in names, dtypes,
shapes and values. A bucket travels as one byte buffer (its tensors' bytes back to back, each at
a 16-byte aligned offset), preceded by its layout as a pickled object: one broadcast of the
layout and one of the bytes per bucket, then a ``None`` layout that ends the stream. Bytes,
not typed tensors, because gloo has no float8 types and FP8 codes are most of a sync's bytes.

On GPU the group is NCCL and the buffers live on ``device`` (the rank's GPU); a member's
received bucket is fresh memory, allocated to be shared by CUDA IPC (``Bucket.handover``): the
``tensor`` transport hands that buffer itself to every engine, and the member drops it after.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.ipc import ipc_allocations
from megatron_rl_fp8.sync.timing import SyncTimes

_ALIGN = 16  # bytes: every dtype's element size divides it, so each view is aligned


def _layout(bucket: Bucket) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int]:
    """(name, dtype, shape, byte offset) of each tensor, and the buffer's size."""
    entries, offset = [], 0
    for name, t in bucket.tensors:
        entries.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return entries, offset


def _pack(bucket: Bucket, entries, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, offset) in zip(bucket.tensors, entries):
        n = t.numel() * t.element_size()
        buf[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf


def _unpack(index: int, entries, buf: torch.Tensor) -> Bucket:
    tensors = []
    for name, dtype, shape, offset in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append((name, buf[offset : offset + n].view(dtype).view(shape)))
    return Bucket(index, tensors, handover=True)


def relay(
    buckets: Iterable[Bucket] | None,
    *,
    src: int,
    group,
    device: torch.device,
    times: SyncTimes | None = None,
) -> Iterator[Bucket]:
    """``src``'s ``buckets`` on every member of ``group`` (``buckets`` is read on ``src`` only;
    pass None elsewhere). Collective: every member must drain the returned iterator. ``times``:
    on ``src``, the seconds of its broadcasts go to ``relay`` (the receivers' waits include the
    sender's export, so they add nothing)."""
    if dist.get_rank() == src:
        yield from _send(buckets, src=src, group=group, device=device, times=times)
        return
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
        if box[0] is None:
            return
        index, entries, size = box[0]
        with ipc_allocations(device):  # the engines get this buffer itself (CUDA IPC)
            buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=src, group=group)
        yield _unpack(index, entries, buf)


def _send(buckets, *, src, group, device, times) -> Iterator[Bucket]:
    for bucket in buckets:
        t0 = time.perf_counter()
        entries, size = _layout(bucket)
        box = [(bucket.index, entries, size)]
        dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
        dist.broadcast(_pack(bucket, entries, size, device), src=src, group=group)
        if times is not None:
            times.relay += time.perf_counter() - t0
        yield bucket
    dist.broadcast_object_list([None], src=src, group=group, device=_object_device(device))


def _object_device(device: torch.device) -> torch.device | None:
    """Where ``broadcast_object_list`` stages its bytes: the GPU for NCCL groups, else its
    default (CPU)."""
    return device if device.type == "cuda" else None
