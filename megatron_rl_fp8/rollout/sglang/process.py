"""The SGLang server as a process: command line, environment, guard, ports, process groups.

The server runs under a tiny guard process (``_GUARD``, stdlib only) in a process group of its
own, so it can never outlive the trainer (see the guard's comment below).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl_fp8.parallel import free_port
from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.sync.ipc import ALLOC_CONF_VARS

REPO_ROOT = Path(__file__).resolve().parents[3]


# The guard: the process the engine actually starts (with the server's python, stdlib only). It
# leads the server's process group, runs `sglang.launch_server` as its child and kills the whole
# group (itself included) when (a) the trainer dies, however it dies, or (b) the server's main
# process exits. SGLang's own children arm their parent-death signal only after their imports
# (~20 s on CPU), so (b) is what keeps a crash during startup from leaking them. Parent death is
# seen twice over: PR_SET_PDEATHSIG (Linux; instant) and a once-a-second getppid() check
# (everywhere). PDEATHSIG also fires when only the trainer *thread* that launched the guard exits,
# so the handler re-checks getppid() before acting. Linux also gets PDEATHSIG=SIGKILL on the
# server's main process itself, set in a preexec_fn here (safe: the guard has one thread), not in
# the multi-threaded trainer.
_GUARD = r"""# mrf8-sglang-guard: see _GUARD in megatron_rl_fp8/rollout/sglang/process.py
import ctypes, os, signal, subprocess, sys, time
trainer, cmd = int(sys.argv[1]), sys.argv[2:]

def kill_group(*_):
    os.killpg(0, signal.SIGKILL)

def on_parent_signal(*_):
    if os.getppid() != trainer:
        kill_group()

def arm(sig):
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(sig))  # PR_SET_PDEATHSIG

signal.signal(signal.SIGUSR1, on_parent_signal)
signal.signal(signal.SIGTERM, kill_group)
arm(signal.SIGUSR1)
if os.getppid() != trainer:  # the trainer died before prctl
    kill_group()
server = subprocess.Popen(cmd, preexec_fn=lambda: arm(signal.SIGKILL))
while server.poll() is None:
    time.sleep(1)
    if os.getppid() != trainer:
        kill_group()
print(f"[mrf8 guard] server exited with code {server.returncode}; killing its process group",
      flush=True)
