"""Benchmark: what calibrated clipping costs, side by side in one run.

Two measurements, each printed as a markdown table of ratios measured in the same run:

``--share`` (default on): the whole calibration cost as a share of the RL step, from the
trainer's own timers. The trainer runs full FP8 (``examples/tiny_cpu_fp8.yaml``; FP8 emulated on
a CPU) with ``loss.calib.interval=2``, so odd steps calibrate and even steps do not, in one run.
On a calibration step ``perf/shadow_time_s`` holds everything calibration adds: the BF16 shadow
forward of pi_old, the FP8 and BF16 forwards of pi_theta per later mini-batch, the histogram
build, its all-reduce and the bounds broadcast (``trainer/calibrator.py``). The table gives, per
model, the medians of plain and calibrating steps, the shadow time, and the amortised share of
the step at intervals 1, 5 and 20::

    share(k) = shadow / (k * plain + shadow)

where ``plain`` is the median step without calibration (evaluation and checkpoint left out). The
difference calib - plain is printed next to the shadow time as a check that the timer holds all
of calibration's cost.

``--collective`` (default on): the data-parallel merge of one calibration, on real process
groups (``torch.distributed``: gloo on the CPU, NCCL with ``--device cuda``): the project's
histogram path (``calibrated_clip_bounds`` with ``group=``: build the packed float64 histogram,
one all-reduce of ``8 * (4 * bins + 7)`` bytes, read the bounds) against the exact alternative
(all-gather every rank's FP8 and BF16 log ratios, advantages and mask, then exact quantiles and
cumulative sums over all tokens on every rank: ``megatron_rl_fp8/loss/exact.py``), for several token
counts per rank and rank counts. Times are the slowest rank's, medians of interleaved repeats;
bytes are what each rank sends; ``|d bound|`` is the largest difference between the two paths'
bounds (the histogram's resolution is ``4 / bins`` in log ratio).

Usage::

    python benchmarks/bench_calibration.py                         # both, defaults below
    python benchmarks/bench_calibration.py --no-share --ranks 2 4 --tokens 16384 131072 1048576
    python benchmarks/bench_calibration.py --no-collective --models tiny 20m --steps 9
    python benchmarks/bench_calibration.py --no-share --device cuda --ranks 2 4 8   # on a GPU node
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from queue import Empty

from megatron_rl_fp8.plan.measure import TIMING_20M as MODEL_20M
from megatron_rl_fp8.plan.measure import TIMING_RUN as COMMON

ROOT = Path(__file__).resolve().parents[1]

FP8_CONFIG = str(ROOT / "examples" / "tiny_cpu_fp8.yaml")
MODELS = {"tiny": [], "20m": MODEL_20M}
NOT_IN_STEP = ("perf/eval_time_s", "perf/checkpoint_time_s")
INTERVALS = (1, 5, 20)
PHASE_KEYS = (
    "perf/rollout_time_s",
    "perf/logprob_time_s",
    "perf/update_time_s",
    "perf/sync_time_s",
    "perf/other_time_s",
)
EPS_LOW, EPS_HIGH = 0.2, 0.28
SEQ = 1024  # tokens per row of the synthetic calibration batches


# --- share of the step ----------------------------------------------------------------------


def step_seconds(m: dict) -> float:
    """A metrics line's step time less evaluation and checkpoint (not every step has them)."""
    return m["perf/step_time_s"] - sum(m.get(k, 0.0) for k in NOT_IN_STEP)


def share_row(lines: Iterable[dict], *, skip: int = 1) -> dict:
    """Medians of calibrating and plain steps (after the first ``skip``) and the amortised share
    of calibration in the step at each of ``INTERVALS``."""
    steps = [m for m in lines if "perf/step_time_s" in m][skip:]
    calib = [m for m in steps if "perf/shadow_time_s" in m]
    plain = [m for m in steps if "perf/shadow_time_s" not in m]
    if not calib or not plain:
        raise ValueError(
            f"need calibrating and plain steps after the first {skip}: got {len(calib)} and "
            f"{len(plain)} (run with loss.calib.interval=2 and at least {skip + 2} steps)"
        )
    row = {
        "calib_steps": len(calib),
        "plain_steps": len(plain),
        "plain_s": statistics.median(step_seconds(m) for m in plain),
        "calib_s": statistics.median(step_seconds(m) for m in calib),
        "shadow_s": statistics.median(m["perf/shadow_time_s"] for m in calib),
        "train_s": statistics.median(
            m["perf/logprob_time_s"] + m["perf/update_time_s"] for m in plain
        ),
    }
    for key in PHASE_KEYS:  # where a plain step's time goes, for reading the table
        row[key] = statistics.median(m.get(key, 0.0) for m in plain)
    for k in INTERVALS:
        row[f"share_{k}"] = amortised_share(row["shadow_s"], row["plain_s"], k)
    return row


