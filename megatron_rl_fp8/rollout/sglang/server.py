"""One SGLang server of a fleet: its process, its health, and the HTTP calls made to it.

A launched server runs ``sglang.launch_server`` under the guard of ``process.py`` (a process
group of its own, gone with the trainer), on placeholder weights from the config-only model
directory, on the port and GPUs the fleet gives it. An attached one
(``rollout.sglang.engine_urls``) is only called. The fleet (``fleet.py``) decides when a server
is launched, relaunched, dropped, put in the router and synced; a server only does it:

    launch / wait_healthy / kill   its process (log ``engine<i>-<launch>.log``, pid file
                                   ``engine<i>.pid`` in the work directory)
    healthy / requests_served      ``/health``, ``/metrics``
    begin_update / end_update      its side of one weight sync (SGLang 0.5.23 takes tensor and
                                   distributed updates only between ``/begin_weight_update`` and
                                   ``/end_weight_update``)
    memory                         colocated placement: ``/release_memory_occupation`` and
                                   ``/resume_memory_occupation``
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from pathlib import Path

import torch

from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.process import (
    MEMORY_SAVER_FLAG,
    kill_group,
    launch_guarded_server,
    pick_port,
    wait_healthy,
)
from megatron_rl_fp8.rollout.sglang.sender import Senders, engine_gpus_on_node


@dataclasses.dataclass(eq=False)
class SGLangServer:
    """One SGLang server: launched here (``proc``, the guard leading its process group) or
    attached (``proc`` None), and what its fleet knows of it."""

    index: int
    work_dir: Path
    url: str = ""
    proc: subprocess.Popen | None = None  # None: attached
    launches: int = 0
    restarts: int = 0  # relaunches since its last good sync
    version: int = -1  # the weight version it was verified to serve; -1 = none
    in_router: bool = False
    node: str = ""  # the node it runs on (a per-node sync's); "" = unknown
    attached_url: str = ""  # attached: where it was given; kept while it is dropped
    rejoin_wait: bool = False  # attached and dropped: wait for it once at the next sync
    # Colocated: the memory tags this process released and has not resumed. Per engine, since
    # SGLang's scheduler raises on resuming a tag its process never released (a relaunched or
    # rejoined engine starts with none): WeightUpdater.resume_memory_occupation, offload_tags.
    released: set[str] = dataclasses.field(default_factory=set)
    # One more at every launch (and every rejoin of an attached engine): a new process, which
    # holds no weight-update group of an earlier one even at the same URL (sender.py).
    generation: int = 0

    @property
    def http(self) -> Http:
        return Http(self.url)

    @property
    def log(self) -> Path:
        """The log of its current (or last) launch."""
        return self.work_dir / f"engine{self.index}-{self.launches}.log"

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return bool(self.url)  # attached: alive until a call to it fails

    # -- the process -----------------------------------------------------------------------------
    def launch(
        self,
        cfg: SGLangConfig,
        *,
        python: str,
        device: str,
        dtype: str,
        fp8_checkpoint: bool,
        model_dir: Path,
        base_gpu_id: int | None,
        memory_saver: bool,
    ) -> None:
        """Start it on placeholder weights (returns at once; :meth:`wait_healthy` for health), on
        port ``cfg.port + index`` (a free one when ``cfg.port`` is 0). ``memory_saver``:
        ``--enable-memory-saver``, so that it can release its GPU memory (colocated)."""
        self.launches += 1
        extra = [MEMORY_SAVER_FLAG] if memory_saver else []
        proc, port = launch_guarded_server(
            dataclasses.replace(cfg, extra_args=[*cfg.extra_args, *extra]),
            python=python,
            device=device,
            dtype=dtype,
            fp8_checkpoint=fp8_checkpoint,
            model_path=model_dir,
            version="-1",
            work_dir=self.work_dir,
            log_path=self.log,
            pid_file=f"engine{self.index}.pid",
            port=pick_port() if cfg.port == 0 else cfg.port + self.index,
            placeholder_weights=True,
            base_gpu_id=base_gpu_id,
        )
        self.proc, self.url = proc, f"http://{cfg.host}:{port}"
        self.version, self.in_router = -1, False
        self.released = set()  # a new process holds all of its memory
        self.generation += 1

    def wait_healthy(self, timeout_s: float) -> None:
        """Until it answers ``/health``; raises ``ServerGone`` when it exits, cannot bind its
        port, or stays silent past ``timeout_s``."""
        port = int(self.url.rsplit(":", 1)[1])
        wait_healthy(self.proc, self.http, self.log, port=port, timeout_s=timeout_s)

    def healthy(self) -> bool:
        if not self.alive():
            return False
        try:
            self.http.call("/health", timeout=10)
            return True
        except RolloutEngineError:
            return False

    def kill(self) -> None:
        """SIGKILL its whole process group and wait until it is gone (attached: nothing)."""
        if self.proc is not None:
            kill_group(self.proc)

    # -- its endpoints ---------------------------------------------------------------------------
    def begin_update(self, version: int, *, timeout: float) -> None:
        """Mark it ``"<v>-partial"`` (aborting requests in flight), open the update session."""
        self.http.ok(
            "/update_weight_version",
            {"new_version": f"{version}-partial", "abort_all_requests": True},
            timeout=timeout,
        )
        self.http.ok("/begin_weight_update", {}, timeout=timeout)

    def abandon_update(self, *, timeout: float) -> None:
        """Close an update session that a failed sync left open (its weights stay partial, its
        version ``"<v>-partial"``: the sync that runs again replaces both); quietly, since the
        engine may be the one that failed."""
        with contextlib.suppress(RolloutEngineError):
            self.http.ok("/end_weight_update", {}, timeout=timeout)

    def end_update(self, version: int, *, timeout: float) -> None:
        """Close the update session, mark it ``"<v>"``, flush its KV/radix cache, and check that
        it reports that version (``/model_info``)."""
        http = self.http
        http.ok("/end_weight_update", {}, timeout=timeout)
        http.ok(
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": True},
            timeout=timeout,
        )
        out = http.call("/flush_cache", {}, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise RolloutEngineError(f"/flush_cache failed after the weight update: {out}")
        info = http.call("/model_info", timeout=timeout)
        got = info.get("weight_version") if isinstance(info, dict) else None
        if got != str(version):
            raise ServerGone(
                f"SGLang server reports weight version {got!r}, expected {str(version)!r}"
            )

    def memory(self, call: str, tags: tuple[str, ...], *, timeout: float) -> None:
        """``/<call>`` (``release_memory_occupation`` or ``resume_memory_occupation``) of
        ``tags``: needs ``--enable-memory-saver``."""
        self.http.ok(f"/{call}", {"tags": list(tags)}, timeout=timeout)

    def requests_served(self) -> float:
        """Requests served since its launch (its ``/metrics``; 0 when dead, or attached without
        ``--enable-metrics``)."""
        if not self.alive():
            return 0.0
        total = 0.0
        try:
            text = self.http.call("/metrics", timeout=30)
            for line in str(text).splitlines():
                if line.startswith("sglang:num_requests_total"):
                    total += float(line.rsplit(" ", 1)[1])
        except RolloutEngineError:
            pass  # no /metrics (an attached engine without --enable-metrics): counted as 0
        return total


def server_gpus(
    cfg: SGLangConfig, count: int, *, colocated: bool, senders: Senders
) -> list[tuple[int, ...]]:
    """The GPUs on this node of ``count`` launched servers, by the launcher's rule
    (``sender.engine_gpus_on_node``): ``base_gpu_id`` onwards when set; else after the
    trainer's GPUs (dedicated) or on the node's last GPUs (colocated). With the distributed
    transport none may be a sending rank's GPU: NCCL refuses a group with two processes on
    one GPU (the tensor transport may share one: CUDA IPC). Refuses, one line, what does
    not fit or clashes, before any server starts."""
    have, tp = torch.cuda.device_count(), cfg.tp_size
    base = cfg.base_gpu_id
    if base is None and not colocated:  # after the trainer's GPUs on this node
        base = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        gpus = engine_gpus_on_node(
            range(count),
            tp_size=tp,
            gpus_per_node=have,
            senders=senders if cfg.transport == "distributed" else None,
            base_gpu_id=base,
            node="this node",
        )
    except ValueError as e:
        raise RolloutEngineError(f"rollout.sglang: {e}") from None
    if gpus[-1][-1] >= have:
        raise RolloutEngineError(
            f"rollout.sglang: {count} engine(s) x tp_size={tp} on GPUs "
            f"{gpus[0][0]}-{gpus[-1][-1]}, this node has {have}; lower num_engines or "
            "tp_size, or set rollout.sglang.base_gpu_id"
        )
    return gpus
