"""Throughput of FP8 128x128 blockwise weight quantization (the weight-sync hot path).

Reports GB/s as bf16 input bytes / time for ``quantize_blockwise`` on square bf16 weights, next
to a plain ``tensor.clone()`` of the same tensor measured in the same run (a memory-bandwidth
yardstick: quantization reads the weight a few times and writes 1 byte per element, so a few
times slower than a clone is the expected range for the eager implementation).

    python tools/bench_fp8_quant.py                    # 4096^2 and 8192^2, CPU (or CUDA if present)
    python tools/bench_fp8_quant.py --sizes 1024 --device cpu --iters 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from megatron_rl_fp8.fp8 import quantize_blockwise


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host-device sync: timing needs the kernels finished


def _time(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192], help="square weight sizes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=5, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pow2-scale", action="store_true", help="round scales up to powers of two")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    print(f"device: {device}, torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print(
        "| shape | bytes (bf16) | clone ms | clone GB/s "
        "| quantize_blockwise ms | quant GB/s | quant/clone |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        w = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        t_clone = _time(lambda: w.clone(), device, args.iters, args.warmup)
        quant = lambda: quantize_blockwise(w, pow2_scale=args.pow2_scale)  # noqa: E731
        t_quant = _time(quant, device, args.iters, args.warmup)
        print(
            f"| {n}x{n} | {nbytes / 2**20:.0f} MiB | {t_clone * 1e3:.2f} "
            f"| {nbytes / t_clone / 1e9:.2f} "
            f"| {t_quant * 1e3:.2f} | {nbytes / t_quant / 1e9:.2f} | {t_quant / t_clone:.1f}x |"
        )
        del w


if __name__ == "__main__":
    main()
