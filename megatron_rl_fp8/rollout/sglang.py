"""SGLang rollout engine: launches and owns ``sglang.launch_server`` processes, samples through
their HTTP API, and pushes every weight sync into them.

How it fits the trainer: :class:`SGLangEngine` implements the same ``RolloutEngine`` protocol as the
in-process ``LocalEngine``; the trainer's ``sync_weights`` streams the buckets of
``sync.buckets.export_for_rollout`` (HF names; FP8 codes + ``_scale_inv`` when ``rollout.fp8`` is
on, or their values in the serving dtype where the server has no FP8 GEMMs: ``export_options``)
into :meth:`SGLangEngine.update_weights`, and its rollout calls :meth:`SGLangEngine.generate`.

Life of the server:

* It starts lazily, at the first ``update_weights``: a server needs a checkpoint to start from, and
  the first synced weights are that checkpoint. Every sync writes the weights it received to
  ``<work_dir>/weights/v<version>/`` (safetensors shards, one per bucket, + ``config.json``) while it
  streams them to the server; only the last complete version is kept. That copy is what a restarted
  server loads, so a crash never needs the trainer to re-send anything.
* Three transports (``rollout.sglang.transport``), all between ``/begin_weight_update`` and
  ``/end_weight_update`` (SGLang 0.5.23 refuses tensor/distributed updates outside that session):
  ``tensor`` (colocated: tensors go through shared memory, only handles travel over HTTP),
  ``distributed`` (disaggregated: a private gloo/NCCL group between this process and the server's
  TP ranks, separate from the trainer's default group; the server joins with
  ``/init_weights_update_group``), ``disk`` (``/update_weights_from_disk`` on the shards above).
* Versions: before the first bucket the server's weight version is set to ``"<v>-partial"``, after
  the last to ``"<v>"`` (then the KV/radix cache is flushed and ``/model_info`` is read back).
  Every ``/generate`` answer carries the version(s) that produced it; a completion whose version is
  not the engine's current one is an error, so a half-applied sync can never be served unnoticed.
* Failures: wherever the engine meets a dead, hung or confused server -- ``generate``, the begin of
  a sync (``/update_weight_version``, ``/begin_weight_update``), the push of a bucket, the end of a
  sync (``/end_weight_update``, ``/update_weight_version``, ``/flush_cache``), the disk update, the
  version check (``/model_info``) -- it kills what is left of the server and launches a fresh one
  from the last complete disk copy, checks the version it reports, and goes on (a rollout is
  retried; a sync is finished, since that copy *is* the new version). A sync always consumes its
  whole stream first: the trainer's gather is a collective. Relaunches, including ones that die
  during startup, are bounded by ``max_restarts`` per call; then :class:`SGLangServerError` names
  the setting and the server log. ``weight_version()`` is -1 whenever no server verifiably serves
  the synced weights (during a sync, after a failure).
* Process lifetime: the server runs under a tiny guard process (``_GUARD``) in a process group of
  its own. The guard kills that whole group when the trainer dies (Linux parent-death signal, and
  a once-a-second parent check everywhere), and when the server's main process exits. SGLang's
  scheduler/detokenizer arm their own parent-death signal only after ~20 s of imports, so without
  the guard a trainer killed during startup would leak them. ``kill -9 -- -$(cat
  <work_dir>/server.pid)`` stops everything.
* Fault injection (testing only): ``MRF8_SGLANG_FAULT=<point>[@<n>][,...]`` or the engine's
  ``fault_hook`` attribute SIGKILLs the server at named points (:data:`FAULT_POINTS`), so tests
  exercise every recovery path deterministically. Unset, it costs one attribute check per point.

Numerics: SGLang's returned logprob of a sampled token is log softmax(logits / T) at the sampling
temperature T (log of the probabilities it sampled from; with top_p < 1 these are the
*unfiltered* probabilities, as in ``LocalEngine``), and log softmax(logits) for greedy requests.
That is exactly what the trainer recomputes. On CPU, SGLang has no FP8 GEMM kernels
(``--quantization fp8`` needs the CUDA/CPU ``sgl_kernel`` build), so the FP8 weights are sent
dequantized: the rollout still runs on FP8-rounded weights, with activations in full precision.
On GPU the server starts from an FP8 block-quantized checkpoint (``quantization_config`` in
``config.json``) with ``--quantization fp8`` and receives codes + scales.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_rl_fp8.rollout.base import Completion, RolloutConfig, SGLangConfig
from megatron_rl_fp8.sync.buckets import Bucket
from megatron_rl_fp8.sync.quantize import SCALE_SUFFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

FAULT_ENV = "MRF8_SGLANG_FAULT"
# Where the engine calls its fault hook, in the order a run meets them. ``startup``: right after a
# (re)launch, before the server is healthy; the rest: just before the server call(s) they name.
FAULT_POINTS = (
    "startup",
    "generate",
    "begin_update",
    "push",
    "end_update",
    "disk_update",
    "check_version",
)


class SGLangServerError(RuntimeError):
    """The SGLang server failed, or answered something the engine cannot accept."""


class _ServerGone(SGLangServerError):
    """The server died, hung or answered for the wrong weights: restart it and retry."""


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
_GUARD = r"""# mrf8-sglang-guard: see _GUARD in megatron_rl_fp8/rollout/sglang.py
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


