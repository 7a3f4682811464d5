"""The servers of an SGLang fleet, kept serving, and the router in front of them.

:class:`ServerPool` is the membership half of :class:`~.fleet.SGLangFleet`, which adds the
rollout-engine half (syncs, generation, colocated memory). It launches every engine at once on
placeholder weights (or attaches to ``engine_urls``) and waits for them; an engine that died or
hangs is relaunched, at most ``rollout.sglang.max_restarts`` times since its last good sync,
and an attached one is dropped instead. With more than one engine a router runs in front of
them (launched here, or ``router_url``): an engine leaves it when it is relaunched and joins it
after its next good sync, and a launched router that dies is relaunched in front of the engines
that are up. One server's own process and calls are :class:`~.server.SGLangServer`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_rl_fp8.parallel import node_name
from megatron_rl_fp8.rollout.errors import RolloutEngineError, first_line
from megatron_rl_fp8.rollout.sglang.faults import fault_hook_from_env
from megatron_rl_fp8.rollout.sglang.placement import engines_per_node
from megatron_rl_fp8.rollout.sglang.process import (
    log_tail,
    resolve_python,
    resolve_work_dir,
    serving,
)
from megatron_rl_fp8.rollout.sglang.router import Router
from megatron_rl_fp8.rollout.sglang.sender import Senders, on_this_host
from megatron_rl_fp8.rollout.sglang.server import SGLangServer, server_gpus
from megatron_rl_fp8.rollout.sglang.transports import write_model_config

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.config import RolloutConfig


class ServerPool:
    """SGLang servers (launched or attached) and the router in front of them, kept serving."""

    def __init__(
        self,
        cfg: RolloutConfig,
        hf_config,
        *,
        output_dir: str | os.PathLike | None = None,
        senders: Senders | None = None,
    ):
        """Launch every engine and wait until each is healthy, or attach (waited for at the
        first sync). ``senders``: the trainer's sending ranks, whose GPUs launched engines keep
        off with the distributed transport; the trainer passes ``Senders.from_env(pp)`` with its
        ``parallel.pipeline_model_parallel_size``. None = this torchrun job at PP 1 (one
        sender, the driver), or this process alone (tools, tests)."""
        self.cfg = cfg.sglang
        self.fp8 = cfg.fp8
        self.colocated = cfg.placement == "colocated"
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
        n = len(self.cfg.engine_urls) or self.cfg.num_engines or self._every_tp_group()
        self.engines = [SGLangServer(i, self.work_dir) for i in range(n)]
        self.senders = senders if senders is not None else Senders.from_env()
        self._gpus: list[tuple[int, ...]] = []  # launched engines' GPUs on this node (cuda)
        self.router = Router(self.cfg, python=self.python, work_dir=self.work_dir)
        self.stats: dict[str, float] = {"restarts": 0, "router_restarts": 0}
        self._attached_seen = False  # attached engines waited for (first sync)
        self.fault_hook: Callable[[str], None] | None = fault_hook_from_env(self)
        try:
            if self.attached:
                nodes = self.cfg.engine_nodes or [""] * len(self.engines)
                for eng, url, node in zip(self.engines, self.cfg.engine_urls, nodes):
                    eng.url = eng.attached_url = url.rstrip("/")
                    eng.node = node
            else:
                here = node_name()
                for eng in self.engines:
                    eng.node = here
                if self.device == "cuda":
                    self._gpus = server_gpus(
                        self.cfg, n, colocated=self.colocated, senders=self.senders
                    )
                for eng in self.engines:  # all at once: a GPU engine takes minutes to start
                    self._launch(eng)
                for eng in self.engines:
                    self._wait_or_relaunch(eng)
            if not self.router.url and len(self.engines) > 1:
                self._launch_router()
        except BaseException:
            self.shutdown()
            raise

    def _every_tp_group(self) -> int:
        """``num_engines=0`` when this fleet launches its engines itself (no launcher): one on
        every TP group of this node's GPUs (``rollout/sglang/placement.py``); one on a CPU."""
        if self.device != "cuda":
            return 1
        return engines_per_node(gpus_per_node=torch.cuda.device_count(), engine_tp=self.cfg.tp_size)

    # -- what the fleet asks for -----------------------------------------------------------------
    def up(self) -> list[SGLangServer]:
        """The engines whose process runs (attached: not dropped)."""
        return [e for e in self.engines if e.alive()]

    def bring_up(self) -> list[SGLangServer]:
        """Before a sync: a dead router relaunched, attached engines waited for (the first
        time), every launched engine that died relaunched and every relaunched one waited for.
        Returns the engines that are up."""
        self._check_router()
        if self.attached and not self._attached_seen:
            self._wait_attached()
        for eng in self.engines:
            if eng.proc is None:
                self._rejoin(eng)
                continue
            if not eng.alive():
                self.relaunch(eng, "its process exited")
            if eng.version < 0:  # relaunched (or unknown): wait until it can take the weights
                self._wait_or_relaunch(eng)
        return self.up()

    def replace_lost(self, *, probe: int | None = None) -> None:
        """Relaunch every engine that died and, with ``probe`` (a weight version), every one
        serving that version that does not answer ``/health`` (hung); they rejoin at the next
        sync. A dead router is relaunched first."""
        self._check_router()
        for eng in self.engines:
            if eng.url and not eng.alive():
                self.relaunch(eng, "its process exited")
            elif probe is not None and eng.url and eng.version == probe and not eng.healthy():
                self.relaunch(eng, "it did not answer /health (hung)")

    def relaunch(self, eng: SGLangServer, why: str) -> None:
        """Take ``eng`` out of the router, kill what is left of it, and start it again (it
        rejoins at the next sync). Attached engines are dropped instead."""
        self._router_remove(eng)
        if eng.proc is None:  # attached: its own node relaunches it (rollout/sglang/role.py)
            print(
                f"[sglang] engine {eng.url}: {why}; dropped from the fleet until it answers "
                "again (the next sync waits for it)",
                file=sys.stderr,
            )
            eng.url, eng.version, eng.rejoin_wait = "", -1, True
            return
        if eng.restarts >= self.cfg.max_restarts:
            log = eng.log
            eng.kill()
            raise RolloutEngineError(
                f"SGLang engine {eng.index} failed ({why}) and {eng.restarts} relaunch(es) did "
                f"not bring it back (rollout.sglang.max_restarts={self.cfg.max_restarts}); "
                f"its log: {log}\n{log_tail(log)}"
            )
        eng.restarts += 1
        self.stats["restarts"] += 1
        print(
            f"[sglang] engine {eng.index} ({eng.url}): {why}; relaunching it (restart "
            f"{eng.restarts} of rollout.sglang.max_restarts={self.cfg.max_restarts}; previous "
            f"log {eng.log}); it is re-synced by the next sync",
            file=sys.stderr,
            flush=True,
        )
        eng.kill()
        self._launch(eng)

    def _rejoin(self, eng: SGLangServer) -> None:
        """An attached engine that was dropped joins again once it answers ``/health`` (its node
        relaunched it on placeholder weights: the sync that follows gives it the weights). The
        first sync after the drop waits for it (``startup_timeout_s``); later ones only ask."""
        if eng.url or not eng.attached_url:
            return
        probe = SGLangServer(eng.index, self.work_dir, url=eng.attached_url)
        deadline = time.monotonic() + (self.cfg.startup_timeout_s if eng.rejoin_wait else 0)
        back = probe.healthy()
        while not back and time.monotonic() < deadline:
            time.sleep(1.0)
            back = probe.healthy()
        if eng.rejoin_wait and not back:
            print(
                f"[sglang] engine {eng.attached_url} did not answer again within "
                f"rollout.sglang.startup_timeout_s={self.cfg.startup_timeout_s}s; the fleet goes "
                "on without it and asks again at every sync",
                file=sys.stderr,
                flush=True,
            )
        eng.rejoin_wait = False
        if back:
            eng.url, eng.version, eng.released = eng.attached_url, -1, set()
            eng.generation += 1
            self.stats["restarts"] += 1
            print(
                f"[sglang] engine {eng.url} answers again; it rejoins with this sync",
                file=sys.stderr,
            )

    def each(
        self, engines: list[SGLangServer], call: Callable[[SGLangServer], None]
    ) -> list[SGLangServer]:
        """Run ``call`` on every engine at once; returns the engines whose call failed."""
        if not engines:
            return []
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            futures = [(e, pool.submit(call, e)) for e in engines]
        failed = []
        for eng, fut in futures:
            error = fut.exception()
            if error is not None:
                if not isinstance(error, RolloutEngineError):
                    raise error
                print(f"[sglang] engine {eng.index}: {first_line(error)}", file=sys.stderr)
                failed.append(eng)
        return failed

    def router_add(self, eng: SGLangServer) -> None:
        """Put ``eng`` in the router (when there is one and it is not in yet)."""
        if eng.in_router or not self.router.url:
            return
        self.router.add(eng.url)
        eng.in_router = True

    def request_counts(self) -> list[float]:
        """Requests each launched engine has served since its launch (its ``/metrics``; attached
        engines may not export them: zeros)."""
        return [eng.requests_served() for eng in self.engines]

    def kill_server(self) -> None:
        """SIGKILL the last engine's process group without telling the fleet, as a crash would
        (fault injection: ``MRF8_SGLANG_FAULT``, tests). An attached one on this host is found
        by the pid file its node's rollout role wrote (``<work_dir>/node<k>/engine<i>.pid``)."""
        eng = self.engines[-1]
        if eng.proc is not None or not eng.url:
            return eng.kill()
        pid_files = list(self.work_dir.glob(f"node*/engine{eng.index}.pid"))
        if not pid_files or not on_this_host(eng.url):
            print(
                f"[sglang] fault: cannot kill attached engine {eng.url} from here", file=sys.stderr
            )
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid_files[0].read_text()), signal.SIGKILL)

    def fault(self, point: str) -> None:
        """The fault hook at ``point`` (``faults.FAULT_POINTS``; testing only)."""
        if self.fault_hook is not None:  # testing only; see faults.KillServerAt
            self.fault_hook(point)

    def shutdown(self) -> None:
        self.router.kill()
        for eng in self.engines:
            eng.kill()
            eng.proc = None
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()

    # -- processes -------------------------------------------------------------------------------
    def _launch(self, eng: SGLangServer) -> None:
        """Start ``eng`` on placeholder weights (returns at once; then ``eng.wait_healthy``)."""
        eng.launch(
            self.cfg,
            python=self.python,
            device=self.device,
            dtype=self.serve_dtype,
            fp8_checkpoint=self.fp8_checkpoint,
            model_dir=self.model_dir,
            base_gpu_id=self._gpus[eng.index][0] if self._gpus else None,
            memory_saver=self.colocated and self.device == "cuda",
        )
        if eng is self.engines[-1]:
            self.fault("startup")  # the engine the fault hook kills

    def _wait_or_relaunch(self, eng: SGLangServer) -> None:
        """Wait until ``eng`` is healthy; one that dies or hangs in startup is relaunched (within
        ``max_restarts``). On CPU, SGLang sizes its KV pool from the host memory it sees free
        before and after loading, which other processes change: a start can fail at random."""
        while True:
            try:
                return eng.wait_healthy(self.cfg.startup_timeout_s)
            except RolloutEngineError as e:
                self.relaunch(eng, first_line(e))

    def _wait_attached(self) -> None:
        """Before the first sync: wait (``startup_timeout_s``) until every attached engine answers
        ``/health``. They are started by someone else (the Slurm launcher's rollout nodes), often
        at the same time as the trainer, and a CPU or large GPU engine takes minutes; one that
        never answers is dropped by the sync that follows."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = [e for e in self.engines if e.url]
        while waiting and time.monotonic() < deadline:
            waiting = [e for e in waiting if not e.healthy()]
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

    # -- router ----------------------------------------------------------------------------------
    def _launch_router(self) -> None:
        serving = [e.url for e in self.engines if e.alive()]
        self.router.launch(serving)
        for eng in self.engines:
            eng.in_router = eng.url in serving

    def _router_remove(self, eng: SGLangServer) -> None:
        if not eng.in_router or not self.router.url:
            return
        eng.in_router = False
        try:
            self.router.remove(eng.url)
        except RolloutEngineError:
            self._check_router()

    def _check_router(self) -> None:
        """Relaunch a router this fleet launched and that has died."""
        if self.router.died():
            self.stats["router_restarts"] += 1
            print("[sglang] sglang-router died; relaunching it", file=sys.stderr, flush=True)
            self.router.kill()
            self._launch_router()
