"""``megatron-rl-fp8 study STUDY.yaml [--jobs N] [--report-only] [--out DIR]`` (see runner.py),
``megatron-rl-fp8 study --evidence STUDY.yaml ...`` (see evidence.py) and ``--dose-response``
(see dose.py)."""

from __future__ import annotations

import argparse
import sys

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.study.dose import write_dose_response
from megatron_rl_fp8.study.evidence import evidence_table
from megatron_rl_fp8.study.report import write_study_report
from megatron_rl_fp8.study.runner import (
    REPORT_DIR,
    hold_study_dir,
    load_study,
    run_study,
    usable_cores,
)
from megatron_rl_fp8.study.slurm import submit_study
from megatron_rl_fp8.trainer.run_dir import check_writable


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Run a study (precision arms x seeds, each an ordinary run) and write its "
        "report: per-arm means with 95% intervals over seeds, differences from the reference "
        "arm, curves with seed bands. Re-running resumes unfinished runs and skips finished ones.",
    )
    p.add_argument(
        "study",
        nargs="+",
        help="Study file (examples/studies/*.yaml; format: docs/study.md); several with "
        "--evidence or --dose-response.",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="Runs at a time (default: one per CPU core this process may use; each run gets "
        "cores / jobs threads).",
    )
    p.add_argument(
        "--out", default=None, help="Study directory (default: runs/studies/<study name>)."
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="Write the report from the runs that exist; run nothing.",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="Submit each unfinished (arm, seed) as a job of slurm/train.sbatch instead of running "
        "it here, and return; run again to submit what failed, --report-only for the report.",
    )
    p.add_argument(
        "--sbatch",
        default="",
        metavar="FLAGS",
        help="With --slurm: sbatch flags for every job, one string after '=' (e.g. "
        "--sbatch='--nodes=2 --partition=gpu --time=08:00:00').",
    )
    p.add_argument(
        "--dose-response",
        action="store_true",
        help="Run nothing: write dose_response.png/.md (into --out, default "
        "runs/studies/dose_response): each FP8 arm's noise (its ratio p01 minus the reference's) "
        "against its clip shares, accuracy and entropy rise minus the reference's, by clip mode.",
    )
    p.add_argument(
        "--evidence",
        action="store_true",
        help="Run nothing: print the calibration evidence table of the studies' existing runs "
        "(each FP8 arm's accuracy against the nominal arm, its clip shares against the reference).",
    )
    p.add_argument(
        "--nominal",
        default="fp8_nominal",
        help="With --evidence: the arm with FP8 and the nominal clip bounds (default fp8_nominal).",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "megatron-rl-fp8 study") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.dose_response:
            if args.evidence or args.jobs or args.report_only or args.slurm:
                raise ConfigError(
                    "--dose-response reads the studies' existing runs and runs nothing; "
                    "drop --evidence, --jobs, --report-only and --slurm"
                )
            print(f"dose response: {write_dose_response(args.study, args.out)}")
            return 0
        if args.evidence:
            if args.out or args.jobs or args.report_only:
                raise ConfigError(
                    "--evidence reads each study's own directory and runs nothing; "
                    "drop --out, --jobs and --report-only"
                )
            print(evidence_table(args.study, args.nominal), end="")
            return 0
        if len(args.study) > 1:
            raise ConfigError(
                f"{len(args.study)} study files given; a study runs one at a time (several "
                "only with --evidence or --dose-response)"
            )
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs {args.jobs}: give at least 1")
        study = load_study(args.study[0], args.out)
        if not args.slurm:  # --slurm checks its own preconditions first, writing nothing
            check_writable(study.out, "--out" if args.out else "the study directory")
        if not (args.report_only or args.slurm):  # a report may be written beside a study
            hold_study_dir(study)
        if args.sbatch and not args.slurm:
            raise ConfigError("--sbatch applies to --slurm only; add --slurm or drop --sbatch")
        if args.slurm:
            if args.report_only or args.jobs:
                raise ConfigError("--slurm submits jobs: drop --report-only and --jobs")
            counts = submit_study(study, args.sbatch)
            print("study: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
            print(
                f"study: the report, once runs have metrics: megatron-rl-fp8 study "
                f"{args.study[0]} --report-only" + (f" --out {args.out}" if args.out else "")
            )
            return 0
        jobs = min(args.jobs or usable_cores(), len(study.runs))
        failed = 0
        if not args.report_only:
            print(
                f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds = "
                f"{len(study.runs)} runs in {study.out}, {jobs} at a time"
            )
            counts = run_study(study, jobs)
            print("study: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
            failed = counts.get("failed", 0)
        arms = study.started_runs()
        if study.reference not in arms:
            raise ConfigError(
                f"study {study.name}: the reference arm {study.reference!r} has no runs in "
                f"{study.out} yet; run the study first"
            )
        title = study.name + (f": {study.description}" if study.description else "")
        report = write_study_report(arms, study.reference, study.out / REPORT_DIR, title)
        print(f"report: {report}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0
