"""What the Slurm launcher (``launch/``) and a server engine agree on: where each engine server of
a job runs, what one rollout node serves, and the :class:`Launcher` an engine's spec gives
(``EngineSpec.launcher``) to place, check, describe and start its servers.

The launcher owns the job (its nodes, their roles, the ports, the commands); the engine owns its
servers (how many, on which GPUs, what they refuse, the overrides that attach the trainer to them,
the foreground process that runs a node's). Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


def url_host(addr: str) -> str:
    """An address as the host part of a URL or endpoint (IPv6 in brackets)."""
    return f"[{addr}]" if ":" in addr else addr


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacedEngine:
    """One engine server of a job: where it runs and where the trainer reaches it."""

    index: int
    node: str
    node_index: int
    addr: str
    gpus: tuple[int, ...]
    port: int

    @property
    def url(self) -> str:
        return f"http://{url_host(self.addr)}:{self.port}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeRole:
    """What rollout node ``node_index`` of a job runs."""

    node_index: int
    node: str
    addr: str
    """The node's address in the layout: the host part of its engines' URLs."""
    engines: tuple[PlacedEngine, ...]
    router_port: int | None
    """The router's port when this node runs it, else None."""
    worker_urls: tuple[str, ...]
    """Every engine of the job: the router's workers."""

    @property
    def router_url(self) -> str | None:
        if self.router_port is None:
            return None
        return f"http://{url_host(self.addr)}:{self.router_port}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """A job's engine servers as their engine places them: the GPUs of each (engine e on rollout
    node e % R) and each one's TP size; whether the engine derived the count (the trainer is
    told it), and where from; lines for the dry-run's summary after the engines."""

    gpus: tuple[tuple[int, ...], ...]
    tp: int
    derived_count: bool = False
    count_note: str = ""
    notes: tuple[str, ...] = ()


class Launcher(Protocol):
    """How ``megatron-rl-fp8 launch`` starts an engine's servers. ``cfg`` is the whole run
    config (``RunConfig``); every refusal is a ``ConfigError`` of one line naming the setting."""

    def check(self, cfg: Any, *, nodes: int, gpus_per_node: int) -> None:
        """Refuse settings the launcher cannot start on a job of ``nodes`` nodes (engines the
        run attaches to by URL, a weight sync that cannot reach them, a count that cannot be
        placed)."""

    def nodes_needed(self, cfg: Any, *, gpus_per_node: int, most_per_node: int) -> int:
        """Dedicated placement: the nodes its engines need (at most ``most_per_node`` engines
        on one node: the job's ports)."""

    def place(
        self,
        cfg: Any,
        *,
        nodes: tuple[str, ...],
        gpus_per_node: int,
        colocated: bool,
        most_per_node: int,
    ) -> Placement:
        """Its engines on ``nodes`` (every node trains as well when ``colocated``)."""

    def check_files(self, cfg: Any) -> None:
        """The files its servers need on the rollout nodes (an interpreter, say)."""

    def trainer_overrides(
        self, engines: Sequence[PlacedEngine], router_url: str | None, derived_count: bool
    ) -> list[str]:
        """The overrides that attach the trainer to the launched servers (and router)."""

    def serve_node(
        self,
        cfg: Any,
        role: NodeRole,
        *,
        colocated: bool,
        restart_count: int,
        log_dir: Path | None,
    ) -> int:
        """Run rollout node ``role``'s servers (and the router) in the foreground until a
        signal (exit 0) or a failure (exit 1; a start that fails, exit 2); logs in ``log_dir``
        (None: a place of the engine's choosing)."""
