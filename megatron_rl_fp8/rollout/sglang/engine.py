"""The SGLang rollout engine: owns the server's life, samples through it, pushes every sync.

The package docstring (``rollout/sglang/__init__.py``) describes the server's life, the
transports, versions, failures and recovery.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_rl_fp8.rollout.base import Completion, RolloutConfig, eos_ids
from megatron_rl_fp8.rollout.sglang.errors import SGLangServerError, _first_line, _ServerGone
from megatron_rl_fp8.rollout.sglang.faults import fault_hook_from_env
from megatron_rl_fp8.rollout.sglang.http import (
    Http,
    begin_update,
    check_version,
    end_update,
    generate_request,
    parse_completion,
    update_from_disk,
)
from megatron_rl_fp8.rollout.sglang.process import (
    _kill_group,
    engine_export_options,
    launch_guarded_server,
    log_tail,
    resolve_python,
    resolve_work_dir,
    serving,
    wait_healthy,
)
from megatron_rl_fp8.rollout.sglang.transports import (
    _per_tensor_scale_names,
    _save_shard,
    destroy_sender_group,
    join_sender_group,
    push_distributed,
    push_tensor,
    write_checkpoint_files,
)
from megatron_rl_fp8.sync.buckets import Bucket


class SGLangEngine:
    """RolloutEngine backed by an SGLang server process that this object starts and owns."""

    def __init__(
        self,
        cfg: RolloutConfig,
        hf_config,
        *,
        pad_token_id: int,
        eos_token_id: int | Iterable[int],
        output_dir: str | os.PathLike | None = None,
    ):
        self.cfg = cfg.sglang
        self.fp8 = cfg.fp8
        self.hf_config = hf_config
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_ids(eos_token_id)  # every id that ends a completion
        self.python = resolve_python(self.cfg)
        self.device, self.serve_dtype, self.fp8_checkpoint = serving(self.cfg, self.fp8)
        if self.cfg.transport == "tensor":
            # Shared-memory tensors to another process: file-descriptor passing fails between
            # unrelated processes (the server crashes on an authentication error), file names work.
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.work_dir, self._tmp = resolve_work_dir(self.cfg, output_dir)
        self.weights_root = self.work_dir / "weights"
        self.weights_root.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None  # the guard, leader of the server's group
        self._port: int | None = None
        self._http: Http | None = None
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
        self.fault_hook: Callable[[str], None] | None = fault_hook_from_env(self)

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
        self._proc, self._port = launch_guarded_server(
            self.cfg,
            python=self.python,
            device=self.device,
            dtype=self.serve_dtype,
            fp8_checkpoint=self.fp8_checkpoint,
            model_path=model_path,
            version=version,
            work_dir=self.work_dir,
            log_path=self.log_path,
        )
        self._http = Http(self.url)
        self._group = None
        self._fault("startup")
        wait_healthy(
            self._proc,
            self._http,
            self.log_path,
            port=self._port,
            timeout_s=self.cfg.startup_timeout_s,
        )

    def _log_tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)

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
    @property
    def export_options(self) -> dict:
        return engine_export_options(
            self.cfg, fp8_checkpoint=self.fp8_checkpoint, dtype=self.serve_dtype
        )

    @torch.no_grad()
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
        write_checkpoint_files(
            partial,
            dict(names),
            self.hf_config,
            serve_dtype=self.serve_dtype,
            fp8=self.fp8 if self.fp8_checkpoint else None,
        )
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

    # Each server call of a sync: its fault point, then the HTTP exchange (http.py).
    def _begin_update(self, version: int) -> None:
        self._fault("begin_update")
        begin_update(self._http, version, timeout=self.cfg.request_timeout_s)

    def _end_update(self, version: int) -> None:
        self._fault("end_update")
        end_update(self._http, version, timeout=self.cfg.request_timeout_s)

    def _update_from_disk(self, path: Path, version: int) -> None:
        self._fault("disk_update")
        update_from_disk(self._http, path, version, timeout=self.cfg.request_timeout_s)

    def _check_version(self, expected: str) -> None:
        self._fault("check_version")
        check_version(self._http, expected, timeout=self.cfg.request_timeout_s)

    def _push_bucket(self, bucket: Bucket) -> None:
        self._fault("push")
        timeout = self.cfg.request_timeout_s
        if self.cfg.transport == "tensor":
            push_tensor(self._http, bucket, tp_size=self.cfg.tp_size, timeout=timeout)
        else:
            group = self._ensure_group()
            push_distributed([self._http], group, bucket, device=self.device, timeout=timeout)
        self.stats["buckets"] += 1

    def _ensure_group(self):
        if self._group is None:
            self._group = join_sender_group(
                [(self._http, self.cfg.tp_size)],
                host=self.cfg.host,
                device=self.device,
                name=f"mrf8_weight_sync_{os.getpid()}_{self._launches}",
                timeout=self.cfg.request_timeout_s,
            )
        return self._group

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            destroy_sender_group(group)

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_restarts": float(self.stats["restarts"])}

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
        tmp = self._tmp
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
        request = generate_request(
            rows,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            seed=seed,
            eos_token_id=self.eos_token_id,
        )
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
