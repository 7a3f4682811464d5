"""SGLang rollout engine: launches and owns ``sglang.launch_server`` processes, samples through
their HTTP API, and pushes every weight sync into them.

How it fits the trainer: :class:`SGLangEngine` implements the same ``RolloutEngine`` protocol as the
in-process ``LocalEngine``; the trainer's ``sync_weights`` streams HF-named tensors (FP8 codes +
``_scale_inv`` when ``rollout.fp8`` is on) into :meth:`SGLangEngine.update_weights` and its
``rollout`` calls :meth:`SGLangEngine.generate`. Nothing else is needed from the trainer.

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
* Failures: a transport error mid-sync restarts the server from the (complete) disk copy of the new
  version; a crash, a hang past ``request_timeout_s`` or a wrong version during ``generate``
  restarts the server and retries the whole request, at most ``max_restarts`` times per call.

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
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron_rl_fp8.rollout.base import Completion, RolloutConfig, SGLangConfig
from megatron_rl_fp8.sync.buckets import MB, Bucket, iter_buckets, rollout_stream
from megatron_rl_fp8.sync.quantize import SCALE_SUFFIX

REPO_ROOT = Path(__file__).resolve().parents[2]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SGLangServerError(RuntimeError):
    """The SGLang server failed, or answered something the engine cannot accept."""


class _ServerGone(SGLangServerError):
    """The server died, hung or answered for the wrong weights: restart it and retry."""


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
            "rollout.sglang.python at a python that has sglang (empty = this interpreter)")
    return str(path)


def resolve_device(cfg: SGLangConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def server_command(cfg: SGLangConfig, *, python: str, model_path: Path, port: int, device: str,
                   dtype: str, fp8_checkpoint: bool, weight_version: str) -> list[str]:
    """The ``sglang.launch_server`` command line (pure function: unit-tested)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", cfg.host, "--port", str(port), "--tp-size", str(cfg.tp_size),
           "--dtype", dtype, "--skip-tokenizer-init", "--weight-version", weight_version,
           "--random-seed", str(cfg.random_seed)]
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


