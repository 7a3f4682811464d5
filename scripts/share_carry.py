"""How stale does the share mode's keep fraction get? Measured on a study's oracle runs.

``loss.calib.mode=share`` (loss/thinning.py) keeps the nominal bounds and clips, per advantage
sign, the fraction ``keep = BF16's clipped count / FP8's`` of the tokens FP8 puts past them,
measured at a calibration and carried to the next one. The oracle decides every clip by the BF16
ratio and now also logs what the FP8 ratio alone would clip (``train/pg_clipfrac_*_carrying``),
so each oracle step gives BF16's share ``b(t)`` and FP8's ``f(t)`` on the same tokens, and the
keep fraction that step needed, ``k(t) = b / f``.

For each sign this prints, over the study's seeds (mean and 95% t interval):
* the trend of ``k(t)`` over the run (its least-squares slope per 100 steps) and how much of the
  step-to-step spread of ``k`` is lost after 20 steps (lag-20 autocorrelation);
* the share mode replayed on the oracle's steps: a keep fraction measured at each calibration
  step (EMA-smoothed shares, as the mode smooths counts), applied to the FP8 shares of the steps
  up to the next, and the resulting clip share minus BF16's (mean over steps), for the
  schedules of ``share_memory_noisy.yaml``; and in-sample (each step's own keep).

A replay on per-step shares is an approximation of the mode (which counts tokens per mini-batch
and rounds per row); it says what the carried fraction alone does on one trajectory.

    python scripts/share_carry.py examples/studies/share_memory_noisy.yaml [--out DIR] [--arm ARM]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import read_metrics
from megatron_rl_fp8.study.report import format_cell, interval, markdown_table
from megatron_rl_fp8.study.runner import load_study

SIGNS = {
    "A<0 lower": ("train/pg_clipfrac_neg_lower", "train/pg_clipfrac_neg_lower_carrying"),
    "A>0 upper": ("train/pg_clipfrac_pos_upper", "train/pg_clipfrac_pos_upper_carrying"),
}
SCHEDULES = {  # name -> (calibration interval, EMA decay of the shares)
    "every 20, EMA 0.5 (default)": (20, 0.5),
    "every 20, no EMA": (20, 0.0),
    "every 5, no EMA": (5, 0.0),
    "every 5, EMA 0.8": (5, 0.8),
    "every 5, pooled": (5, None),
    "every 20, pooled": (20, None),
}


def keep_fraction(b: float, f: float) -> float:
    """As the mode's: BF16's over FP8's, at most 1, 1 where FP8 clips none."""
    return 1.0 if f <= 0 else min(1.0, b / f)


def replay(b: list[float], f: list[float], interval_: int, decay: float | None) -> float:
    """Mean over steps of (carried keep x FP8 share - BF16 share); steps are 1, 2, ...; the
    calibration steps 1, 1 + interval, ... measure on themselves, as the mode does. ``decay``
    None pools: the shares add up over every calibration so far, each weighing the same."""
    sb = sf = None
    out = []
    for t, (bt, ft) in enumerate(zip(b, f)):
        if t % interval_ == 0:
            if decay is None:
                sb, sf = (sb or 0.0) + bt, (sf or 0.0) + ft
            else:
                sb = bt if sb is None else decay * sb + (1 - decay) * bt
                sf = ft if sf is None else decay * sf + (1 - decay) * ft
        out.append(keep_fraction(sb, sf) * ft - bt)
    return sum(out) / len(out)


def slope_per_100(ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` against their index, per 100 steps."""
    pts = [(i, y) for i, y in enumerate(ys) if y is not None]
    if len(pts) < 3:
        return None
    mx = sum(i for i, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((i - mx) ** 2 for i, _ in pts)
    return 100 * sum((i - mx) * (y - my) for i, y in pts) / sxx if sxx else None


def autocorrelation(ys: list[float], lag: int) -> float | None:
    pairs = [(a, c) for a, c in zip(ys, ys[lag:]) if a is not None and c is not None]
    if len(pairs) < 3:
        return None
    ma = sum(a for a, _ in pairs) / len(pairs)
    mc = sum(c for _, c in pairs) / len(pairs)
    cov = sum((a - ma) * (c - mc) for a, c in pairs)
    va = sum((a - ma) ** 2 for a, _ in pairs)
    vc = sum((c - mc) ** 2 for _, c in pairs)
    return cov / math.sqrt(va * vc) if va and vc else None


def series(run_dir: Path, key: str) -> list[float]:
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int) and r["step"] >= 1]
    if rows and key not in rows[0]:
        raise SystemExit(f"{run_dir}: no {key} in metrics.jsonl (an oracle run of this version?)")
    return [float(r[key]) for r in sorted(rows, key=lambda r: r["step"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study file whose runs to read")
    parser.add_argument("--out", help="its study directory (default runs/studies/<name>)")
    parser.add_argument("--arm", default="fp8_oracle", help="the oracle arm (default fp8_oracle)")
    args = parser.parse_args(argv)
    try:
        study = load_study(args.study, args.out)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    runs = study.started_runs().get(args.arm)
    if not runs:
        raise SystemExit(f"{study.out}: no run of arm {args.arm!r}; run the study first")
    n = len(runs)
    header = ["sign", "statistic", f"mean [95% interval] over {n} seeds"]
    rows = []
    for sign, (bf16_key, fp8_key) in SIGNS.items():
        per_seed = {}
        for path in runs.values():
            b, f = series(path, bf16_key), series(path, fp8_key)
            k = [None if ft <= 0 else bt / ft for bt, ft in zip(b, f)]
            stats = {
                "BF16 clip share": sum(b) / len(b),
                "FP8 clip share at the nominal bounds": sum(f) / len(f),
                "keep k(t): mean over steps with FP8 clips": (
                    sum(x for x in k if x is not None) / max(1, sum(x is not None for x in k))
                ),
                "keep k(t): slope per 100 steps": slope_per_100(k),
                "keep k(t): lag-20 autocorrelation": autocorrelation(k, 20),
                "in-sample replay: clip share - BF16's": replay(b, f, 1, 0.0),
            }
            for name, (every, decay) in SCHEDULES.items():
                stats[f"replay {name}: clip share - BF16's"] = replay(b, f, every, decay)
            for name, v in stats.items():
                per_seed.setdefault(name, []).append(v)
        for name, values in per_seed.items():
            rows.append(
                [sign, name, format_cell(interval(values), ".4f", n, mark="replay" in name)]
            )
    print("\n".join(markdown_table(header, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
