"""``megatron-rl-fp8 report``: PNG figures and a Markdown summary that overlay several runs.

The usual input is one task trained in several precision modes (BF16, FP8, FP8 with calibrated
clipping). What the figures show and how to read them: ``docs/report.md``.

Per run directory it reads ``metrics.jsonl``, ``config.yaml`` if present (the precision column of
the table and the PPO reference bounds) and ``guard_events.jsonl`` if present (``metrics/runs.py``).
It writes ``report.md`` and one PNG per figure that has data into ``--out``
(``metrics/figures.py``); a panel that no run has data for is left out and listed in
``report.md``.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.figures import FIGURES, Panel, has_data, render_figure, resolve_panel
from megatron_rl_fp8.metrics.runs import Run, finite_number, load_runs, precision
from megatron_rl_fp8.metrics.step_time import BESIDE, OTHER, PARTS, PHASES, STEP

LAST_N_REWARD = 5  # the "final" training reward is the mean of this many last steps


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
        if isinstance(r.get("step"), int)
        and r["step"] >= 1
        and finite_number(r.get(STEP)) is not None
    ]
    if not rows:
        return None
    total = sum(finite_number(r[STEP]) for r in rows)
    keys = [key for _, key in PHASES]
    keys += [key for _, parent in PHASES for _, key in _breakdown_rows(parent, "")]
    keys += [key for _, key in BESIDE]
    out = {}
    for key in keys:
        values = [finite_number(r.get(key)) for r in rows]
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
    ordered += [("other", OTHER), ("step", STEP), *BESIDE]
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
        for panel in (resolve_panel(p, runs) for p in panels):
            if has_data(panel, runs):
                shown.append(panel)
            elif panel not in skipped:
                skipped.append(panel)
        path = out / f"{name}.png"
        if shown:
            _write(path, render_figure(title, shown, runs, colours))
            written.append(name)
        else:
            path.unlink(missing_ok=True)  # a stale figure of an earlier report would mislead
    report = out / "report.md"
    _write(report, _markdown(runs, written, skipped).encode())
    return report
