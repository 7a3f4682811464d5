"""Per-node weight syncs: the engines of every node get every pipeline stage's weights from a
trainer rank of their own node, over shared memory (CPU) or CUDA IPC (GPU), so no engine needs
a cross-node broadcast and no GPU has to stay free for one.

A plan is per node (:meth:`NodeSync.relayed`) when, with the ``tensor`` transport, its engines
span several nodes or some pipeline stage's sender runs on a node without them. Each such node has one *relay rank* (:func:`relay_ranks`): a pipeline
stage's sending rank on that node when there is one, else a rank of the node outside the
replica that gathers the weights. Stage by stage, as in every sync:

    the stage's replica gathers and exports its buckets (sync/buckets.py) to the stage's sender
    the sender broadcasts each bucket to every relay rank (sync/relay.py: one trainer-side
        group per stage, NCCL on GPU, gloo on CPU; the nodes' own interconnect)
    every relay rank pushes each bucket to its own node's engines (``plan.on_node``)

With ``rollout.delta_sync`` the broadcast carries only what changed since the last sync
(sync/relay.py, sync/delta.py): each stage sender and relay rank keep a copy per stage, and a
relay rank whose apply fails reports its node's error, so the sync runs again, in full.

The driver still begins and ends the sync and checks every engine's version
(``EngineLink._sync_once``); a relay rank's failed push is its node's error in that check.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable

import torch.distributed as dist

from megatron_rl_fp8.parallel import Groups, current_device, node_name
from megatron_rl_fp8.rollout.base import SyncPlan, SyncSender
from megatron_rl_fp8.rollout.errors import RolloutEngineError
from megatron_rl_fp8.rollout.receiver import RemoteReceiver, parse_address
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.relay import DeltaLink, relay
from megatron_rl_fp8.sync.timing import SyncTimes


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one trainer rank is, for a per-node sync."""

    node: str
    pp_rank: int
    stage_sender: bool  # its stage's sending rank (TP rank 0 of the gathering replica)
    # In a stage's gather: the replica that gathers the weights (DP rank 0, CP rank 0), and a MoE
    # model's other expert-parallel ranks of it
    gathers: bool


def relay_ranks(
    places: list[RankPlace], nodes: Iterable[str], fix: str = "a transport that reaches every node"
) -> dict[str, int]:
    """Each of ``nodes``' relay rank (global ranks index ``places``): its lowest stage sender,
    else its lowest rank outside the gathering replica. Raises RolloutEngineError, one line, for
    a node without such a rank (no trainer rank there, or only ranks busy in a stage's gather);
    ``fix``: the engine's setting that avoids the per-node sync (``SyncPlan.reach_every_node``)."""
    out = {}
    for node in nodes:
        ranks = [r for r, p in enumerate(places) if p.node == node]
        pick = [r for r in ranks if places[r].stage_sender] or [
            r for r in ranks if not places[r].gathers
        ]
        if not pick:
            why = "no trainer rank runs there" if not ranks else "its ranks all gather a stage"
            raise RolloutEngineError(
                f"per-node weight sync: engines on node {node} but {why}, so none can hand them "
                "the weights over shared memory / CUDA IPC: colocate them with trainer ranks "
                f"(rollout.placement=colocated) or use {fix}"
            )
        out[node] = pick[0]
    return out


class RelayFailed(RolloutEngineError):
    """A per-node sync's relay between trainer ranks broke: a rank of one of its nodes died or
    lost its network. Not retried: the job's ranks cannot go on without it."""


def relay_failure(stage: int, members: tuple[int, ...], places: list[RankPlace], e) -> str:
    """The one line for a relay that broke in ``stage``'s turn between ``members``."""
    nodes = ", ".join(f"{places[r].node} (rank {r})" for r in members)
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"per-node weight sync, stage {stage}: the relay between {nodes} failed ({reason[:200]}): "
        "a trainer rank there died or lost its network; the run stops, and resubmitting it "
        "resumes from the last checkpoint"
    )


def stage_senders(places: list[RankPlace]) -> list[int]:
    """The sending rank of every pipeline stage, by stage."""
    senders = {p.pp_rank: r for r, p in enumerate(places) if p.stage_sender}
    return [senders[s] for s in range(len(senders))]


