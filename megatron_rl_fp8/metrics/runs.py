"""The run directories a report reads: ``metrics.jsonl`` (through ``read_metrics``; anything that
is not a finite number counts as missing), ``config.yaml`` if present and ``guard_events.jsonl``
if present (else the ``guard/rule/`` keys of the metrics name the events).

``megatron-rl-fp8 report`` (``metrics/report.py``) and the study report (``study/report.py``)
read runs through :func:`load_runs` / :class:`Run`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.recipes import fp8_training
from megatron_rl_fp8.metrics.logger import EVENTS_FILE, METRICS_FILE, read_metrics

# A derived series (``Run.series`` computes it step by step) for runs that predate
# ``perf/useful_tokens_per_s``.
RESPONSE_TOKENS_PER_S = "train/response_tokens / perf/step_time_s"


@dataclass
class Run:
    """One run directory as the report sees it."""

    label: str
    path: Path
    records: list[dict]
    config: dict = field(default_factory=dict)
    guard_events: list[dict] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the steps where it is a finite number."""
        if key == RESPONSE_TOKENS_PER_S:
            return self._response_tokens_per_s()
        steps, values = [], []
        for rec in self.records:
            v = finite_number(rec.get(key))
            step = rec.get("step")
            if v is not None and isinstance(step, int):
                steps.append(step)
                values.append(v)
        return steps, values

    def _response_tokens_per_s(self) -> tuple[list[int], list[float]]:
        steps, values = [], []
        for rec in self.records:
            tokens = finite_number(rec.get("train/response_tokens"))
            seconds = finite_number(rec.get("perf/step_time_s"))
            if tokens is not None and seconds and isinstance(rec.get("step"), int):
                steps.append(rec["step"])
                values.append(tokens / seconds)
        return steps, values


def finite_number(v) -> float | None:
    """``v`` as a finite float, else None (strings such as "nan", None and bools are missing)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def config_value(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def read_run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}  # the config only labels the run; the metrics are what is reported
    return cfg if isinstance(cfg, dict) else {}


def read_guard_events(run_dir: Path, records: list[dict]) -> list[dict]:
    """The events of ``guard_events.jsonl``. Without that file (a run whose events file was lost),
    the ``guard/rule/<rule>`` keys of the metrics lines, one event per rule that fired, with the
    step's ``guard/action/<action>``: after a rollback those keys sit on the first replayed step,
    so the events file is the one to trust for steps."""
    path = run_dir / EVENTS_FILE
    events = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if isinstance(ev, dict) and isinstance(ev.get("step"), int):
                events.append(ev)
        return events
    for rec in records:
        if not isinstance(rec.get("step"), int):
            continue
        fired = sorted(k for k in rec if k.startswith("guard/rule/") and finite_number(rec[k]))
        actions = sorted(k for k in rec if k.startswith("guard/action/") and finite_number(rec[k]))
        action = ", ".join(a.removeprefix("guard/action/") for a in actions)
        for key in fired:
            rule = key.removeprefix("guard/rule/")
            events.append({"step": rec["step"], "rule": rule, "action": action, "evidence": ""})
    return events


def precision(cfg: dict) -> str:
    """A short description of the run's precision mode from its config ("?" without one)."""
    recipe = config_value(cfg, "fp8.recipe")
    rollout = config_value(cfg, "rollout.fp8.weight_quant")
    if recipe is None and rollout is None:
        return "?"
    text = f"train {recipe or 'bf16'}, rollout {rollout or 'bf16'}"
    if fp8_training(recipe) and config_value(cfg, "loss.calib.enabled"):
        text += ", calibrated clip"
    return text


def load_runs(run_dirs: list[str | Path], labels: list[str] | None = None) -> list[Run]:
    """Read every run; a missing directory or metrics file, or a label count that does not match
    the run count, is a ``ConfigError``."""
    if labels and len(labels) != len(run_dirs):
        raise ConfigError(
            f"--label given {len(labels)} times for {len(run_dirs)} runs; give one --label per "
            "RUN_DIR, in the same order, or none (labels are then the directory names)"
        )
    paths = [Path(d) for d in run_dirs]
    for p in paths:
        if not p.is_dir():
            raise ConfigError(f"run directory {str(p)!r} does not exist")
        if not (p / METRICS_FILE).is_file():
            raise ConfigError(
                f"run directory {str(p)!r} has no {METRICS_FILE} (is it a train.output_dir?)"
            )
    if not labels:
        labels = [p.resolve().name for p in paths]
        if len(set(labels)) < len(labels):  # e.g. a/run and b/run: keep the parent to tell apart
            labels = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    runs = []
    for p, label in zip(paths, labels):
        records = [r for r in read_metrics(p) if isinstance(r, dict)]
        runs.append(Run(label, p, records, read_run_config(p), read_guard_events(p, records)))
    return runs
