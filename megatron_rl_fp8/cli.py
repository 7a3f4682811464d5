"""``megatron-rl-fp8 train CONFIG.yaml [section.key=value ...]`` (use torchrun for several ranks).

``megatron-rl-fp8 config [CONFIG.yaml] [section.key=value ...]``: every setting of that run with
its resolved value, its default and its help (``*`` marks values that differ from the default).

``megatron-rl-fp8 convert hf-to-mcore|mcore-to-hf|export-fp8 ...``: checkpoint conversion
(see docs/convert.md).

``megatron-rl-fp8 report RUN_DIR [RUN_DIR ...] --out DIR [--label NAME ...]``: PNG figures and a
Markdown summary overlaying several runs (see docs/report.md).

``megatron-rl-fp8 plan CONFIG.yaml [--gpus-per-node 8] [--nodes N] [section.key=value ...]``: per-GPU
memory of the run, whether its layout fits, and the layouts that would (see docs/plan.md).

``megatron-rl-fp8 study STUDY.yaml [--jobs N] [--report-only] [--out DIR]``: precision arms x
seeds, each an ordinary run, and a report with intervals over seeds (see docs/study.md).

``megatron-rl-fp8 launch CONFIG.yaml [section.key=value ...] --dry-run [--nodes N ...]``: check a
Slurm layout and print every node role's command (see slurm/README.md).

``megatron-rl-fp8 receiver --port PORT``: a delta-sync receiver beside rollout engines the
trainer cannot reach (see docs/delta_sync.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from megatron_rl_fp8.launch import REQUEUE_EXIT_CODE
from megatron_rl_fp8.utils.library_noise import quiet_library_noise

# The commands import their modules inside their functions ("lazy: start-up"): `megatron-rl-fp8
# --help` loads none of them (torch takes ~3 s; even config_utils ~20 ms of a ~70 ms start).


def _train(args) -> int:
    # lazy: start-up (the config's modules import torch)
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import load_config

    cfg = load_config(args.config, args.overrides)
    # Validate the layout before any process group, model or engine exists.
    cfg.validate(parallel.world_from_env()[1])
    # lazy: start-up; and after the checks above, so a config error is not held up by the
    # trainer's imports (Megatron-Core, ~6 s)
    from megatron_rl_fp8.config_utils import ConfigError
    from megatron_rl_fp8.rollout.errors import RolloutEngineError
    from megatron_rl_fp8.rollout.registry import engine_spec
    from megatron_rl_fp8.trainer.guard import GuardStop
    from megatron_rl_fp8.trainer.loop import Trainer
    from megatron_rl_fp8.utils.fs import storage_refusal

    trainer = None
    try:
        trainer = Trainer(cfg)
        if trainer.run():
            return REQUEUE_EXIT_CODE  # checkpointed on a preemption signal: requeue me
    except GuardStop as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"guard: {e}", file=sys.stderr)
        return 3
    except ConfigError:
        raise  # the one-line form, in main()
    except RolloutEngineError as e:
        # The engines' side failed (an engine that will not start, none left serving): the
        # message names the setting and the engine log; the traceback adds nothing but goes to
        # the run directory all the same.
        log = _keep_traceback(cfg.train.output_dir)
        where = f" (traceback: {log})" if log else ""
        label = engine_spec(cfg.rollout.engine).error_label  # the engine's word for its errors
        print(f"{label}: {e}{where}", file=sys.stderr)
        return 1
    except OSError as e:
        # A write the storage refused (a full disk, a quota) outside a checkpoint save, which
        # says so itself: one line naming the file; anything else is unexpected (below).
        where = e.filename or cfg.train.output_dir
        refusal = storage_refusal(e, Path(where), judge_by_free_space=False)
        if refusal is None:
            return _unexpected(cfg)
        print(
            f"storage error: cannot write {where}: {refusal}; "
            "free space there (or choose another train.output_dir) and run again",
            file=sys.stderr,
        )
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    # torch's CheckpointException is a BaseException: caught here so it leaves its traceback too.
    except BaseException:
        return _unexpected(cfg)
    finally:
        if trainer is not None:
            trainer.close()
        parallel.destroy()
    return 0


def _unexpected(cfg) -> int:
    """Not a user error: a bug or the environment. The traceback is the evidence; keep a copy in
    the run directory, where it survives the terminal."""
    log = _keep_traceback(cfg.train.output_dir)
    traceback.print_exc()
    where = f"; the traceback is also in {log}" if log else ""
    print(f"error: the run failed unexpectedly{where}", file=sys.stderr)
    return 1


def _keep_traceback(output_dir: str) -> str | None:
    """Write the current exception's traceback to ``<output_dir>/crash-rank<R>.log``; its path,
    or None when the directory cannot take it."""
    path = os.path.join(output_dir, f"crash-rank{os.environ.get('RANK', '0')}.log")
    try:
        with open(path, "w") as f:
            traceback.print_exc(file=f)
    except OSError:
        return None
    return path


def _show_config(args) -> int:
    # lazy: start-up (the config's modules import torch)
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.config_utils import describe_fields

    cfg = load_config(args.config, args.overrides)
    # What `train` refuses, `config` refuses: the rules that span settings, on the smallest world
    # the layout runs on (plan and launch check a given cluster; this machine's packages are not
    # asked for, as configs are often read away from the GPUs).
    cfg.validate(cfg.parallel.model_parallel_size, this_machine=False)
    section = None
    for doc in describe_fields(cfg):
        top = doc.path.split(".")[0]
        if top != section:
            section = top
            print(f"\n[{section}]")
        mark = "*" if doc.value != doc.default else " "
        default = "" if doc.value == doc.default else f"  (default: {doc.default!r})"
        print(f"{mark} {doc.path} = {doc.value!r}{default}")
        if doc.help:
            print(f"      {doc.help}")
    return 0


def _report(args) -> int:
    from megatron_rl_fp8.metrics.report import write_report  # lazy: start-up (~70 ms)

    path = write_report(args.runs, args.out, args.label)
    print(f"report: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Every command; Ctrl-C ends any of them with one line and exit 130 (what a shell reports
    for SIGINT), not a traceback: what was saved is resumed by running the command again."""
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_library_noise()  # before any command imports Megatron-Core, transformers or torchao
    try:
        return _main(argv)
    except KeyboardInterrupt:
        command = " ".join(["megatron-rl-fp8", *argv[:1]])
        print(
            f"\ninterrupted: {command} stopped by Ctrl-C; run the same command again to resume "
            "from what was saved",
            file=sys.stderr,
        )
        return 130


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl-fp8", description=__doc__, allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", allow_abbrev=False, help="Run RL training from a YAML config.")
    train.add_argument(
        "config", nargs="?", default=None, help="YAML config (default: examples/tiny_cpu.yaml)."
    )
    train.add_argument("overrides", nargs="*", help="section.key=value overrides.")
    show = sub.add_parser(
        "config",
        allow_abbrev=False,
        help="Print every setting of a run: resolved value, default and help.",
    )
    show.add_argument(
        "config", nargs="?", default=None, help="YAML config (default: examples/tiny_cpu.yaml)."
    )
    show.add_argument("overrides", nargs="*", help="section.key=value overrides.")
    report = sub.add_parser(
        "report",
        allow_abbrev=False,
        help="Figures and a Markdown summary overlaying several runs' metrics.",
    )
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="Run output directories.")
    report.add_argument("--out", required=True, help="Directory for report.md and the PNGs.")
    report.add_argument(
        "--label",
        action="append",
        help="A run's name in legends and tables; once per RUN_DIR, in order "
        "(default: the directory names).",
    )
    sub.add_parser(
        "convert",
        allow_abbrev=False,
        help="Checkpoint conversion: hf-to-mcore | mcore-to-hf | export-fp8 "
        "(`megatron-rl-fp8 convert -h`).",
    )
    sub.add_parser(
        "plan",
        allow_abbrev=False,
        help="Per-GPU memory of a run, whether its layout fits, and the layouts that would "
        "(`megatron-rl-fp8 plan -h`).",
    )
    sub.add_parser(
        "study",
        allow_abbrev=False,
        help="Precision arms x seeds side by side, with intervals (`megatron-rl-fp8 study -h`).",
    )
    sub.add_parser(
        "launch",
        allow_abbrev=False,
        help="Slurm: check a multi-node layout and print every node role's command "
        "(`megatron-rl-fp8 launch -h`).",
    )
    sub.add_parser(
        "receiver",
        allow_abbrev=False,
        help="A delta-sync receiver beside rollout engines the trainer cannot reach "
        "(`megatron-rl-fp8 receiver -h`).",
    )
    if argv[:1] == ["receiver"]:  # its own parser, as plan's
        from megatron_rl_fp8.rollout.receiver import main as receiver_main  # lazy: start-up

        return receiver_main(argv[1:])
    if argv[:1] == ["convert"]:  # its own parser owns every argument after the word
        from megatron_rl_fp8.convert.cli import main as convert_main  # lazy: start-up

        return convert_main(argv[1:], prog="megatron-rl-fp8 convert")
    if argv[:1] == ["plan"]:  # its own parser: overrides may follow the flags
        from megatron_rl_fp8.plan.cli import main as plan_main  # lazy: start-up

        return plan_main(argv[1:], prog="megatron-rl-fp8 plan")
    if argv[:1] == ["study"]:  # its own parser, as plan's
        from megatron_rl_fp8.study.cli import main as study_main  # lazy: start-up

        return study_main(argv[1:], prog="megatron-rl-fp8 study")
    if argv[:1] == ["launch"]:  # its own parser, as plan's
        from megatron_rl_fp8.launch.cli import main as launch_main  # lazy: start-up

        return launch_main(argv[1:], prog="megatron-rl-fp8 launch")
    args = parser.parse_args(argv)
    from megatron_rl_fp8.config_utils import ConfigError  # lazy: start-up (after --help exits)

    try:
        if args.command == "train":
            return _train(args)
        if args.command == "config":
            return _show_config(args)
        if args.command == "report":
            return _report(args)
    except ConfigError as e:
        # lazy: start-up; only on this error path (data imports torch)
        from megatron_rl_fp8.data import DataError
        from megatron_rl_fp8.utils.fs import StorageError

        kind = (
            "data error"
            if isinstance(e, DataError)
            else "storage error"
            if isinstance(e, StorageError)
            else "config error"
        )
        print(f"{kind}: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":  # the guard dist_checkpointing's multiprocessing needs
    sys.exit(main())
