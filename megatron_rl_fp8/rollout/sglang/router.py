"""The sglang-router in front of a fleet's engines (``sglang_router.launch_router``).

One the fleet launched is relaunched in front of the engines that serve when it dies; one that
already runs (``rollout.sglang.router_url``) is only called. Engines leave it when they die or
hang and join it again after their next good sync (the fleet decides when; see ``fleet.py``).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.process import (
    kill_group,
    launch_logged,
    pick_port,
    router_command,
    server_env,
)


class Router:
    """A router at ``url`` ("" while there is none): launched here (:meth:`launch`) or attached."""

    def __init__(self, cfg: SGLangConfig, *, python: str, work_dir: Path):
        self.cfg = cfg
        self.python = python
        self.work_dir = work_dir
        self.url = cfg.router_url
        self.proc: subprocess.Popen | None = None
        self.launches = 0

    def launch(self, worker_urls: list[str]) -> None:
        """Start a router in front of ``worker_urls`` and wait until it lists every one."""
        self.launches += 1
        port = pick_port()
        log = self.work_dir / f"router-{self.launches}.log"
        cmd = router_command(
            self.cfg,
            python=self.python,
            port=port,
            worker_urls=worker_urls,
            metrics_port=pick_port(),
        )
        self.proc = launch_logged(
            cmd, python=self.python, env=server_env(self.cfg, "cpu"), log_path=log
        )
        self.url = f"http://{self.cfg.host}:{port}"
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RolloutEngineError(f"sglang-router exited during startup; see {log}")
            try:
                if len(self.workers()) == len(worker_urls):
                    return
            except RolloutEngineError:
                pass  # not listening yet: poll again until the deadline
            if time.monotonic() > deadline:
                raise RolloutEngineError(
                    f"sglang-router not ready after rollout.sglang.startup_timeout_s="
                    f"{self.cfg.startup_timeout_s}s; see {log}"
                )
            time.sleep(0.3)

    def workers(self) -> dict[str, str]:
        """url -> worker id, as the router lists them."""
        out = Http(self.url).call("/workers", timeout=30)
        return {w["url"]: w["id"] for w in (out or {}).get("workers", [])}

    def remove(self, url: str) -> None:
        """Take the worker at ``url`` out (raises RolloutEngineError when the router fails)."""
        wid = self.workers().get(url)
        if wid is not None:
            Http(self.url).call(f"/workers/{wid}", timeout=30, method="DELETE")

    def add(self, url: str) -> None:
        """Put the worker at ``url`` in and wait until the router lists it (60 s)."""
        Http(self.url).call("/workers", {"url": url}, timeout=30)
        deadline = time.monotonic() + 60
        while url not in self.workers():
            if time.monotonic() > deadline:
                raise ServerGone(f"sglang-router did not take worker {url} within 60 s")
            time.sleep(0.2)

    def died(self) -> bool:
        """Whether a router launched here has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None
