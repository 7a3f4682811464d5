"""The rollout role of a Slurm job: one node's SGLang engines (and the router), in the foreground.

``megatron-rl-fp8 launch CONFIG [overrides] --role rollout --node-index K`` runs on rollout node K
(one ``srun`` task, rendered by ``launch/render.py``). The launcher derives the job's layout from
the same flags as the dry-run and hands this module node K's :class:`~..launching.NodeRole`, so it
starts exactly the engines whose URLs the trainer was given, on the ports and GPUs the layout
assigns, and the sglang-router when the layout puts it on this node. The trainer attaches to them
by URL (``rollout.sglang.engine_urls`` / ``router_url``) and syncs their weights by broadcast.

How it differs from the trainer's own fleet (``fleet.py``; its ``pool.py`` launches engines on
the trainer's node and relaunches them):

* **Addresses.** The engines are reached from other nodes, so they cannot listen on
  ``rollout.sglang.host``'s default 127.0.0.1 (:func:`listen_host`).
* **Relaunch here, re-sync there.** An engine started here that exits is started again on the
  same port and GPUs, on placeholder weights (at most ``rollout.sglang.max_restarts`` times;
  past that, or when the router exits, the role ends with exit 1 and the log tail). The trainer
  drops an engine it finds dead, waits for it at its next sync and, once it answers again,
  syncs it (per node with the tensor transport) and puts it back in the router.
* **Engines on other nodes** come up at their own pace. sglang-router 0.3.2 listens at once with
  its ``--worker-urls`` still unregistered and keeps probing each one (backoff up to 5 s, for
  ``--worker-startup-timeout-secs``, 1800 s by default), so the router's node need not wait for
  them; the trainer also adds every engine to the router after each sync (a worker it already
  has is accepted again, not duplicated).

Everything runs under the guard of ``process.py`` (each in its own process group, killed when
this process dies however it dies). SIGTERM / SIGINT (the sbatch script stopping the step) kill
the groups and exit 0. The command lines are built by a pure function (:func:`role_commands`)
that the unit tests check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.data import load_prompt_encoder
from megatron_rl_fp8.models.hf_mapping import hf_config_with_tokens
from megatron_rl_fp8.rollout.errors import RolloutEngineError, first_line
from megatron_rl_fp8.rollout.launching import NodeRole
from megatron_rl_fp8.rollout.sglang.http import Http
from megatron_rl_fp8.rollout.sglang.process import (
    MEMORY_SAVER_FLAG,
    kill_group,
    launch_logged,
    log_tail,
    resolve_python,
    router_command,
    server_command,
    server_env,
    serving,
    wait_healthy,
)
from megatron_rl_fp8.rollout.sglang.transports import write_model_config

if TYPE_CHECKING:
    import subprocess

    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

RunConfig = Any
"""``megatron_rl_fp8.config.RunConfig``, the whole run's config (a layer above ``rollout/``)."""

