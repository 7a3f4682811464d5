"""The trainer's side of the rollout engines: weight syncs into them, and the GPU memory handed
back and forth around each generation when they share the trainer's GPUs (colocated).

    sync(version)        Megatron shards -> full tensors -> export (HF names, rollout FP8,
                         buckets) -> the engines, between the driver engine's begin_sync and
                         end_sync: through the driver, or from each pipeline stage's sending rank,
                         as the engine's plan says; retried on SyncFailed
    generation(phase)    trainer state to host memory, engines' KV cache back, phase(), and the
                         reverse; a rollout whose engines lost the weights is synced and rerun

It knows engines only by the ``RolloutEngine`` protocol (``rollout/base.py``) and their errors
(``rollout/errors.py``). Every method is collective over all ranks; the driver (global rank 0)
owns the engine.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.rollout.base import RolloutEngine, SyncPlan, SyncSender
from megatron_rl_fp8.rollout.errors import RolloutLost, SyncFailed
from megatron_rl_fp8.rollout.registry import engine_spec
from megatron_rl_fp8.sync.buckets import export_for_rollout
from megatron_rl_fp8.sync.gather import ExpertGroups, iter_full_params
from megatron_rl_fp8.sync.timing import SyncTimes, timed
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.trainer.node_sync import NodeSync
from megatron_rl_fp8.trainer.offload import TrainerOffload

T = TypeVar("T")


class EngineLink:
    """Syncs ``actor``'s weights into ``engine`` (the driver's; None on other ranks) and runs
    generation phases on it, handing GPU memory over when colocated (``offload``: the trainer's
    state to host memory, or None to keep it)."""

    def __init__(
        self,
        cfg: RunConfig,
        groups: Groups,
        actor: Actor,
        engine: RolloutEngine | None,
        offload: TrainerOffload | None,
    ):
        self.cfg = cfg
        self.groups = groups
        self.actor = actor
        self.engine = engine
        self.offload = offload
        self.is_driver = groups.is_driver
        self.colocated = cfg.rollout.placement == "colocated"
        # How often a sync or a lost rollout is run again: the engine's restart policy.
        self.max_restarts = engine_spec(cfg.rollout.engine).max_restarts(cfg.rollout)
        # A non-driver sending rank's side of the syncs (the driver's is its engine's ``sender``),
        # made from the first plan that has this rank send.
        self.weight_sender: SyncSender | None = None
        self.node_sync = NodeSync(  # per-node syncs (trainer/node_sync.py)
            groups,
            delta=cfg.rollout.delta_sync,
            verify_every=cfg.rollout.delta_verify_every,
            receivers=cfg.rollout.delta_receivers,
        )
        self.synced_version = -1
        self._noted = False  # the note that rollout.delta_sync does nothing here, printed once
        self.times = SyncTimes()  # the last sync's parts (the driver's; sync/timing.py)

    def sync(self, version: int) -> float:
        """Megatron shards -> full tensors -> the export path (``sync.buckets.export_for_rollout``:
        HF names, rollout FP8, buckets) -> engine. Collective over the DP-rank-0 replica (its
        CP-rank-0 ranks: the other CP ranks hold the same weights) and, for a MoE model, the
        other ranks of its expert-parallel groups; a barrier for the rest.

        The driver's engine plans each sync (``begin_sync``) and finishes it (``end_sync``); in
        between the plan's sending ranks push (:meth:`_push`). A sync that the engines could not
        complete (``SyncFailed``: an engine died during it and was relaunched) runs again: the
        engines' weights are unknown, the trainer's are not. Colocated engines get their
        weights' memory back before it (their KV cache before they generate).

        Returns its seconds; ``self.times`` gets its parts on the driver (every attempt's;
        the rest of the time is barriers and the colocated memory calls)."""
        t0 = time.perf_counter()
        self.times = times = SyncTimes()
        if self.colocated and self.is_driver:
            self.engine.resume_memory(("weights",))
        for attempt in range(1, self.max_restarts + 2):
            failure = self._sync_once(version, times)
            failure = broadcast_object(failure, self.groups.driver_rank)  # also the barrier
            if failure is None:
                break
            print_rank0(f"sync: {failure} (attempt {attempt})")
        else:
            raise SyncFailed(f"weight sync to version {version} failed on every attempt")
        self.synced_version = version
        return time.perf_counter() - t0

    def _sync_once(self, version: int, times: SyncTimes) -> str | None:
        """One sync: the driver begins it, the plan's sending ranks push (:meth:`_push`), the
        driver ends it. Returns the failure to retry on, or None. ``times`` gets every sender's
        parts (stages push one after the other, so they add up) and the begin / end calls as
        engine load."""
        g = self.groups
        t0 = time.perf_counter()
        plan = self.engine.begin_sync(version) if self.is_driver else None
        begin = time.perf_counter() - t0
        plan = broadcast_object(plan, g.driver_rank)
        error, mine = self._push(plan)
        # One gather carries every sender's failure and its parts' seconds.
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (error, mine))
        if self.is_driver:
            for _, part in reports:
                times.add(part)
            times.load += begin
            t0 = time.perf_counter()
            try:
                self.engine.end_sync(plan, [e for e, _ in reports])
            except SyncFailed as e:
                return str(e)
            finally:
                times.load += time.perf_counter() - t0
        return None

    def _push(self, plan: SyncPlan) -> tuple[str | None, SyncTimes]:
        """This rank's part of ``plan``: (its push's failure or None, its parts' seconds).

        ``plan.from_stages`` (servers every rank reaches): each pipeline stage's sending rank
        (its TP-rank-0 rank of the DP-rank-0 / CP-rank-0 replica) gathers its stage's TP shards
        and pushes its own buckets, one stage after the other (NCCL groups sharing engines must
        not interleave). Otherwise (an in-process engine) every stage's full tensors go to the
        driver, which pushes them all. The ranks that only take part in a gather (a sender's TP
        peers; a MoE model's other expert-parallel ranks) drive its collectives and report no
        parts."""
        g = self.groups
        relayed = self.node_sync.relayed(plan)
        if self.cfg.rollout.delta_sync and not relayed and not self._noted:
            self._noted = True
            print_rank0(
                "sync: rollout.delta_sync has no effect on this run: its senders reach every "
                "engine directly (delta syncs are for per-node syncs and delta receivers, "
                "docs/delta_sync.md)"
            )
        if relayed:  # each node's engines from a relay rank of that node
            return self.node_sync.push(
                plan,
                export=lambda times: self._export(plan, times),
                sender=lambda: self._sender(plan),
            )
        if plan.from_stages:  # this stage's sender, in its turn
            sender = dist.get_process_group_ranks(g.tp)[0] if g.tp is not None else g.rank
            stages, pp_group = range(g.pp_size), None
        else:  # the driver, in one gather over every stage
            sender, stages, pp_group = g.driver_rank, [g.pp_rank], g.pp
        error, mine = None, SyncTimes()
        gathers = g.gathers_weights or g.gathers_experts_only
        for stage in stages:
            if gathers and stage == g.pp_rank:
                buckets = self._export(plan, mine, pp_group=pp_group, dst=sender)
                if g.rank == sender:
                    pusher = self._sender(plan)
                    error = pusher.push(plan, buckets)
                    mine.transfer += pusher.times.transfer
                    mine.load += pusher.times.load
                else:
                    collections.deque(buckets, maxlen=0)  # the gather's collectives
                    mine = SyncTimes()  # a sender's peers: the same gather, not added again
            if plan.from_stages:
                dist.barrier()
        return error, mine

    def _export(self, plan: SyncPlan, times: SyncTimes, *, pp_group=None, dst=None):
        """This rank's part of its stage's export stream to ``dst`` (its TP rank 0 by
        default): the full tensors gathered, renamed, quantized and bucketed as ``plan`` asks,
        the gather and the export timed into ``times``."""
        g = self.groups
        if dst is None:
            dst = dist.get_process_group_ranks(g.tp)[0] if g.tp is not None else g.rank
        full = iter_full_params(
            self.actor.model,
            tp_group=g.tp,
            pp_group=pp_group,
            dst_global_rank=dst,
            experts=ExpertGroups(ep=g.ep, etp=g.etp),
            experts_only=g.gathers_experts_only,
        )
        buckets = export_for_rollout(
            timed(full, times, "gather"),
            self.cfg.model,
            self.cfg.rollout.fp8,
            **plan.export_options,
        )
        return timed(buckets, times, "export")

    def _sender(self, plan: SyncPlan) -> SyncSender:
        """This rank's sending side: the driver's engine's, or one of its own made by the plan."""
        if self.is_driver:
            return self.engine.sender
        if self.weight_sender is None:
            self.weight_sender = plan.new_sender()
        return self.weight_sender

    def generation(self, phase: Callable[[], T], *, release: tuple[str, ...]) -> T:
        """``phase()``, a phase that generates on the engines (the rollout, an evaluation).
        Collective.

        Colocated placement: before it the trainer's weights, gradients and optimizer state go
        to host memory (``rollout.offload_trainer``) and the engines take back their KV cache;
        after it the engines give back ``release`` (released weights need a sync before the
        next generation) and the trainer's state returns. When the engines lost the synced weights during it
        (``RolloutLost``, raised on every rank alike: engines died and were relaunched on
        placeholders), the engines are synced again and ``phase`` runs again."""
        for attempt in range(1, self.max_restarts + 2):
            self._engines_turn()
            try:
                result = phase()
            except RolloutLost as e:
                self._trainers_turn(("weights", "kv_cache"))
                print_rank0(f"rollout: {e} (attempt {attempt}); syncing the engines again")
                self.sync(version=self.synced_version)
                continue
            except BaseException:
                if self.offload is not None:  # on this rank alone: an empty storage read crashes
                    self.offload.reload()
                raise
            self._trainers_turn(release)
            return result
        raise RolloutLost(
            f"the engines lost the synced weights in {attempt} attempts "
            f"({self.max_restarts} restart(s) allowed: rollout.engine={self.cfg.rollout.engine})"
        )

    def _engines_turn(self) -> None:
        if not self.colocated:
            return
        if self.offload is not None:
            self.offload.offload()
            dist.barrier()  # every GPU's trainer memory is free before the engines take theirs
        if self.is_driver:
            self.engine.resume_memory(("kv_cache",))

    def _trainers_turn(self, release: tuple[str, ...]) -> None:
        if not self.colocated:
            return
        if self.is_driver:
            self.engine.release_memory(release)
        dist.barrier()  # every GPU's engine memory is free before any rank takes its state back
        if self.offload is not None:
            self.offload.reload()

    def close(self) -> None:
        """Shut the engine down (the driver; its sender too) or this rank's sender."""
        if self.engine is not None:
            self.engine.shutdown()
        elif self.weight_sender is not None:
            self.weight_sender.close()
