"""``megatron-rl-fp8 report``: PNG figures and a Markdown summary that overlay several runs.

The usual input is one task trained in several precision modes (BF16, FP8, FP8 with calibrated
clipping). Each run keeps one colour in every figure; inside a panel, each metric of the panel has
one line style. What the figures show and how to read them: ``docs/report.md``.

Per run directory it reads ``metrics.jsonl`` (through ``read_metrics``; anything that is not a
finite number counts as missing), ``config.yaml`` if present (the precision column of the table and
the PPO reference bounds) and ``guard_events.jsonl`` if present (else the ``guard/rule/`` keys of
the metrics name the events). It writes ``report.md`` and one PNG per figure that has data
into ``--out``; a panel that no run has data for is left out and listed in ``report.md``.

Plots are a table of ``Panel`` specs (``FIGURES``) drawn by one function, ``_draw_panel``. Only
this module imports matplotlib, and only when a report is written (Agg canvas, no pyplot, so
nothing global changes in the calling process).
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import EVENTS_FILE, METRICS_FILE, read_metrics
from megatron_rl_fp8.metrics.step_time import OTHER, PARTS, PHASES, STEP

USEFUL_TOKENS_PER_S = "perf/useful_tokens_per_s"
# A derived series (``Run.series`` computes it step by step) for runs that predate the key above.
RESPONSE_TOKENS_PER_S = "train/response_tokens / perf/step_time_s"
LAST_N_REWARD = 5  # the "final" training reward is the mean of this many last steps
_STYLES = ("-", "--", ":", "-.")
_DPI = 80  # a 3x2 overview is then ~1200 px wide: readable, and ~100-150 KB


# -- runs --------------------------------------------------------------------------------------
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
            v = _number(rec.get(key))
            step = rec.get("step")
            if v is not None and isinstance(step, int):
                steps.append(step)
                values.append(v)
        return steps, values

    def _response_tokens_per_s(self) -> tuple[list[int], list[float]]:
        steps, values = [], []
        for rec in self.records:
            tokens = _number(rec.get("train/response_tokens"))
            seconds = _number(rec.get("perf/step_time_s"))
            if tokens is not None and seconds and isinstance(rec.get("step"), int):
                steps.append(rec["step"])
                values.append(tokens / seconds)
        return steps, values


def _number(v) -> float | None:
    """``v`` as a finite float, else None (strings such as "nan", None and bools are missing)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _config_value(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}  # the config only labels the run; the metrics are what is reported
    return cfg if isinstance(cfg, dict) else {}


def _read_guard_events(run_dir: Path, records: list[dict]) -> list[dict]:
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
        fired = sorted(k for k in rec if k.startswith("guard/rule/") and _number(rec[k]))
        actions = sorted(k for k in rec if k.startswith("guard/action/") and _number(rec[k]))
        action = ", ".join(a.removeprefix("guard/action/") for a in actions)
        for key in fired:
            rule = key.removeprefix("guard/rule/")
            events.append({"step": rec["step"], "rule": rule, "action": action, "evidence": ""})
    return events


def precision(cfg: dict) -> str:
    """A short description of the run's precision mode from its config ("?" without one)."""
    recipe = _config_value(cfg, "fp8.recipe")
    rollout = _config_value(cfg, "rollout.fp8.weight_quant")
    if recipe is None and rollout is None:
        return "?"
    text = f"train {recipe or 'bf16'}, rollout {rollout or 'bf16'}"
    if recipe not in (None, "bf16") and _config_value(cfg, "loss.calib.enabled"):
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
        runs.append(Run(label, p, records, _read_config(p), _read_guard_events(p, records)))
    return runs


# -- figures -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Panel:
    """One axes: its metric keys (one line style each, with a short legend name), and extras."""

    title: str
    ylabel: str
    keys: tuple[tuple[str, str], ...]
    smooth: bool = False  # a light moving average over the raw curve (drawn faint)
    markers: bool = False  # sparse metric (evaluation steps): draw the points
    guard: bool = False  # vertical markers at guard events
    ppo_bounds: bool = False  # reference lines at 1 - eps_low, 1 + eps_high from config.yaml


