"""``megatron-rl-fp8 study --dose-response A.yaml B.yaml ... [--out DIR]``: does FP8's departure
from BF16 grow with the noise, and does calibration remove it?

Every arm but the reference of every study given is one point: x is its measured noise, how much
lower its ratios' 1st percentile (``train/ratio_p01``, mean over steps) lies than the reference's,
paired over seeds, with its 95% interval: the widening of the lower tail the clip acts on. The
table also gives ``fp8/token_mult_prob_error`` (the mean over tokens of exp |logp_rollout -
logp_train|, 1.0 without error), the axis before 2026-12-04: a few tokens several nats off
dominate that mean on a 4-bit grid (docs/reproduction.md, the noise ladder), the percentile is
robust to them. y is, in four panels, its paired
difference from the study's reference arm (BF16) in the A<0 lower-clip share, the A>0 upper-clip
share, the final accuracy and the largest entropy rise, with its interval. Points are coloured by
how the arm clips, read from each run's resolved ``config.yaml``: ``nominal`` (calibration off),
``calibrated (<strategy>)``, ``share`` (the nominal clip set thinned) or ``oracle`` (the clip
decided by the BF16 shadow); a BF16 arm that is not the reference is ``bf16``. Writes
``dose_response.png`` and ``dose_response.md`` (the same numbers as a table) into ``DIR``
(default ``runs/studies/dose_response``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from megatron_rl_fp8.metrics.runs import config_value
from megatron_rl_fp8.study.evidence import load_started
from megatron_rl_fp8.study.report import (
    STATS,
    format_cell,
    loaded_numbers,
    markdown_table,
    palette_png,
)
from megatron_rl_fp8.utils.fs import atomic_write_bytes, atomic_write_text

X_STAT = "ratio_p01"  # its difference from the reference: how far the lower tail widened
MISMATCH_STAT = "token_mult_prob_error"
X_LABEL = "ratio p01 − BF16 (lower tail widening; mean over steps)"
Y_STATS = ("neg_lower_clip_share", "pos_upper_clip_share", "final_accuracy", "max_entropy_rise")
DEFAULT_OUT = Path("runs") / "studies" / "dose_response"


def clip_mode(config: dict) -> str:
    """How a run decides its clip: ``bf16``, ``nominal``, ``oracle``, ``share`` or
    ``calibrated (rule)``."""
    if not config_value(config, "fp8.recipe"):
        return "bf16"
    if config_value(config, "loss.calib.enabled") is False:
        return "nominal"
    if config_value(config, "loss.calib.mode") in ("oracle", "share"):
        return config_value(config, "loss.calib.mode")
    return f"calibrated ({config_value(config, 'loss.calib.strategy')})"


def dose_points(paths: list[str | Path]) -> list[dict]:
    """One point per (study, arm other than the reference): setting, arm, mode, seeds, ``x`` (the
    arm's noise interval) and ``y`` (statistic -> its difference from the reference)."""
    points = []
    for path in paths:
        study, loaded = load_started(path)
        numbers = loaded_numbers(loaded, study.reference)["arms"]
        for arm, runs in loaded.items():
            if arm == study.reference:
                continue
            modes = {clip_mode(run.config) for run in runs.values()}
            points.append(
                {
                    "setting": study.name,
                    "arm": arm,
                    "mode": " / ".join(sorted(modes)),
                    "seeds": len(runs),
                    "x": numbers[arm]["diff"][X_STAT],
                    "mismatch": numbers[arm]["stats"][MISMATCH_STAT],
                    "y": {k: numbers[arm]["diff"][k] for k in Y_STATS},
                }
            )
    return points


def _errors(iv: dict) -> tuple[float, float] | None:
    if iv["mean"] is None:
        return None
    if iv["lo"] is None:
        return 0.0, 0.0
    return iv["mean"] - iv["lo"], iv["hi"] - iv["mean"]


def render(points: list[dict], title: str) -> bytes:
    """The four panels as a PNG: per mode, each point with its x and y intervals."""
    from matplotlib.figure import Figure  # lazy: matplotlib (~1 s) only when a figure is drawn

    modes = sorted({p["mode"] for p in points})
    colours = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    fig = Figure(figsize=(9.0, 6.8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, stat in zip(axes, Y_STATS):
        ax.axhline(0.0, color="0.4", lw=0.8)
        if not any(_errors(p["x"]) and _errors(p["y"][stat]) for p in points):
            ax.text(0.5, 0.5, "no run logs this", ha="center", transform=ax.transAxes)
        for mode in modes:
            pts = [
                p for p in points if p["mode"] == mode and _errors(p["x"]) and _errors(p["y"][stat])
            ]
            if not pts:
                continue
            xs = [p["x"]["mean"] for p in pts]
            ys = [p["y"][stat]["mean"] for p in pts]
            xerr = list(zip(*(_errors(p["x"]) for p in pts)))
            yerr = list(zip(*(_errors(p["y"][stat]) for p in pts)))
            ax.errorbar(
                xs, ys, xerr=xerr, yerr=yerr, fmt="o", ms=4, capsize=2, color=colours[mode],
                label=mode,
            )  # fmt: skip
        ax.set_title(f"{STATS[stat][0]} − BF16", fontsize=10)
        ax.set_xlabel(X_LABEL, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    # Two lines: the settings' names alone can outrun the figure's width.
    fig.suptitle(
        f"{textwrap.shorten(title, 110)}\nmean and 95% interval over seeds (paired differences)",
        fontsize=10,
    )
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4))
    return palette_png(fig)


def markdown(points: list[dict], title: str) -> str:
    header = ["setting", "arm", "mode", "seeds", f"{STATS[X_STAT][0]} − BF16"]
    header += [STATS[MISMATCH_STAT][0]]
    header += [f"{STATS[k][0]} − BF16" for k in Y_STATS]
    rows = [
        [
            p["setting"],
            p["arm"],
            p["mode"],
            str(p["seeds"]),
            format_cell(p["x"], STATS[X_STAT][1], p["seeds"], True),
            format_cell(p["mismatch"], STATS[MISMATCH_STAT][1], p["seeds"]),
            *(format_cell(p["y"][k], STATS[k][1], p["seeds"], True) for k in Y_STATS),
        ]
        for p in sorted(points, key=lambda p: (p["mode"], -(p["x"]["mean"] or 0.0)))
    ]
    note = (
        "Cells: mean [95% interval] over seeds; differences are paired over seeds with the "
        "study's reference arm; `*`: the interval excludes 0. Figure: dose_response.png."
    )
    return "\n".join([f"# {title}", "", *markdown_table(header, rows), "", note]) + "\n"


def write_dose_response(paths: list[str | Path], out: str | Path | None = None) -> Path:
    """Write ``dose_response.png`` and ``.md`` for the studies ``paths`` into ``out``; returns
    the markdown's path. Every study is checked before anything is written."""
    points = dose_points(paths)
    out = Path(out) if out is not None else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    title = "Dose response: " + ", ".join(sorted({p["setting"] for p in points}))
    atomic_write_bytes(out / "dose_response.png", render(points, title))
    md = out / "dose_response.md"
    atomic_write_text(md, markdown(points, title))
    return md
