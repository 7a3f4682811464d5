"""SGLang rollout engines: one, or a fleet behind one sglang-router, synced from the trainer.

What it is for: at 8B-32B one server is not a deployment. ``rollout.sglang.num_engines`` engines
(each ``tp_size`` GPUs) are launched; with more than one, a router runs in front of them
(``sglang_router.launch_router``, or one that already runs: ``router_url``) and every rollout
request goes through it, one request per completion, so the router spreads the batch over the
engines. Or the run attaches to engines something else started (``engine_urls``, e.g. the Slurm
launcher's rollout nodes). A single engine is a fleet of one, called directly.

Life of an engine:

* Launched engines start on SGLang's placeholder weights (``--load-format dummy``) from a
  directory that holds only ``config.json``; the first sync gives them the real weights. Nothing
  of the weights is ever written to disk: the trainer always holds the current weights, so an
  engine that is lost is relaunched on placeholders and re-synced by the trainer.
* A sync: the driver's :meth:`SGLangFleet.begin_sync` marks every engine that is up
  ``"<v>-partial"`` and returns a :class:`~.sender.SyncPlan`; every sending rank pushes its
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
On CPU there is no GPU memory to give back: the calls are logged and recorded
(``memory_calls``), not sent, so the sequencing is tested there. A sync while the weights are
released, or a rollout while anything is, is refused.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from megatron_rl_fp8.rollout.base import Completion, RolloutConfig, eos_ids
from megatron_rl_fp8.rollout.sglang.errors import (
    RolloutLost,
    SGLangServerError,
    SyncFailed,
    _first_line,
    _ServerGone,
)
from megatron_rl_fp8.rollout.sglang.faults import fault_hook_from_env
from megatron_rl_fp8.rollout.sglang.http import (
    Http,
    begin_update,
    check_version,
    end_update,
    parse_completion,
    row_requests,
)
from megatron_rl_fp8.rollout.sglang.process import (
    _kill_group,
    engine_export_options,
    launch_guarded_server,
    log_tail,
    pick_port,
    resolve_python,
    resolve_work_dir,
    serving,
    wait_healthy,
)
from megatron_rl_fp8.rollout.sglang.router import Router
from megatron_rl_fp8.rollout.sglang.sender import (
    Senders,
    SyncPlan,
    WeightSender,
    engine_gpus_on_node,
)
from megatron_rl_fp8.rollout.sglang.transports import write_model_config
from megatron_rl_fp8.sync.buckets import Bucket


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


@dataclasses.dataclass(eq=False)
class _Engine:
    """One SGLang server of the fleet."""

    index: int
    url: str = ""
    proc: subprocess.Popen | None = None  # the guard leading its process group; None: attached
    launches: int = 0
    restarts: int = 0  # relaunches since its last good sync
    version: int = -1  # the weight version it was verified to serve; -1 = none
    in_router: bool = False

    @property
    def http(self) -> Http:
        return Http(self.url)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return bool(self.url)  # attached: alive until a call to it fails


class SGLangFleet:
    """RolloutEngine over several SGLang servers (launched or attached) and one router."""

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
        """``senders``: the trainer's sending ranks, whose GPUs launched engines keep off with
        the distributed transport; the trainer passes ``Senders.from_env(pp)`` with its
        ``parallel.pipeline_model_parallel_size``. None = this torchrun job at PP 1 (one
        sender, the driver), or this process alone (tools, tests)."""
        self.cfg = cfg.sglang
        self.fp8 = cfg.fp8
        self.colocated = cfg.placement == "colocated"
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_ids(eos_token_id)
        self.attached = bool(self.cfg.engine_urls)
        # A python with SGLang is needed to launch engines, or a router in front of attached ones.
        launches_router = not self.cfg.router_url and len(self.cfg.engine_urls) > 1
        self.python = resolve_python(self.cfg) if not self.attached or launches_router else ""
        self.device, self.serve_dtype, self.fp8_checkpoint = serving(self.cfg, self.fp8)
        self.work_dir, self._tmp = resolve_work_dir(self.cfg, output_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.work_dir / "model"  # config.json only: engines start on placeholders
        self.model_dir.mkdir(exist_ok=True)
        write_model_config(
            self.model_dir,
            hf_config,
            serve_dtype=self.serve_dtype,
            fp8=self.fp8 if self.fp8_checkpoint else None,
        )
        n = len(self.cfg.engine_urls) or self.cfg.num_engines
        self.engines = [_Engine(i) for i in range(n)]
        self.senders = senders if senders is not None else Senders.from_env()
        self._gpus: list[tuple[int, ...]] = []  # launched engines' GPUs on this node (cuda)
        self.router = Router(self.cfg, python=self.python, work_dir=self.work_dir)
        self.sender = WeightSender()  # this process's side of a sync
        self._members: list[_Engine] = []  # the engines of the sync in progress
        self._sync_started = 0.0
        self._version = -1  # the last version synced into every engine that is up
        self._released: set[str] = set()  # colocated: memory tags released, not yet resumed
        self.memory_calls: list[tuple[str, tuple[str, ...]]] = []
        self.stats: dict[str, float] = {
            "restarts": 0,
            "router_restarts": 0,
            "retried_requests": 0,
            "update_seconds": 0.0,
        }
        self._engines_used = 0  # engines that answered requests in the last rollout
        # Seconds of the last generate call with fewer requests in flight than engines serving
        # (``short_of_engines``): the rollout's time waiting on its slowest engines.
        self.wait_s = 0.0
        self._attached_seen = False  # attached engines waited for (first sync)
        self.fault_hook: Callable[[str], None] | None = fault_hook_from_env(self)
        try:
            if self.attached:
                for eng, url in zip(self.engines, self.cfg.engine_urls):
                    eng.url = url.rstrip("/")
            else:
                self._gpus = self._place_gpus()
                for eng in self.engines:  # all at once: a GPU engine takes minutes to start
                    self._launch(eng)
                for eng in self.engines:
                    self._wait_or_relaunch(eng)
            if not self.router.url and len(self.engines) > 1:
                self._launch_router()
        except BaseException:
            self.shutdown()
            raise

    # -- processes -------------------------------------------------------------------------------
    def _log(self, eng: _Engine) -> Path:
        return self.work_dir / f"engine{eng.index}-{eng.launches}.log"

    def _place_gpus(self) -> list[tuple[int, ...]]:
        """Every launched engine's GPUs on this node, by the launcher's rule
        (``sender.engine_gpus_on_node``): ``base_gpu_id`` onwards when set; else after the
        trainer's GPUs (dedicated) or on the node's last GPUs (colocated). With the distributed
        transport none may be a sending rank's GPU: NCCL refuses a group with two processes on
        one GPU (the tensor transport may share one: CUDA IPC). Refuses, one line, what does
        not fit or clashes, before any engine starts."""
        if self.device != "cuda":
            return []
        have, tp = torch.cuda.device_count(), self.cfg.tp_size
        base = self.cfg.base_gpu_id
        if base is None and not self.colocated:  # after the trainer's GPUs on this node
            base = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        senders = self.senders if self.cfg.transport == "distributed" else None
        try:
            gpus = engine_gpus_on_node(
                range(len(self.engines)),
                tp_size=tp,
                gpus_per_node=have,
                senders=senders,
                base_gpu_id=base,
                node="this node",
            )
        except ValueError as e:
            raise SGLangServerError(f"rollout.sglang: {e}") from None
        if gpus[-1][-1] >= have:
            raise SGLangServerError(
                f"rollout.sglang: {len(self.engines)} engine(s) x tp_size={tp} on GPUs "
                f"{gpus[0][0]}-{gpus[-1][-1]}, this node has {have}; lower num_engines or "
                "tp_size, or set rollout.sglang.base_gpu_id"
            )
        return gpus

    def _launch(self, eng: _Engine) -> None:
        """Start ``eng`` on placeholder weights (returns at once; :meth:`_wait` for health)."""
        eng.launches += 1
        extra = ["--enable-memory-saver"] if self.colocated and self.device == "cuda" else []
        proc, port = launch_guarded_server(
            dataclasses.replace(self.cfg, extra_args=[*self.cfg.extra_args, *extra]),
            python=self.python,
            device=self.device,
            dtype=self.serve_dtype,
            fp8_checkpoint=self.fp8_checkpoint,
            model_path=self.model_dir,
            version="-1",
            work_dir=self.work_dir,
            log_path=self._log(eng),
            pid_file=f"engine{eng.index}.pid",
            port=pick_port() if self.cfg.port == 0 else self.cfg.port + eng.index,
            placeholder_weights=True,
            base_gpu_id=self._gpus[eng.index][0] if self._gpus else None,
        )
        eng.proc, eng.url = proc, f"http://{self.cfg.host}:{port}"
        eng.version, eng.in_router = -1, False
        if eng is self.engines[-1]:
            self._fault("startup")  # the engine the fault hook kills

    def _wait(self, eng: _Engine) -> None:
        wait_healthy(
            eng.proc,
            eng.http,
            self._log(eng),
            port=int(eng.url.rsplit(":", 1)[1]),
            timeout_s=self.cfg.startup_timeout_s,
        )

    def _wait_or_relaunch(self, eng: _Engine) -> None:
        """Wait until ``eng`` is healthy; one that dies or hangs in startup is relaunched (within
        ``max_restarts``). On CPU, SGLang sizes its KV pool from the host memory it sees free
        before and after loading, which other processes change: a start can fail at random."""
        while True:
            try:
                return self._wait(eng)
            except SGLangServerError as e:
                self._relaunch(eng, _first_line(e))

    def _wait_attached(self) -> None:
        """Before the first sync: wait (``startup_timeout_s``) until every attached engine answers
        ``/health``. They are started by someone else (the Slurm launcher's rollout nodes), often
        at the same time as the trainer, and a CPU or large GPU engine takes minutes; one that
        never answers is dropped by the sync that follows."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = [e for e in self.engines if e.url]
        while waiting and time.monotonic() < deadline:
            waiting = [e for e in waiting if not self._healthy(e)]
            if waiting:
                time.sleep(1.0)
        if waiting:
            print(
                f"[sglang] attached engine(s) {[e.url for e in waiting]} did not answer /health "
                f"within rollout.sglang.startup_timeout_s={self.cfg.startup_timeout_s}s",
                file=sys.stderr,
                flush=True,
            )
        self._attached_seen = True

    def _relaunch(self, eng: _Engine, why: str) -> None:
        """Take ``eng`` out of the router, kill what is left of it, and start it again (it
        rejoins at the next sync). Attached engines are dropped instead."""
        self._router_remove(eng)
        if eng.proc is None:  # attached: nothing to relaunch
            print(f"[sglang] engine {eng.url}: {why}; dropped from the fleet", file=sys.stderr)
            eng.url, eng.version = "", -1
            return
        if eng.restarts >= self.cfg.max_restarts:
            log = self._log(eng)
            _kill_group(eng.proc)
            raise SGLangServerError(
                f"SGLang engine {eng.index} failed ({why}) and {eng.restarts} relaunch(es) did "
                f"not bring it back (rollout.sglang.max_restarts={self.cfg.max_restarts}); "
                f"its log: {log}\n{log_tail(log)}"
            )
        eng.restarts += 1
        self.stats["restarts"] += 1
        print(
            f"[sglang] engine {eng.index} ({eng.url}): {why}; relaunching it (restart "
            f"{eng.restarts} of rollout.sglang.max_restarts={self.cfg.max_restarts}; previous "
            f"log {self._log(eng)}); it is re-synced by the next sync",
            file=sys.stderr,
            flush=True,
        )
        _kill_group(eng.proc)
        self._launch(eng)

    def kill_server(self) -> None:
        """SIGKILL the last engine's process group without telling the fleet, as a crash would
        (fault injection: ``MRF8_SGLANG_FAULT``, tests)."""
        eng = self.engines[-1]
        if eng.proc is not None:
            _kill_group(eng.proc)

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:  # testing only; see faults.KillServerAt
            self.fault_hook(point)

    # -- router ----------------------------------------------------------------------------------
    def _launch_router(self) -> None:
        serving = [e.url for e in self.engines if e.alive()]
        self.router.launch(serving)
        for eng in self.engines:
            eng.in_router = eng.url in serving

    def _router_remove(self, eng: _Engine) -> None:
        if not eng.in_router or not self.router.url:
            return
        eng.in_router = False
        try:
            self.router.remove(eng.url)
        except SGLangServerError:
            self._check_router()

    def _router_add(self, eng: _Engine) -> None:
        if eng.in_router or not self.router.url:
            return
        self.router.add(eng.url)
        eng.in_router = True

    def _check_router(self) -> None:
        """Relaunch a router this fleet launched and that has died."""
        if self.router.died():
            self.stats["router_restarts"] += 1
            print("[sglang] sglang-router died; relaunching it", file=sys.stderr, flush=True)
            self.router.kill()
            self._launch_router()

    # -- weights ---------------------------------------------------------------------------------
    @property
    def export_options(self) -> dict:
        return engine_export_options(
            self.cfg, fp8_checkpoint=self.fp8_checkpoint, dtype=self.serve_dtype
        )

    def _up(self) -> list[_Engine]:
        return [e for e in self.engines if e.alive()]

    def _each(self, engines: list[_Engine], call: Callable[[_Engine], None]) -> list[_Engine]:
        """Run ``call`` on every engine at once; returns the engines whose call failed."""
        if not engines:
            return []
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            futures = [(e, pool.submit(call, e)) for e in engines]
        failed = []
        for eng, fut in futures:
            error = fut.exception()
            if error is not None:
                if not isinstance(error, SGLangServerError):
                    raise error
                print(f"[sglang] engine {eng.index}: {_first_line(error)}", file=sys.stderr)
                failed.append(eng)
        return failed

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        """A whole sync from this process, the only sender (the trainer at PP=1, tools, tests):
        :meth:`begin_sync`, this fleet's sender pushes every bucket, :meth:`end_sync`."""
        plan = self.begin_sync(version)
        self.end_sync(plan, [self.sender.push(plan, buckets, fault=self._fault)])

    def begin_sync(self, version: int) -> SyncPlan:
        """Prepare sync ``version``: relaunched engines are waited for, every engine that is up
        is marked ``"<v>-partial"``. Returns the plan every sending rank pushes by (its
        ``failed`` is set when an engine refused already: senders then only consume their
        stream, and :meth:`end_sync` asks for the sync again)."""
        if "weights" in self._released:
            raise SGLangServerError(
                "weight sync while the engines' weights are released (colocated placement): "
                "resume_memory(('weights',)) must come first"
            )
        self._sync_started = time.perf_counter()
        self._check_router()
        if self.attached and not self._attached_seen:
            self._wait_attached()
        for eng in self.engines:
            if eng.proc is None:
                continue  # attached: one that died was dropped
            if not eng.alive():
                self._relaunch(eng, "its process exited")
            if eng.version < 0:  # relaunched (or unknown): wait until it can take the weights
                self._wait_or_relaunch(eng)
        members = self._up()
        if not members:
            raise SGLangServerError("no SGLang engine is up to take the weights")
        self._version = -1
        for eng in members:
            eng.version = -1
        timeout = self.cfg.request_timeout_s
        self._fault("begin_update")
        failed = self._each(members, lambda e: begin_update(e.http, version, timeout=timeout))
        self._members = members
        return SyncPlan(
            version=version,
            engines=[(e.url, self.cfg.tp_size) for e in members],
            device=self.device,
            timeout=timeout,
            export_options=self.export_options,
            failed=[e.url for e in failed],
            transport=self.cfg.transport,
            rename_scales=self.fp8_checkpoint and self.fp8.weight_quant == "per_tensor",
        )

    def end_sync(self, plan: SyncPlan, errors: list[str | None]) -> None:
        """Finish sync ``plan.version`` after every sender pushed (``errors``: each sender's
        failure, or None): mark every engine ``"<v>"``, check the version it reports, put new
        ones in the router. Raises :class:`SyncFailed` (after relaunching the engines that
        failed) when anything failed: the trainer then runs the sync again."""
        members, version = self._members, plan.version
        failed = [e for e in members if e.url in plan.failed]
        pushed = [e for e in errors if e]
        if pushed:
            print(f"[sglang] weight broadcast failed: {pushed[0]}", file=sys.stderr)
            failed = [e for e in members if not self._healthy(e)]
        if not failed and not pushed:
            self._fault("end_update")
            timeout = plan.timeout

            def finish(e: _Engine) -> None:
                end_update(e.http, version, timeout=timeout)
                check_version(e.http, str(version), timeout=timeout)

            failed = self._each(members, finish)
        if failed or pushed:
            for eng in failed:
                self._relaunch(eng, f"failed during the sync to version {version}")
            raise SyncFailed(
                f"the weight sync to version {version} failed "
                f"({'on engine(s) ' + str([e.index for e in failed]) if failed else pushed[0]}); "
                "the sync is to be run again"
            )
        for eng in members:
            eng.version, eng.restarts = version, 0
            self._router_add(eng)
        self._version = version
        self.stats["update_seconds"] = time.perf_counter() - self._sync_started

    def _healthy(self, eng: _Engine) -> bool:
        if not eng.alive():
            return False
        try:
            eng.http.call("/health", timeout=10)
            return True
        except SGLangServerError:
            return False

    def weight_version(self) -> int:
        return self._version if any(e.version == self._version for e in self._up()) else -1

    def health(self) -> bool:
        return any(self._healthy(e) for e in self.engines)

    # -- colocated memory ------------------------------------------------------------------------
    def release_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Colocated: the engines give the memory of ``tags`` back to the trainer. Released
        weights are gone (SGLang keeps no copy): generating needs a sync first."""
        tags = tuple(t for t in tags if t not in self._released)
        if tags:
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
        if tags:
            self._memory("resume_memory_occupation", tags)
            self._released -= set(tags)

    def _memory(self, call: str, tags: tuple[str, ...]) -> None:
        if not self.colocated:
            return
        self.memory_calls.append((call, tuple(tags)))
        if self.device != "cuda":
            print(
                f"[sglang] colocated: {call}{list(tags)} skipped (no GPU memory on CPU)",
                file=sys.stderr,
                flush=True,
            )
            return
        timeout = self.cfg.request_timeout_s
        failed = self._each(
            self._up(), lambda e: e.http.ok(f"/{call}", {"tags": list(tags)}, timeout=timeout)
        )
        for eng in failed:
            self._relaunch(eng, f"/{call} failed")

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Completion]:
        if self._released:
            raise SGLangServerError(
                f"rollout while the engines' memory is released ({sorted(self._released)}); "
                "resume_memory must come first"
            )
        if self._version < 0:
            raise SGLangServerError(
                "the SGLang fleet holds no synced weights; call update_weights (the trainer's "
                "EngineLink.sync) before generate"
            )
        rows = [p for p in prompts for _ in range(n)]
        requests = dict(
            enumerate(
                row_requests(
                    rows,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=greedy,
                    seed=seed,
                    eos_token_id=self.eos_token_id,
                )
            )
        )
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
            raise SGLangServerError(
                f"{len(requests) - len(done)} of {len(requests)} rollout requests failed on every "
                f"try (rollout.sglang.max_restarts={self.cfg.max_restarts}); engine logs in "
                f"{self.work_dir}"
            )
        self._engines_used = sum(b > a for a, b in zip(before, self.request_counts()))
        return [done[i] for i in range(len(rows))]

    def _target(self) -> str:
        if self.router.url:
            return self.router.url
        serving = [e for e in self._up() if e.version == self._version]
        if not serving:
            raise SGLangServerError("no SGLang engine serves the synced weights")
        return serving[0].url

    def _send(
        self, pending: dict[int, dict], rows: list[list[int]], *, engines: int = 1
    ) -> dict[int, Completion]:
        """One round of requests (one per row), all in flight at once; the answers that came
        back right, by row. Adds the round's time short of ``engines`` requests in flight to
        ``wait_s``."""
        http = Http(self._target())
        timeout = self.cfg.request_timeout_s
        out: dict[int, Completion] = {}
        spans: list[tuple[float, float]] = []  # (sent, answered) per request, driver's clock

        def call(r: dict):
            t0 = time.perf_counter()
            try:
                return http.call("/generate", r, timeout=timeout)
            finally:
                spans.append((t0, time.perf_counter()))  # list.append is atomic

        with concurrent.futures.ThreadPoolExecutor(min(len(pending), 64)) as pool:
            futures = {i: pool.submit(call, r) for i, r in pending.items()}
            self._fault("generate")  # mid-rollout: the requests are in flight
            failures = []
            for i, fut in futures.items():
                try:
                    answer = fut.result()
                    if not isinstance(answer, dict):
                        raise _ServerGone(f"/generate returned {type(answer).__name__}")
                    out[i] = parse_completion(
                        rows[i],
                        answer,
                        eos_token_id=self.eos_token_id,
                        expected_version=str(self._version),
                    )
                except SGLangServerError as e:
                    failures.append(f"row {i}: {_first_line(e)}")
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
        self._check_router()
        for eng in self.engines:
            if eng.url and not eng.alive():
                self._relaunch(eng, "its process exited")
            elif probe and eng.url and eng.version == self._version and not self._healthy(eng):
                self._relaunch(eng, "it did not answer /health (hung)")
        if not any(e.version == self._version and e.alive() for e in self.engines):
            lost = f"no SGLang engine serves weight version {self._version} any more"
            if not any(e.proc is not None or e.url for e in self.engines):
                # Attached engines, all dropped: nothing is left to sync.
                raise SGLangServerError(f"{lost}; engine logs in {self.work_dir}")
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

    def request_counts(self) -> list[float]:
        """Requests each launched engine has served since its launch (its ``/metrics``; attached
        engines may not export them: zeros)."""
        counts = []
        for eng in self.engines:
            if not eng.alive():
                counts.append(0.0)
                continue
            total = 0.0
            try:
                text = eng.http.call("/metrics", timeout=30)
                for line in str(text).splitlines():
                    if line.startswith("sglang:num_requests_total"):
                        total += float(line.rsplit(" ", 1)[1])
            except SGLangServerError:
                pass  # no /metrics (an attached engine without --enable-metrics): counted as 0
            counts.append(total)
        return counts

    def shutdown(self) -> None:
        self.sender.close()
        self.router.kill()
        for eng in self.engines:
            if eng.proc is not None:
                _kill_group(eng.proc)
                eng.proc = None
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()
