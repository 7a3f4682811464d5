"""One-step off-policy pipelining against the synchronous step: the tiny job with a real SGLang
CPU engine pinned to one core and the trainer pinned to another, both ``train.pipeline`` settings
in one run, wall seconds per step side by side and their ratio.

    python benchmarks/bench_pipeline.py                      # needs .venv-sglang (make install-sglang)
    python benchmarks/bench_pipeline.py --steps 8 --rounds 2 --json pipeline.json

Each job is ``megatron-rl-fp8 train examples/tiny_cpu_fp8.yaml`` (``--config``: the full FP8
pipeline with calibrated clipping) with ``rollout.engine=sglang``
(dedicated placement): the trainer process runs on ``--trainer-core``, the engine (its guard, the
server and its scheduler) on ``--engine-core``, each with one thread, so the engine generates
while the trainer updates only when the steps are pipelined. The sizes (prompts, samples, new
tokens, updates per step) default to ones where a rollout takes about as long as the rest of the
step on this kind of box (the FP8 GEMMs are emulated on a CPU, so the trainer's side is longer
than tiny_cpu.yaml's), which is where overlap pays most: a step cannot take less than the longer
of the two sides, so the ratio is bounded below by max(rollout, rest) / (rollout + rest), printed
as "perfect overlap".

Per step: ``perf/step_time_s`` from the job's metrics, steps after ``--warmup`` and without an
evaluation or checkpoint (those are the same in both settings and not overlapped). The jobs share
one SFT warm-start cache, built before the first timed job. ``--rounds`` runs the pair again,
alternating the order, so a drift of the machine's speed shows as a spread, not as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("sync", "one_step_off")
# Rows of the step's breakdown shown beside the step time (docs/logging.md).
COLUMNS = {
    "step": "perf/step_time_s",
    "rollout wait": "perf/rollout_time_s",
    "update": "perf/update_time_s",
    "logprobs": "perf/logprob_time_s",
    "sync": "perf/sync_time_s",
    "rollout (own)": "perf/pipeline/rollout_time_s",
    "overlap": "perf/pipeline/overlap_time_s",
    "engine idle": "perf/pipeline/engine_idle_time_s",
}

# The engine's processes run this instead of SGLang's python: pin, one thread, then exec it.
PINNED = """#!{python}
import os, sys
os.sched_setaffinity(0, {{{core}}})
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def sglang_python(arg: str | None) -> str:
    path = arg or os.environ.get("MRF8_SGLANG_PYTHON") or str(ROOT / ".venv-sglang/bin/python")
    if not Path(path).exists():
        sys.exit(
            f"bench_pipeline: no SGLang python at {path}: run `make install-sglang` (creates "
            ".venv-sglang) or pass --sglang-python"
        )
    return path


def pinned_python(python: str, core: int, work: Path) -> str:
    """An executable that runs ``python`` on ``core`` only (inherited by what it starts)."""
    path = work / f"python-core{core}"
    path.write_text(PINNED.format(python=python, core=core))
    path.chmod(0o755)
    return str(path)


def overrides(args, setting: str, work: Path, engine_python: str, out: Path) -> list[str]:
    return [
        f"train.steps={args.steps}",
        f"train.pipeline={setting}",
        f"train.prompts_per_step={args.prompts}",
        f"train.updates_per_step={args.updates}",
        f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"task.max_response_len={args.max_new_tokens}",
        "train.eval_interval=0",
        f"train.eval_prompts={args.prompts}",
        "train.save_interval=0",
        f"train.output_dir={out}",
        f"train.cache_dir={work / 'cache'}",
        "rollout.engine=sglang",
        "rollout.placement=dedicated",
        f"rollout.sglang.python={engine_python}",
        f"rollout.sglang.work_dir={out / 'sglang'}",
        "rollout.sglang.startup_timeout_s=600",
    ]


def run_job(args, setting: str, work: Path, engine_python: str, tag: str) -> list[dict]:
    """One training job, the trainer pinned to its core; its per-step metrics."""
    from megatron_rl_fp8.metrics.logger import read_metrics

    out = work / tag
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl_fp8",
        "train",
        args.config,
        *overrides(args, setting, work, engine_python, out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("MRF8_SGLANG_FAULT", None)
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, {args.trainer_core}),
        )
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        sys.exit(
            f"bench_pipeline: the {setting} job failed (exit {done.returncode}); {log}:\n{tail}"
        )
    print(f"  {tag}: {time.perf_counter() - t0:.0f} s", flush=True)
    return read_metrics(out)


