"""A pipeline stage's export stream, relayed from its sending rank to other trainer ranks (the
per-node weight sync: each node's relay rank hands its own node's engines every stage's layers).

    relay(buckets, src=..., group=..., device=...)

is collective over ``group``. On ``src`` it yields ``buckets`` unchanged, each one after
broadcasting it; on every other member it yields the buckets received, equal in names, dtypes,
shapes and values. A bucket travels as one byte buffer (its tensors' bytes back to back, each at
a 16-byte aligned offset), preceded by its layout as a pickled object: one broadcast of the
layout and one of the bytes per bucket, then a ``None`` layout that ends the stream. Bytes,
not typed tensors, because gloo has no float8 types and FP8 codes are most of a sync's bytes.

With ``delta`` (``rollout.delta_sync``, sync/delta.py), the members first gather their versions
and the sender encodes each tensor as the elements that changed since the version every
receiver holds (a ``DeltaSender`` on the sender, a ``DeltaReceiver`` on each receiver, one pair
per stream, kept between syncs): a delta entry's bytes are its int32 positions, then its new
values. A receiver on another version makes the sender send in full, saying why in one line;
a receiver whose apply fails (a digest mismatch) yields no more buckets and records the failure
(``DeltaLink.failure``), so the sync fails and its retry goes in full.

On GPU the group is NCCL and the buffers live on ``device`` (the rank's GPU); a member's
received bucket is fresh memory, allocated to be shared by CUDA IPC (``Bucket.handover``): the
``tensor`` transport hands that buffer itself to every engine, and the member drops it after.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.delta import DeltaReceiver, DeltaSender, NeedFullSync, TensorDelta
from megatron_rl_fp8.sync.ipc import ipc_allocations
from megatron_rl_fp8.sync.timing import SyncTimes


class RemoteReceiver(Protocol):
    """A delta receiver outside the trainer, as a stage's sender streams to it
    (``rollout/receiver.py``); it never raises: its first failure is ``error``."""

    name: str
    error: str | None

    def version(self) -> int | None: ...

    def begin(self, version: int, base: int | None, *, verify: bool) -> None: ...

    def send(self, index: int, entries: list, buf: torch.Tensor) -> None: ...

    def end(self) -> None: ...


_ALIGN = 16  # bytes: every dtype's element size divides it, so each view is aligned


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclasses.dataclass
class DeltaLink:
    """One relay stream's delta state on one member (``rollout.delta_sync``): its sender's
    last version sent (on the stream's sender) or its receiver's copy (on the others), kept
    from sync to sync. ``verify``: this sync's tensors carry digests, checked on receipt;
    ``failure``: why this member's last receipt failed (None: it did not)."""

    sender: DeltaSender = dataclasses.field(default_factory=DeltaSender)
    receiver: DeltaReceiver = dataclasses.field(default_factory=DeltaReceiver)
    version: int = 0
    verify: bool = True
    failure: str | None = None
    log: list[str] = dataclasses.field(default_factory=list)  # the sender's full-sync reasons


# One tensor on the wire: (name, dtype, shape, byte offset, changed elements: -1 = sent
# whole, digest or None).
_Entry = tuple[str, torch.dtype, tuple[int, ...], int, int, "str | None"]


def wire_layout(items) -> tuple[list[_Entry], int]:
    """The wire layout of ``items``: (name, tensor or TensorDelta, digest) each."""
    entries, offset = [], 0
    for name, t, dg in items:
        if isinstance(t, TensorDelta):
            n = t.positions.numel()
            entries.append((name, t.dtype, t.shape, offset, n, dg))
            offset += _aligned(n * 4) + _aligned(t.values.numel() * t.values.element_size())
        else:
            entries.append((name, t.dtype, tuple(t.shape), offset, -1, dg))
            offset += _aligned(t.numel() * t.element_size())
    return entries, offset


def pack(items, entries, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for (_, t, _), (*_, offset, n, _) in zip(items, entries):
        parts = [t] if n < 0 else [t.positions, t.values]
        for part in parts:
            raw = part.contiguous().view(-1).view(torch.uint8)
            buf[offset : offset + raw.numel()].copy_(raw)
            offset += _aligned(raw.numel())
    return buf


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buf[offset : offset + n].view(dtype).view(shape)


def _unpack(index: int, entries, buf: torch.Tensor) -> Bucket:
    tensors = [
        (name, _view(buf, offset, dtype, shape)) for name, dtype, shape, offset, *_ in entries
    ]
    return Bucket(index, tensors, handover=True)


def _received_items(entries, buf: torch.Tensor):
    """What the wire carries of each entry: (name, full tensor or TensorDelta, digest)."""
    for name, dtype, shape, offset, n, dg in entries:
        if n < 0:
            yield name, _view(buf, offset, dtype, shape), dg
            continue
        positions = _view(buf, offset, torch.int32, (n,)).cpu()
        values = _view(buf, offset + _aligned(n * 4), dtype, (n,)).cpu()
        yield name, TensorDelta(tuple(shape), dtype, positions, values), dg


def relay(
    buckets: Iterable[Bucket] | None,
    *,
    src: int,
    group,
    device: torch.device,
    times: SyncTimes | None = None,
    delta: DeltaLink | None = None,
    remotes: Sequence[RemoteReceiver] = (),
) -> Iterator[Bucket]:
    """``src``'s ``buckets`` on every member of ``group`` (``buckets`` is read on ``src`` only;
    pass None elsewhere). Collective: every member must drain the returned iterator. ``times``:
    on ``src``, the seconds of its broadcasts go to ``relay`` and the bytes to ``relay_mb`` (the
    receivers' waits include the sender's export, so they add nothing). ``delta``: every
    member's, or None on all (full buckets). ``remotes`` (``src`` only, with ``delta``): delta
    receivers outside the trainer (``rollout/receiver.py``) that get the same stream over a socket;
    each one's failure is its ``error`` afterwards."""
    head = _negotiate(delta, src, group, device, remotes) if delta is not None else None
    if dist.get_rank() == src:
        yield from _send(buckets, src=src, group=group, device=device, times=times, delta=delta,
                         remotes=remotes)  # fmt: skip
        return
    failed = False
    if delta is not None:
        try:
            delta.receiver.begin(*head)
        except NeedFullSync as e:
            failed, delta.failure = True, str(e)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
        if box[0] is None:
            if delta is not None and not failed:
                delta.receiver.finish()
            return
        index, entries, size = box[0]
        if delta is None:  # the engines get this buffer itself (CUDA IPC)
            with ipc_allocations(device):
                buf = torch.empty(size, dtype=torch.uint8, device=device)
            dist.broadcast(buf, src=src, group=group)
            yield _unpack(index, entries, buf)
            continue
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=src, group=group)
        if failed:
            continue  # drained: the sync fails, and its retry goes in full
        try:
            yield applied_bucket(delta.receiver, index, entries, buf, device)
        except NeedFullSync as e:
            failed, delta.failure = True, str(e)


def _negotiate(delta: DeltaLink, src: int, group, device, remotes) -> tuple[int, int | None]:
    """This sync's (version, base: the version its deltas apply to, or None when full), the
    same on every member: the members' versions (and the remote receivers') are gathered, and
    ``src`` sends in full when one differs from its own (the reason goes to ``delta.log``)."""
    me = dist.get_rank()
    mine = delta.sender.version if me == src else delta.receiver.version
    versions: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(versions, (me, mine), group=group)
    delta.failure = None
    box = [None]
    if me == src:
        holders = [(f"rank {r}", v) for r, v in versions if r != src]
        for remote in remotes:
            v = remote.version()
            if remote.error is None:  # else it fails this sync, and is asked again at the next
                holders.append((remote.name, v))
        behind = [(who, v) for who, v in holders if v != mine]
        why = f"{behind[0][0]} holds version {behind[0][1]}, not {mine}" if behind else ""
        base, why = delta.sender.begin(delta.version, full=why)
        if why:
            delta.log.append(why)
        for remote in remotes:
            remote.begin(delta.version, base, verify=delta.verify)
        box = [(delta.version, base)]
    dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
    return box[0]


def applied_bucket(
    receiver: DeltaReceiver, index: int, entries, buf: torch.Tensor, device: torch.device
) -> Bucket:
    """A received bucket (``entries`` over ``buf``) applied to ``receiver``'s copy: its full
    tensors in one fresh buffer on ``device`` to hand the engines, as a received full bucket
    is. Raises :class:`NeedFullSync` where a delta does not apply."""
    full = [
        (name, receiver.apply_tensor(name, item, dg), None)
        for name, item, dg in _received_items(entries, buf)
    ]
    layout, size = wire_layout(full)
    with ipc_allocations(device):
        buf = pack(full, layout, size, device)
    return _unpack(index, layout, buf)


def _send(buckets, *, src, group, device, times, delta, remotes) -> Iterator[Bucket]:
    for bucket in buckets:
        t0 = time.perf_counter()
        if delta is None:
            items = [(name, t, None) for name, t in bucket.tensors]
        else:
            items = [
                (name, delta.sender.encode_tensor(name, t), None) for name, t in bucket.tensors
            ]
            items = [
                (name, item, delta.sender.digest(name) if delta.verify else None)
                for name, item, _ in items
            ]
        entries, size = wire_layout(items)
        box = [(bucket.index, entries, size)]
        dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
        buf = pack(items, entries, size, device)
        dist.broadcast(buf, src=src, group=group)
        for remote in remotes:
            remote.send(bucket.index, entries, buf)
        if times is not None:
            times.relay += time.perf_counter() - t0
            times.relay_mb += size / 2**20
            times.relay_full_mb += (
                sum(t.numel() * t.element_size() for _, t in bucket.tensors) / 2**20
            )
        yield bucket
    dist.broadcast_object_list([None], src=src, group=group, device=_object_device(device))
    for remote in remotes:
        remote.end()
    if delta is not None:
        delta.sender.finish()


def _object_device(device: torch.device) -> torch.device | None:
    """Where ``broadcast_object_list`` stages its bytes: the GPU for NCCL groups, else its
    default (CPU)."""
    return device if device.type == "cuda" else None
