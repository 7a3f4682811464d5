"""The report's figures: a table of ``Panel`` specs (``FIGURES``) drawn by one function,
``_draw_panel``. Each run keeps one colour in every figure; inside a panel, each metric of the
panel has one line style. What the figures show and how to read them: ``docs/report.md``.

Only this module imports matplotlib, and only when a figure is rendered (Agg canvas, no pyplot, so
nothing global changes in the calling process).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from megatron_rl_fp8.metrics.runs import RESPONSE_TOKENS_PER_S, Run, config_value, finite_number

USEFUL_TOKENS_PER_S = "perf/useful_tokens_per_s"
_STYLES = ("-", "--", ":", "-.")
DPI = 80  # a 3x2 overview is then ~1200 px wide: readable, and ~100-150 KB


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
KEEP = Panel(
    "Share-mode keep fractions",
    "calib/keep_neg_lower, calib/keep_pos_upper",
    (("calib/keep_neg_lower", "A<0, lower"), ("calib/keep_pos_upper", "A>0, upper")),
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
# THROUGHPUT's stand-in when a run lacks its key (see resolve_panel): one definition per panel.
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
        (CLIP_BY_SIGN, CLIP_BY_SIDE, BOUNDS, KEEP, RATIO_OUTLIERS, RATIO_QUANTILES),
    ),
    "mismatch": ("Rollout vs train mismatch", (MISMATCH, KL, GARBLED)),
    "throughput": ("Throughput", (THROUGHPUT, STEP_TIME)),
}


def resolve_panel(panel: Panel, runs: list[Run]) -> Panel:
    """The panel to draw for ``panel``: THROUGHPUT falls back to RESPONSE_THROUGHPUT for every run
    when one run with step times lacks ``perf/useful_tokens_per_s`` (the two count different
    tokens, so one panel never mixes them)."""
    if panel is THROUGHPUT and any(
        run.series("perf/step_time_s")[0] and not run.series(USEFUL_TOKENS_PER_S)[0] for run in runs
    ):
        return RESPONSE_THROUGHPUT
    return panel


def has_data(panel: Panel, runs: list[Run]) -> bool:
    """Whether any run has any of ``panel``'s keys (a panel without data is left out)."""
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
        lo = finite_number(config_value(run.config, "loss.eps_low"))
        hi = finite_number(config_value(run.config, "loss.eps_high"))
        if lo is not None and hi is not None:
            bounds.update((round(1.0 - lo, 6), round(1.0 + hi, 6)))
    return sorted(bounds)


def _draw_panel(ax, panel: Panel, runs: list[Run], colours: list[str]) -> None:
    from matplotlib.lines import Line2D  # lazy: matplotlib (~1 s) only when a figure is drawn

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


def render_figure(title: str, panels: list[Panel], runs: list[Run], colours: list[str]) -> bytes:
    """One figure as PNG bytes: ``panels`` in a grid of up to 3 columns, ``runs`` in ``colours``
    (one each) and one legend of the runs under it."""
    # lazy: matplotlib (~1 s) only when a figure is drawn; `study` imports this module for DPI
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
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
