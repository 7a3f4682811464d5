"""Namespaced step metrics (train/, rollout/, eval/, perf/, ...): JSONL always, TensorBoard and
Weights & Biases when ``logging.*`` switches them on.

Only the driver rank writes. ``metrics.jsonl`` is the run's record (docs/logging.md):

* One JSON object per line, ``{"step": int, "<namespace>/<name>": float, ...}``, flushed and
  fsynced, so a crash loses at most the step in flight.
* Every line is strict JSON. Non-finite values are written as the strings ``"nan"``, ``"inf"`` and
  ``"-inf"`` (JSON has no token for them, and ``null`` would lose whether a loss was NaN or inf);
  :func:`read_metrics` turns them back into floats.
* A kill -9 mid-write can leave a torn last line. Readers skip any line that is not a whole record;
  :meth:`MetricsLogger.log` starts a new line first when the file does not end with one, and
  :meth:`MetricsLogger.truncate_after` (run at every start) moves torn or damaged lines to
  ``metrics.unreadable.jsonl`` and says so: nothing that cannot be parsed is deleted.
* On resume, lines past the restored step are dropped first (``truncate_after``), so the replayed
  steps are not duplicated. TensorBoard hides the replaced events the same way (``purge_step``).
  W&B cannot delete logged steps and rejects a step that does not increase, so each row carries the
  training step as the metric ``trainer/step``, the x-axis of every chart; a replayed step is a new
  row at the same ``trainer/step``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
import string
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.config import LoggingConfig
from megatron_rl_fp8.utils.fs import atomic_write_text

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "guard_events.jsonl"
UNREADABLE_FILE = "metrics.unreadable.jsonl"  # lines of metrics.jsonl set aside at a start
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"
WANDB_STEP_METRIC = "trainer/step"

# The strings of non-finite floats in metrics.jsonl. Decoding returns these very objects, so two
# reads of the same record compare equal (containers compare items by identity first; nan != nan).
_DECODE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(v) -> float | str:
    v = float(v)
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _decode(v):
    return _DECODE.get(v, v) if isinstance(v, str) else v


def _parse(line: str) -> dict | None:
    """One line of metrics.jsonl as a record, or None if it is not a whole one (torn, corrupt)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        return None
    return {k: _decode(v) for k, v in rec.items()}