kill_group()
"""


def spawn_guarded(
    cmd: list[str],
    *,
    python: str,
    stdout,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` under the guard (``_GUARD``, run by ``python``) in a new session and process
    group, whose id is the returned process's pid. The group dies with this process, and when
    ``cmd``'s own process exits."""
    return subprocess.Popen(
        [python, "-c", _GUARD, str(os.getpid()), *cmd],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


def server_group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``. Linux reads /proc; elsewhere the
    answer is ``[pgid]`` while any member can still be signalled, else ``[]``."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state not in "ZX":
            pids.append(int(entry.name))
    return pids


def kill_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILL ``proc``'s process group, reap ``proc``, and wait (bounded) for the rest to go.

    SIGKILL, not a graceful SIGTERM: the server holds nothing worth saving (the trainer has its
    weights) and SGLang answers SIGTERM on its children with a crash report that sleeps 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass  # reaped later; the group's remaining members are waited for below
    deadline = time.monotonic() + timeout
    while server_group_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def pick_port(low: int = 15000, high: int = 22000) -> int:
    """A free TCP port for a server that binds it only later (uvicorn binds ~20-40 s after launch).

    Not from the kernel's ephemeral range (32768+, where ``bind(0)`` ports come from): every
    outgoing connection takes its local port there, and one of them took a server's port during
    its startup in testing (the server then hung instead of exiting). Not SGLang's own range
    either (22000-29999, where it picks its NCCL port). Random with a private generator: the
    trainer seeds the global one, and two runs on one host must not pick alike."""
    for port in random.Random().sample(range(low, high), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def resolve_python(cfg: SGLangConfig) -> str:
    """The interpreter that runs the server (``cfg.python``; relative to the repository root)."""
    if not cfg.python:
        return sys.executable
    path = Path(cfg.python).expanduser()
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.exists():
        raise FileNotFoundError(
            f"rollout.sglang.python={cfg.python!r}: {path} does not exist. Install SGLang's CPU "
            "engine with `scripts/install_sglang_cpu.sh` (creates .venv-sglang), or point "
            "rollout.sglang.python at a python that has sglang (empty = this interpreter)"
        )
    return str(path)


def resolve_device(cfg: SGLangConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def server_command(
    cfg: SGLangConfig,
    *,
    python: str,
    model_path: Path,
    port: int,
    device: str,
    dtype: str,
    fp8_checkpoint: bool,
    weight_version: str,
    placeholder_weights: bool = False,
    base_gpu_id: int | None = None,
) -> list[str]:
    """The ``sglang.launch_server`` command line (pure function: unit-tested).

    ``placeholder_weights``: ``model_path`` holds only ``config.json`` and the server starts on
    SGLang's dummy weights (``--load-format dummy``), to be replaced by the first sync; its
    request counters are exported (``--enable-metrics``) so a fleet can report who served."""
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--tp-size",
        str(cfg.tp_size),
        "--dtype",
        dtype,
        "--skip-tokenizer-init",
        "--weight-version",
        weight_version,
        "--random-seed",
        str(cfg.random_seed),
    ]
    if device == "cpu":
        # The CPU engine (PLATFORM_NOTES): torch-native attention, KV pool sized from host memory.
        cmd += ["--device", "cpu", "--attention-backend", "torch_native"]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    elif device == "cpu":
        cmd += ["--mem-fraction-static", "0.05"]
    if cfg.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if fp8_checkpoint:
        cmd += ["--quantization", "fp8"]
    if placeholder_weights:
        cmd += ["--load-format", "dummy", "--enable-metrics"]
    if base_gpu_id is not None and device == "cuda":
        cmd += ["--base-gpu-id", str(base_gpu_id)]
    return cmd + list(cfg.extra_args)


def router_command(
    cfg: SGLangConfig,
    *,
    python: str,
    port: int,
    worker_urls: list[str],
    metrics_port: int | None = None,
) -> list[str]:
    """The ``sglang_router.launch_router`` command line in front of ``worker_urls``.
    ``metrics_port``: its Prometheus exporter's port (the router's default, 29000, is taken by
    any other router on the host, and the router then panics at start)."""
    metrics = ["--prometheus-port", str(metrics_port)] if metrics_port else []
    return [
        python,
        "-m",
        "sglang_router.launch_router",
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--policy",
        cfg.router_policy,
        *metrics,
        "--worker-urls",
        *worker_urls,
    ]


MEMORY_SAVER_FLAG = "--enable-memory-saver"
# Each answer's routed experts (a MoE's, for rollout.routing_replay): SGLang's capturer pins its
# host buffer with cudaHostRegister, so only GPU servers take it (state_capturer/base.py).
ROUTES_FLAG = "--enable-return-routed-experts"
# SGLang 0.5.23 refuses to start a TP > 1 engine when one of its GPUs has < 90% of the free
# memory another has (distributed/bootstrap.py: _check_tp_memory_balance) unless this is false;
# colocated trainer ranks make that likely. Peers (slime, verl) switch it off for colocated runs.
TP_BALANCE_CHECK = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
# SGLang 0.5.23 on Blackwell (sm100+) with DeepGEMM (its default there) requantizes block-FP8
# weights to UE8M0 scales at load and packs the scales into another layout, once
# (layers/quantization/fp8_utils.py: requant_block_scale_ue8m0_for_deepgemm returns early when
# format_ue8m0 is set): a synced checkpoint-format scale no longer fits (docs/gpu_contracts.md
# SG-12). With DeepGEMM off, the dense layers take FlashInfer's groupwise GEMM and MoE Triton,
# both of which read the live weights and scales.
DEEPGEMM = "SGLANG_ENABLE_JIT_DEEPGEMM"


def fp8_engine_env(capabilities: list[tuple[int, int]]) -> dict[str, str]:
    """The environment an engine loading FP8 checkpoints needs on GPUs of these compute
    capabilities: DeepGEMM off where any is Blackwell or newer (major >= 10)."""
    return {DEEPGEMM: "0"} if any(major >= 10 for major, _ in capabilities) else {}


def _visible_capabilities() -> list[tuple[int, int]]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def without_expandable_segments(conf: str) -> str:
    """A ``PYTORCH_CUDA_ALLOC_CONF`` value (``key:value`` options joined by ``,``) without its
    ``expandable_segments`` option."""
    kept = [o for o in conf.split(",") if o.split(":", 1)[0].strip() != "expandable_segments"]
    return ",".join(o for o in kept if o.strip())


def server_env(cfg: SGLangConfig, device: str, *, fp8_checkpoint: bool = False) -> dict[str, str]:
    """The server's environment: ours, minus the trainer's torch.distributed variables (the
    server builds its own process groups), plus the CPU engine switch and ``cfg.env``.

    An engine with ``--enable-memory-saver`` in ``cfg.extra_args`` (colocated) gets no
    ``expandable_segments`` allocator option: torch_memory_saver (0.0.10,
    ``entrypoint.py: _sanity_checks``) raises at the engine's start when
    ``PYTORCH_CUDA_ALLOC_CONF`` holds ``expandable_segments:True``, which the trainer's
    environment may well set (it reduces the trainer's fragmentation). It also starts with
    SGLang's TP memory-balance check off (``TP_BALANCE_CHECK``) unless ``cfg.env`` sets it: the
    trainer's ranks on the same GPUs hold unequal memory. An engine loading FP8 checkpoints
    gets :func:`fp8_engine_env` for the GPUs this process sees (the node's), under ``cfg.env``."""
    env = dict(os.environ)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        env.pop(key, None)
    if MEMORY_SAVER_FLAG in cfg.extra_args:
        env[TP_BALANCE_CHECK] = "false"
    if fp8_checkpoint and device == "cuda":
        env.update(fp8_engine_env(_visible_capabilities()))
    env.update(cfg.env)
    if MEMORY_SAVER_FLAG in cfg.extra_args:
        for var in ALLOC_CONF_VARS:
            if var in env:
                conf = without_expandable_segments(env[var])
                if conf:
                    env[var] = conf
                else:
                    del env[var]
    return env


def log_tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a server log (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def launch_guarded_server(
    cfg: SGLangConfig,
    *,
    python: str,
    device: str,
    dtype: str,
    fp8_checkpoint: bool,
    model_path: Path,
    version: str,
    work_dir: Path,
    log_path: Path,
    pid_file: str = "server.pid",
    port: int | None = None,
    **command,
) -> tuple[subprocess.Popen, int]:
    """Start one server on ``model_path`` under the guard; returns (guard process, port).
    ``command``: further :func:`server_command` arguments.

    The command line heads the log. ``<work_dir>/<pid_file>`` names the live process group, for
    operators and tests: ``kill -9 -- -$(cat engine0.pid)`` stops all of it."""
    port = port or cfg.port or pick_port()
    cmd = server_command(
        cfg,
        python=python,
        model_path=model_path,
        port=port,
        device=device,
        dtype=dtype,
        fp8_checkpoint=fp8_checkpoint,
        weight_version=version,
        **command,
    )
    env = server_env(cfg, device, fp8_checkpoint=fp8_checkpoint)
    proc = launch_logged(cmd, python=python, env=env, log_path=log_path)
    (work_dir / pid_file).write_text(f"{proc.pid}\n")
    return proc, port


def launch_logged(cmd: list[str], *, python: str, env: dict, log_path: Path) -> subprocess.Popen:
    """``cmd`` under the guard, its output in ``log_path`` after the command line."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return spawn_guarded(cmd, python=python, stdout=log, env=env, cwd=log_path.parent)


def wait_healthy(
    proc: subprocess.Popen, http, log_path: Path, *, port: int, timeout_s: float
) -> None:
    """Poll ``/health`` until the server answers; a server that exits, cannot bind its port or
    stays silent past ``timeout_s`` (``rollout.sglang.startup_timeout_s``) is a failed launch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerGone(f"SGLang server exited during startup; see {log_path}")
        if "error while attempting to bind" in log_tail(log_path, 50):
            # uvicorn could not bind the port; SGLang 0.5.23 then hangs instead of exiting.
            raise ServerGone(f"SGLang server could not bind port {port}; see {log_path}")
        try:
            http.call("/health", timeout=5)
            return
        except RolloutEngineError:
            time.sleep(0.5)
    raise ServerGone(
        f"SGLang server not healthy after rollout.sglang.startup_timeout_s={timeout_s}s; "
        f"see {log_path}"
    )


def serving(cfg: SGLangConfig, fp8) -> tuple[str, str, bool]:
    """(device, serving dtype, whether engines load FP8 checkpoints) of SGLang engines: FP8 GEMMs
    only on GPU; on CPU the FP8-rounded weights are served in the serving dtype."""
    device = resolve_device(cfg)
    return device, serve_dtype(cfg, device), fp8.enabled and device == "cuda"


def serve_dtype(cfg: SGLangConfig, device: str) -> str:
    """``rollout.sglang.dtype``; ``auto`` = float32 on the CPU engine, bfloat16 on GPUs."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if device == "cpu" else "bfloat16"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_export_options(cfg: SGLangConfig, *, fp8_checkpoint: bool, dtype: str) -> dict:
    """The ``export_for_rollout`` options of SGLang engines: buckets of ``rollout.sglang.bucket_mb``;
    without FP8 GEMMs (CPU) the FP8-rounded weights are sent in the serving ``dtype``."""
    return {"bucket_mb": cfg.bucket_mb, "dequantize_to": None if fp8_checkpoint else _DTYPES[dtype]}


def resolve_work_dir(
    cfg: SGLangConfig, output_dir
) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The engines' directory (logs, pid files, the config-only model): ``cfg.work_dir``, else
    ``<output_dir>/sglang``, else a temporary directory (returned too, to be cleaned up)."""
    work = cfg.work_dir or (Path(output_dir) / "sglang" if output_dir else None)
    tmp = None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="mrf8-sglang-")
        work = tmp.name
    return Path(work).expanduser().resolve(), tmp
