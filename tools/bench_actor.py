"""One actor training step on one GPU at a ~2B Qwen3 shape: tokens/s, MFU and peak memory.

The project's own ``Actor`` (Megatron GPTModel, local layer spec unless Transformer Engine is
installed, Megatron DDP and Adam), one process, TP = PP = DP = 1, bf16 parameters with float32
main weights and gradients. The default batch is 8 rows x 2048 tokens in micro-batches of 2, a
token-mean NLL loss, one optimizer step per timed step.

Model: the Qwen3-1.7B block (28 layers, hidden 2048, 16 query / 8 KV heads of 128, SwiGLU 6144,
vocab 151936) with an untied output layer, 2.03B parameters. Throughput in model FLOPs
(PaLM's convention, no recompute, causal attention counted in full):

    FLOPs per token = 6 * (linear weights, output layer included)
                      + 12 * layers * seq * heads * head_dim

MFU divides that by ``--peak-tflops`` (dense BF16; default 989 for H100 / H200, the datasheet's
dense number; other GPUs need the flag). Peak memory is ``torch.cuda.max_memory_allocated``
over the timed steps (parameters, gradients and Adam state included), in GB of 10^9 bytes.

    python tools/bench_actor.py                          # on a GPU node
    python tools/bench_actor.py --peak-tflops 2250 --json out.json
    python tools/bench_actor.py --cpu-smoke              # 2 layers on the CPU: tests the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense BF16 tensor-core peak by GPU name fragment (NVIDIA datasheets, SXM, without sparsity)."""


def model_config(cpu_smoke: bool, seq: int):
    from megatron_rl_fp8.models.config import ModelConfig

    if cpu_smoke:
        return ModelConfig(
            arch="qwen3",
            num_layers=2,
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=128,
            max_position_embeddings=seq,
        )
    return ModelConfig(
        arch="qwen3",
        num_layers=28,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=seq,
        params_dtype="bfloat16",
        tie_word_embeddings=False,
    )


def flops_per_token(mc, seq: int) -> tuple[float, int]:
    """(training model FLOPs per token, parameter count) of a Qwen3-shaped ``ModelConfig``."""
    d, f, layers = mc.hidden_size, mc.ffn_hidden_size, mc.num_layers
    q_width = mc.num_attention_heads * mc.kv_channels
    kv_width = mc.num_query_groups * mc.kv_channels
    vocab = mc.padded_vocab_size()
    per_layer = d * (q_width + 2 * kv_width) + q_width * d + d * 2 * f + f * d
    linear = layers * per_layer + d * vocab  # + the output layer (a GEMM, unlike the embedding)
    norms = layers * (2 * d + 2 * mc.kv_channels) + d  # RMSNorm weights incl. QK-norm
    params = linear + norms + (0 if mc.tie_word_embeddings else d * vocab)
    attention = 12 * layers * seq * q_width
    return 6.0 * linear + attention, params


def peak_tflops(arg: float | None) -> float | None:
    if arg is not None:
        return arg
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def run(args) -> dict:
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8 import FP8Config
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU: bench_actor measures a GPU training step (use --cpu-smoke "
            "to test the script on CPU)"
        )
    mc = model_config(args.cpu_smoke, args.seq)
    groups = parallel.initialize(parallel.ParallelConfig(), seed=1)
    try:
        t0 = time.perf_counter()
        actor = Actor(mc, OptimConfig(), groups, fp8=FP8Config(recipe=args.fp8_recipe))
        build_s = time.perf_counter() - t0
        print(actor.describe(), flush=True)
        # Batches stay on the host, as the trainer builds them; the actor moves each micro-batch.
        ids = torch.randint(
            4, mc.vocab_size, (args.rows, args.seq), generator=torch.Generator().manual_seed(0)
        )
        batch = {
            "input_ids": ids,
            "labels": ids.roll(-1, 1),
            "loss_mask": torch.ones(args.rows, args.seq),
        }
        tokens = args.rows * args.seq

        def nll(mb, logprobs):
            return -(logprobs * mb["loss_mask"]).sum() / tokens, {}

        def step() -> float:
            t = time.perf_counter()
            _, grad_norm, ok = actor.train_step(batch, args.micro_batch, nll)
            if groups.device.type == "cuda":
                torch.cuda.synchronize()  # the step's kernels, not just their launches
            if not ok:
                raise RuntimeError("the optimizer skipped the step (non-finite gradients)")
            return time.perf_counter() - t

        for _ in range(args.warmup):  # first step allocates Adam state and autotunes kernels
            step()
        if groups.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = statistics.median(step() for _ in range(args.steps))
        peak_mem = torch.cuda.max_memory_allocated() / 1e9 if groups.device.type == "cuda" else None
    finally:
        parallel.destroy()

    fpt, params = flops_per_token(mc, args.seq)
    peak = peak_tflops(args.peak_tflops)
    achieved = fpt * tokens / seconds / 1e12
    return {
        "device": torch.cuda.get_device_name() if groups.device.type == "cuda" else "cpu",
        "params_b": params / 1e9,
        "layers": mc.num_layers,
        "hidden": mc.hidden_size,
        "fp8_recipe": args.fp8_recipe,
        "rows": args.rows,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "build_s": build_s,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "model_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "peak_mem_gb": peak_mem,
    }


def markdown(r: dict) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "- (pass --peak-tflops)"
    mem = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "- (CPU)"
    return "\n".join(
        [
            "| device | params | recipe | rows x seq (mb) | s/step | tokens/s | TFLOP/s | MFU | "
            "peak GB |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|",
            f"| {r['device']} | {_params(r['params_b'])} | {r['fp8_recipe']} | "
            f"{r['rows']} x {r['seq']} ({r['micro_batch']}) | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['model_tflops']:.3g} | {mfu} | {mem} |",
        ]
    )


def _params(billions: float) -> str:
    return f"{billions:.2f}B" if billions >= 0.1 else f"{billions * 1e3:.2f}M"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="a 2-layer model, 4 rows x 16 tokens, on the CPU: tests the script",
    )
    p.add_argument("--rows", type=int, help="sequences per step (default 8; smoke 4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048; smoke 16)")
    p.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument(
        "--fp8-recipe",
        default="bf16",
        help="FP8Config.recipe of the actor (bf16 = off; FP8 runs through Transformer "
        "Engine when installed, else the emulation, which measures nothing useful)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense BF16 peak for MFU (default: 989 on H100/H200)",
    )
    p.add_argument("--json", type=Path, help="also write the result to this JSON file")
    args = p.parse_args(argv)
    args.rows = args.rows or (4 if args.cpu_smoke else 8)
    args.seq = args.seq or (16 if args.cpu_smoke else 2048)
    if args.cpu_smoke:
        args.steps = min(args.steps, 2)
    result = run(args)
    print(markdown(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