def amortised_share(shadow: float, plain: float, interval: int) -> float:
    """Share of the time calibration takes when one step in ``interval`` calibrates."""
    return shadow / (interval * plain + shadow)


def run_trainer(overrides: list[str], out: Path, steps: int) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl_fp8",
        "train",
        FP8_CONFIG,
        *COMMON,
        f"train.steps={steps}",
        f"train.output_dir={out}",
        "loss.calib.interval=2",
        *overrides,
    ]
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    text = (out / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


def share_table(rows: dict[str, dict]) -> str:
    head = (
        "| model | plain step s | calibration step s | calib - plain s | shadow s "
        "| shadow / training phase | share at interval 1 | 5 | 20 |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['plain_s']:.3f} | {r['calib_s']:.3f} "
            f"| {r['calib_s'] - r['plain_s']:.3f} | {r['shadow_s']:.3f} "
            f"| {r['shadow_s'] / r['train_s']:.2f} | "
            + " | ".join(f"{100 * r[f'share_{k}']:.1f}%" for k in INTERVALS)
            + " |"
        )
    return "\n".join(lines)


# --- histogram all-reduce vs exact all-gather --------------------------------------------------


def make_batch(tokens: int, seed: int, device: str):
    """Synthetic calibration inputs of ``tokens`` tokens (rows of ``SEQ``): FP8 log ratios biased
    low for negative advantages, as benchmarks/bench_loss.py."""
    import torch

    rows = max(1, tokens // SEQ)
    g = torch.Generator().manual_seed(seed)
    bf16 = 0.1 * torch.randn(rows, SEQ, generator=g)
    adv = torch.randn(rows, generator=g)
    neg = (adv < 0)[:, None].expand(rows, SEQ)
    fp8 = bf16 + 0.05 * torch.randn(rows, SEQ, generator=g) - 0.05 * neg
    mask = torch.rand(rows, SEQ, generator=g) < 0.9
    return [t.to(device) for t in (fp8, bf16, adv, mask)]


def _exact_bounds(batch, group):
    """All-gather every rank's tokens, then the exact bounds over all of them (every rank)."""
    import torch
    import torch.distributed as dist

    from megatron_rl_fp8.loss.exact import exact_calibrated_clip_bounds

    world = dist.get_world_size(group)
    gathered = []
    for t in batch:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        gathered.append(torch.cat(parts))
    return exact_calibrated_clip_bounds(*gathered, EPS_LOW, EPS_HIGH)


def _collective_worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl_fp8.loss import calibrated_clip_bounds

    torch.set_num_threads(args["threads"])
    cuda = args["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    bins = args["bins"]

    def synced(fn):
        def run():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0, out

        return run

    rows = []
    try:
        for tokens in args["tokens"]:
            batch = make_batch(tokens, seed=rank, device=device)
            hist = synced(
                lambda b=batch: calibrated_clip_bounds(
                    *b, EPS_LOW, EPS_HIGH, group=dist.group.WORLD, bins=bins
                )
            )
            exact = synced(lambda b=batch: _exact_bounds(b, dist.group.WORLD))
            hist(), exact()  # warm-up
            times: dict[str, list[float]] = {"hist": [], "exact": []}
            bounds: dict[str, tuple[float, float]] = {}
            for _ in range(args["repeats"]):
                for name, fn in (("hist", hist), ("exact", exact)):
                    seconds, bounds[name] = fn()
                    times[name].append(seconds)
            medians = torch.tensor([statistics.median(times[n]) for n in ("hist", "exact")])
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
            sent_exact = sum(t.numel() * t.element_size() for t in batch)
            rows.append(
                {
                    "tokens_per_rank": batch[0].numel(),
                    "ranks": world,
                    "hist_s": float(medians[0]),
                    "exact_s": float(medians[1]),
                    "hist_bytes": 8 * (4 * bins + 7),
                    "exact_bytes": sent_exact,
                    "bound_diff": max(abs(a - b) for a, b in zip(bounds["hist"], bounds["exact"])),
                }
            )
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def collective_rows(
    world: int,
    tokens: list[int],
    *,
    repeats: int,
    bins: int,
    device: str = "cpu",
    threads: int = 1,
) -> list[dict]:
    """Run the merge comparison on ``world`` real ranks (spawned processes); rank 0's rows."""
    import torch.multiprocessing as mp

    from megatron_rl_fp8.parallel import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {
        "tokens": tokens,
        "repeats": repeats,
        "bins": bins,
        "device": device,
        "threads": threads,
    }
    port = free_port()
    # Each rank runs this file by its path (runpy), not a function pickled by module name: a
    # test loads this script from its file, under a name a spawned process cannot import.
    procs = [
        ctx.Process(
            target=runpy.run_path,
            args=(__file__,),
            kwargs={
                "init_globals": {"RANK_ARGS": (r, world, port, args, queue)},
                "run_name": RANK_RUN,
            },
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        while True:  # a rank that died (a failed import, a broken group) ends the wait
            try:
                rows = queue.get(timeout=5)
                break
            except Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"collective benchmark: ranks exited with {bad}")
    return rows


RANK_RUN = "__bench_calibration_rank__"  # the run name a rank of collective_rows runs this file by


def collective_table(rows: list[dict]) -> str:
    lines = [
        "| tokens / rank | ranks | histogram all-reduce ms | exact all-gather ms | exact / hist "
        "| bytes sent / rank: hist | exact | \\|d bound\\| |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens_per_rank']:,} | {r['ranks']} | {1e3 * r['hist_s']:.1f} "
            f"| {1e3 * r['exact_s']:.1f} | {r['exact_s'] / r['hist_s']:.1f}x "
            f"| {r['hist_bytes']:,} | {r['exact_bytes']:,} | {r['bound_diff']:.1e} |"
        )
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--share", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--collective", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--models", nargs="+", default=["tiny", "20m"], choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=9, help="RL steps per trainer run (>= 3)")
    ap.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="extra key=value for every trainer run, e.g. fp8.recipe=tensorwise_current",
    )
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--tokens", nargs="+", type=int, default=[16384, 131072, 1048576])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bins", type=int, default=4096)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", type=Path, help="also write every row to this file")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error(
            f"--steps {args.steps}: need >= 3 (a warm-up step, then a plain and a calibrating one)"
        )
    if any(r < 2 for r in args.ranks):
        ap.error(f"--ranks {args.ranks}: each rank count must be >= 2")
    if args.collective and args.device == "cuda":
        import torch

        if max(args.ranks) > torch.cuda.device_count():
            ap.error(
                f"--ranks {args.ranks}: NCCL needs one GPU per rank, this node has "
                f"{torch.cuda.device_count()}; use --device cpu (gloo) or fewer ranks"
            )
    if any(t < SEQ for t in args.tokens):
        ap.error(f"--tokens {args.tokens}: each count must be >= {SEQ} (one row)")

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    result: dict = {"date": stamp}
    if args.share:
        rows = {}
        with tempfile.TemporaryDirectory(prefix="bench_calibration.") as tmp:
            for name in args.models:
                t0 = time.perf_counter()
                lines = run_trainer([*MODELS[name], *args.override], Path(tmp) / name, args.steps)
                rows[name] = share_row(lines)
                print(f"# {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print("\nCalibration's share of the RL step (full FP8, loss.calib.interval=2):\n")
        print(share_table(rows))
        result["share"] = rows
    if args.collective:
        rows = []
        for world in args.ranks:
            rows += collective_rows(
                world,
                args.tokens,
                repeats=args.repeats,
                bins=args.bins,
                device=args.device,
                threads=args.threads,
            )
        print(f"\nThe merge of one calibration ({args.device}, {args.bins} bins):\n")
        print(collective_table(rows))
        result["collective"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == RANK_RUN:  # a rank of collective_rows
    _collective_worker(*RANK_ARGS)  # noqa: F821 (runpy's init_globals)
