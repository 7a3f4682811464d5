"""``megatron-rl-fp8 study --evidence A.yaml B.yaml ...``: which calibration rule may be the default.

One row per (setting, FP8 arm), a setting being one study (the shipped job, an off-policy one, a
noisy one), from the runs each study has. The question each row answers is the one a user asks
before turning calibration on: does it ever do worse than leaving it off, and does it bring what
the clip removes back to BF16's? So the columns are paired differences over seeds:

- ``final acc.`` and ``acc. AUC`` minus the *nominal* arm's (full FP8 with the nominal bounds, no
  calibration): a rule fails when the interval lies wholly below 0;
- the A<0 lower-clip and A>0 upper-clip shares minus the *reference* arm's (BF16): a rule fails a
  sign when the interval excludes 0 (it clips that sign differently from BF16);
- for context, final accuracy and the largest entropy rise minus BF16's: where nominal FP8 departs
  from BF16 at all.

A difference with fewer than two paired seeds has no interval and decides nothing (shown as
``?``). The statistic is report.py's (paired t over shared seeds, else Welch).
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.study.report import (
    STATS,
    format_cell,
    load_arms,
    loaded_numbers,
    markdown_table,
)
from megatron_rl_fp8.study.runner import Study, load_study

VS_NOMINAL = ("final_accuracy", "accuracy_auc")
VS_BF16 = ("final_accuracy", "max_entropy_rise", "neg_lower_clip_share", "pos_upper_clip_share")
CLIP_SIGNS = {"neg_lower_clip_share": "A<0", "pos_upper_clip_share": "A>0"}


def _below(iv: dict) -> bool | None:
    return None if iv["hi"] is None else iv["hi"] < 0


def _excludes_zero(iv: dict) -> bool | None:
    return None if iv["lo"] is None else (iv["lo"] > 0 or iv["hi"] < 0)


def verdict(vs_nominal: dict[str, dict] | None, vs_bf16: dict[str, dict]) -> str:
    """``ok``, ``?`` (too few seeds to tell), or what failed: below nominal in a statistic of
    ``VS_NOMINAL``, or a sign whose clip share differs from BF16's."""
    failed, unknown = [], False
    for stat, iv in (vs_nominal or {}).items():
        below = _below(iv)
        unknown |= below is None
        if below:
            failed.append(f"{STATS[stat][0]} below nominal")
    for stat, sign in CLIP_SIGNS.items():
        off = _excludes_zero(vs_bf16[stat])
        unknown |= off is None
        if off:
            failed.append(f"{sign} clip share != BF16")
    return "; ".join(failed) if failed else ("?" if unknown else "ok")


def load_started(path: str | Path, nominal: str | None = None) -> tuple[Study, dict]:
    """The study at ``path`` and its started runs, loaded (``load_arms``); a one-line
    ``ConfigError`` when the reference arm (or the ``nominal`` one) is missing or has no runs."""
    study = load_study(path)
    arms = study.started_runs()
    where = f"study {study.name} ({study.out})"
    needs = [(study.reference, "reference")] + ([(nominal, "nominal")] if nominal else [])
    for need, what in needs:
        if need not in study.arms:
            raise ConfigError(
                f"{where}: has no arm {need!r} (the {what} arm); its arms are "
                f"{', '.join(study.arms)}" + ("; pass --nominal ARM" if what == "nominal" else "")
            )
        if need not in arms:
            raise ConfigError(f"{where}: the {what} arm {need!r} has no runs yet; run the study")
    return study, load_arms(arms, study.reference)


def study_evidence(path: str | Path, nominal: str) -> list[dict]:
    """Rows of one study: every arm but the reference, each with its differences and how many of
    the runs it compares (its arm's, the reference's, nominal's) have not finished (read as far
    as they got)."""
    study, loaded = load_started(path, nominal)
    unfinished = [r.arm for r in study.runs if r.state() in ("partial", "failed")]
    vs_bf16 = loaded_numbers(loaded, study.reference)["arms"]
    vs_nom = loaded_numbers(loaded, nominal)["arms"]
    rows = []
    for arm, runs in loaded.items():
        if arm == study.reference:
            continue
        nom = None if arm == nominal else {k: vs_nom[arm]["diff"][k] for k in VS_NOMINAL}
        bf16 = {k: vs_bf16[arm]["diff"][k] for k in VS_BF16}
        rows.append(
            {
                "setting": study.name,
                "arm": arm,
                "seeds": len(runs),
                "unfinished": sum(a in (arm, study.reference, nominal) for a in unfinished),
                "vs_nominal": nom,
                "vs_bf16": bf16,
                "verdict": verdict(nom, bf16),
            }
        )
    return rows


def evidence_table(paths: list[str | Path], nominal: str = "fp8_nominal") -> str:
    """The evidence table of the studies ``paths`` (markdown), every study checked first."""
    rows = [row for p in paths for row in study_evidence(p, nominal)]
    header = [
        "setting",
        "arm",
        "seeds",
        *(f"{STATS[k][0]} − nominal" for k in VS_NOMINAL),
        *(f"{STATS[k][0]} − BF16" for k in VS_BF16),
        "verdict",
    ]
    cells = []
    for r in rows:
        n = r["seeds"]
        nom = [
            "(nominal)"
            if r["vs_nominal"] is None
            else format_cell(r["vs_nominal"][k], STATS[k][1], n, True)
            for k in VS_NOMINAL
        ]
        bf16 = [format_cell(r["vs_bf16"][k], STATS[k][1], n, True) for k in VS_BF16]
        seeds = f"{n} ({r['unfinished']} unfinished)" if r["unfinished"] else str(n)
        cells.append([r["setting"], r["arm"], seeds, *nom, *bf16, r["verdict"]])
    note = (
        f"Cells: paired difference, mean [95% interval] over seeds; `*`: the interval excludes 0. "
        f"Verdict: `ok` when no accuracy interval lies below the nominal arm (`{nominal}`) and "
        "both signs' clip-share intervals contain BF16's; `?` when too few seeds give an interval."
    )
    if any(r["unfinished"] for r in rows):
        note += (
            " `unfinished`: runs of the row (its arm, BF16's or nominal's) still running or "
            "failed, read as far as they got; the row is not the study's result yet."
        )
    return "\n".join([*markdown_table(header, cells), "", note]) + "\n"
