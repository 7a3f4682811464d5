"""Benchmark: the cost of calibrated clipping on top of the plain policy loss, and its traffic.

Times, in one process and on the same synthetic batch (default 1024 x 1024 = 1M tokens):

* ``plain``       policy_loss forward + backward with the nominal bounds;
* ``calibrated``  calibrated_clip_bounds (histogram build + solve) + the same policy_loss step.

Calibration runs only every ``interval`` steps, so the honest numbers are both the ratio on a
calibration step and the ratio amortised over ``interval`` steps. The BF16 shadow forward that a
calibration step also needs is model cost, not loss cost, and is not part of this benchmark.

Then, for several token counts and simulated data-parallel rank counts, it builds one histogram per
simulated rank, sums them (what the all-reduce does), checks the merged bounds equal the
single-process ones, and prints the bytes each rank all-reduces per calibration next to what an
exact all-gather of the tokens would move.

Usage::

    python benchmarks/bench_loss.py [--batch 1024] [--seq 1024] [--repeats 9] [--interval 20] \\
        [--bins 4096] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_rl_fp8.loss import (
    bounds_from_histogram,
    build_calibration_histogram,
    calibrated_clip_bounds,
    policy_loss,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_batch(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(b, t, generator=g)
    bf16_lr = 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    neg = (adv < 0)[:, None].expand(b, t)
    fp8_lr = bf16_lr + 0.05 * torch.randn(b, t, generator=g) - 0.05 * neg
    mask = torch.rand(b, t, generator=g) < 0.9
    return {
        "old": old,
        "log_prob": old + fp8_lr,
        "fp8_lr": fp8_lr,
        "bf16_lr": bf16_lr,
        "adv": adv,
        "mask": mask,
    }


def interleaved_medians(fns: list, repeats: int) -> list[float]:
    """Median seconds of each function, runs interleaved so machine noise hits all alike."""
    for fn in fns:
        fn()  # warm-up: allocator and first-call overheads
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def loss_step(batch, lower: float, upper: float) -> None:
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        log_prob, batch["old"], batch["adv"], batch["mask"], clip_low=lower, clip_high=upper
    )
    loss.backward()


def calibrated_step(batch, bins: int) -> None:
    lower, upper = calibrated_clip_bounds(
        batch["fp8_lr"], batch["bf16_lr"], batch["adv"], batch["mask"], EPS_LOW, EPS_HIGH, bins=bins
    )
    loss_step(batch, lower, upper)


def traffic_rows(bins: int, token_counts: list[int], rank_counts: list[int], t: int = 1024):
    rows = []
    for n_tokens in token_counts:
        batch = make_batch(n_tokens // t, t, seed=1)
        args = (batch["fp8_lr"], batch["bf16_lr"], batch["adv"], batch["mask"], EPS_LOW, EPS_HIGH)
        single = calibrated_clip_bounds(*args, bins=bins)
        for ranks in rank_counts:
            shards = [torch.tensor_split(x, ranks) for x in args[:4]]
            packed = [
                build_calibration_histogram(*parts, EPS_LOW, EPS_HIGH, bins=bins)
                for parts in zip(*shards)
            ]
            merged = torch.stack(packed).sum(0)  # what all_reduce(SUM) computes
            lower, upper, _ = bounds_from_histogram(merged, EPS_LOW, EPS_HIGH, bins=bins)
            diff = max(abs(lower - single[0]), abs(upper - single[1]))
            exact_bytes = n_tokens * 3 * 4  # all-gather fp8/bf16 log ratio + advantage, fp32
            rows.append(
                (n_tokens, ranks, packed[0].numel() * packed[0].element_size(), exact_bytes, diff)
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--bins", type=int, default=4096)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 by default because on a shared small CPU "
        "box multi-threaded timings are dominated by contention noise",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = make_batch(args.batch, args.seq)
    n = args.batch * args.seq
    plain, calib, bounds_only = interleaved_medians(
        [
            lambda: loss_step(batch, 1 - EPS_LOW, 1 + EPS_HIGH),
            lambda: calibrated_step(batch, args.bins),
            lambda: calibrated_clip_bounds(
                batch["fp8_lr"],
                batch["bf16_lr"],
                batch["adv"],
                batch["mask"],
                EPS_LOW,
                EPS_HIGH,
                bins=args.bins,
            ),
        ],
        args.repeats,
    )
    per_step = calib / plain
    amortised = (calib + (args.interval - 1) * plain) / (args.interval * plain)

    print(
        f"## Loss cost, {n:,} tokens ({args.batch} x {args.seq}), "
        f"median of {args.repeats} interleaved runs, "
        f"{torch.get_num_threads()} CPU thread(s)\n"
    )
    print("| variant | ms | ratio vs plain |")
    print("|---|---:|---:|")
    print(f"| plain policy_loss (fwd+bwd) | {plain * 1e3:.1f} | 1.00 |")
    print(
        f"| calibration step (calibrated_clip_bounds + policy_loss) | {calib * 1e3:.1f} | "
        f"{per_step:.2f} |"
    )
    print(f"| calibrated_clip_bounds alone | {bounds_only * 1e3:.1f} | {bounds_only / plain:.2f} |")
    print(
        f"| amortised over interval={args.interval} | "
        f"{(calib + (args.interval - 1) * plain) / args.interval * 1e3:.1f} | {amortised:.3f} |"
    )
    print(
        f"\ntarget <= 1.10: per calibration step {'met' if per_step <= 1.10 else 'NOT met'}, "
        f"amortised {'met' if amortised <= 1.10 else 'NOT met'}\n"
    )

    print(f"## Bytes all-reduced per calibration (bins={args.bins})\n")
    print(
        "| tokens | simulated ranks | all-reduce bytes / rank | exact all-gather bytes | "
        "max bound diff vs 1 process |"
    )
    print("|---:|---:|---:|---:|---:|")
    for n_tok, ranks, hist_bytes, exact_bytes, diff in traffic_rows(
        args.bins, [16_384, 131_072, 1_048_576], [1, 8, 64]
    ):
        print(f"| {n_tok:,} | {ranks} | {hist_bytes:,} | {exact_bytes:,} | {diff:.1e} |")


if __name__ == "__main__":
    main()
