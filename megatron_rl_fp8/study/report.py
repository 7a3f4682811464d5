"""A study's report: precision arms x seeds, as means with 95% intervals over seeds.

One RL run is one draw of a noisy process, so a study trains every *arm* (a precision setting:
bf16, fp8_nominal, fp8_calibrated, ...) with several seeds, and every number here is a mean over
seeds with an interval. Each (arm, seed) is an ordinary run directory (``metrics.jsonl``,
``config.yaml``, maybe ``guard_events.jsonl``); a value that is not a finite number is missing.

Per run (``run_stats``; None where the run lacks the data):
- ``sft_loss``: ``sft/final_loss``, the warm start's loss (logged with the first step);
  ``start_accuracy``: ``eval/reward_mean`` at the first eval step (step 0: the warm start's).
- ``final_accuracy`` / ``best_accuracy``: ``eval/reward_mean`` at the last eval step / its maximum.
- ``accuracy_auc``: the trapezoid area under the eval curve over steps, divided by (last - first
  eval step): the time-mean accuracy, which credits learning early (None with < 2 eval points).
- ``max_entropy_rise``: max over t of H_t - min_{s<=t} H_s, with H = ``train/entropy``.
- ``entropy_rule_step``: the first t with H_t - min_{s<t} H_s > ``guard.max_entropy_rise`` (1.0
  where config.yaml leaves it unset): where a guard that saw the whole history would fire. The
  trainer's guard looks back ``guard.window`` healthy steps only, so it may fire later or never.
- Means over steps (``STEP_MEANS``): clip shares by side and advantage sign, ratio quantiles,
  garbled share, FP8 mismatch, useful tokens/s.
- ``guard_events``: events in ``guard_events.jsonl`` (0 without one); ``steps``: the last step.

Per arm (``interval``): n (the seeds that have the statistic), the mean, and the 95% Student-t
interval mean +- t_{0.975, n-1} sd / sqrt(n), sd with n - 1 (no interval for n = 1).

Difference from the reference arm (``difference``): an arm run with exactly the reference's seeds
is *paired*, seed by seed (same seed = same warm start, sampling seeds and prompt order, so the seed-to-seed noise
cancels): the interval above over the per-seed differences, when >= 2 seeds have the statistic in
both. Otherwise Welch's interval: d = m_a - m_r, se^2 = s_a^2/n_a + s_r^2/n_r, t at the
Welch-Satterthwaite df = se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_r^2/n_r)^2/(n_r-1)).

``t_quantile`` is scipy's t distribution, so Welch's fractional df need no table.
"""

from __future__ import annotations

import io
import json
import math
from functools import lru_cache
from pathlib import Path

from scipy.stats import t as student_t

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.figures import DPI
from megatron_rl_fp8.metrics.logger import EVENTS_FILE, METRICS_FILE, read_metrics
from megatron_rl_fp8.metrics.runs import (
    Run,
    config_value,
    finite_number,
    read_guard_events,
    read_run_config,
)
from megatron_rl_fp8.utils.fs import atomic_write_bytes, atomic_write_text

