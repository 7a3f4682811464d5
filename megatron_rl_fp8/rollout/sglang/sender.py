"""A sending rank's side of a weight sync into SGLang engines.

The fleet's driver begins a sync and hands every sending rank a :class:`SGLangSyncPlan` (the
trainer broadcasts it); each sending rank -- the driver itself at PP=1, each pipeline stage's
TP-rank-0 rank of the DP-rank-0 replica otherwise -- pushes the buckets of its own layers with a
:class:`WeightSender` (the driver's is its fleet's ``sender``, the others' come from
``plan.new_sender()``); the driver ends the sync with every sender's error (``fleet.end_sync``).

Two transports (``rollout.sglang.transport``):

* ``distributed``: the sender's private process group with every engine's TP ranks (the sender
  is rank 0; NCCL on GPU, gloo on CPU), formed again whenever the engines change or a push
  failed; each bucket goes once, as one flat byte buffer, to every engine at the same time.
  Engines can be on any node reachable from the sender, but not on the GPU of any sending rank
  (NCCL refuses a communicator with two ranks on one GPU: "Duplicate GPU detected"). Which GPUs
  those are is :class:`Senders`; where engines go around them, :func:`engine_gpus_on_node` (the
  launcher's placement and the fleet's start-up check both ask these two).
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from urllib.parse import urlparse

import torch

from megatron_rl_fp8.rollout.base import SyncPlan
from megatron_rl_fp8.rollout.errors import RolloutEngineError, first_line
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.transports import (
    destroy_sender_group,
    handover_tensors,
    join_sender_group,
    push_distributed,
    push_tensor,
)
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.timing import SyncTimes

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(kw_only=True)
class SGLangSyncPlan(SyncPlan):
    """What every sending rank needs for one sync into a fleet (picklable: the driver broadcasts
    it). Every pipeline stage's sending rank pushes its own layers (``from_stages``)."""

    engines: list[tuple[str, int]]  # (url, tp_size) of every engine taking this sync, in order
    device: str  # the engines' device: NCCL / CUDA IPC on cuda, gloo / shared memory on cpu
    timeout: float
    failed: list[str]  # engines that refused the begin of the sync: push nothing
    transport: str = "distributed"
    from_stages: bool = True
    engine_nodes: list[str] = dataclasses.field(default_factory=list)  # each engine's, or []
    # Each engine's process generation (``SGLangServer.generation``: one more at every launch or
    # rejoin), or []: an engine relaunched at the same URL is a new process without the
    # ``distributed`` transport's group, so the group is keyed on it too.
    generations: list[int] = dataclasses.field(default_factory=list)

    def new_sender(self) -> WeightSender:
        return WeightSender()

    @property
    def nodes(self) -> list[str]:
        """``tensor`` transport: the engines' nodes, in order (a per-node sync where they are
        not all on the sending ranks' node); otherwise ``[]``."""
        return list(dict.fromkeys(self.engine_nodes)) if self.transport == "tensor" else []

    @property
    def reach_every_node(self) -> str:
        return "rollout.sglang.transport=distributed"

    def on_node(self, node: str) -> SGLangSyncPlan:
        if not self.engine_nodes:
            return self
        mine = [i for i, n in enumerate(self.engine_nodes) if n == node]
        engines = [self.engines[i] for i in mine]
        urls = {url for url, _ in engines}
        return dataclasses.replace(
            self,
            engines=engines,
            engine_nodes=[node] * len(engines),
            failed=[url for url in self.failed if url in urls],
            generations=[self.generations[i] for i in mine] if self.generations else [],
        )

    @property
    def group_key(self) -> tuple:
        """What a ``distributed`` transport's group was formed with: it serves the next sync
        only if this is unchanged (the same engines, at the same URLs, in the same processes)."""
        return tuple(self.engines), tuple(self.generations)