REWARD = Panel(
    "Training reward",
    "rollout/reward_mean",
    (("rollout/reward_mean", "reward"),),
    smooth=True,
    guard=True,
)
EVAL = Panel(
    "Validation accuracy", "eval/reward_mean", (("eval/reward_mean", "accuracy"),), markers=True
)
ENTROPY = Panel(
    "Entropy", "train/entropy (nats / token)", (("train/entropy", "entropy"),), guard=True
)
CLIP_BY_SIGN = Panel(
    "Clip shares by side and advantage sign",
    "share of the sign's tokens",
    (
        ("train/pg_clipfrac_pos_upper", "A>0, upper"),
        ("train/pg_clipfrac_neg_lower", "A<0, lower"),
        ("train/pg_clipfrac_pos_lower", "A>0, lower"),
        ("train/pg_clipfrac_neg_upper", "A<0, upper"),
    ),
)
CLIP_BY_SIDE = Panel(
    "Clip shares by side (all tokens)",
    "share of tokens",
    (("train/pg_clipfrac_lower", "lower"), ("train/pg_clipfrac_upper", "upper")),
)
BOUNDS = Panel(
    "Clip bounds on the ratio",
    "calib/lower, calib/upper",
    (("calib/lower", "lower"), ("calib/upper", "upper")),
    ppo_bounds=True,
)
MISMATCH = Panel(
    "Rollout vs train mismatch",
    "fp8/token_mult_prob_error",
    (("fp8/token_mult_prob_error", "mult. prob. error"),),
)
KL = Panel("Rollout vs train KL", "fp8/rollout_train_kl", (("fp8/rollout_train_kl", "KL"),))
GARBLED = Panel("Garbled rollouts", "rollout/garbled_frac", (("rollout/garbled_frac", "garbled"),))
RATIO_OUTLIERS = Panel(
    "Importance-ratio outliers",
    "share of tokens",
    (("train/ratio_above_2", "ratio > 2"), ("train/ratio_below_half", "ratio < 0.5")),
)
RATIO_QUANTILES = Panel(
    "Importance-ratio quantiles",
    "ratio",
    (("train/ratio_p01", "1st percentile"), ("train/ratio_p99", "99th percentile")),
)
THROUGHPUT = Panel("Throughput", "perf/useful_tokens_per_s", ((USEFUL_TOKENS_PER_S, "tokens/s"),))
# THROUGHPUT's stand-in when a run lacks its key (see _resolve): one definition per panel.
RESPONSE_THROUGHPUT = Panel(
    "Throughput (response tokens / step time)",
    "train/response_tokens / perf/step_time_s",
    ((RESPONSE_TOKENS_PER_S, "tokens/s"),),
)
STEP_TIME = Panel("Step time", "perf/step_time_s (s)", (("perf/step_time_s", "step time"),))

# Figure name (the PNG's stem) -> its title and panels. A panel may appear in several figures.
FIGURES: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "overview": ("Overview", (REWARD, EVAL, ENTROPY, CLIP_BY_SIGN, BOUNDS, MISMATCH)),
    "clipping": (
        "Clipping and importance ratios",
        (CLIP_BY_SIGN, CLIP_BY_SIDE, BOUNDS, RATIO_OUTLIERS, RATIO_QUANTILES),
    ),
    "mismatch": ("Rollout vs train mismatch", (MISMATCH, KL, GARBLED)),
    "throughput": ("Throughput", (THROUGHPUT, STEP_TIME)),
}


def _resolve(panel: Panel, runs: list[Run]) -> Panel:
    """The panel to draw for ``panel``: THROUGHPUT falls back to RESPONSE_THROUGHPUT for every run
    when one run with step times lacks ``perf/useful_tokens_per_s`` (the two count different
    tokens, so one panel never mixes them)."""
    if panel is THROUGHPUT and any(
        run.series("perf/step_time_s")[0] and not run.series(USEFUL_TOKENS_PER_S)[0] for run in runs
    ):
        return RESPONSE_THROUGHPUT
    return panel


def _has_data(panel: Panel, runs: list[Run]) -> bool:
    return any(run.series(key)[0] for run in runs for key, _ in panel.keys)


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _smoothing_window(panel: Panel, runs: list[Run]) -> int:
    """One window for every run (so the title can say what it shows): ~1/20 of the longest run."""
    longest = max(len(run.series(key)[0]) for run in runs for key, _ in panel.keys)
    return max(1, round(longest / 20))


def _ppo_bounds(runs: list[Run]) -> list[float]:
    bounds = set()
    for run in runs:
        lo = _number(_config_value(run.config, "loss.eps_low"))
        hi = _number(_config_value(run.config, "loss.eps_high"))
        if lo is not None and hi is not None:
            bounds.update((round(1.0 - lo, 6), round(1.0 + hi, 6)))
    return sorted(bounds)


