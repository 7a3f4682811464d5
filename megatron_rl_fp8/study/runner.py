"""``megatron-rl-fp8 study STUDY.yaml``: precision arms x seeds, each an ordinary run, side by side.

A study file names a base config, the settings every run shares, the *arms* (name -> the settings
that make it, e.g. BF16, FP8 rollout only, full FP8 with nominal or calibrated clip bounds) and the
seeds::

    name: calibration_tiny              # default: the file's stem
    description: what the study asks    # optional, shown in the report
    base: ../tiny_cpu.yaml              # relative to the study file
    overrides: {train.steps: 20}        # every run
    seeds: [1, 2, 3]                    # train.seed of each run; also pairs the arms' runs
    reference: bf16                     # default: the first arm
    arms:
      bf16: {}
      fp8_calibrated: {fp8.enabled: true, loss.calib.enabled: true}

Each (arm, seed) is a run directory ``<study dir>/<arm>/seed<seed>`` holding its frozen config
(``study_config.yaml``, the fully resolved settings) and everything a run writes. Running the
command again resumes unfinished runs from their checkpoints and skips finished ones, so killing
it (``kill -9`` included; its runs die with it) loses at most the steps since each run's last
checkpoint. A run the guard stopped (exit 3) is a result, not a failure: it is not run again.

Everything is checked before any run starts: the study file's keys, every arm's settings through
the same validation as ``train`` (one line naming the arm and the field), and, for runs that
already exist, that their frozen config is still what the study file says.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from megatron_rl_fp8 import checkpoint
from megatron_rl_fp8.checkpoint.layout import complete_names
from megatron_rl_fp8.config import RunConfig, load_config
from megatron_rl_fp8.config_utils import ConfigError, describe_fields, to_dict
from megatron_rl_fp8.metrics.logger import EVENTS_FILE
from megatron_rl_fp8.rollout.registry import error_labels
from megatron_rl_fp8.trainer.run_dir import changed_settings
from megatron_rl_fp8.utils.fs import FileLock, atomic_write_text
from megatron_rl_fp8.utils.yaml_unique import safe_load, yaml_problem

KEYS = ("name", "description", "base", "overrides", "seeds", "reference", "arms")
RUN_CONFIG = "study_config.yaml"
RUN_STATUS = "study_status.json"
RUN_LOG = "study.log"
GUARD_STOP_EXIT = 3
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
REPORT_DIR = "report"  # <study dir>/report: the report, beside the arms' directories


@dataclass
class StudyRun:
    arm: str
    seed: int
    path: Path
    config: RunConfig

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    def state(self) -> str:
        """``done`` (reached train.steps), ``stopped`` (by the guard), ``failed``, ``partial``
        (checkpoints, not finished) or ``new``."""
        status = read_status(self.path)
        root = self.path / "checkpoints"
        # The newest finished checkpoint when ``latest`` is garbled (the run's next start repairs
        # it): a finished run is not relaunched for a damaged marker.
        newest = checkpoint.latest_name(root) or next(iter(complete_names(root)), None)
        if newest == f"iter_{self.config.train.steps:07d}":
            return "done"
        if status.get("state") == "stopped" or self._guard_stopped():
            return "stopped"
        if status.get("state") == "failed":
            return "failed"
        return "partial" if (self.path / "checkpoints").is_dir() else "new"

    def _guard_stopped(self) -> bool:
        """Whether the run's last guard event is a stop (how a run under Slurm, whose exit code
        torchrun hides, says the guard stopped it)."""
        try:
            lines = (self.path / EVENTS_FILE).read_text(errors="replace").splitlines()
            last = json.loads(lines[-1]) if lines else {}
        except (OSError, ValueError):
            return False
        return isinstance(last, dict) and last.get("action") == "stop"

    def last_step(self) -> int:
        """The newest step in the run's metrics.jsonl (its last line; 0 when none yet)."""
        try:
            with open(self.path / "metrics.jsonl", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                lines = f.read().splitlines()
            for line in reversed(lines):
                step = json.loads(line).get("step")
                if isinstance(step, int):
                    return step
        except (OSError, ValueError):
            pass
        return 0


@dataclass
class Study:
    name: str
    description: str
    path: Path  # the study file
    out: Path  # the study directory
    reference: str
    arms: dict[str, dict]
    seeds: list[int]
    runs: list[StudyRun]

    def started_runs(self) -> dict[str, dict[int, Path]]:
        """arm -> seed -> run directory, for the runs that have started; arms with none left out."""
        arms = {
            arm: {r.seed: r.path for r in self.runs if r.arm == arm and r.state() != "new"}
            for arm in self.arms
        }
        return {arm: seeds for arm, seeds in arms.items() if seeds}


def read_status(run_dir: Path) -> dict:
    try:
        status = json.loads((run_dir / RUN_STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _settings(value, where: str) -> dict:
    """Overrides as a mapping of dotted keys: written as a mapping or as ``key=value`` strings."""
    if value is None:
        return {}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{where}: keys must be dotted setting names, got {bad[0]!r}")
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        pairs = [v.split("=", 1) for v in value]
        return {k.strip(): yaml.safe_load(v) for k, v in pairs}
    raise ConfigError(
        f"{where}: expected a mapping of settings (train.steps: 20) or a list of key=value "
        f"strings, got {value!r:.60}"
    )


STUDY_OWNED = {
    "train.seed": "from 'seeds'",
    "train.output_dir": "<out>/<arm>/seed<N>",
}
"""Settings each run gets from the study itself; a study file that sets one is refused (it would
be silently replaced)."""


def _as_overrides(settings: dict) -> list[str]:
    # JSON is YAML: every value reads back as written (strings stay strings, 1e-3 a number).
    return [f"{k}={json.dumps(v)}" for k, v in settings.items()]


def load_study(path: str | Path, out: str | Path | None = None) -> Study:
    """Read and check a study file and plan its runs; every problem is one ConfigError line
    naming the study file, before anything is written."""
    path = Path(path)
    where = f"study file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(
            f"{where} does not exist" + (" (it is a directory)" if path.is_dir() else "")
        )
    try:
        text = path.read_bytes().decode()
    except (OSError, ValueError) as e:  # ValueError: not UTF-8
        raise ConfigError(f"{where} is not a readable YAML file ({type(e).__name__})") from None
    try:
        data = safe_load(text)  # a second arm of one name would silently replace the first
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {yaml_problem(e, text)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping ({', '.join(KEYS)})")
    unknown = sorted(set(map(str, data)) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
            f"{', '.join(KEYS)}"
        )
    if not data.get("base"):
        raise ConfigError(f"{where}: 'base' (the config every run starts from) is missing")
    base = (path.parent / str(data["base"])).resolve()
    seeds = data.get("seeds")
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        raise ConfigError(f"{where}: 'seeds' must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}: 'seeds' lists a seed twice: {seeds}")
    arms = data.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{where}: 'arms' must map at least one arm name to its settings")
    for name in arms:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: arm name {name!r} must be letters, digits, '_', '-' or '.' (it names "
                "the arm's directory)"
            )
        if name == REPORT_DIR:
            raise ConfigError(
                f"{where}: arm name {name!r} is the study's report folder; rename the arm"
            )
    arm_settings = {a: _settings(v, f"{where}: arm {a!r}") for a, v in arms.items()}
    reference = data.get("reference", next(iter(arms)))
    if not isinstance(reference, str) or reference not in arms:
        raise ConfigError(f"{where}: reference {reference!r} is not an arm ({', '.join(arms)})")
    common = _settings(data.get("overrides"), f"{where}: 'overrides'")
    for part, settings in [
        ("'overrides'", common),
        *((f"arm {a!r}", v) for a, v in arm_settings.items()),
    ]:
        for key in STUDY_OWNED.keys() & settings.keys():
            raise ConfigError(
                f"{where}: {part} sets {key}, which the study sets for each run ({STUDY_OWNED[key]}); "
                "remove it"
            )
    name = str(data.get("name") or path.stem)
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: name {name!r} must be letters, digits, '_', '-' or '.' (it names the "
            "study's directory under runs/studies)"
        )
    out = Path(out) if out is not None else Path("runs") / "studies" / name
    runs = []
    for seed in seeds:
        for arm, settings in arm_settings.items():
            run_dir = (out / arm / f"seed{seed}").absolute()
            own = {"train.seed": seed, "train.output_dir": str(run_dir)}
            try:
                cfg = load_config(base, _as_overrides({**common, **settings, **own}))
                cfg.validate(1)
            except ConfigError as e:
                raise ConfigError(f"{where}: arm {arm!r}: {e}") from None
            runs.append(StudyRun(arm, seed, run_dir, cfg))
    study = Study(
        name, str(data.get("description") or ""), path, out, reference, arm_settings, seeds, runs
    )
    _check_frozen(study, where)
    return study


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``prefixes`` or inside one (a prefix ending in '.' is a
    section)."""
    return any(key == p or key.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


def _check_frozen(study: Study, where: str) -> None:
    """A run that exists must still be the run the study file describes. Where it lives is not
    part of that: a study directory that was moved, copied off a cluster or reached through a
    link holds the same runs (a resumed run writes where it now is)."""
    for run in study.runs:
        frozen = run.path / RUN_CONFIG
        if frozen.exists() and not frozen.is_file():
            raise ConfigError(
                f"{where}: {run.label}: {frozen} is not a file; remove it (the study writes the "
                "run's settings there) and run again"
            )
        if frozen.is_file():
            try:
                frozen.read_bytes()
            except OSError as e:
                raise ConfigError(
                    f"{where}: {run.label}: {frozen} cannot be read ({e.strerror or e}); fix its "
                    f"permissions, or delete {run.path} to run it afresh"
                ) from None
            # A field newer than the run, set to what the run's code did without it (its default,
            # or the ``before`` of a field that changed behaviour as it came), is the same run.
            absent = {d.path: d.before for d in describe_fields(run.config)}
            # Nor is a setting that acts on nothing in the run (a calibration default that moved
            # under a BF16 arm), nor where the run lives.
            idle = (*run.config.idle_settings(), "train.output_dir")
            changed = [
                c
                for c in changed_settings(frozen, to_dict(run.config), absent=absent)
                if not _under(c.split(":", 1)[0], idle)
            ]
            if changed:
                raise ConfigError(
                    f"{where}: {run.label} was started with other settings ({'; '.join(changed)}"
                    f"); restore the study file, or give --out a new directory (or delete "
                    f"{run.path})"
                )


# -- running -------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the study process dies (Linux), so a killed
    study leaves no run behind; a resumed study restarts them from their checkpoints."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(run: StudyRun, threads: int) -> tuple[subprocess.Popen, int]:
    """Start (or resume) the run; (its process, its thread count). A resumed run keeps the
    thread count it started with: CPU reductions depend on it, and a resume continues the
    numbers of the run it resumes whatever ``--jobs`` is now."""
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run.path / RUN_CONFIG, run.config.to_yaml())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    before = read_status(run.path).get("threads")
    threads = before if isinstance(before, int) and before > 0 else threads
    env.setdefault("OMP_NUM_THREADS", str(threads))
    threads = int(env["OMP_NUM_THREADS"]) if env["OMP_NUM_THREADS"].isdigit() else threads
    status = {"state": "running", "threads": threads}
    atomic_write_text(run.path / RUN_STATUS, json.dumps(status) + "\n")
    log = open(run.path / RUN_LOG, "ab")
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", str(run.path / RUN_CONFIG)]
    try:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
    finally:
        log.close()
    return proc, threads


def _last_line(path: Path) -> str:
    """The run's own last error line from its log (not library warnings)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kinds = ("config error:", "data error:", "storage error:", "guard:", "error:")
    kinds += tuple(f"{label}:" for label in error_labels())  # each engine's error word
    mine = [x.strip() for x in lines if x.strip().startswith(kinds)]
    return (mine or [x for x in lines if x.strip()] or [""])[-1][:300]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


STUDY_LOCK = ".study.lock"
_held: list[FileLock] = []  # this process's study locks, held until it exits


def hold_study_dir(study: Study) -> None:
    """One study process per directory: a second one (running or submitting) would start runs
    the first is running, which their run locks refuse, and overwrite their statuses. Held until
    this process exits; ConfigError naming the holder when another process has it."""
    lock = FileLock(study.out / STUDY_LOCK, "--out")
    if not lock.try_acquire():
        raise ConfigError(
            f"study directory {str(study.out)!r} is in use by another study process "
            f"({lock.describe_owner()}); wait for it to end, or give --out another directory"
        )
    _held.append(lock)


def run_study(study: Study, jobs: int, *, echo=print) -> dict[str, int]:
    """Run every unfinished run, ``jobs`` at a time; returns the count of runs per final state."""
    todo = [r for r in study.runs if r.state() not in ("done", "stopped")]
    skipped = len(study.runs) - len(todo)
    if skipped:
        echo(f"study: {skipped} of {len(study.runs)} runs already finished; skipping them")
    threads = max(1, usable_cores() // max(1, jobs))
    total = sum(r.config.train.steps for r in study.runs)
    # disable=None: no bar where stderr is not a terminal (a log file gets the status lines only)
    bar = tqdm(
        total=total, desc=f"study {study.name}", disable=None, dynamic_ncols=True, leave=False
    )
    running: dict[int, tuple[StudyRun, subprocess.Popen, float, int]] = {}
    pending = list(todo)

    def progress() -> None:
        bar.n = sum(min(r.last_step(), r.config.train.steps) for r in study.runs)
        bar.set_postfix_str(", ".join(f"{r.label}" for r, *_ in running.values()))

    try:
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                proc, used = _start(run, threads)
                running[proc.pid] = (run, proc, time.perf_counter(), used)
            time.sleep(0.5)
            for pid, (run, proc, t0, used) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[pid]
                state = "done" if rc == 0 else "stopped" if rc == GUARD_STOP_EXIT else "failed"
                seconds = round(time.perf_counter() - t0, 1)
                status = {"state": state, "rc": rc, "seconds": seconds, "threads": used}
                if rc:
                    status["line"] = _last_line(run.path / RUN_LOG)
                atomic_write_text(run.path / RUN_STATUS, json.dumps(status) + "\n")
                why = f": {status['line']}" if rc else ""
                bar.write(f"study: {run.label}: {state} in {status['seconds']:.0f} s{why}")
            progress()
            bar.refresh()
    finally:
        for run, proc, _, used in running.values():  # interrupted: the runs resume next time
            proc.kill()
            proc.wait()
            status = {"state": "interrupted", "threads": used}
            atomic_write_text(run.path / RUN_STATUS, json.dumps(status) + "\n")
        bar.close()
    counts: dict[str, int] = {}
    for run in study.runs:
        counts[run.state()] = counts.get(run.state(), 0) + 1
    return counts