def sampling_params(*, max_new_tokens: int, temperature: float, top_p: float, greedy: bool,
                    eos_token_id: int, seed: int | None) -> dict:
    """One request's ``sampling_params`` (greedy = temperature 0, SGLang's argmax path)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "stop_token_ids": [eos_token_id],
                              "temperature": 0.0 if greedy else temperature,
                              "top_p": 1.0 if greedy else top_p, "top_k": -1}
    if seed is not None and not greedy:
        params["sampling_seed"] = seed
    return params


def parse_completion(prompt: list[int], answer: dict, *, eos_token_id: int,
                     expected_version: str) -> Completion:
    """A ``/generate`` answer -> Completion, after checking it came from ``expected_version``."""
    meta = answer.get("meta_info", {})
    versions = {meta.get("weight_version")} | {s.get("version") for s in meta.get("weight_versions") or []}
    versions.discard(None)
    if versions != {expected_version}:
        raise _ServerGone(f"completion produced by weight version(s) {sorted(versions)}, "
                          f"expected {expected_version!r}")
    ids = [int(t) for t in answer["output_ids"]]
    lp = meta.get("output_token_logprobs") or []
    if len(lp) != len(ids) or any(int(e[1]) != t for e, t in zip(lp, ids)):
        raise SGLangServerError("SGLang returned logprobs that do not line up with the output ids "
                                f"({len(lp)} logprobs for {len(ids)} tokens)")
    finished = bool(ids) and ids[-1] == eos_token_id
    return Completion(prompt_ids=list(prompt), response_ids=ids,
                      response_logprobs=[float(e[0]) for e in lp], finished=finished)


class _Http:
    """The few JSON calls the engine makes (stdlib only: the trainer's venv needs no extra)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(self, path: str, payload: dict | None = None, *, timeout: float,
             method: str | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method or (
            "GET" if data is None else "POST"), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code >= 500:
                raise _ServerGone(f"{path}: HTTP {e.code}: {detail}") from e
            raise SGLangServerError(f"{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
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

    def __init__(self, cfg: RolloutConfig, hf_config, *, pad_token_id: int, eos_token_id: int,
                 output_dir: str | os.PathLike | None = None):
        self.cfg = cfg.sglang
        self.fp8 = cfg.fp8
        self.hf_config = hf_config
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.python = resolve_python(self.cfg)
        self.device = resolve_device(self.cfg)
        self.serve_dtype = self.cfg.dtype if self.cfg.dtype != "auto" else (
            "float32" if self.device == "cpu" else "bfloat16")
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
        self._proc: subprocess.Popen | None = None
        self._port: int | None = None
        self._http: _Http | None = None
        self._group = None  # (process group, name) of the distributed transport
        self._launches = 0
        self._version = -1
        self._weights_dir: Path | None = None  # last complete synced weights (restart source)
        self.stats: dict[str, float] = {"restarts": 0, "update_seconds": 0.0, "buckets": 0}
        self.bucket_times: list[tuple[int, float]] = []  # (bytes, seconds) per pushed bucket

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
        from megatron_rl_fp8.parallel import free_port

        self._launches += 1
        port = self.cfg.port or free_port()
        cmd = server_command(self.cfg, python=self.python, model_path=model_path, port=port,
                             device=self.device, dtype=self.serve_dtype,
                             fp8_checkpoint=self.fp8_checkpoint, weight_version=version)
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)  # the server builds its own process groups
        env.update(self.cfg.env)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # Own session: the server forks scheduler/detokenizer processes; kill the whole group.
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, cwd=self.work_dir)
        log.close()
        # Operators (and the recovery test) find the live server here.
        (self.work_dir / "server.pid").write_text(f"{self._proc.pid}\n")
        self._port = port
        self._http = _Http(self.url)
        self._group = None
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SGLangServerError(
                    f"SGLang server exited with code {self._proc.returncode} during startup; "
                    f"see {self.log_path}:\n{self._log_tail()}")
            try:
                self._http.call("/health", timeout=5)
                return
            except SGLangServerError:
                time.sleep(0.5)
        self._kill()
        raise SGLangServerError(
            f"SGLang server not healthy after rollout.sglang.startup_timeout_s="
            f"{self.cfg.startup_timeout_s}s; see {self.log_path}:\n{self._log_tail()}")

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        self._destroy_group()
        proc, self._proc = self._proc, None
        self._port = None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=15)

    def server_pid(self) -> int | None:
        """PID of the server's main process (tests kill it to check recovery)."""
        return self._proc.pid if self._proc is not None else None

    def restart(self) -> None:
        """Kill the server and start a fresh one serving the last complete synced weights."""
        if self._weights_dir is None:
            raise SGLangServerError("cannot restart the SGLang server: no weights were synced yet")
        self.stats["restarts"] += 1
        self._kill()
        self._launch(self._weights_dir, str(self._version))
        self._check_version(str(self._version))

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       version: int) -> None:
        t0 = time.perf_counter()
        final = self.weights_root / f"v{version}"
        partial = self.weights_root / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        dequantize_to = None if self.fp8_checkpoint else _DTYPES[self.serve_dtype]
        stream = rollout_stream(named_tensors, self.fp8, dequantize_to=dequantize_to)
        if self.fp8_checkpoint and self.fp8.weight_quant == "per_tensor":
            stream = _per_tensor_scale_names(stream)
        push = self._proc is not None and self._proc.poll() is None and \
            self.cfg.transport != "disk"
        push_error: Exception | None = None
        self._version = -1  # until the new version is complete and verified
        try:
            if push:
                self._begin_update(version)
            names: list[tuple[str, str]] = []
            for bucket in iter_buckets(stream, int(self.cfg.bucket_mb * MB)):
                shard = f"model-{bucket.index:05d}.safetensors"
                _save_shard(bucket, partial / shard)
                names += [(n, shard) for n in bucket.names]
                if push and push_error is None:
                    try:
                        tb = time.perf_counter()
                        self._push_bucket(bucket)
                        self.bucket_times.append((bucket.nbytes, time.perf_counter() - tb))
                    except SGLangServerError as e:
                        # Keep consuming the stream (the trainer's collectives need it and the
                        # disk copy must be complete); the server restarts from disk below.
                        push_error = e
            if push and push_error is None:
                self._end_update(version)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self._write_checkpoint_files(partial, dict(names))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        previous, self._weights_dir = self._weights_dir, final
        self._version = version
        if self._proc is None or self._proc.poll() is not None or push_error is not None:
            # First sync (start from these weights), dead server, or a failed push: a fresh
            # server on the complete new version is the only state we accept.
            self.stats["restarts"] += self._proc is not None
            self._kill()
            self._launch(final, str(version))
        elif self.cfg.transport == "disk":
            self._update_from_disk(final, version)
        self._check_version(str(version))
        if previous is not None and previous != final:
            shutil.rmtree(previous, ignore_errors=True)
        self.stats["update_seconds"] = time.perf_counter() - t0

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
        http, t = self._http, self.cfg.request_timeout_s
        http.ok("/update_weight_version", {"new_version": f"{version}-partial",
                                           "abort_all_requests": True}, timeout=t)
        http.ok("/begin_weight_update", {}, timeout=t)

    def _end_update(self, version: int) -> None:
        http, t = self._http, self.cfg.request_timeout_s
        http.ok("/end_weight_update", {}, timeout=t)
        http.ok("/update_weight_version", {"new_version": str(version),
                                           "abort_all_requests": True}, timeout=t)
        out = http.call("/flush_cache", {}, timeout=t)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangServerError(f"/flush_cache failed after the weight update: {out}")

    def _update_from_disk(self, path: Path, version: int) -> None:
        self._http.ok("/update_weights_from_disk",
                      {"model_path": str(path), "weight_version": str(version),
                       "abort_all_requests": True, "flush_cache": True},
                      timeout=self.cfg.request_timeout_s)

    def _check_version(self, expected: str) -> None:
        info = self._http.call("/model_info", timeout=self.cfg.request_timeout_s)
        got = info.get("weight_version") if isinstance(info, dict) else None
        if got != expected:
            raise SGLangServerError(f"SGLang server reports weight version {got!r} after the "
                                    f"update, expected {expected!r}")

    def _push_bucket(self, bucket: Bucket) -> None:
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
        self._http.ok("/update_weights_from_tensor",
                      {"serialized_named_tensors": [payload] * self.cfg.tp_size,
                       "flush_cache": False}, timeout=self.cfg.request_timeout_s)
        del flat  # the server has copied the values when the call returns

    def _push_distributed(self, bucket: Bucket) -> None:
        group = self._ensure_group()
        tensors = [t.contiguous() for _, t in bucket.tensors]
        if self.device == "cuda":
            tensors = [t.cuda() for t in tensors]
        payload = {"names": bucket.names,
                   "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                   "shapes": [list(t.shape) for t in tensors], "group_name": group[1],
                   "flush_cache": False}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self._http.ok, "/update_weights_from_distributed", payload,
                                timeout=self.cfg.request_timeout_s)
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
        from megatron_rl_fp8.parallel import free_port

        name = f"mrf8_weight_sync_{os.getpid()}_{self._launches}"
        port = free_port()
        world = 1 + self.cfg.tp_size
        backend = "nccl" if self.device == "cuda" else "gloo"
        payload = {"master_address": self.cfg.host, "master_port": port, "rank_offset": 1,
                   "world_size": world, "group_name": name, "backend": backend}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self._http.ok, "/init_weights_update_group", payload,
                                timeout=self.cfg.request_timeout_s)
            pg = new_sender_group(self.cfg.host, port, world, name, backend,
                                  timeout_s=self.cfg.request_timeout_s)
            reply.result()
        self._group = (pg, name)
        return self._group

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if self._http is not None and self._proc is not None and self._proc.poll() is None:
            try:
                self._http.call("/destroy_weights_update_group", {"group_name": group[1]},
                                timeout=10)
            except SGLangServerError:
                pass
        try:
            torch.distributed.destroy_process_group(group[0])
        except (RuntimeError, ValueError, KeyError):
            pass

    def weight_version(self) -> int:
        return self._version

    def health(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
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
    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int,
                 temperature: float, top_p: float = 1.0, seed: int = 0,
                 greedy: bool = False) -> list[Completion]:
        if self._version < 0 or self._weights_dir is None:
            raise SGLangServerError("SGLang engine has no complete weights; call update_weights "
                                    "(the trainer's sync_weights) before generate")
        rows = [p for p in prompts for _ in range(n)]
        request = {
            "input_ids": rows,
            "sampling_params": [
                sampling_params(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, greedy=greedy, eos_token_id=self.eos_token_id,
                                # Distinct, reproducible per-row seeds (honoured by SGLang's
                                # deterministic sampling mode; otherwise a hint).
                                seed=(seed * 1_000_003 + i) % (2**31))
                for i in range(len(rows))],
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        last_error: Exception | None = None
        for attempt in range(self.cfg.max_restarts + 1):
            if attempt:
                self.restart()
            try:
                answers = self._http.call("/generate", request, timeout=self.cfg.request_timeout_s)
                if not isinstance(answers, list) or len(answers) != len(rows):
                    raise _ServerGone(f"/generate returned {type(answers).__name__} for "
                                      f"{len(rows)} rows")
                return [parse_completion(p, a, eos_token_id=self.eos_token_id,
                                         expected_version=str(self._version))
                        for p, a in zip(rows, answers)]
            except _ServerGone as e:
                last_error = e
        raise SGLangServerError(
            f"SGLang rollout failed after {self.cfg.max_restarts} restart(s) "
            f"(rollout.sglang.max_restarts); last error: {last_error}; server log: "
            f"{self.log_path}\n{self._log_tail()}") from last_error


def new_sender_group(host: str, port: int, world_size: int, group_name: str, backend: str, *,
                     timeout_s: float):
    """Rank 0 of a private process group with the server's TP ranks (ranks 1..world_size-1).

    It is built the way SGLang's ``init_custom_process_group`` builds the receiving side (a TCP
    rendezvous store prefixed with the group name, then c10d's group factory), so the two sides
    agree on store keys; it is *not* the default group, so the trainer's collectives are untouched.
    """
    import datetime
    import inspect

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{host}:{port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **options)
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
            view = flat[offset:offset + t.numel()].view(t.shape)
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