EVAL = "eval/reward_mean"
ENTROPY = "train/entropy"
DEFAULT_ENTROPY_RISE = 1.0  # GuardConfig.max_entropy_rise's default
STATISTIC = (
    "mean and 95% Student-t interval over seeds; "
    "differences: paired t over shared seeds, else Welch"
)
# Per-run means over steps: statistic -> metric key.
STEP_MEANS = {
    "neg_lower_clip_share": "train/pg_clipfrac_neg_lower",
    "pos_upper_clip_share": "train/pg_clipfrac_pos_upper",
    "ratio_p01": "train/ratio_p01",
    "ratio_p50": "train/ratio_p50",
    "ratio_p99": "train/ratio_p99",
    "garbled_share": "rollout/garbled_frac",
    "token_mult_prob_error": "fp8/token_mult_prob_error",
    "useful_tokens_per_s": "perf/useful_tokens_per_s",
    # Multi-turn runs (env.tools) only: None elsewhere, and their table is left out.
    "tool_use_share": "rollout/tool_used_frac",
    "turns_mean": "rollout/turns_mean",
    # Mixture-of-experts runs only (rollout.routing_replay measure / replay for the first).
    "routing_mismatch": "moe/routing_mismatch",
    "expert_load_max": "moe/load_max_over_mean",
}
# Every statistic in report order: its column label and number format.
STATS: dict[str, tuple[str, str]] = {
    "sft_loss": ("SFT loss", ".3f"),
    "start_accuracy": ("start acc.", ".3f"),
    "final_accuracy": ("final acc.", ".3f"),
    "best_accuracy": ("best acc.", ".3f"),
    "accuracy_auc": ("acc. AUC", ".3f"),
    "max_entropy_rise": ("max entropy rise", ".3f"),
    "entropy_rule_step": ("entropy rule step", ".1f"),
    "guard_events": ("guard events", ".2f"),
    "neg_lower_clip_share": ("A<0 lower clip", ".4f"),
    "pos_upper_clip_share": ("A>0 upper clip", ".4f"),
    "ratio_p01": ("ratio p01", ".4f"),
    "ratio_p50": ("ratio p50", ".4f"),
    "ratio_p99": ("ratio p99", ".4f"),
    "garbled_share": ("garbled", ".3f"),
    "token_mult_prob_error": ("mult. prob. error", ".4f"),
    "useful_tokens_per_s": ("useful tok/s", ".4g"),
    "steps": ("steps", ".1f"),
    "tool_use_share": ("sampled tool use", ".3f"),
    "final_tool_use": ("final eval tool use", ".3f"),
    "turns_mean": ("turns", ".3f"),
    "routing_mismatch": ("routing mismatch", ".4f"),
    "expert_load_max": ("busiest expert / mean", ".3f"),
}
TABLES = {  # report.md's per-arm and difference tables: heading -> columns
    "Accuracy and stability": list(STATS)[:8],
    "Clipping, mismatch and throughput": list(STATS)[8:16],
    "Tool use": ["tool_use_share", "final_tool_use", "turns_mean"],
    "Mixture of experts": ["routing_mismatch", "expert_load_max"],
}
OPTIONAL_TABLES = ("Tool use", "Mixture of experts")  # shown only where some run has values
# Panels of curves.png: metric key -> title. Eval steps are sparse, so that panel has markers.
CURVES = {
    EVAL: "Validation accuracy",
    ENTROPY: "Entropy",
    "train/pg_clipfrac_neg_lower": "Lower-clip share of A<0 tokens",
    "train/pg_clipfrac_pos_upper": "Upper-clip share of A>0 tokens",
    "rollout/reward_mean": "Training reward",
    "fp8/token_mult_prob_error": "Rollout vs train mult. prob. error",
}