def _import_backend(module: str, setting: str, extra: str):
    """Import an optional backend's package, or raise the one error a user needs to see."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{setting}=true needs the {extra} package: pip install 'megatron-rl-fp8[{extra}]' "
            f"(or set {setting}=false)"
        ) from e


def require_packages(cfg: LoggingConfig) -> None:
    """Raise ConfigError if a switched-on backend's package is missing. ``MetricsLogger`` checks this
    itself; call it on every rank before anything starts, so no rank waits for a driver that
    failed."""
    if cfg.tensorboard:
        _import_backend("torch.utils.tensorboard", "logging.tensorboard", "tensorboard")
    if cfg.wandb.enabled:
        _import_backend("wandb", "logging.wandb.enabled", "wandb")


class MetricsLogger:
    """``log(step, metrics)`` to metrics.jsonl and the switched-on backends; ``close()`` at the end.

    ``run_config`` (the resolved run config as a dict) becomes the W&B run's config. With
    ``enabled=False`` (every rank but the driver) nothing is imported, opened or written.
    """

    def __init__(
        self,
        output_dir: str | Path,
        cfg: LoggingConfig | None = None,
        *,
        enabled: bool = True,
        run_config: dict | None = None,
    ):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.cfg = cfg if cfg is not None else LoggingConfig()
        self._tb_writer_cls = None
        self._tb = None  # created at the first truncate_after / log, which knows the purge step
        self._wandb = None
        self._wandb_run = None
        if not enabled:
            return
        # Both imports happen here, before any compute, so a missing package fails the run at once.
        if self.cfg.tensorboard:
            tb = _import_backend("torch.utils.tensorboard", "logging.tensorboard", "tensorboard")
            self._tb_writer_cls = tb.SummaryWriter
        if self.cfg.wandb.enabled:
            self._wandb = _import_backend("wandb", "logging.wandb.enabled", "wandb")
            self._init_wandb(run_config)

    # -- W&B ---------------------------------------------------------------------------------------
    def _wandb_run_id(self) -> str:
        """This output directory's W&B run id: read back on resume, made once otherwise."""
        path = self.output_dir / WANDB_RUN_ID_FILE
        if path.is_file():
            run_id = path.read_text().strip()
            if run_id:
                return run_id
        # W&B's own form (8 lowercase letters and digits); wandb has no public generator for it.
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, run_id + "\n")
        return run_id

    def _init_wandb(self, run_config: dict | None) -> None:
        w = self.cfg.wandb
        run_id = self._wandb_run_id()
        self._wandb_run = self._wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or self.output_dir.resolve().name,
            group=w.group,
            tags=list(w.tags),
            mode=w.mode,
            dir=w.dir if w.dir is not None else str(self.output_dir),
            config=run_config,
            id=run_id,
            resume="allow",
        )
        # The training step is a metric of its own and the x-axis of every chart: W&B's internal
        # step must increase, which a resumed run replaying steps would break.
        self._wandb_run.define_metric(WANDB_STEP_METRIC)
        self._wandb_run.define_metric("*", step_metric=WANDB_STEP_METRIC, step_sync=True)

    # -- the record --------------------------------------------------------------------------------
    def truncate_after(self, step: int) -> None:
        """Drop lines with step > ``step`` (a resumed run replays them) and torn lines; TensorBoard
        will hide its events from step + 1 on. ``step=-1`` starts the record afresh."""
        if not self.enabled:
            return
        if self._tb_writer_cls is not None and self._tb is None:
            self._open_tb(purge_step=step + 1)
        if not self.path.exists():
            return
        kept, unreadable = [], []
        for raw in self.path.read_bytes().split(b"\n"):
            try:
                rec = _parse(raw.decode())
            except UnicodeDecodeError:
                rec = None
            if rec is None:
                if raw.strip():
                    unreadable.append(raw)
            elif rec["step"] <= step:
                kept.append(raw)
        if unreadable:
            # Set aside, never deleted: the bytes may be the only record of those steps.
            aside = self.output_dir / UNREADABLE_FILE
            with open(aside, "ab") as f:
                f.write(b"".join(raw + b"\n" for raw in unreadable))
                f.flush()
                os.fsync(f.fileno())
            print_rank0(
                f"metrics: {len(unreadable)} line(s) of {self.path} are not whole records (a kill "
                f"mid-write leaves a torn last line; other damage, more); moved to {aside}"
            )
        atomic_write_text(self.path, b"".join(raw + b"\n" for raw in kept).decode())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {"step": step, **{k: _encode(v) for k, v in sorted(metrics.items())}}
        line = json.dumps(record, allow_nan=False) + "\n"
        with open(self.path, "a+b") as f:
            # A killed run may have left a torn last line; never glue this record onto it.
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())  # append mode: always at the end, whatever the position
            f.flush()
            os.fsync(f.fileno())
        values = {k: float(v) for k, v in metrics.items()}  # non-finite stay floats here
        if self._tb_writer_cls is not None:
            if self._tb is None:
                self._open_tb(purge_step=None)
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({WANDB_STEP_METRIC: step, **values})

    def event(self, step: int, **fields) -> None:
        """Append one record to ``guard_events.jsonl``: the stability guard's events, kept whole
        across rollbacks and resumes (metrics.jsonl lines of rolled-back steps are replaced)."""
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": step, **fields}, allow_nan=False) + "\n"
        with open(self.output_dir / EVENTS_FILE, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def _open_tb(self, purge_step: int | None) -> None:
        # purge_step: TensorBoard hides events of the earlier run at steps >= purge_step, so
        # replayed steps replace them rather than showing twice.
        self._tb = self._tb_writer_cls(
            str(self.output_dir / TENSORBOARD_DIR), purge_step=purge_step
        )

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            try:
                run.finish()
            finally:
                # finish() leaves W&B's service process running until the interpreter exits; the
                # trainer owns W&B in its process, so stop it now and leave no process behind.
                self._wandb.teardown()


def read_metrics(output_dir: str | Path) -> list[dict]:
    """The records of ``<output_dir>/metrics.jsonl`` in file order, non-finite values as floats.

    Lines that are not whole records (a torn line from a killed run) are skipped.
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = (_parse(line) for line in path.read_text(errors="replace").splitlines())
    return [rec for rec in records if rec is not None]


def print_rank0(*args, **kwargs) -> None:
    """The one place that prints to the console from a multi-rank job."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)
