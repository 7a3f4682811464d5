"""Namespaced metrics (train/, rollout/, eval/, perf/, ...) to JSONL, optionally TensorBoard.

Only the driver rank writes. ``metrics.jsonl`` gets one line per step, flushed and fsynced, so a
crash loses at most the step in flight; on resume, lines past the restored step are dropped first
(``truncate_after``) so nothing is duplicated.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megatron_rl_fp8.utils.fs import atomic_write_text


def _clean(v):
    v = float(v)
    return v if math.isfinite(v) else None


class MetricsLogger:
    def __init__(self, output_dir: str | Path, *, enabled: bool = True, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - optional
                raise ImportError(
                    "TensorBoard logging needs: pip install 'megatron-rl-fp8[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(Path(output_dir) / "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop lines with step > ``step`` (a resumed run replays them)."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError):
                continue  # a torn last line from a crash
        atomic_write_text(self.path, "".join(k + "\n" for k in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def print_rank0(*args, **kwargs) -> None:
    """The one place that prints to the console from a multi-rank job."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)