# -- the t distribution ------------------------------------------------------------------------
@lru_cache(maxsize=256)
def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` (> 0, may be fractional) degrees of freedom."""
    if not (0.0 < q < 1.0 and df > 0):
        raise ValueError(f"t_quantile needs 0 < q < 1 and df > 0, got q={q}, df={df}")
    return float(student_t.ppf(q, df))


# -- intervals ---------------------------------------------------------------------------------
def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def interval(values: list[float | None]) -> dict:
    """n, mean and the 95% t interval (lo, hi) of the values that are not None."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "lo": None, "hi": None}
    m, sd = _mean_sd(xs)
    if len(xs) == 1:
        return {"n": 1, "mean": m, "lo": None, "hi": None}
    half = t_quantile(0.975, len(xs) - 1) * sd / math.sqrt(len(xs))
    return {"n": len(xs), "mean": m, "lo": m - half, "hi": m + half}


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's 95% interval of mean(a) - mean(b); none unless both have >= 2 values."""
    out = {"n": len(a), "n_ref": len(b), "mean": None, "lo": None, "hi": None, "df": None}
    if not a or not b:
        return out
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    out["mean"] = ma - mb
    if len(a) < 2 or len(b) < 2:
        return out  # no spread to estimate on one side
    va, vb = sa * sa / len(a), sb * sb / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:  # both arms constant: the difference is exact
        out.update(lo=out["mean"], hi=out["mean"], df=float(len(a) + len(b) - 2))
        return out
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    half = t_quantile(0.975, df) * se
    out.update(lo=out["mean"] - half, hi=out["mean"] + half, df=df)
    return out


def difference(arm: dict[int, float | None], ref: dict[int, float | None]) -> dict:
    """arm - reference for one statistic, ``{seed: value}`` each: paired when the arm has the
    reference's seeds and >= 2 of them have the value in both, else Welch."""
    shared = [s for s in arm if arm[s] is not None and ref.get(s) is not None]
    if set(arm) == set(ref) and len(shared) >= 2:
        out = interval([arm[s] - ref[s] for s in shared])
        return {**out, "n_ref": out["n"], "df": float(out["n"] - 1), "test": "paired"}
    a = [v for v in arm.values() if v is not None]
    b = [v for v in ref.values() if v is not None]
    return {**welch(a, b), "test": "welch"}


# -- per run -----------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def accuracy_stats(steps: list[int], acc: list[float]) -> dict[str, float | None]:
    """start, final, best and time-mean (trapezoid) accuracy of one eval curve."""
    if not steps:
        return {
            "start_accuracy": None,
            "final_accuracy": None,
            "best_accuracy": None,
            "accuracy_auc": None,
        }
    auc = None
    if len(steps) >= 2 and steps[-1] > steps[0]:
        area = sum(
            (s1 - s0) * (a0 + a1) / 2 for s0, s1, a0, a1 in zip(steps, steps[1:], acc, acc[1:])
        )
        auc = area / (steps[-1] - steps[0])
    return {
        "start_accuracy": acc[0],
        "final_accuracy": acc[-1],
        "best_accuracy": max(acc),
        "accuracy_auc": auc,
    }


def entropy_stats(steps: list[int], entropy: list[float], limit: float) -> dict:
    """The largest rise above the running minimum, and the first step the rise exceeds ``limit``
    (the minimum over earlier steps only: the rule compares a step with its past)."""
    if not steps:
        return {"max_entropy_rise": None, "entropy_rule_step": None}
    rise, rule_step, low = 0.0, None, math.inf
    for step, h in zip(steps, entropy):
        if rule_step is None and h - low > limit:
            rule_step = step
        low = min(low, h)
        rise = max(rise, h - low)
    return {"max_entropy_rise": rise, "entropy_rule_step": rule_step}


def run_stats(run: Run) -> dict[str, float | None]:
    """Every statistic of ``STATS`` for one run (None where the run lacks the data)."""
    limit = finite_number(config_value(run.config, "guard.max_entropy_rise"))
    limit = DEFAULT_ENTROPY_RISE if limit is None else limit
    out = {**accuracy_stats(*run.series(EVAL)), **entropy_stats(*run.series(ENTROPY), limit)}
    for name, key in STEP_MEANS.items():
        out[name] = _mean(run.series(key)[1])
    out["final_tool_use"] = next(reversed(run.series("eval/tool_used_frac")[1]), None)
    out["sft_loss"] = next(iter(run.series("sft/final_loss")[1]), None)
    out["guard_events"] = len(run.guard_events)
    steps = [r["step"] for r in run.records if isinstance(r.get("step"), int)]
    out["steps"] = max(steps, default=None)
    return {name: out[name] for name in STATS}


def load_arms(arms: dict[str, dict[int, Path]], reference: str) -> dict[str, dict[int, Run]]:
    """Every run of the study, checked first: a missing metrics file is a ``ConfigError``."""
    if reference not in arms:
        raise ConfigError(f"reference arm {reference!r} is not one of the arms {list(arms)}")
    loaded: dict[str, dict[int, Run]] = {}
    for arm, seeds in arms.items():
        if not seeds:
            raise ConfigError(f"arm {arm!r} has no seeds (no run directory to report)")
        loaded[arm] = {}
        for seed in sorted(seeds):
            p = Path(seeds[seed])
            if not (p / METRICS_FILE).is_file():
                raise ConfigError(
                    f"arm {arm!r} seed {seed}: {str(p)!r} has no {METRICS_FILE} (did the run "
                    "start? rerun it, or leave the seed out)"
                )
            records = [r for r in read_metrics(p) if isinstance(r, dict)]
            # records=[]: no events file means no events here (not the metrics' guard keys).
            events = read_guard_events(p, []) if (p / EVENTS_FILE).is_file() else []
            loaded[arm][seed] = Run(f"{arm} seed {seed}", p, records, read_run_config(p), events)
    return loaded


def loaded_numbers(loaded: dict[str, dict[int, Run]], reference: str) -> dict:
    """``study_numbers`` over runs already loaded (``load_arms``)."""
    per_run = {arm: {s: run_stats(r) for s, r in runs.items()} for arm, runs in loaded.items()}
    ref = per_run[reference]
    out = {}
    for arm, runs in per_run.items():
        by_seed = {k: {s: r[k] for s, r in runs.items()} for k in STATS}
        ref_by_seed = {k: {s: r[k] for s, r in ref.items()} for k in STATS}
        out[arm] = {
            "seeds": list(runs),
            "runs": {str(s): stats for s, stats in runs.items()},  # str: JSON object keys
            "stats": {k: interval(list(by_seed[k].values())) for k in STATS},
            "diff": {}
            if arm == reference
            else {k: difference(by_seed[k], ref_by_seed[k]) for k in STATS},
        }
    return {"reference": reference, "statistic": STATISTIC, "arms": out}


def study_numbers(arms: dict[str, dict[int, Path]], reference: str) -> dict:
    """The study's numbers (what ``study.json`` holds): per arm its seeds, every run's statistics
    (``runs``, keyed by str(seed)), the per-arm intervals (``stats``: n, mean, lo, hi) and the
    differences from ``reference`` (``diff``: also n_ref, df, test; empty for the reference).
    Missing values are None."""
    return loaded_numbers(load_arms(arms, reference), reference)


# -- figure ------------------------------------------------------------------------------------
def seed_band(runs: list[Run], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, lo, hi) over seeds at each step; lo, hi are nan where < 2 seeds have it."""
    per_step: dict[int, list[float]] = {}
    for run in runs:
        for step, v in zip(*run.series(key)):
            per_step.setdefault(step, []).append(v)
    steps = sorted(per_step)
    ivs = [interval(per_step[s]) for s in steps]
    mean, lo, hi = (
        [math.nan if iv[k] is None else iv[k] for iv in ivs] for k in ("mean", "lo", "hi")
    )
    return steps, mean, lo, hi


def _render(title: str, keys: list[str], loaded: dict[str, dict[int, Run]]) -> bytes:
    # lazy: matplotlib (~1 s) only when a figure is drawn
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    colours = {arm: f"C{i % 10}" for i, arm in enumerate(loaded)}  # one colour per arm
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.4 * ncols, 3.1 * nrows + 0.7), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        for arm, runs in loaded.items():
            steps, mean, lo, hi = seed_band(list(runs.values()), key)
            if not steps:
                continue
            marker = "o" if key == EVAL or len(steps) == 1 else None  # one point: no line
            ax.plot(steps, mean, color=colours[arm], lw=1.5, marker=marker, ms=3)
            ax.fill_between(steps, lo, hi, color=colours[arm], alpha=0.2, lw=0)
        ax.set_title(CURVES[key], fontsize=10)
        ax.set_xlabel("RL step", fontsize=8)
        ax.set_ylabel(key, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.remove()
    handles = [Line2D([], [], color=c, lw=2) for c in colours.values()]
    labels = [f"{arm} ({len(runs)} seeds)" for arm, runs in loaded.items()]
    fig.suptitle(f"{title}: mean over seeds, band 95% t interval", fontsize=12)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 5), fontsize=9)
    return palette_png(fig)


def palette_png(fig) -> bytes:
    """``fig`` as a 64-colour palette PNG: noisy curves under seed bands make an RGBA PNG of
    ~300 KB; a palette keeps them under ~100 KB and loses nothing a plot needs."""
    from PIL import Image  # lazy: matplotlib's own dependency, only when a figure is saved

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    image = image.quantize(64, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    buf = io.BytesIO()
    image.save(buf, format="png", optimize=True)
    return buf.getvalue()


# -- report.md ---------------------------------------------------------------------------------
def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def format_cell(iv: dict, spec: str, seeds: int, mark: bool = False) -> str:
    """The cell ``mean [lo, hi]``, with ``(n=k)`` where only k of the seeds have the value and
    (``mark``) a ``*`` where the interval excludes 0."""
    if iv["mean"] is None:
        return "–"
    text = _fmt(iv["mean"], spec)
    if iv["lo"] is not None:
        text += f" [{_fmt(iv['lo'], spec)}, {_fmt(iv['hi'], spec)}]"
        if mark and (iv["lo"] > 0 or iv["hi"] < 0):
            text += " *"
    return text + (f" (n={iv['n']})" if iv["n"] != seeds else "")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def _markdown(title: str, numbers: dict, figure: bool, skipped: list[str]) -> str:
    arms, ref = numbers["arms"], numbers["reference"]
    lines = [f"# {title}", "", f"Statistic: {STATISTIC}; reference arm: `{ref}`.", ""]
    for heading, cols in TABLES.items():
        absent = all(a["stats"][c]["mean"] is None for a in arms.values() for c in cols)
        if heading in OPTIONAL_TABLES and absent:
            continue
        header = ["arm", "seeds", *(STATS[c][0] for c in cols)]
        rows = []
        for arm, a in arms.items():
            n = len(a["seeds"])
            rows.append([arm, str(n), *(format_cell(a["stats"][c], STATS[c][1], n) for c in cols)])
        lines += [f"## {heading}", "", *markdown_table(header, rows), ""]
        diff_rows = []
        for arm, a in arms.items():
            if arm == ref:
                continue
            tests = sorted({a["diff"][c]["test"] for c in cols if a["diff"][c]["mean"] is not None})
            cells = [format_cell(a["diff"][c], STATS[c][1], len(a["seeds"]), True) for c in cols]
            diff_rows.append([arm, "/".join(tests), *cells])
        if diff_rows:
            header = ["arm", "test", *(STATS[c][0] for c in cols)]
            lines += [f"### Difference from `{ref}`", "", *markdown_table(header, diff_rows), ""]
    lines += [
        "Cells: mean [95% interval] over seeds; (n=k) where only k seeds have the value; "
        "`*`: the difference's interval excludes 0. Accuracy AUC: the time-mean of the eval "
        "curve. Entropy rule step: the first step entropy rose more than guard.max_entropy_rise "
        "above its running minimum (mean over the seeds where it did).",
        "",
        "## Runs",
        "",
    ]
    cols = {"final_accuracy": ".3f", "max_entropy_rise": ".3f", "guard_events": "d", "steps": "d"}
    rows = [
        [arm, seed, *(_fmt(stats[c], spec) for c, spec in cols.items())]
        for arm, a in arms.items()
        for seed, stats in a["runs"].items()
    ]
    lines += [*markdown_table(["arm", "seed", *(STATS[c][0] for c in cols)], rows), ""]
    lines += ["## Curves", ""]
    lines += ["![curves](curves.png)", ""] if figure else ["No figure: no run has the metrics.", ""]
    if skipped:
        lines += ["Skipped panels (no run has the metric): " + ", ".join(f"`{k}`" for k in skipped)]
    return "\n".join(lines) + "\n"


def write_study_report(
    arms: dict[str, dict[int, Path]], reference: str, out: Path, title: str
) -> Path:
    """Write ``report.md``, ``study.json`` (``study_numbers``) and ``curves.png`` into ``out``;
    returns the report's path. Every input is checked (``ConfigError``) before anything is written."""
    loaded = load_arms(arms, reference)
    numbers = loaded_numbers(loaded, reference)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for seeds in loaded.values() for r in seeds.values()]
    shown = [k for k in CURVES if any(r.series(k)[0] for r in runs)]
    skipped = [k for k in CURVES if k not in shown]
    png = out / "curves.png"
    if shown:
        atomic_write_bytes(png, _render(title, shown, loaded))
    else:
        png.unlink(missing_ok=True)  # a stale figure of an earlier report would mislead
    atomic_write_text(out / "study.json", json.dumps(numbers, indent=1, allow_nan=False) + "\n")
    report = out / "report.md"
    atomic_write_text(report, _markdown(title, numbers, bool(shown), skipped))
    return report