def parse_fault_spec(spec: str) -> dict[str, set[int]]:
    """``"push@2,generate"`` -> ``{"push": {2}, "generate": {1}}`` (point -> 1-based occurrences)."""
    plan: dict[str, set[int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, nth = item.partition("@")
        if point not in FAULT_POINTS or not (nth == "" or nth.isdigit() and int(nth) >= 1):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {item!r} is not <point>[@<n>] with n >= 1 and "
                f"point one of {', '.join(FAULT_POINTS)}"
            )
        plan.setdefault(point, set()).add(int(nth or 1))
    return plan


class KillServerAt:
    """TESTING ONLY: a ``fault_hook`` that SIGKILLs the engine's server at chosen points.

    ``KillServerAt(engine, "begin_update")`` kills at the first ``begin_update`` the engine meets
    after this object is installed, ``"push@3"`` at the third push, ``"generate,startup@1"`` at the
    first rollout and then during the first relaunch. Occurrences count per point, from
    installation. The kill takes the whole process group and waits until it is gone, so the very
    next server call fails the way a crash makes it fail. Production runs never install one; the
    engine installs one only when ``MRF8_SGLANG_FAULT`` is set (read once, at construction).
    """

    def __init__(self, engine: SGLangEngine, spec: str):
        self.engine = engine
        self.plan = parse_fault_spec(spec)
        self.seen: dict[str, int] = {}
        self.fired: list[str] = []  # "point@n" of every kill, for tests to assert on

    def __call__(self, point: str) -> None:
        n = self.seen[point] = self.seen.get(point, 0) + 1
        if n in self.plan.get(point, ()):
            self.fired.append(f"{point}@{n}")
            self.engine.kill_server()


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


def _kill_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILL ``proc``'s process group, reap ``proc``, and wait (bounded) for the rest to go.

    SIGKILL, not a graceful SIGTERM: the server holds nothing worth saving (its weights are on disk)
    and SGLang answers SIGTERM on its children with a crash report that sleeps 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
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
    import random
    import socket

    for port in random.Random().sample(range(low, high), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    from megatron_rl_fp8.parallel import free_port

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
            "engine with `tools/install_sglang_cpu.sh` (creates .venv-sglang), or point "
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
) -> list[str]:
    """The ``sglang.launch_server`` command line (pure function: unit-tested)."""
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
    return cmd + list(cfg.extra_args)


def sampling_params(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    eos_token_id: int,
    seed: int | None,
) -> dict:
    """One request's ``sampling_params`` (greedy = temperature 0, SGLang's argmax path)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": [eos_token_id],
        "temperature": 0.0 if greedy else temperature,
        "top_p": 1.0 if greedy else top_p,
        "top_k": -1,
    }
    if seed is not None and not greedy:
        params["sampling_seed"] = seed
    return params


def parse_completion(
    prompt: list[int], answer: dict, *, eos_token_id: int, expected_version: str
) -> Completion:
    """A ``/generate`` answer -> Completion, after checking it came from ``expected_version``."""
    meta = answer.get("meta_info", {})
    versions = {meta.get("weight_version")} | {
        s.get("version") for s in meta.get("weight_versions") or []
    }
    versions.discard(None)
    if versions != {expected_version}:
        raise _ServerGone(
            f"completion produced by weight version(s) {sorted(versions)}, "
            f"expected {expected_version!r}"
        )
    ids = [int(t) for t in answer["output_ids"]]
    lp = meta.get("output_token_logprobs") or []
    if len(lp) != len(ids) or any(int(e[1]) != t for e, t in zip(lp, ids)):
        raise SGLangServerError(
            "SGLang returned logprobs that do not line up with the output ids "
            f"({len(lp)} logprobs for {len(ids)} tokens)"
        )
    finished = bool(ids) and ids[-1] == eos_token_id
    return Completion(
        prompt_ids=list(prompt),
        response_ids=ids,
        response_logprobs=[float(e[0]) for e in lp],
        finished=finished,
    )


class _Http:
    """The few JSON calls the engine makes (stdlib only: the trainer's venv needs no extra)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(
        self, path: str, payload: dict | None = None, *, timeout: float, method: str | None = None
    ) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method or ("GET" if data is None else "POST"),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code >= 500:
                raise _ServerGone(f"{path}: HTTP {e.code}: {detail}") from e
            raise SGLangServerError(f"{path}: HTTP {e.code}: {detail}") from e
        except TimeoutError as e:  # a hung server: it is relaunched like a dead one
            raise _ServerGone(f"{path}: no answer within {timeout:g} s") from e
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            raise _ServerGone(f"{path}: {e}") from e
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def ok(self, path: str, payload: dict | None = None, *, timeout: float) -> dict:
        """POST expecting SGLang's ``{"success": true, ...}``."""
        out = self.call(path, payload if payload is not None else {}, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangServerError(f"{path} failed: {out.get('message')}")
        return out


class SGLangEngine:
    """RolloutEngine backed by an SGLang server process that this object starts and owns."""

    def __init__(
        self,
        cfg: RolloutConfig,
        hf_config,
        *,
        pad_token_id: int,
        eos_token_id: int,
        output_dir: str | os.PathLike | None = None,
    ):
        self.cfg = cfg.sglang
        self.fp8 = cfg.fp8
        self.hf_config = hf_config
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.python = resolve_python(self.cfg)
        self.device = resolve_device(self.cfg)
        self.serve_dtype = (
            self.cfg.dtype
            if self.cfg.dtype != "auto"
            else ("float32" if self.device == "cpu" else "bfloat16")
        )
        # FP8 GEMMs only on GPU; on CPU the FP8-rounded weights are sent in serve_dtype.
        self.fp8_checkpoint = self.fp8.enabled and self.device == "cuda"
        if self.cfg.transport == "tensor":
            # Shared-memory tensors to another process: file-descriptor passing fails between
            # unrelated processes (the server crashes on an authentication error), file names work.
            torch.multiprocessing.set_sharing_strategy("file_system")
        work = self.cfg.work_dir or (Path(output_dir) / "sglang" if output_dir else None)
        if work is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mrf8-sglang-")
            work = self._tmp.name
        self.work_dir = Path(work).expanduser().resolve()
        self.weights_root = self.work_dir / "weights"
        self.weights_root.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None  # the guard, leader of the server's group
        self._port: int | None = None
        self._http: _Http | None = None
        self._group = None  # (process group, name) of the distributed transport
        self._launches = 0
        self._weights_dir: Path | None = None  # last complete synced weights (restart source)
        self._synced = -1  # the version in _weights_dir
        self._version = -1  # the version the running server was verified to serve; -1 = none
        self._restarts_left = self.cfg.max_restarts  # reset at every generate / update_weights
        self.stats: dict[str, float] = {"restarts": 0, "update_seconds": 0.0, "buckets": 0}
        self.bucket_times: list[tuple[int, float]] = []  # (bytes, seconds) per pushed bucket
        # TESTING ONLY: called with a FAULT_POINTS name at each of those points (see KillServerAt).
        # None in real runs, which then pay one attribute check per point.
        self.fault_hook: Callable[[str], None] | None = None
        spec = os.environ.get(FAULT_ENV, "")
        if spec:
            self.fault_hook = KillServerAt(self, spec)
            print(
                f"[sglang] {FAULT_ENV}={spec!r}: the server will be SIGKILLed at these points "
                "(fault injection, for tests only)",
                file=sys.stderr,
                flush=True,
            )

    # -- process ---------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.work_dir / f"server-{self._launches}.log"

    @property
    def url(self) -> str:
        if self._port is None:
            raise SGLangServerError("the SGLang server is not running (no weights synced yet)")
        return f"http://{self.cfg.host}:{self._port}"

    def _launch(self, model_path: Path, version: str) -> None:
        self._launches += 1
        port = self.cfg.port or pick_port()
        cmd = server_command(
            self.cfg,
            python=self.python,
            model_path=model_path,
            port=port,
            device=self.device,
            dtype=self.serve_dtype,
            fp8_checkpoint=self.fp8_checkpoint,
            weight_version=version,
        )
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        for key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
        ):
            env.pop(key, None)  # the server builds its own process groups
        env.update(self.cfg.env)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        self._proc = spawn_guarded(cmd, python=self.python, stdout=log, env=env, cwd=self.work_dir)
        log.close()
        # Operators (and tests) find the live server here: `kill -9 -- -<pgid>` stops all of it.
        (self.work_dir / "server.pid").write_text(f"{self._proc.pid}\n")
        self._port = port
        self._http = _Http(self.url)
        self._group = None
        self._fault("startup")
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise _ServerGone(f"SGLang server exited during startup; see {self.log_path}")
            if "error while attempting to bind" in self._log_tail(50):
                # uvicorn could not bind the port; SGLang 0.5.23 then hangs instead of exiting.
                raise _ServerGone(
                    f"SGLang server could not bind port {self._port}; see {self.log_path}"
                )
            try:
                self._http.call("/health", timeout=5)
                return
            except SGLangServerError:
                time.sleep(0.5)
        raise _ServerGone(
            f"SGLang server not healthy after rollout.sglang.startup_timeout_s="
            f"{self.cfg.startup_timeout_s}s; see {self.log_path}"
        )

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _kill(self) -> None:
        """Stop the server (its whole process group) and forget it; it serves nothing after."""
        proc, self._proc = self._proc, None
        self._port, self._http, self._version = None, None, -1
        if proc is not None:
            _kill_group(proc)
        self._destroy_group()  # after the kill: nothing can be waiting on the dead peer

    def kill_server(self) -> None:
        """SIGKILL the server's whole process group and wait until it is gone, without telling
        the engine, as a crash would: the next server call fails and recovers. For fault
        injection (KillServerAt) and tests."""
        if self._proc is not None:
            _kill_group(self._proc)

    def server_pid(self) -> int | None:
        """The running server's process-group id (the guard's pid; also ``<work_dir>/server.pid``)."""
        return self._proc.pid if self._proc is not None else None

    def restart(self) -> None:
        """Kill the server and start a fresh one serving the last complete synced weights."""
        if self._weights_dir is None:
            raise SGLangServerError("cannot restart the SGLang server: no weights were synced yet")
        self._restarts_left = self.cfg.max_restarts
        self._relaunch(None, "restart()")

    def _relaunch(self, cause: Exception | None, during: str) -> None:
        """Replace the server by a fresh one on the last complete disk copy, verified to report
        that copy's version.

        Every launch but the engine's very first counts against this call's ``max_restarts``,
        including relaunches that die or hang during startup or report another version: those
        are retried within the bound, then the call fails with one clear error."""
        error = cause
        while True:
            if self._launches:
                if self._restarts_left <= 0:
                    self._give_up(during, error)
                self._restarts_left -= 1
                self.stats["restarts"] += 1
                used = self.cfg.max_restarts - self._restarts_left
                print(
                    f"[sglang] {during}: {_first_line(error)}; relaunching the server on weight "
                    f"version {self._synced} (restart {used} of rollout.sglang.max_restarts="
                    f"{self.cfg.max_restarts}; previous log {self.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            self._kill()
            try:
                self._launch(self._weights_dir, str(self._synced))
                self._check_version(str(self._synced))
            except SGLangServerError as e:
                error = e
                continue
            self._version = self._synced
            return

    def _give_up(self, during: str, error: Exception | None) -> None:
        self._kill()  # nothing half-alive stays behind; the next call starts from the disk copy
        n = self.cfg.max_restarts
        raise SGLangServerError(
            f"SGLang server failed during {during} and {n} restart(s) did not bring it back "
            f"(rollout.sglang.max_restarts={n}); last error: {_first_line(error)}; server log: "
            f"{self.log_path}\n{self._log_tail()}"
        ) from error

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:  # testing only; see KillServerAt
            self.fault_hook(point)

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    @property
    def export_options(self) -> dict:
        """Buckets of ``rollout.sglang.bucket_mb``; without FP8 GEMMs (CPU) the FP8-rounded
        weights are sent in the serving dtype."""
        return {
            "bucket_mb": self.cfg.bucket_mb,
            "dequantize_to": None if self.fp8_checkpoint else _DTYPES[self.serve_dtype],
        }

    def update_weights(self, buckets: Iterable[Bucket], *, version: int) -> None:
        t0 = time.perf_counter()
        self._restarts_left = self.cfg.max_restarts
        final = self.weights_root / f"v{version}"
        partial = self.weights_root / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if self.fp8_checkpoint and self.fp8.weight_quant == "per_tensor":
            buckets = (Bucket(b.index, list(_per_tensor_scale_names(b.tensors))) for b in buckets)
        # Update in place only a server verified to serve the last synced version; otherwise
        # (first sync, a server lost since, an earlier sync that failed) launch one from the copy.
        serving = self._alive() and self._synced >= 0 and self._version == self._synced
        push = serving and self.cfg.transport != "disk"
        self._version = -1  # no version is vouched for until the check below
        failure: SGLangServerError | None = None  # the first server call of this sync that failed
        try:
            if push:
                failure = self._attempt(self._begin_update, version)
            names: list[tuple[str, str]] = []
            for bucket in buckets:
                shard = f"model-{bucket.index:05d}.safetensors"
                _save_shard(bucket, partial / shard)
                names += [(n, shard) for n in bucket.names]
                # After a failure the stream is still consumed to its end: the trainer's gather is
                # a collective, and the disk copy the server restarts from must be complete.
                if push and failure is None:
                    failure = self._attempt(self._push_bucket, bucket)
            if push and failure is None:
                failure = self._attempt(self._end_update, version)
        except BaseException:
            # The stream itself failed: no new version. The server may hold part of it, but
            # weight_version() is -1, so the next call relaunches it from the last complete copy.
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self._write_checkpoint_files(partial, dict(names))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        previous, self._weights_dir, self._synced = self._weights_dir, final, version
        if serving and failure is None:
            if self.cfg.transport == "disk":
                failure = self._attempt(self._update_from_disk, final, version)
            if failure is None:
                failure = self._attempt(self._check_version, str(version))
        if serving and failure is None:
            self._version = version
        else:
            # A fresh server on the complete new copy is the only state accepted after a failure.
            if failure is None and self._launches:
                failure = _ServerGone(
                    "no server was serving the last synced weights when the sync began"
                )
            self._relaunch(failure, f"the weight update to version {version}")
        if previous is not None and previous != final:
            shutil.rmtree(previous, ignore_errors=True)
        self.stats["update_seconds"] = time.perf_counter() - t0

    def _attempt(self, call: Callable[..., Any], *args) -> SGLangServerError | None:
        """One server call of a sync; its failure is returned, not raised, so the sync goes on and
        ends with a relaunch. Any SGLangServerError counts, not only a dead server: after a
        refused update call the server's weights are unknown, and a fresh server on the complete
        copy is right whatever happened (each one is reported on stderr)."""
        try:
            call(*args)
            return None
        except SGLangServerError as e:
            return e

    def _write_checkpoint_files(self, path: Path, weight_map: dict[str, str]) -> None:
        config = self.hf_config.to_dict()
        config["torch_dtype"] = config["dtype"] = self.serve_dtype
        if self.fp8_checkpoint:
            qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
            if self.fp8.weight_quant == "blockwise":
                qc["weight_block_size"] = list(self.fp8.weight_block)
            config["quantization_config"] = qc
        (path / "config.json").write_text(json.dumps(config, indent=1, default=str))
        index = {"metadata": {}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))

    def _begin_update(self, version: int) -> None:
        self._fault("begin_update")
        http, t = self._http, self.cfg.request_timeout_s
        http.ok(
            "/update_weight_version",
            {"new_version": f"{version}-partial", "abort_all_requests": True},
            timeout=t,
        )
        http.ok("/begin_weight_update", {}, timeout=t)

    def _end_update(self, version: int) -> None:
        self._fault("end_update")
        http, t = self._http, self.cfg.request_timeout_s
        http.ok("/end_weight_update", {}, timeout=t)
        http.ok(
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": True},
            timeout=t,
        )
        out = http.call("/flush_cache", {}, timeout=t)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangServerError(f"/flush_cache failed after the weight update: {out}")

    def _update_from_disk(self, path: Path, version: int) -> None:
        self._fault("disk_update")
        self._http.ok(
            "/update_weights_from_disk",
            {
                "model_path": str(path),
                "weight_version": str(version),
                "abort_all_requests": True,
                "flush_cache": True,
            },
            timeout=self.cfg.request_timeout_s,
        )

    def _check_version(self, expected: str) -> None:
        self._fault("check_version")
        info = self._http.call("/model_info", timeout=self.cfg.request_timeout_s)
        got = info.get("weight_version") if isinstance(info, dict) else None
        if got != expected:
            raise _ServerGone(
                f"SGLang server reports weight version {got!r}, expected {expected!r}"
            )

    def _push_bucket(self, bucket: Bucket) -> None:
        self._fault("push")
        if self.cfg.transport == "tensor":
            self._push_tensor(bucket)
        else:
            self._push_distributed(bucket)
        self.stats["buckets"] += 1

    def _push_tensor(self, bucket: Bucket) -> None:
        import base64
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

        # One flat shared-memory buffer per dtype per bucket (one file, not one per tensor), and
        # never the trainer's own storages (sharing would move them into shared memory).
        flat = _flatten(bucket.tensors)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(flat)
        payload = base64.b64encode(buf.getvalue()).decode()
        self._http.ok(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload] * self.cfg.tp_size, "flush_cache": False},
            timeout=self.cfg.request_timeout_s,
        )
        del flat  # the server has copied the values when the call returns

    def _push_distributed(self, bucket: Bucket) -> None:
        group = self._ensure_group()
        tensors = [t.contiguous() for _, t in bucket.tensors]
        if self.device == "cuda":
            tensors = [t.cuda() for t in tensors]
        payload = {
            "names": bucket.names,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group[1],
            "flush_cache": False,
        }
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(
                self._http.ok,
                "/update_weights_from_distributed",
                payload,
                timeout=self.cfg.request_timeout_s,
            )
            try:
                for t in tensors:  # the server posts its receives in this order
                    opts = torch.distributed.BroadcastOptions()
                    opts.rootRank = 0
                    group[0].broadcast([t], opts).wait()
            except RuntimeError as e:
                reply.cancel()
                raise _ServerGone(f"broadcast to the SGLang server failed: {e}") from e
            reply.result()

    def _ensure_group(self):
        if self._group is not None:
            return self._group
        name = f"mrf8_weight_sync_{os.getpid()}_{self._launches}"
        port = pick_port()
        world = 1 + self.cfg.tp_size
        backend = "nccl" if self.device == "cuda" else "gloo"
        timeout = self.cfg.request_timeout_s
        payload = {
            "master_address": self.cfg.host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": name,
            "backend": backend,
        }
        # Our side joins in a daemon thread while the HTTP call makes the server join; the reply
        # comes only once both sides are in. If the call fails instead (server gone), the
        # rendezvous can never complete: it is left to time out in its thread, not waited for.
        joined: dict[str, Any] = {}

        def join():
            try:
                joined["pg"] = new_sender_group(
                    self.cfg.host, port, world, name, backend, timeout_s=timeout
                )
            except Exception as e:  # noqa: BLE001 - reported by the caller below
                joined["error"] = e

        thread = threading.Thread(target=join, name="mrf8-sglang-weight-group", daemon=True)
        thread.start()
        self._http.ok("/init_weights_update_group", payload, timeout=timeout)
        thread.join(timeout)
        if "pg" not in joined:
            raise _ServerGone(
                f"the weight-sync group with the SGLang server did not form: "
                f"{joined.get('error', 'timed out')}"
            )
        self._group = (joined["pg"], name)
        return self._group

    def _destroy_group(self) -> None:
        """Drop our side of the distributed transport's group (the server's side dies with it)."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            torch.distributed.destroy_process_group(group[0])
        except (RuntimeError, ValueError, KeyError):
            pass  # already torn down by a failed collective: nothing left to free

    def weight_version(self) -> int:
        return self._version

    def health(self) -> bool:
        if not self._alive():
            return False
        try:
            self._http.call("/health", timeout=10)
            return True
        except SGLangServerError:
            return False

    def shutdown(self) -> None:
        self._kill()
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()

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
        if self._weights_dir is None:
            raise SGLangServerError(
                "SGLang engine has no complete weights; call update_weights "
                "(the trainer's sync_weights) before generate"
            )
        rows = [p for p in prompts for _ in range(n)]
        request = {
            "input_ids": rows,
            "sampling_params": [
                sampling_params(
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=greedy,
                    eos_token_id=self.eos_token_id,
                    # Distinct, reproducible per-row seeds (honoured by SGLang's
                    # deterministic sampling mode; otherwise a hint).
                    seed=(seed * 1_000_003 + i) % (2**31),
                )
                for i in range(len(rows))
            ],
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        self._restarts_left = self.cfg.max_restarts
        while True:  # ends: each pass returns, or relaunches within the bound, or raises
            try:
                if not (self._alive() and self._version == self._synced):
                    raise _ServerGone(
                        "no server was serving the synced weights when the rollout began"
                    )
                self._fault("generate")
                answers = self._http.call("/generate", request, timeout=self.cfg.request_timeout_s)
                if not isinstance(answers, list) or len(answers) != len(rows):
                    raise _ServerGone(
                        f"/generate returned {type(answers).__name__} for {len(rows)} rows"
                    )
                return [
                    parse_completion(
                        p, a, eos_token_id=self.eos_token_id, expected_version=str(self._version)
                    )
                    for p, a in zip(rows, answers)
                ]
            except _ServerGone as e:
                self._relaunch(e, "a rollout")


def new_sender_group(
    host: str, port: int, world_size: int, group_name: str, backend: str, *, timeout_s: float
):
    """Rank 0 of a private process group with the server's TP ranks (ranks 1..world_size-1).

    It is built the way SGLang's ``init_custom_process_group`` builds the receiving side (a TCP
    rendezvous store prefixed with the group name, then c10d's group factory), so the two sides
    agree on store keys; it is *not* the default group, so the trainer's collectives are untouched.
    """
    import datetime
    import inspect

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(
        c10d.rendezvous(f"tcp://{host}:{port}", 0, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **options,
    )
    return pg


def _flatten(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``named`` as views into one fresh contiguous buffer per dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[tuple[str, torch.Tensor] | None] = [None] * len(named)
    for dtype, idx in by_dtype.items():
        flat = torch.empty(sum(named[i][1].numel() for i in idx), dtype=dtype)
        offset = 0
        for i in idx:
            name, t = named[i]
            view = flat[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            out[i] = (name, view)
            offset += t.numel()
    return out  # type: ignore[return-value]


def _save_shard(bucket: Bucket, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, t in bucket.tensors:
        t = t.detach().contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses views that share a storage
        tensors[name] = t
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def _per_tensor_scale_names(named):
    # SGLang's per-tensor FP8 checkpoints name the dequantisation scale ``weight_scale``.
    for name, t in named:
        if name.endswith("weight" + SCALE_SUFFIX):
            name = name[: -len(SCALE_SUFFIX)] + "_scale"
        yield name, t


def _first_line(error: Exception | None) -> str:
    if error is None:
        return "restart requested"
    return (str(error).splitlines() or [repr(error)])[0]