def _draw_panel(ax, panel: Panel, runs: list[Run], colours: list[str]) -> None:
    from matplotlib.lines import Line2D

    window = _smoothing_window(panel, runs) if panel.smooth else 1
    keys_shown = []
    for run, colour in zip(runs, colours):
        for (key, name), style in zip(panel.keys, _STYLES):
            steps, values = run.series(key)
            if not steps:
                continue
            if name not in keys_shown:
                keys_shown.append(name)
            marker = "o" if panel.markers else None
            if window > 1:
                ax.plot(steps, values, color=colour, ls=style, lw=0.8, alpha=0.25)
                values = _moving_average(values, window)
            ax.plot(steps, values, color=colour, ls=style, lw=1.5, marker=marker, ms=4)
        if panel.guard:
            for ev in run.guard_events:
                ax.axvline(ev["step"], color=colour, ls=(0, (1, 2)), lw=1.2, alpha=0.8)
    handles = [
        Line2D([], [], color="0.25", ls=style, lw=1.5)
        for (_, name), style in zip(panel.keys, _STYLES)
        if name in keys_shown
    ]
    names = [name for _, name in panel.keys if name in keys_shown]
    bounds = _ppo_bounds(runs) if panel.ppo_bounds else []
    for y in bounds:  # a broad grey band under the runs: still visible where a run sits on it
        ax.axhline(y, color="0.6", lw=4, alpha=0.5, zorder=0)
    if bounds:
        handles.append(Line2D([], [], color="0.6", lw=4, alpha=0.5))
        names.append("PPO 1-eps_low, 1+eps_high")
    if len(handles) > 1:  # one metric needs no key: the title and y label name it
        ax.legend(handles, names, fontsize=7, loc="best", framealpha=0.8)
    title = panel.title + (f" (moving avg. of {window}; faint: raw)" if window > 1 else "")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step", fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _render(title: str, panels: list[Panel], runs: list[Run], colours: list[str]) -> bytes:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.3 * nrows + 0.7), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, runs, colours)
    for ax in axes[len(panels) :]:
        ax.remove()
    handles = [Line2D([], [], color=c, lw=2) for c in colours]
    labels = [run.label for run in runs]
    if any(p.guard for p in panels) and any(run.guard_events for run in runs):
        handles.append(Line2D([], [], color="0.25", ls=(0, (1, 2)), lw=1.2))
        labels.append("guard event (run's colour)")
    fig.suptitle(title, fontsize=12)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 5), fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


# -- summary -----------------------------------------------------------------------------------
def summary_row(run: Run) -> dict[str, str]:
    """The summary table's cells for one run (the numbers ``report.md`` shows)."""
    steps = [r["step"] for r in run.records if isinstance(r.get("step"), int)]
    eval_steps, evals = run.series("eval/reward_mean")
    _, rewards = run.series("rollout/reward_mean")
    _, entropy = run.series("train/entropy")
    _, step_times = run.series("perf/step_time_s")
    final_eval = best_eval = "–"
    if evals:
        final_eval = f"{evals[-1]:.3f} (step {eval_steps[-1]})"
        best = max(range(len(evals)), key=lambda i: (evals[i], -i))  # the first best
        best_eval = f"{evals[best]:.3f} (step {eval_steps[best]})"
    last = rewards[-LAST_N_REWARD:]
    return {
        "run": run.label,
        "path": f"`{run.path}`",
        "precision": precision(run.config),
        "steps": str(max(steps, default=0)),
        "final eval": final_eval,
        "best eval": best_eval,
        f"reward (last {LAST_N_REWARD})": f"{sum(last) / len(last):.3f}" if last else "–",
        "entropy first→last": f"{entropy[0]:.3f} → {entropy[-1]:.3f}" if entropy else "–",
        "mean step time": f"{sum(step_times) / len(step_times):.2f} s" if step_times else "–",
        "guard events": str(len(run.guard_events)),
    }


def _breakdown_rows(parent: str, label: str):
    """(label, key) of ``parent``'s nested parts, depth first, labels prefixed by the path."""
    for name, key in PARTS.get(parent, ()):
        yield f"{label}: {name}", key
        yield from _breakdown_rows(key, f"{label}: {name}")


def step_time_breakdown(run: Run) -> dict[str, tuple[float, float]] | None:
    """Mean seconds per step and share of the step time of every phase ``run`` logged (key ->
    (mean, share)), of ``perf/step_time_s`` and of ``perf/other_time_s`` (recomputed as the step
    time no phase accounts for, so runs from before it was logged have it too), over its RL
    steps with a step time; a step without a phase counts 0 for it (so a
    checkpoint every 50 steps shows its amortised cost). None without step times."""
    rows = [
        r
        for r in run.records
        if isinstance(r.get("step"), int) and r["step"] >= 1 and _number(r.get(STEP)) is not None
    ]
    if not rows:
        return None
    total = sum(_number(r[STEP]) for r in rows)
    keys = [key for _, key in PHASES]
    keys += [key for _, parent in PHASES for _, key in _breakdown_rows(parent, "")]
    out = {}
    for key in keys:
        values = [_number(r.get(key)) for r in rows]
        if all(v is None for v in values):
            continue  # never logged by this run: "–", not 0
        seconds = sum(v for v in values if v is not None)
        out[key] = (seconds / len(rows), seconds / total if total > 0 else math.nan)
    phases = sum(out[key][0] for _, key in PHASES if key in out)
    other = max(0.0, total / len(rows) - phases)
    out[OTHER] = (other, other * len(rows) / total if total > 0 else math.nan)
    out[STEP] = (total / len(rows), 1.0)
    return out


