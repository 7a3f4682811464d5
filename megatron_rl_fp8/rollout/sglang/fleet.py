"""SGLang rollout engines: one, or a fleet behind one sglang-router, synced from the trainer.

What it is for: at 8B-32B one server is not a deployment. ``rollout.sglang.num_engines`` engines
(each ``tp_size`` GPUs) are launched; with more than one, a router runs in front of them
(``sglang_router.launch_router``, or one that already runs: ``router_url``) and every rollout
request goes through it, one request per completion, so the router spreads the batch over the
engines. Or the run attaches to engines something else started (``engine_urls``, e.g. the Slurm
launcher's rollout nodes). A single engine is a fleet of one, called directly.

Three layers: :class:`~.server.SGLangServer` is one server (its process, health and calls);
:class:`~.pool.ServerPool` keeps a fleet's servers and its router up (launch, relaunch, router
membership); :class:`SGLangFleet` is the ``RolloutEngine`` over them (syncs, colocated memory,
generation and its retries).

Life of an engine:

* Launched engines start on SGLang's placeholder weights (``--load-format dummy``) from a
  directory that holds only ``config.json``; the first sync gives them the real weights. Nothing
  of the weights is ever written to disk: the trainer always holds the current weights, so an
  engine that is lost is relaunched on placeholders and re-synced by the trainer.
* A sync: the driver's :meth:`SGLangFleet.begin_sync` marks every engine that is up
  ``"<v>-partial"`` and returns a :class:`~.sender.SGLangSyncPlan`; every sending rank pushes its
  buckets with a :class:`~.sender.WeightSender` (``rollout.sglang.transport``: one broadcast per
  bucket to all engines, or CUDA-IPC / shared-memory handles); :meth:`SGLangFleet.end_sync`
  marks every engine ``"<v>"``, flushes its cache and reads back the version it reports.
  Engines that were not in the router (new or relaunched) join it then. :meth:`update_weights`
  is the whole sync from one process (the trainer at PP=1, tools, tests).
* A rollout: requests go to the router (or to the only engine). An answer from another weight
  version, or a request that failed, is retried; after failed requests every engine's process is
  checked, and one that died or hangs (no ``/health``) is taken out of the router and relaunched
  (it rejoins at the next sync). When no engine serves the synced weights any more,
  :class:`RolloutLost` tells the trainer to sync again and repeat the rollout. Relaunches per
  engine are bounded by ``max_restarts`` since its last good sync; past that the run stops with
  the engine's log tail. A launched router that dies is relaunched in front of the engines that
  serve. Attached engines cannot be relaunched: one that dies is dropped, and the run stops when
  none serves.
* A sync that fails (an engine died during it, the group broke) leaves every engine's weights
  unknown: the failed engines are relaunched, and :class:`SyncFailed` tells the trainer to run
  the whole sync again (its export is a collective; see ``trainer/loop.py``).

Colocated placement (``rollout.placement=colocated``): the engines share the trainer's GPUs.
The trainer calls :meth:`release_memory` once the rollout is done, :meth:`resume_memory` with
``("weights",)`` before the sync and ``("kv_cache",)`` before generating (SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation``, with ``--enable-memory-saver``).
What is released is kept per engine (``SGLangServer.released``): an engine is only ever asked to
resume what its own process released (SGLang raises on any other tag, which takes the engine
down), and an engine relaunched or rejoined while the fleet holds memory released joins released
at the next sync (:meth:`begin_sync`), before the KV cache is resumed on every engine at once.
On CPU there is no GPU memory to give back: the calls are logged and recorded
(``memory_calls``: call, tags, engine indices), not sent, and each engine's ``released`` is kept
as on a GPU, so the sequencing is tested there. A sync while the weights are released, or a
rollout while anything is, is refused.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_rl_fp8.rollout.base import Completion, eos_ids, prompt_limits
from megatron_rl_fp8.rollout.errors import (
    RolloutEngineError,
    RolloutLost,
    SyncFailed,
)
from megatron_rl_fp8.rollout.sglang.answers import AnswerProcess, answer_round
from megatron_rl_fp8.rollout.sglang.http import row_requests
from megatron_rl_fp8.rollout.sglang.pool import ServerPool
from megatron_rl_fp8.rollout.sglang.process import ROUTES_FLAG, engine_export_options
from megatron_rl_fp8.rollout.sglang.sender import Senders, SGLangSyncPlan, WeightSender
from megatron_rl_fp8.rollout.sglang.server import SGLangServer
from megatron_rl_fp8.sync.buckets import Bucket

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.config import RolloutConfig


def short_of_engines(spans: list[tuple[float, float]], engines: int) -> float:
    """Seconds between the first request sent and the last answered during which some but
    fewer than ``engines`` of the requests ``spans`` ((sent, answered) times) were in flight.

    Whatever the router did, at least one engine had nothing to do then while another worked:
    the rollout was waiting on its slowest engines (typically the tail, where the longest
    completions finish). Moments with no request in flight at all (the driver's threads not yet
    sending, on a loaded machine) are the driver's time, not an engine's: not counted, so one
    engine never waits."""
    if not spans or engines < 1:
        return 0.0
    events = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    short, in_flight, last = 0.0, 0, events[0][0]
    for t, change in events:
        if 0 < in_flight < engines:
            short += t - last
        in_flight += change
        last = t
    return short


class SGLangFleet(ServerPool):
    """RolloutEngine over SGLang servers (launched or attached) and one router: the sync
    fan-out, colocated memory, and generation with its retries, on a :class:`ServerPool`."""

    def __init__(
        self,
        cfg: RolloutConfig,
        hf_config,
        *,
        pad_token_id: int,
        eos_token_id: int | Iterable[int],
        output_dir: str | os.PathLike | None = None,
        senders: Senders | None = None,
    ):
        """Launches the engines (or attaches to them): :class:`ServerPool`, whose docstring
        also says what ``senders`` is."""
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_ids(eos_token_id)
        self.sender = WeightSender()  # this process's side of a sync
        self._members: list[SGLangServer] = []  # the engines of the sync in progress
        self._sync_started = 0.0
        self._version = -1  # the last version synced into every engine that is up
        # Colocated: the tags the trainer has released and not resumed, the state every engine
        # is brought to (each engine's own is SGLangServer.released).
        self._released: set[str] = set()
        self.memory_calls: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []
        self._engines_used = 0  # engines that answered requests in the last rollout
        # Seconds of the last generate call with fewer requests in flight than engines serving
        # (``short_of_engines``): the rollout's time waiting on its slowest engines.
        self.wait_s = 0.0
        # Rollout answers are decoded in a helper process unless parse_answers is "thread".
        process = cfg.sglang.parse_answers == "process"
        self._answers = AnswerProcess() if process else None
        # A MoE's routes (rollout.routing_replay): each answer's experts, per (layer, top-k).
        self.route_shape = None
        if cfg.routing_replay != "none":
            self.route_shape = (hf_config.num_hidden_layers, hf_config.num_experts_per_tok)
            sg = cfg.sglang
            if ROUTES_FLAG not in sg.extra_args:
                sg = dataclasses.replace(sg, extra_args=[*sg.extra_args, ROUTES_FLAG])
            cfg = dataclasses.replace(cfg, sglang=sg)
        super().__init__(cfg, hf_config, output_dir=output_dir, senders=senders)
        self.stats.update(retried_requests=0, update_seconds=0.0)

    # -- weights ---------------------------------------------------------------------------------
    @property
    def export_options(self) -> dict:
        return engine_export_options(
            self.cfg, fp8_checkpoint=self.fp8_checkpoint, dtype=self.serve_dtype
        )

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        """A whole sync from this process, the only sender (the trainer at PP=1, tools, tests):
        :meth:`begin_sync`, this fleet's sender pushes every bucket, :meth:`end_sync`."""
        plan = self.begin_sync(version)
        self.end_sync(plan, [self.sender.push(plan, buckets, fault=self.fault)])

    def begin_sync(self, version: int) -> SGLangSyncPlan:
        """Prepare sync ``version``: relaunched engines are waited for, every engine that is up
        is marked ``"<v>-partial"``. Returns the plan every sending rank pushes by (its
        ``failed`` is set when an engine refused already: senders then only consume their
        stream, and :meth:`end_sync` asks for the sync again)."""
        if "weights" in self._released:
            raise RolloutEngineError(
                "weight sync while the engines' weights are released (colocated placement): "
                "resume_memory(('weights',)) must come first"
            )
        self._sync_started = time.perf_counter()
        members = self.bring_up()
        if not members:
            raise RolloutEngineError("no SGLang engine is up to take the weights")
        if self._released:  # colocated: engines (re)started since the release join released
            self._memory("release_memory_occupation", tuple(sorted(self._released)))
            members = self.up()
        self._version = -1
        for eng in members:
            eng.version = -1
        timeout = self.cfg.request_timeout_s
        self.fault("begin_update")
        failed = self.each(members, lambda e: e.begin_update(version, timeout=timeout))
        self._members = members
        return SGLangSyncPlan(
            version=version,
            engines=[(e.url, self.cfg.tp_size) for e in members],
            device=self.device,
            timeout=timeout,
            export_options=self.export_options,
            failed=[e.url for e in failed],
            transport=self.cfg.transport,
            engine_nodes=[e.node for e in members] if all(e.node for e in members) else [],
            generations=[e.generation for e in members],
        )

    def end_sync(self, plan: SGLangSyncPlan, errors: list[str | None]) -> None:
        """Finish sync ``plan.version`` after every sender pushed (``errors``: each sender's
        failure, or None): mark every engine ``"<v>"``, check the version it reports, put new
        ones in the router. Raises :class:`SyncFailed` (after relaunching the engines that
        failed) when anything failed: the trainer then runs the sync again."""
        members, version = self._members, plan.version
        failed = [e for e in members if e.url in plan.failed]
        pushed = [e for e in errors if e]
        if pushed:
            print(f"[sglang] weight broadcast failed: {pushed[0]}", file=sys.stderr)
            failed = [e for e in members if not e.healthy()]
        if not failed and not pushed:
            self.fault("end_update")
            timeout = plan.timeout
            failed = self.each(members, lambda e: e.end_update(version, timeout=timeout))
        if failed or pushed:
            # The others' sessions are open (begin_update succeeded): the next attempt begins anew.
            opened = [e for e in members if e not in failed and e.url not in plan.failed]
            self.each(opened, lambda e: e.abandon_update(timeout=plan.timeout))
            for eng in failed:
                self.relaunch(eng, f"failed during the sync to version {version}")
            raise SyncFailed(
                f"the weight sync to version {version} failed "
                f"({'on engine(s) ' + str([e.index for e in failed]) if failed else pushed[0]}); "
                "the sync is to be run again"
            )
        for eng in members:
            eng.version, eng.restarts = version, 0
            self.router_add(eng)
        self._version = version
        self.stats["update_seconds"] = time.perf_counter() - self._sync_started

    def weight_version(self) -> int:
        return self._version if any(e.version == self._version for e in self.up()) else -1

    def health(self) -> bool:
        return any(e.healthy() for e in self.engines)

    # -- colocated memory ------------------------------------------------------------------------
    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Colocated: the engines give the memory of ``tags`` back to the trainer. Released
        weights are gone (SGLang keeps no copy): generating needs a sync first."""
        tags = tuple(t for t in tags if t not in self._released)
        self._memory("release_memory_occupation", tags)
        self._released |= set(tags)
        if self.colocated and "weights" in tags:
            self._version = -1
            for eng in self.engines:
                eng.version = -1

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Colocated: the engines take back the memory of ``tags`` (weights before a sync, the
        KV cache before generating); tags not released are skipped."""
        tags = tuple(t for t in tags if t in self._released)
        self._memory("resume_memory_occupation", tags)
        self._released -= set(tags)

    def _memory(self, call: str, tags: tuple[str, ...]) -> None:
        """``call`` for ``tags`` on every engine that is up, each asked only for what it can
        take: to release what it holds, to resume what it released. An engine whose call failed
        is relaunched (it comes back holding everything; the next sync makes it join)."""
        if not self.colocated or not tags:
            return
        release = call == "release_memory_occupation"
        todo: dict[tuple[str, ...], list[SGLangServer]] = {}
        for eng in self.up():
            mine = tuple(t for t in tags if (t in eng.released) != release)
            if mine:
                todo.setdefault(mine, []).append(eng)
        timeout = self.cfg.request_timeout_s
        for mine, engines in todo.items():
            self.memory_calls.append((call, mine, tuple(e.index for e in engines)))
            if self.device != "cuda":
                print(
                    f"[sglang] colocated: {call}{list(mine)} on engine(s) "
                    f"{[e.index for e in engines]} skipped (no GPU memory on CPU)",
                    file=sys.stderr,
                    flush=True,
                )
                failed = []
            else:
                failed = self.each(engines, lambda e, m=mine: e.memory(call, m, timeout=timeout))
            for eng in engines:
                if eng in failed:
                    self.relaunch(eng, f"/{call} failed")
                elif release:
                    eng.released |= set(mine)
                else:
                    eng.released -= set(mine)

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Completion]:
        if self._released:
            raise RolloutEngineError(
                f"rollout while the engines' memory is released ({sorted(self._released)}); "
                "resume_memory must come first"
            )
        if self._version < 0:
            raise RolloutEngineError(
                "the SGLang fleet holds no synced weights; call update_weights (the trainer's "
                "EngineLink.sync) before generate"
            )
        rows = [p for p in prompts for _ in range(n)]
        limits = prompt_limits(max_new_tokens, len(prompts))
        requests = dict(
            enumerate(
                row_requests(
                    rows,
                    max_new_tokens=max(limits),
                    temperature=temperature,
                    top_p=top_p,
                    greedy=greedy,
                    seed=seed,
                    eos_token_id=self.eos_token_id,
                    return_routes=self.route_shape is not None,
                )
            )
        )
        # Each row asks for its prompt's own limit: SGLang refuses a request whose input plus
        # max_new_tokens passes the model's context (tokenizer_manager's total-token check).
        for i, r in requests.items():
            r["sampling_params"] = {**r["sampling_params"], "max_new_tokens": limits[i // n]}
        before = self.request_counts()
        done: dict[int, Completion] = {}
        self.wait_s = 0.0
        for attempt in range(self.cfg.max_restarts + 2):
            pending = {i: r for i, r in requests.items() if i not in done}
            if not pending:
                break
            if attempt:
                self.stats["retried_requests"] += len(pending)
            # A router spreads the requests over every engine serving; without one they all go
            # to one engine.
            engines = sum(e.version == self._version and e.alive() for e in self.engines)
            answered = self._send(pending, rows, engines=engines if self.router.url else 1)
            done.update(answered)
            # After failed requests, also ask every live engine for /health: a hung one is
            # replaced like a dead one.
            self._check_engines(probe=len(answered) < len(pending))
        if len(done) < len(requests):
            raise RolloutEngineError(
                f"{len(requests) - len(done)} of {len(requests)} rollout requests failed on every "
                f"try (rollout.sglang.max_restarts={self.cfg.max_restarts}); engine logs in "
                f"{self.work_dir}"
            )
        self._engines_used = sum(b > a for a, b in zip(before, self.request_counts()))
        completions = [done[i] for i in range(len(rows))]
        for c in completions:  # every engine that answered serves this version (no sync ran)
            c.version = self._version
        return completions

    def _target(self) -> str:
        if self.router.url:
            return self.router.url
        serving = [e for e in self.up() if e.version == self._version]
        if not serving:
            raise RolloutEngineError("no SGLang engine serves the synced weights")
        return serving[0].url

    def _send(
        self, pending: dict[int, dict], rows: list[list[int]], *, engines: int = 1
    ) -> dict[int, Completion]:
        """One round of requests (one per row), all in flight at once; the answers that came
        back right, by row. Adds the round's time short of ``engines`` requests in flight to
        ``wait_s``."""
        url, version = self._target(), str(self._version)
        kwargs = dict(
            timeout=self.cfg.request_timeout_s,
            eos_token_id=self.eos_token_id,
            expected_version=version,
            route_shape=self.route_shape,
        )
        if self._answers is None:  # parse_answers: thread
            rows_by_id = {i: rows[i] for i in pending}
            hook = lambda: self.fault("generate")  # noqa: E731
            out, failed, spans = answer_round(url, pending, rows_by_id, in_flight=hook, **kwargs)
        else:
            future = self._answers.submit(url, pending, **kwargs)
            self.fault("generate")  # mid-rollout: the requests are (being) sent
            out, failed, spans = self._answers.result(future, pending, rows)
        failures = [f"row {i}: {message}" for i, message in failed.items()]
        self.wait_s += short_of_engines(spans, engines)
        if failures:
            print(
                f"[sglang] {len(failures)} rollout request(s) failed, to be retried; first: "
                f"{failures[0]}",
                file=sys.stderr,
                flush=True,
            )
        return out

    def _check_engines(self, *, probe: bool = False) -> None:
        """Relaunch every engine that died, or with ``probe`` does not answer ``/health`` (it
        rejoins at the next sync); fail when none serves."""
        self.replace_lost(probe=self._version if probe else None)
        if not any(e.version == self._version and e.alive() for e in self.engines):
            lost = f"no SGLang engine serves weight version {self._version} any more"
            if not any(e.proc is not None or e.url for e in self.engines):
                # Attached engines, all dropped: nothing is left to sync.
                raise RolloutEngineError(f"{lost}; engine logs in {self.work_dir}")
            raise RolloutLost(f"{lost}; the relaunched engines are to be synced again")

    # -- reporting, shutdown ---------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Per-step numbers for the trainer's log."""
        return {
            "rollout/engines_serving": float(
                sum(e.version == self._version and e.alive() for e in self.engines)
            ),
            "rollout/engines_used": float(self._engines_used),
            "rollout/engine_restarts": float(self.stats["restarts"]),
            "rollout/retried_requests": float(self.stats["retried_requests"]),
        }

    def shutdown(self) -> None:
        self.sender.close()
        if self._answers is not None:
            self._answers.close()
        super().shutdown()