class WeightSender:
    """One sending rank's pushes into the engines of a plan, by the plan's transport. The
    driver's lives in its fleet; with pipeline parallelism every stage's sending rank has one."""

    def __init__(self):
        self._group = None  # distributed: (process group, name)
        self._key: tuple = ()  # the plan's group_key the group was formed with
        # The last push's transfer and engine-load seconds (``sync/timing.py``).
        self.times = SyncTimes()

    def push(
        self,
        plan: SGLangSyncPlan,
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
        except RolloutEngineError as e:
            error = f"the sync into the engines could not start: {first_line(e)}"
        for bucket in buckets:
            if error or plan.failed:
                continue
            try:
                if fault is not None:
                    fault("push")
                send(bucket)
            except RolloutEngineError as e:
                error = first_line(e)
        if error:
            self.close()  # a broken group is formed afresh next time
        return error

    def _sender(self, plan: SGLangSyncPlan) -> Callable[[Bucket], None]:
        engines = [Http(url) for url, _ in plan.engines]
        if plan.transport == "tensor":
            far = [url for url, _ in plan.engines if not on_this_host(url)]
            if far:
                raise RolloutEngineError(
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
                named = handover_tensors(bucket)  # once: every engine opens the same buffers
                built = time.perf_counter() - t0
                handed = _each(
                    engines,
                    lambda h, tp: push_tensor(h, named, tp_size=tp, timeout=plan.timeout),
                    tps,
                )
                # The engines' calls run at once: the slowest one's handles are transfer too.
                transfer = built + max(handed, default=0.0)
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

    def _ensure_group(self, plan: SGLangSyncPlan):
        key = plan.group_key
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
        for url, _ in key[0]:
            try:
                Http(url).ok("/destroy_weights_update_group", {"group_name": group[1]}, timeout=10)
            except RolloutEngineError:
                pass  # a dead engine took its side of the group with it
        destroy_sender_group(group)


def _each(engines: list[Http], call, args: list) -> list:
    """``call(engine, arg)`` for every engine at once: their results, or the first failure,
    naming its engine."""
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        futures = [pool.submit(call, h, a) for h, a in zip(engines, args)]
    for http, fut in zip(engines, futures):
        error = fut.exception()
        if isinstance(error, RolloutEngineError):
            raise type(error)(f"{http.base_url}: {error}") from error
        if error is not None:
            raise error
    return [fut.result() for fut in futures]


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


# -- where the sending ranks sit: the distributed transport's GPU rule ---------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Senders:
    """The trainer's sending ranks and the node-local GPUs they run on.

    Each pipeline stage's weights are sent by TP rank 0 of its DP-rank-0 / CP-rank-0 replica
    (``trainer/engine_link.py``). Megatron's default rank order ``tp-cp-ep-dp-pp`` puts PP
    outermost, so stage s begins at global rank ``s * world_size / PP``, and that rank is the
    stage's sender. torchrun gives global rank r the local rank ``r % gpus_per_node``, and the
    trainer takes the GPU of its local rank (``parallel.initialize``). Which node holds which
    ranks is torchrun's rendezvous's choice (it orders the nodes by hostname, not as Slurm lists
    them), so a GPU index here is a sending rank's on any trainer node.

    With ``rollout.sglang.transport=distributed`` every sender joins one NCCL group with every
    engine's TP ranks, and NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU
    detected", nccl ``src/init.cc``): no engine may take a GPU in :attr:`gpus`."""

    world_size: int
    pipeline_model_parallel_size: int = 1
    gpus_per_node: int = 1

    @classmethod
    def from_env(
        cls, pipeline_model_parallel_size: int = 1, environ: Mapping[str, str] = os.environ
    ) -> Senders:
        """The senders of this torchrun job (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``; one process
        when unset) at the trainer's ``parallel.pipeline_model_parallel_size``."""
        return cls(
            world_size=int(environ.get("WORLD_SIZE", "1")),
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            gpus_per_node=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The sending rank of each pipeline stage, in stage order (rank 0, the driver, first)."""
        stride = self.world_size // self.pipeline_model_parallel_size
        return tuple(s * stride for s in range(self.pipeline_model_parallel_size))

    @property
    def gpus(self) -> dict[int, tuple[int, ...]]:
        """Node-local GPU -> the sending ranks that run on that GPU of some node."""
        out: dict[int, tuple[int, ...]] = {}
        for r in self.ranks:
            g = r % self.gpus_per_node
            out[g] = (*out.get(g, ()), r)
        return out

    def describe(self, gpu: int) -> str:
        """Who sends from ``gpu``, as a clause: 'sending rank 4 (pipeline stage 1 of 2) runs'."""
        ranks = self.gpus[gpu]
        stride = max(self.world_size // self.pipeline_model_parallel_size, 1)
        stages = ", ".join(str(r // stride) for r in ranks)
        plural = "s" if len(ranks) > 1 else ""
        driver = "; rank 0 is the driver" if 0 in ranks else ""
        where = (
            "may run (torchrun's rendezvous picks the nodes' order)"
            if self.world_size > self.gpus_per_node
            else "runs"
        )
        return (
            f"sending rank{plural} {', '.join(map(str, ranks))} (pipeline stage{plural} {stages} "
            f"of {self.pipeline_model_parallel_size}{driver}) {where}"
        )


def free_engine_blocks(gpus_per_node: int, tp_size: int, avoid: Iterable[int] = ()) -> list[int]:
    """First GPUs of the ``tp_size``-wide blocks engines can take on one node, from its last GPUs
    down, skipping every block that holds a GPU in ``avoid`` (the senders'); ascending. Taking
    the highest free block each time fits the most blocks."""
    avoid = set(avoid)
    blocks, top = [], gpus_per_node
    while top >= tp_size:
        hit = [g for g in range(top - tp_size, top) if g in avoid]
        if hit:
            top = min(hit)  # the next block ends below the lowest sender GPU of this one
        else:
            blocks.append(top - tp_size)
            top -= tp_size
    return sorted(blocks)


def engine_gpus_on_node(
    engines: Sequence[int],
    *,
    tp_size: int,
    gpus_per_node: int,
    senders: Senders | None,
    base_gpu_id: int | None,
    node: str,
) -> list[tuple[int, ...]]:
    """The GPUs of one node's engines (``engines``: their indices, in the node's slot order).

    ``base_gpu_id`` set (``rollout.sglang.base_gpu_id``, or the caller's fixed start): engine i
    of the node on ``base + i * tp_size`` onwards. None: the node's last GPUs, off every GPU of
    ``senders`` (:func:`free_engine_blocks`). ``senders``: the sending ranks whose GPUs engines
    must avoid (``rollout.sglang.transport=distributed`` on a node that trains); None = no rule.
    Raises ValueError, one line naming the engine, its GPU on ``node``, the sending rank there
    and what to change, when an engine would share a sender's GPU."""
    avoid = senders.gpus if senders is not None else {}
    if base_gpu_id is not None:
        placed = [tuple(range(base_gpu_id + i * tp_size, base_gpu_id + (i + 1) * tp_size))
                  for i in range(len(engines))]  # fmt: skip
        fix = (
            "set rollout.sglang.base_gpu_id=null (engines then go on the node's last GPUs off "
            f"GPUs {_gpu_list(avoid)}), or move it so that no engine covers those"
        )
    else:
        free = free_engine_blocks(gpus_per_node, tp_size, avoid)
        if len(free) >= len(engines):
            first = free[len(free) - len(engines) :]
            return [tuple(range(b, b + tp_size)) for b in first]
        # Too few free blocks: name a clash of the plain placement (the node's last GPUs).
        start = gpus_per_node - len(engines) * tp_size
        placed = [tuple(range(start + i * tp_size, start + (i + 1) * tp_size))
                  for i in range(len(engines))]  # fmt: skip
        fix = (
            f"off GPUs {_gpu_list(avoid)}, a node has room for {len(free)} engine(s) of tp_size "
            f"{tp_size}, not {len(engines)}: lower rollout.sglang.num_engines or tp_size, or "
            "choose parallel.pipeline_model_parallel_size so that the sending ranks leave room"
        )
    for e, gpus in zip(engines, placed):
        clash = next((g for g in gpus if g in avoid), None)
        if clash is not None:
            raise ValueError(
                f"engine {e} would use GPU {clash} of {node}, where {senders.describe(clash)}, "
                "and the weight sync's NCCL group (rollout.sglang.transport=distributed) cannot "
                f"hold two processes on one GPU: {fix}; or, on one node, use "
                "rollout.sglang.transport=tensor (CUDA IPC may share a GPU)"
            )
    if base_gpu_id is None:  # more engines than the node has GPUs: the caller's check is first
        raise ValueError(
            f"{len(engines)} engine(s) of tp_size {tp_size} do not fit on the {gpus_per_node} "
            f"GPUs of {node}: lower rollout.sglang.num_engines or tp_size"
        )
    return placed


def _gpu_list(gpus: Iterable[int]) -> str:
    return ", ".join(str(g) for g in sorted(gpus))