class NodeSync:
    """This rank's side of per-node syncs; every method is collective over all ranks."""

    def __init__(
        self,
        groups: Groups,
        *,
        delta: bool = False,
        verify_every: int = 1,
        receivers: Iterable[str] = (),
    ):
        self.groups = groups
        self._places: list[RankPlace] | None = None
        self._relay_groups: dict[tuple[int, ...], object] = {}
        # rollout.delta_sync: each stage's stream's delta state on this rank, by stage
        self.delta = delta
        self.verify_every = verify_every
        self.links: dict[int, DeltaLink] = {}
        self.syncs = 0
        # rollout.delta_receivers: node -> (host, port) of the delta receiver beside its engines
        self.receivers = {node: (host, port) for node, host, port in map(parse_address, receivers)}

    def places(self) -> list[RankPlace]:
        """Every rank's place (one all-gather, the first time)."""
        if self._places is None:
            g = self.groups
            tp_first = dist.get_process_group_ranks(g.tp)[0] if g.tp is not None else g.rank
            sender = g.gathers_weights and tp_first == g.rank
            gathers = g.gathers_weights or g.gathers_experts_only
            mine = RankPlace(node_name(), g.pp_rank, sender, gathers)
            places: list = [None] * dist.get_world_size()
            dist.all_gather_object(places, mine)
            self._places = places
        return self._places

    def relayed(self, plan: SyncPlan) -> bool:
        """Whether ``plan`` syncs per node: its engines' nodes (``plan.nodes``) are several, or
        some stage's sender runs elsewhere (a multi-node job whose engines are all on one
        node). Otherwise every stage's sender reaches the engines itself."""
        if not plan.nodes:
            return False
        places = self.places()
        return (
            len(plan.nodes) > 1
            or any(n in self.receivers for n in plan.nodes)
            or any(places[r].node not in plan.nodes for r in stage_senders(places))
        )

    def _group(self, members: tuple[int, ...]):
        """The relay group of ``members`` (made once; ``new_group`` is collective)."""
        if members not in self._relay_groups:
            self._relay_groups[members] = dist.new_group(list(members))
        return self._relay_groups[members]

    def push(
        self,
        plan: SyncPlan,
        *,
        export: Callable[[SyncTimes], Iterable[Bucket]],
        sender: Callable[[], SyncSender],
    ) -> tuple[str | None, SyncTimes]:
        """This rank's part of the per-node ``plan``: (its node's push failure or None, its
        parts' seconds). ``export(times)``: this rank's stage's export stream (gather and export
        timed into ``times``), called on the gathering replica in its stage's turn;
        ``sender()``: this rank's sending side, called on relay ranks."""
        g = self.groups
        places = self.places()
        remote = [n for n in plan.nodes if n in self.receivers]
        fix = f"{plan.reach_every_node}, or a delta receiver there (rollout.delta_receivers)"
        relays = relay_ranks(places, [n for n in plan.nodes if n not in remote], fix)
        senders = stage_senders(places)
        me = places[g.rank]
        relaying = relays.get(me.node) == g.rank
        error, mine = None, SyncTimes()
        verify = self.verify_every > 0 and self.syncs % self.verify_every == 0
        self.syncs += 1
        for stage, src in enumerate(senders):
            members = tuple(sorted({src, *relays.values()}))
            group = self._group(members)
            link = None
            if self.delta and g.rank in members:
                link = self.links.setdefault(stage, DeltaLink())
                link.version, link.verify, link.log = plan.version, verify, []
            stream: Iterable[Bucket] | None = None
            if me.gathers and me.pp_rank == stage:
                stream = export(mine)
                if g.rank != src:  # a sender's peer: drives the gather's collectives
                    collections.deque(stream, maxlen=0)
                    stream, mine = None, SyncTimes()
            remotes = []
            if g.rank == src:  # the stage's stream also goes to every delta receiver
                remotes = [
                    RemoteReceiver(n, *self.receivers[n], stage=stage, plan=plan.on_node(n),
                                   timeout=getattr(plan, "timeout", 600.0))
                    for n in remote
                ]  # fmt: skip
            if g.rank in members:
                stream = relay(
                    stream, src=src, group=group, device=current_device(), times=mine,
                    delta=link, remotes=remotes,
                )  # fmt: skip
                try:
                    if relaying:
                        pusher = sender()
                        failed = pusher.push(plan.on_node(me.node), stream)
                        if link is not None and link.failure:
                            failed = failed or (
                                f"node {me.node}'s relay rank could not apply the delta sync of "
                                f"stage {stage} ({link.failure}); the sync runs again, in full"
                            )
                        error = error or failed
                        mine.transfer += pusher.times.transfer
                        mine.load += pusher.times.load
                    else:  # a stage sender whose node has another relay rank
                        collections.deque(stream, maxlen=0)
                except (RuntimeError, dist.DistError) as e:
                    raise RelayFailed(relay_failure(stage, members, places, e)) from None
                for why in link.log if link is not None and g.rank == src else ():
                    print(f"sync: stage {stage}'s delta sync goes in full: {why}", flush=True)
                for r in remotes:
                    if r.error:
                        error = error or f"stage {stage}: {r.error}"
            dist.barrier()
        return error, mine
