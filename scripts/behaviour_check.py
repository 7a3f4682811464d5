"""Does a refactor change what the trainer does? Run two fixed tiny full-FP8 jobs and compare
their metrics with the same jobs run on another commit, bit for bit.

    python scripts/behaviour_check.py run OUT            # the jobs, into OUT (removed first)
    python scripts/behaviour_check.py compare OUT_A OUT_B   # exit 1 and the first differences

``blockwise`` (examples/tiny_cpu_fp8.yaml, shortened): blockwise FP8 training and rollout,
calibrated clipping every 3 optimizer steps, DAPO dynamic sampling and overlong shaping, a guard
action every step (``guard.max_mismatch`` below the FP8 job's mismatch, so every step
recalibrates), and a resume: the first start runs steps 1-4, the second resumes from step 4's
checkpoint and runs to step 8. ``noisy``: the same job with the study's noisiest emulated FP8
(delayed tensorwise scaling and its amax histories, hybrid formats, Hopper-like accumulation, the
LM head in FP8) and share-matched clipping every 2 steps with 4 optimizer steps per batch: the
recipe and clipping paths the blockwise job does not reach. One thread, so the float sums are the
same on every run of one machine. Compared: every record of metrics.jsonl except the perf/
(timing) keys, and guard_events.jsonl.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = [
    "sft.steps=60",
    "sft.batch_size=32",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=8",
    "train.save_interval=2",
    "train.eval_interval=4",
    "train.eval_prompts=16",
    "reward.format_weight=0.5",
    "loss.calib.mode=calibrate",
    "loss.calib.interval=3",
    "loss.calib.ema_decay=0.5",
    "loss.dynamic_sampling=true",
    "loss.overlong_buffer=3",
    "guard.max_mismatch=1.0001",
    "guard.on_mismatch=recalibrate",
    "rollout.fp8.quantizer=builtin",
]


NOISY = [
    "fp8.recipe=tensorwise_delayed",
    "fp8.format=hybrid",
    "fp8.accumulation=hopper",
    "fp8.keep_lm_head_bf16=false",
    "train.updates_per_step=4",
    "loss.calib.mode=share",
    "loss.calib.interval=2",
    "loss.calib.ema_decay=0",
]
JOBS = {"blockwise": JOB, "noisy": [*JOB, *NOISY]}


def run(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name, job in JOBS.items():
        where = out / name
        base = [sys.executable, "-m", "megatron_rl_fp8", "train", "examples/tiny_cpu_fp8.yaml"]
        base += [*job, f"train.output_dir={where}", f"train.cache_dir={out / 'cache'}"]
        for steps in (4, 8):
            subprocess.run([*base, f"train.steps={steps}"], cwd=ROOT, env=env, check=True)


def _records(out: Path) -> list[dict]:
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not k.startswith("perf/")})
    return rows


def compare(a: Path, b: Path) -> int:
    diffs = []
    for name in JOBS:
        diffs += [f"{name}: {d}" for d in _differences(a / name, b / name)]
    if diffs:
        print("\n".join(diffs[:20]) + (f"\n... {len(diffs) - 20} more" if len(diffs) > 20 else ""))
        return 1
    print(f"identical: the {' and '.join(JOBS)} jobs' metrics (perf/ excluded) and guard events")
    return 0


def _differences(a: Path, b: Path) -> list[str]:
    ra, rb = _records(a), _records(b)
    diffs = []
    if len(ra) != len(rb):
        diffs.append(f"{len(ra)} records against {len(rb)}")
    for i, (x, y) in enumerate(zip(ra, rb)):
        for key in sorted(set(x) | set(y)):
            if x.get(key, "<absent>") != y.get(key, "<absent>"):
                diffs.append(
                    f"record {i} (step {x.get('step')}): {key}: {x.get(key, '<absent>')} != {y.get(key, '<absent>')}"
                )
    ga, gb = (p / "guard_events.jsonl" for p in (a, b))
    if (ga.read_text() if ga.exists() else "") != (gb.read_text() if gb.exists() else ""):
        diffs.append("guard_events.jsonl differs")
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("out", type=Path)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.cmd == "run":
        run(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
