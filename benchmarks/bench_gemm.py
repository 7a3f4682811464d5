"""GEMM throughput: BF16 against FP8 (tensorwise, rowwise, blockwise) at Qwen3 linear shapes.

One row per (model, linear, method): TFLOP/s (2*M*N*K per GEMM, median of timed runs), the
ratio to the BF16 GEMM of the same shape, and the largest error against the float32 product of
the dequantized FP8 operands, as a share of the largest output (a check that the call's scales
mean what we think, not a precision study). M = 8192 tokens (``--tokens``: a list, e.g. 1024,8192,
for the small micro-batches where FP8's fixed costs weigh more); (N, K) of each linear from the
models' public configs:

=========  ======  =====  ====  =======  ===============================================
model      hidden  heads  kv    ffn      linears (N, K)
=========  ======  =====  ====  =======  ===============================================
Qwen3-8B   4096    32     8     12288    qkv (6144, 4096)  o (4096, 4096)
                                         gate_up (24576, 4096)  down (4096, 12288)
Qwen3-32B  5120    64     8     25600    qkv (10240, 5120)  o (5120, 8192)
                                         gate_up (51200, 5120)  down (5120, 25600)
=========  ======  =====  ====  =======  ===============================================

Methods (all e4m3, bf16 output):

* ``bf16``: ``torch.mm`` on bf16 operands (the baseline).
* ``fp8_tensorwise``: ``torch._scaled_mm`` with one float32 scale per operand (0-d tensors);
  ``fp8_tensorwise_fast`` the same with ``use_fast_accum=True`` (no promotion to float32; what
  Transformer Engine and torchao use for the forward GEMM).
* ``fp8_rowwise``: ``torch._scaled_mm`` with scales of shape (M, 1) and (1, N).
* ``fp8_blockwise``: ``torch.nn.functional.scaled_mm`` with 1x128 activation and 128x128 weight
  scales (DeepSeek-V3), in the layouts torch 2.11 accepted on an H200 (docs/gpu.md):
  ``scale_a`` (M, K/128) with column-major strides, ``scale_b`` the transposed view of a
  contiguous (N/128, K/128). Reported unavailable where the torch has no ``F.scaled_mm``.

FP8 needs a CUDA GPU with compute capability 8.9+ (blockwise: 9.0). ``--cpu-smoke`` runs tiny
shapes on the CPU instead (bf16 and fp32 rows only, FP8 rows marked unavailable) so the script
itself can be tested anywhere.

    python benchmarks/bench_gemm.py                    # on a GPU node
    python benchmarks/bench_gemm.py --json out.json    # also write the rows as JSON
    python benchmarks/bench_gemm.py --tokens 1024,2048,8192
    python benchmarks/bench_gemm.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

M_TOKENS = 8192
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    # model: {linear: (N, K)}; qkv N = (heads + 2 * kv_heads) * head_dim, o K = heads * head_dim
    "Qwen3-8B": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    },
    "Qwen3-32B": {
        "qkv": (10240, 5120),
        "o": (5120, 8192),
        "gate_up": (51200, 5120),
        "down": (5120, 25600),
    },
}
SMOKE_M = 256
SMOKE_SHAPES = {"tiny": {"qkv": (384, 256), "down": (256, 512)}}
FP8_METHODS = ("fp8_tensorwise", "fp8_tensorwise_fast", "fp8_rowwise", "fp8_blockwise")
E4M3_MAX = 448.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # timing needs the kernels finished


def _median_seconds(
    fn: Callable[[], object], device: torch.device, iters: int, warmup: int
) -> float:
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


def _quant_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.abs().amax().float() / E4M3_MAX).clamp_min(1e-12)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _quant_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_min(1e-12)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _quant_blocks(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and scales per ``rows`` x 128 block of a [R, K] tensor (R, K multiples of it)."""
    r, k = t.shape
    v = t.float().view(r // rows, rows, k // 128, 128)
    scale = (v.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    codes = (v / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(r, k)
    return codes, scale.view(r // rows, k // 128)


def _fp8_gemm(
    method: str, x: torch.Tensor, w: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], torch.Tensor] | str:
    """(gemm closure, float32 reference from the dequantized operands), or why unavailable."""
    m, k = x.shape
    n = w.shape[0]
    if method in ("fp8_tensorwise", "fp8_tensorwise_fast"):
        xq, sx = _quant_tensor(x)
        wq, sw = _quant_tensor(w)
        fast = method == "fp8_tensorwise_fast"
        ref = (xq.float() * sx) @ (wq.float() * sw).t()
        return (
            lambda: torch._scaled_mm(
                xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
        ), ref
    if method == "fp8_rowwise":
        xq, sx = _quant_rows(x)  # (M, 1)
        wq, sw = _quant_rows(w)  # (N, 1) -> (1, N)
        ref = (xq.float() * sx) @ (wq.float() * sw).t()
        sw_t = sw.t()
        return (
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw_t, out_dtype=torch.bfloat16)
        ), ref
    if method == "fp8_blockwise":
        fn = getattr(torch.nn.functional, "scaled_mm", None)
        kinds = getattr(torch.nn.functional, "ScalingType", None)
        if fn is None or kinds is None:
            return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
        if torch.cuda.get_device_capability() < (9, 0):
            return "blockwise FP8 GEMMs need sm_90+"
        xq, sx = _quant_blocks(x, 1)  # (M, K/128)
        wq, sw = _quant_blocks(w, 128)  # (N/128, K/128), contiguous
        ref = (xq.float().view(m, k // 128, 128) * sx[..., None]).view(m, k) @ (
            wq.float().view(n // 128, 128, k // 128, 128) * sw[:, None, :, None]
        ).view(n, k).t()
        scale_a = sx.t().contiguous().t()  # column-major (M, K/128)
        scale_b = sw.t()  # a view, as torch 2.11 wants it
        return (
            lambda: fn(
                xq,
                wq.t(),
                scale_a,
                kinds.BlockWise1x128,
                scale_b,
                kinds.BlockWise128x128,
                output_dtype=torch.bfloat16,
            )
        ), ref
    raise ValueError(f"unknown method {method!r}")


def run(cpu_smoke: bool, iters: int, warmup: int, tokens: list[int] | None = None) -> list[dict]:
    """Rows for every token count in ``tokens`` (default: 8192; the smoke test's 256)."""
    device = torch.device("cpu" if cpu_smoke else "cuda")
    if not cpu_smoke and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU: bench_gemm measures GPU GEMMs (use --cpu-smoke to test the script on CPU)"
        )
    shapes, default_m = (SMOKE_SHAPES, SMOKE_M) if cpu_smoke else (SHAPES, M_TOKENS)
    fp8_reason = None
    if cpu_smoke:
        fp8_reason = "no CUDA (--cpu-smoke)"
    elif torch.cuda.get_device_capability() < (8, 9):
        fp8_reason = "FP8 tensor cores need sm_89+"
    methods = ["bf16", "fp32"] if cpu_smoke else ["bf16"]
    methods += list(FP8_METHODS)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    with torch.no_grad():
        for model, linears, m in (
            (model, linears, m) for m in tokens or [default_m] for model, linears in shapes.items()
        ):
            for linear, (n, k) in linears.items():
                x = torch.randn(m, k, device=device, generator=g)
                w = torch.randn(n, k, device=device, generator=g) * 0.02
                flops = 2.0 * m * n * k
                base = None
                for method in methods:
                    row = {
                        "model": model,
                        "linear": linear,
                        "M": m,
                        "N": n,
                        "K": k,
                        "method": method,
                        "tflops": None,
                        "vs_bf16": None,
                        "max_err": None,
                        "status": "ok",
                    }
                    if method in ("bf16", "fp32"):
                        dtype = torch.bfloat16 if method == "bf16" else torch.float32
                        a, b = x.to(dtype), w.to(dtype).t()
                        fn, ref = (lambda a=a, b=b: a @ b), None
                    elif fp8_reason:
                        fn = fp8_reason
                    else:
                        fn = _fp8_gemm(method, x, w)
                    if isinstance(fn, str):
                        row["status"] = f"unavailable: {fn}"
                        rows.append(row)
                        continue
                    if isinstance(fn, tuple):
                        fn, ref = fn
                    try:
                        out = fn()
                        seconds = _median_seconds(fn, device, iters, warmup)
                    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
                        row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                        rows.append(row)
                        continue
                    row["tflops"] = flops / seconds / 1e12
                    if method == "bf16":
                        base = row["tflops"]
                    if base:
                        row["vs_bf16"] = row["tflops"] / base
                    if ref is not None:
                        row["max_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | linear | M x N x K | method | TFLOP/s | vs bf16 | max err | status |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        tf = f"{r['tflops']:.3g}" if r["tflops"] is not None else "-"
        ratio = f"{r['vs_bf16']:.2f}" if r["vs_bf16"] is not None else "-"
        err = f"{r['max_err']:.2%}" if r["max_err"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['linear']} | {r['M']}x{r['N']}x{r['K']} | "
            f"{r['method']} | {tf} | {ratio} | {err} | {r['status']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on the CPU (bf16 / fp32 only): tests the script, not a GPU",
    )
    p.add_argument("--iters", type=int, default=20, help="timed runs per GEMM (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    p.add_argument(
        "--tokens",
        default="",
        help="comma-separated GEMM M (tokens) to run, e.g. 1024,8192 (default: 8192; smoke 256)",
    )
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: give comma-separated integers, e.g. 1024,8192")
    if any(t < 16 or t % 16 for t in tokens):
        p.error(f"--tokens {args.tokens!r}: each must be a positive multiple of 16 (FP8 GEMMs)")
    iters, warmup = (2, 1) if args.cpu_smoke else (args.iters, args.warmup)
    if torch.cuda.is_available() and not args.cpu_smoke:
        print(f"# GEMM throughput on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    rows = run(args.cpu_smoke, iters, warmup, tokens)
    print(markdown(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"device": _device_name(args.cpu_smoke), "rows": rows}, indent=1)
        )
    failed = [r for r in rows if r["status"].startswith("failed")]
    return 1 if failed else 0


def _device_name(cpu_smoke: bool) -> str:
    if cpu_smoke or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name()


if __name__ == "__main__":
    raise SystemExit(main())