def timed_steps(metrics: list[dict], warmup: int) -> list[dict]:
    """The steps that are only rollout + update + sync (no evaluation, no checkpoint)."""
    return [
        m
        for m in metrics
        if m["step"] > warmup
        and not m.get("perf/eval_time_s")
        and not m.get("perf/checkpoint_time_s")
        and "perf/step_time_s" in m
    ]


def summary(steps: list[dict]) -> dict:
    return {
        name: statistics.median(m.get(key, 0.0) for m in steps) for name, key in COLUMNS.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples/tiny_cpu_fp8.yaml"))
    p.add_argument("--steps", type=int, default=8, help="RL steps per job")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--rounds", type=int, default=1, help="pairs of jobs, alternating the order")
    p.add_argument("--prompts", type=int, default=32, help="train.prompts_per_step")
    p.add_argument("--samples", type=int, default=8, help="rollout.n_samples_per_prompt")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--updates", type=int, default=2, help="train.updates_per_step")
    p.add_argument("--trainer-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument(
        "--sglang-python", default=None, help="default: $MRF8_SGLANG_PYTHON, .venv-sglang"
    )
    p.add_argument("--work-dir", default=None, help="default: a temporary directory, removed")
    p.add_argument("--json", default=None, help="write every step's times and the summary here")
    args = p.parse_args()
    if args.steps <= args.warmup + 1:
        sys.exit(f"bench_pipeline: --steps {args.steps} leaves no timed step after --warmup")
    cores = os.sched_getaffinity(0)
    for name in ("trainer_core", "engine_core"):
        if getattr(args, name) not in cores:
            sys.exit(
                f"bench_pipeline: --{name.replace('_', '-')} is not one of this process's cores {sorted(cores)}"
            )
    if args.trainer_core == args.engine_core:
        sys.exit("bench_pipeline: --trainer-core and --engine-core must differ (nothing overlaps)")

    with tempfile.TemporaryDirectory(prefix="bench_pipeline-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        engine_python = pinned_python(sglang_python(args.sglang_python), args.engine_core, work)
        print(
            f"tiny job, {args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} "
            f"tokens, {args.updates} updates/step, {args.steps} steps; trainer on core "
            f"{args.trainer_core}, SGLang engine on core {args.engine_core}",
            flush=True,
        )
        steps: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        for r in range(args.rounds):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                metrics = run_job(args, setting, work, engine_python, f"{setting}-{r}")
                steps[setting] += timed_steps(metrics, args.warmup)
        report(args, steps)


def report(args, steps: dict[str, list[dict]]) -> None:
    rows = {s: summary(steps[s]) for s in SETTINGS}
    names = list(COLUMNS)
    print(
        f"\nmedian seconds per step over {len(steps['sync'])} / {len(steps['one_step_off'])} steps"
    )
    print(f"| {'setting':<13} | " + " | ".join(f"{n:>13}" for n in names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for s in SETTINGS:
        print(f"| {s:<13} | " + " | ".join(f"{rows[s][n]:>13.3f}" for n in names) + " |")
    sync_steps = [m["perf/step_time_s"] for m in steps["sync"]]
    pipe_steps = [m["perf/step_time_s"] for m in steps["one_step_off"]]
    ratio = statistics.median(pipe_steps) / statistics.median(sync_steps)
    # The spread: the ratio of the slowest and of the fastest steps.
    low = min(pipe_steps) / max(sync_steps)
    high = max(pipe_steps) / min(sync_steps)
    bound = max(rows["sync"]["rollout wait"], rows["sync"]["step"] - rows["sync"]["rollout wait"])
    print(
        f"\none_step_off / sync, wall seconds per step: {ratio:.2f}x (median; extremes "
        f"{low:.2f}x-{high:.2f}x); perfect overlap of the sync job's phases would give "
        f"{bound / rows['sync']['step']:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "summary": rows, "ratio": ratio, "steps": steps}, indent=1
            )
        )


if __name__ == "__main__":
    main()
