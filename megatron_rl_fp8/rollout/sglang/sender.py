"""A sending rank's side of a weight sync into SGLang engines.

The fleet's driver begins a sync and hands every sending rank a :class:`SyncPlan` (the trainer
broadcasts it); each sending rank -- the driver itself at PP=1, each pipeline stage's
TP-rank-0 rank of the DP-rank-0 replica otherwise -- pushes the buckets of its own layers with a
:class:`WeightSender`; the driver ends the sync with every sender's error (``fleet.end_sync``).

Two transports (``rollout.sglang.transport``):

* ``distributed``: the sender's private process group with every engine's TP ranks (the sender
  is rank 0; NCCL on GPU, gloo on CPU), formed again whenever the engines change or a push
  failed; each bucket goes once, as one flat byte buffer, to every engine at the same time.
  Engines can be on any node reachable from the sender, but not on its GPU.
* ``tensor``: each bucket is copied into one buffer per dtype and handed to every engine as a
  handle (shared memory on CPU, CUDA IPC on GPU) with ``/update_weights_from_tensor``. Engines
  must run on the sender's node; on GPU they may share its GPU (colocated on the same GPUs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlparse

import torch

from megatron_rl_fp8.rollout.sglang.errors import SGLangServerError, _first_line
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.transports import (
    destroy_sender_group,
    join_sender_group,
    push_distributed,
    push_tensor,
)
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.quantize import SCALE_SUFFIX
from megatron_rl_fp8.sync.timing import SyncTimes

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class SyncPlan:
    """What every sending rank needs for one sync (picklable: the driver broadcasts it)."""

    version: int
    engines: list[tuple[str, int]]  # (url, tp_size) of every engine taking this sync, in order
    device: str  # the engines' device: NCCL / CUDA IPC on cuda, gloo / shared memory on cpu
    timeout: float
    export_options: dict  # the fleet's ``export_options`` (bucket size, serving dtype)
    failed: list[str]  # engines that refused the begin of the sync: push nothing
    transport: str = "distributed"
    rename_scales: bool = False  # per-tensor FP8 checkpoints: SGLang names the scale weight_scale


class WeightSender:
    """One sending rank's pushes into the engines of a plan, by the plan's transport. The
    driver's lives in its fleet; with pipeline parallelism every stage's sending rank has one."""

    def __init__(self):
        self._group = None  # distributed: (process group, name)
        self._key: tuple = ()  # the plan's engines the group was formed with
        # The last push's transfer and engine-load seconds (``sync/timing.py``).
        self.times = SyncTimes()

    def push(
        self,
        plan: SyncPlan,
        buckets: Iterable[Bucket],
        *,
        fault: Callable[[str], None] | None = None,
    ) -> str | None:
        """Send every bucket to ``plan``'s engines; returns the first failure (then the rest of
        the stream is only consumed: the export is a collective), or None. ``self.times``
        holds its transfer and engine-load seconds afterwards."""
        error = None
        self.times = SyncTimes()
        try:
            send = self._sender(plan) if not plan.failed else None
        except SGLangServerError as e:
            error = f"the sync into the engines could not start: {_first_line(e)}"
        for bucket in buckets:
            if error or plan.failed:
                continue
            if plan.rename_scales:
                bucket = Bucket(bucket.index, list(_per_tensor_scale_names(bucket.tensors)))
            try:
                if fault is not None:
                    fault("push")
                send(bucket)
            except SGLangServerError as e:
                error = _first_line(e)
        if error:
            self.close()  # a broken group is formed afresh next time
        return error

    def _sender(self, plan: SyncPlan) -> Callable[[Bucket], None]:
        engines = [Http(url) for url, _ in plan.engines]
        if plan.transport == "tensor":
            far = [url for url, _ in plan.engines if not on_this_host(url)]
            if far:
                raise SGLangServerError(
                    f"engine {far[0]} is not on this host ({socket.gethostname()}): "
                    "rollout.sglang.transport=tensor hands weights over by shared memory / CUDA "
                    "IPC, within one node; use transport=distributed"
                )
            if plan.device != "cuda":
                # File descriptors cannot be passed between unrelated processes (the server
                # fails on an authentication error); shared-memory file names can.
                torch.multiprocessing.set_sharing_strategy("file_system")
            tps = [tp for _, tp in plan.engines]

            def send(bucket: Bucket) -> None:
                t0 = time.perf_counter()
                handed = _each(
                    engines,
                    lambda h, tp: push_tensor(h, bucket, tp_size=tp, timeout=plan.timeout),
                    tps,
                )
                # The engines' calls run at once: the slowest one's buffer building is transfer.
                transfer = max(handed, default=0.0)
                self.times.transfer += transfer
                self.times.load += time.perf_counter() - t0 - transfer

            return send
        group = self._ensure_group(plan)

        def send(bucket: Bucket) -> None:
            transfer, load = push_distributed(
                engines, group, bucket, device=plan.device, timeout=plan.timeout
            )
            self.times.transfer += transfer
            self.times.load += load

        return send

    def _ensure_group(self, plan: SyncPlan):
        key = tuple(plan.engines)
        if self._group is not None and key == self._key:
            return self._group
        self.close()
        self._group = join_sender_group(
            [(Http(url), tp) for url, tp in plan.engines],
            host=sender_address(plan.engines[0][0]),
            device=plan.device,
            name=f"mrf8_sync_pid{os.getpid()}_{time.monotonic_ns()}_{socket.gethostname()}",
            timeout=plan.timeout,
        )
        self._key = key
        return self._group

    def close(self) -> None:
        """Leave the group: the engines that still answer drop it too (best effort)."""
        group, self._group, key = self._group, None, self._key
        self._key = ()
        if group is None:
            return
        for url, _ in key:
            try:
                Http(url).ok("/destroy_weights_update_group", {"group_name": group[1]}, timeout=10)
            except SGLangServerError:
                pass  # a dead engine took its side of the group with it
        destroy_sender_group(group)


def _each(engines: list[Http], call, args: list) -> list:
    """``call(engine, arg)`` for every engine at once: their results, or the first failure,
    naming its engine."""
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        futures = [pool.submit(call, h, a) for h, a in zip(engines, args)]
    for http, fut in zip(engines, futures):
        error = fut.exception()
        if isinstance(error, SGLangServerError):
            raise type(error)(f"{http.base_url}: {error}") from error
        if error is not None:
            raise error
    return [fut.result() for fut in futures]


def _per_tensor_scale_names(named):
    for name, t in named:
        if name.endswith("weight" + SCALE_SUFFIX):
            name = name[: -len(SCALE_SUFFIX)] + "_scale"
        yield name, t


def sender_address(engine_url: str) -> str:
    """The address of this host that ``engine_url``'s host reaches it at (where the sync group's
    rendezvous listens): loopback for a local engine, else the interface that routes there (a UDP
    socket's local address after connect; nothing is sent)."""
    host = urlparse(engine_url).hostname or "127.0.0.1"
    if host in _LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def on_this_host(engine_url: str) -> bool:
    """Whether ``engine_url`` names this host (loopback, or an address this host routes to
    itself from)."""
    host = urlparse(engine_url).hostname or "127.0.0.1"
    if host in _LOOPBACK or host == socket.gethostname():
        return True
    try:
        addr = socket.gethostbyname(host)
        return addr.startswith("127.") or sender_address(engine_url) == addr
    except OSError:  # unresolvable, or no route to it (a box without a default route)
        return False