_LOOPBACK = ("127.0.0.1", "localhost", "::1", "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """One process the role starts: its command line, and where it answers /health."""

    name: str
    """``engine<i>`` (i: the engine's index in the job) or ``router``."""
    argv: tuple[str, ...]
    url: str


def listen_host(configured: str, addr: str) -> str:
    """The address the engines and the router bind: ``rollout.sglang.host`` when it is set to
    something other than loopback (e.g. ``0.0.0.0`` or one interface); otherwise the node's
    address when it is an IP (scontrol's NodeAddr), else ``0.0.0.0``: a node *name* can resolve
    to a loopback address on its own host (Debian's ``127.0.1.1 <hostname>`` line), and an engine
    bound there is unreachable from the trainer's nodes."""
    if configured not in _LOOPBACK:
        return configured
    try:
        ipaddress.ip_address(addr)
        return addr
    except ValueError:
        return "0.0.0.0"


def role_commands(
    role: NodeRole,
    sg: SGLangConfig,
    *,
    python: str,
    model_dir: Path,
    device: str,
    dtype: str,
    fp8_checkpoint: bool,
    colocated: bool = False,
) -> list[Launch]:
    """The command lines node ``role`` starts: its engines on placeholder weights (config-only
    ``model_dir``, ``--load-format dummy``, ``--enable-metrics``; the layout's port and first
    GPU), then the router in front of every engine of the job when the node runs it. ``sg`` is
    ``rollout.sglang``; the arguments after it are :func:`~...process.serving`'s (pure)."""
    sg = node_sglang(sg, role, colocated=colocated, device=device)
    out = [
        Launch(
            name=f"engine{e.index}",
            argv=tuple(
                server_command(
                    sg,
                    python=python,
                    model_path=model_dir,
                    port=e.port,
                    device=device,
                    dtype=dtype,
                    fp8_checkpoint=fp8_checkpoint,
                    weight_version="-1",  # placeholders until the trainer's first sync
                    placeholder_weights=True,
                    base_gpu_id=e.gpus[0],
                )
            ),
            url=e.url,
        )
        for e in role.engines
    ]
    if role.router_port is not None:
        argv = router_command(
            sg, python=python, port=role.router_port, worker_urls=list(role.worker_urls)
        )
        out.append(Launch(name="router", argv=tuple(argv), url=role.router_url or ""))
    return out


def listening(sg: SGLangConfig, role: NodeRole) -> SGLangConfig:
    """``rollout.sglang`` with the host the node's processes bind (:func:`listen_host`)."""
    return dataclasses.replace(sg, host=listen_host(sg.host, role.addr))


def node_sglang(sg: SGLangConfig, role: NodeRole, *, colocated: bool, device: str) -> SGLangConfig:
    """``rollout.sglang`` as the node's engines run it: :func:`listening`, and colocated on GPUs
    ``--enable-memory-saver`` (the trainer releases their memory while it trains), which also
    keeps ``expandable_segments`` out of their environment (``process.server_env``)."""
    sg = listening(sg, role)
    if colocated and device == "cuda":
        sg = dataclasses.replace(sg, extra_args=[*sg.extra_args, MEMORY_SAVER_FLAG])
    return sg


def node_dir(cfg: RunConfig, k: int) -> Path:
    """The role's directory (logs, pid files, the config-only model): ``<rollout.sglang.work_dir
    or train.output_dir/sglang>/node<K>``, next to the trainer's own ``sglang/``."""
    base = cfg.rollout.sglang.work_dir or Path(cfg.train.output_dir) / "sglang"
    return Path(base).expanduser().resolve() / f"node{k}"


# -- running it ------------------------------------------------------------------------------------


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived: stop everything and exit 0."""


def _on_stop(signum, _frame):
    # Once: a second signal must not interrupt the cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped(signal.Signals(signum).name)


def serve_node(
    cfg: RunConfig,
    role: NodeRole,
    *,
    colocated: bool = False,
    restart_count: int = 0,
    log_dir: Path | None = None,
) -> int:
    """Start node ``role``'s engines and router, wait for /health, then stay until a signal (exit
    0) or until one of them exits (exit 1). A start that fails is one line on stderr and exit 2;
    a config that cannot start raises ConfigError (the CLI prints it). ``restart_count``: the
    job's (its logs get a suffix after a requeue)."""
    k = role.node_index
    sg = cfg.rollout.sglang
    _check_local(role)
    try:
        python = resolve_python(sg)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    device, dtype, fp8_checkpoint = serving(sg, cfg.rollout.fp8)
    work = (log_dir or node_dir(cfg, k)).expanduser().resolve()
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    _write_model(cfg, model_dir, dtype=dtype, fp8_checkpoint=fp8_checkpoint)
    launches = role_commands(
        role,
        sg,
        python=python,
        model_dir=model_dir,
        device=device,
        dtype=dtype,
        fp8_checkpoint=fp8_checkpoint,
        colocated=colocated,
    )
    suffix = f"-restart{restart_count}" if restart_count else ""
    logs = {p.name: work / f"{p.name}{suffix}.log" for p in launches}
    env = server_env(
        node_sglang(sg, role, colocated=colocated, device=device),
        device,
        fp8_checkpoint=fp8_checkpoint,
    )
    procs: dict[str, subprocess.Popen] = {}
    old = {s: signal.signal(s, _on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in launches:  # all at once: a GPU engine takes minutes to start
            procs[p.name] = launch_logged(
                list(p.argv), python=python, env=env, log_path=logs[p.name]
            )
            (work / f"{p.name}.pid").write_text(f"{procs[p.name].pid}\n")
        failed = _wait_ready(launches, procs, logs, sg.startup_timeout_s)
        if failed:
            print(f"launch error: rollout node {k}: {failed}", file=sys.stderr, flush=True)
            return 2
        print(_ready_line(role, work), flush=True)

        def relaunch(p: Launch, n: int) -> None:
            logs[p.name] = work / f"{p.name}{suffix}-relaunch{n}.log"
            procs[p.name] = launch_logged(
                list(p.argv), python=python, env=env, log_path=logs[p.name]
            )
            (work / f"{p.name}.pid").write_text(f"{procs[p.name].pid}\n")

        return _watch(k, launches, procs, logs, relaunch=relaunch, max_restarts=sg.max_restarts)
    except _Stopped as why:
        print(f"rollout node {k}: {why}: stopping its engines", flush=True)
        return 0
    finally:
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        for proc in procs.values():  # every group at once, then wait for each to be gone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs.values():
            kill_group(proc)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _check_local(role: NodeRole) -> None:
    """An IP the layout gives this node must be one of this host's, or the engines could not
    bind it (a wrong --node-index or --node-addrs)."""
    try:
        ipaddress.ip_address(role.addr)
    except ValueError:
        return  # a name: bound as 0.0.0.0 (listen_host)
    family = socket.AF_INET6 if ":" in role.addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((role.addr, 0))
        except OSError:
            raise ConfigError(
                f"node {role.node_index} ({role.node}) has address {role.addr} in the layout, "
                f"which is not an address of this host ({socket.gethostname()}): check "
                "--node-index and --node-addrs"
            ) from None


def _write_model(cfg: RunConfig, model_dir: Path, *, dtype: str, fp8_checkpoint: bool) -> None:
    """``config.json`` of the run's model, with the tokenizer's ids, as the trainer writes it."""
    tok = load_prompt_encoder(cfg.tokenizer, hf_checkpoint=cfg.model.hf_checkpoint)
    config = hf_config_with_tokens(cfg.model, tok)
    fp8 = cfg.rollout.fp8 if fp8_checkpoint else None
    write_model_config(model_dir, config, serve_dtype=dtype, fp8=fp8)


def _wait_ready(launches, procs, logs, timeout_s: float) -> str | None:
    """Wait (one deadline for all) until every engine and the router answer /health; None, or
    the first failure in one line."""
    deadline = time.monotonic() + timeout_s
    for p in launches:
        port = int(p.url.rsplit(":", 1)[1])
        left = max(deadline - time.monotonic(), 0.5)
        try:
            wait_healthy(procs[p.name], Http(p.url), logs[p.name], port=port, timeout_s=left)
        except RolloutEngineError as e:
            if procs[p.name].poll() is None and "not healthy after" in str(e):
                return (
                    f"{p.name} ({p.url}) not healthy after rollout.sglang.startup_timeout_s="
                    f"{timeout_s:g}s; see {logs[p.name]}"
                )
            return first_line(e).replace("SGLang server", f"{p.name} ({p.url})")
    return None


def _ready_line(role: NodeRole, work: Path) -> str:
    engines = ", ".join(f"{e.index} {e.url}" for e in role.engines) or "none"
    router = f"; router {role.router_url}" if role.router_url else ""
    return f"rollout node {role.node_index}: engines {engines} ready{router} (logs: {work})"


def _watch(k: int, launches, procs, logs, *, relaunch, max_restarts: int) -> int:
    """Stay until a signal (raises _Stopped). An engine that exits is started again on
    placeholder weights (``relaunch(launch, n)``, at most ``max_restarts`` times each), and the
    trainer re-syncs it when it answers again; the router exiting, or an engine past its
    relaunches, ends the role (exit 1 with its log)."""
    restarts = {p.name: 0 for p in launches}
    while True:
        for p in launches:
            if procs[p.name].poll() is None:
                continue
            if p.name != "router" and restarts[p.name] < max_restarts:
                restarts[p.name] += 1
                kill_group(procs[p.name])  # whatever is left of its process group
                print(
                    f"rollout node {k}: {p.name} ({p.url}) exited; relaunching it (restart "
                    f"{restarts[p.name]} of rollout.sglang.max_restarts={max_restarts}; the "
                    f"end of {logs[p.name]}:\n{log_tail(logs[p.name], 5)})",
                    file=sys.stderr,
                    flush=True,
                )
                relaunch(p, restarts[p.name])
                continue
            print(
                f"rollout node {k}: {p.name} ({p.url}) exited; stopping this node's "
                f"processes. The end of {logs[p.name]}:\n{log_tail(logs[p.name])}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        time.sleep(1.0)