def _breakdown_table(runs: list[Run]) -> list[str]:
    """The report's step-time table: one row per phase (nested parts under theirs), one column
    per run with the mean seconds per step and the share of the step time."""
    tables = {run.label: step_time_breakdown(run) for run in runs}
    shown = [run for run in runs if tables[run.label]]
    if not shown:
        return []
    rows, ordered = [], []
    for label, key in PHASES:
        ordered.append((label, key))
        ordered += list(_breakdown_rows(key, label))
    ordered += [("other", OTHER), ("step", STEP)]
    for label, key in ordered:
        if not any(key in tables[run.label] for run in shown):
            continue
        row = {"phase": label, "key": f"`{key}`"}
        for run in shown:
            cell = tables[run.label].get(key)
            row[run.label] = "–" if cell is None else f"{cell[0]:.3g} s ({100 * cell[1]:.1f}%)"
        rows.append(row)
    return _table(rows)


def _table(rows: list[dict[str, str]]) -> list[str]:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(row[c].replace("|", "\\|") for c in cols) + " |")
    return lines


def _markdown(runs: list[Run], figures: list[str], skipped: list[Panel]) -> str:
    lines = ["# Run report", "", *_table([summary_row(run) for run in runs]), ""]
    lines += [
        f"Final eval: the last `eval/reward_mean`; best: its maximum (step 0 is the warm start). "
        f"Reward: mean `rollout/reward_mean` of the last {LAST_N_REWARD} steps. "
        "What each figure shows: `docs/report.md`.",
        "",
    ]
    breakdown = _breakdown_table(runs)
    if breakdown:
        lines += ["## Step-time breakdown", "", *breakdown, ""]
        lines += [
            "Mean seconds per RL step (a step without the phase counts 0) and share of the step "
            "time; a `phase: part` row is a part of its phase's row (not added to the step again). "
            "Other: the step time no phase accounts for. Definitions: `docs/logging.md`.",
            "",
        ]
    events = [(run, ev) for run in runs for ev in run.guard_events]
    if events:
        lines += ["## Guard events", ""]
        lines += _table(
            [
                {
                    "run": run.label,
                    "step": str(ev["step"]),
                    "rule": str(ev.get("rule", "")),
                    "action": str(ev.get("action", "")),
                    "evidence": str(ev.get("evidence", "")).replace("\n", " "),
                }
                for run, ev in events
            ]
        )
        lines.append("")
    lines += ["## Figures", ""]
    for name in figures:
        lines += [f"### {FIGURES[name][0]}", "", f"![{name}]({name}.png)", ""]
    if not figures:
        lines += ["No figure: no run has any of the plotted metrics.", ""]
    lines += ["## Skipped panels", ""]
    if skipped:
        for panel in skipped:
            keys = ", ".join(f"`{k}`" for k, _ in panel.keys)
            lines.append(f"- {panel.title}: no run has {keys}")
    else:
        lines.append("None: every panel had data.")
    return "\n".join(lines) + "\n"


# -- output ------------------------------------------------------------------------------------
def _write(path: Path, data: bytes) -> None:
    """Write a sibling, then rename over ``path``: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ConfigError(
            f"--out {str(out)!r} is not a writable directory ({e.strerror or e})"
        ) from e


def write_report(
    run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None
) -> Path:
    """Write ``report.md`` and the figures with data into ``out``; returns the report's path.

    Every input is checked (``ConfigError``) before anything is written.
    """
    runs = load_runs(run_dirs, labels)
    out = Path(out)
    _check_out_dir(out)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    written, skipped = [], []
    for name, (title, panels) in FIGURES.items():
        shown = []
        for panel in (_resolve(p, runs) for p in panels):
            if _has_data(panel, runs):
                shown.append(panel)
            elif panel not in skipped:
                skipped.append(panel)
        path = out / f"{name}.png"
        if shown:
            _write(path, _render(title, shown, runs, colours))
            written.append(name)
        else:
            path.unlink(missing_ok=True)  # a stale figure of an earlier report would mislead
    report = out / "report.md"
    _write(report, _markdown(runs, written, skipped).encode())
    return report
