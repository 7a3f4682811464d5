"""What FP8 costs on this machine: emulation per training step, FP8 rollout, and weight quantization.

Three tables, each measured in one run so the ratios compare like with like:

1. **Training step** (forward + backward + Adam through Megatron's schedule, one rank) for every
   trainer recipe, relative to the unquantized step; plus the BF16 shadow forward that calibrated
   clipping adds on calibration steps, relative to the FP8 forward it shadows.
2. **Rollout**: in-process engine generation with FP8 W8A8 numerics (block-FP8 weights, 1x128
   dynamic activation quantization) relative to full precision.
3. **quantize_blockwise** throughput (GB/s of bf16 weight bytes) next to a plain ``clone()`` of the
   same tensor: the weight-sync hot path against a memory-bandwidth yardstick.

On CPU, FP8 is emulated (quantize-dequantize in float32 around float32 GEMMs), so FP8 is *slower*
than BF16 here and the ratios measure the emulation's overhead, not FP8 speedups; on GPU the same
config runs Transformer Engine's FP8 GEMMs instead.

    python benchmarks/bench_fp8.py                       # tiny + small model, CPU
    python benchmarks/bench_fp8.py --models tiny --quant-sizes 1024 --iters 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

RECIPES = ("bf16", "tensorwise_delayed", "tensorwise_current", "rowwise", "blockwise", "mxfp8")
MODELS = {
    # name: (layers, hidden, ffn, heads, query groups)
    "tiny": (2, 128, 512, 4, 2),  # examples/tiny_cpu.yaml
    "small": (4, 512, 1536, 8, 4),  # ~17M parameters
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # timing needs the kernels finished


def _time(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model_cfg(name: str):
    from megatron_rl_fp8.models.config import ModelConfig

    layers, hidden, ffn, heads, groups = MODELS[name]
    return ModelConfig(
        arch="qwen3",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=53,
        max_position_embeddings=64,
    )


def bench_train(models: list[str], rows: int, seq: int, iters: int) -> None:
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    groups = parallel.initialize(parallel.ParallelConfig(), seed=1)
    ids = torch.randint(4, 53, (rows, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(rows, seq)}

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / (rows * seq), {}

    print(f"## Training step ({rows} rows x {seq} tokens, one micro-batch, one rank)\n")
    print("| model | recipe | step ms | vs bf16 | FP8 fwd ms | BF16 shadow fwd ms | shadow / fwd |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in models:
        base = None
        for recipe in RECIPES:
            actor = Actor(
                _model_cfg(name), OptimConfig(lr=1e-6), groups, fp8=FP8Config(recipe=recipe)
            )
            step = _time(lambda a=actor: a.train_step(batch, rows, nll), iters)
            fwd = _time(lambda a=actor: a.compute_logprobs(batch, rows), iters)

            def shadow(a=actor):
                with a.full_precision():
                    a.compute_logprobs(batch, rows)

            shadow_t = _time(shadow, iters)
            base = base or step
            print(
                f"| {name} | {recipe} | {step * 1e3:.1f} | {step / base:.2f} | {fwd * 1e3:.1f} "
                f"| {shadow_t * 1e3:.1f} | {shadow_t / fwd:.2f} |"
            )
            del actor
    parallel.destroy()
    print()


def bench_rollout(models: list[str], prompts: int, new_tokens: int, iters: int) -> None:
    from megatron_rl_fp8.fp8.config import RolloutFP8Config
    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.rollout.local import LocalEngine
    from megatron_rl_fp8.sync.buckets import rollout_buckets

    print(f"## Rollout ({prompts} prompts x {new_tokens} new tokens, in-process engine)\n")
    print("| model | rollout weights | generate ms | vs bf16 | weight sync ms |")
    print("|---|---|---:|---:|---:|")
    prompt_ids = [[1] + [4 + (7 * i + j) % 40 for j in range(8)] for i in range(prompts)]
    for name in models:
        cfg = hf_config(_model_cfg(name), bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        import transformers

        weights = {
            n: p.detach().clone()
            for n, p in transformers.AutoModelForCausalLM.from_config(cfg).named_parameters()
        }
        base = None
        for quant in ("bf16", "blockwise"):
            fp8 = RolloutFP8Config(weight_quant=quant)
            engine = LocalEngine(cfg, pad_token_id=0, eos_token_id=2, fp8=fp8)
            sync = _time(
                lambda e=engine, f=fp8, w=weights: e.update_weights(
                    rollout_buckets(w.items(), f, **e.export_options), version=1
                ),
                iters,
            )
            gen = _time(
                lambda e=engine: e.generate(
                    prompt_ids, n=1, max_new_tokens=new_tokens, temperature=1.0, seed=0
                ),
                iters,
            )
            base = base or gen
            print(f"| {name} | {quant} | {gen * 1e3:.1f} | {gen / base:.2f} | {sync * 1e3:.1f} |")
    print()


def bench_quantize(sizes: list[int], iters: int, pow2_scale: bool) -> None:
    from megatron_rl_fp8.fp8.quantize import quantize_blockwise

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"## quantize_blockwise vs clone (bf16 input, {device}, "
        f"{torch.get_num_threads()} threads)\n"
    )
    print(
        "| shape | bytes (bf16) | clone ms | clone GB/s | quantize ms | quantize GB/s "
        "| quantize / clone time |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for n in sizes:
        w = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        t_clone = _time(lambda w=w: w.clone(), iters)
        t_quant = _time(lambda w=w: quantize_blockwise(w, pow2_scale=pow2_scale), iters)
        print(
            f"| {n}x{n} | {nbytes / 2**20:.0f} MiB | {t_clone * 1e3:.2f} "
            f"| {nbytes / t_clone / 1e9:.2f} | {t_quant * 1e3:.2f} "
            f"| {nbytes / t_quant / 1e9:.2f} | {t_quant / t_clone:.1f}x |"
        )
        del w
    print()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rows", type=int, default=32, help="training rows per step")
    p.add_argument("--seq", type=int, default=24, help="tokens per training row")
    p.add_argument("--prompts", type=int, default=64, help="rollout prompts")
    p.add_argument("--new-tokens", type=int, default=8, help="rollout tokens per prompt")
    p.add_argument("--quant-sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--iters", type=int, default=5, help="timed calls per measurement (median)")
    p.add_argument("--pow2-scale", action="store_true", help="power-of-two weight scales")
    p.add_argument("--skip", nargs="*", default=[], choices=["train", "rollout", "quantize"])
    args = p.parse_args(argv)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'CUDA' if torch.cuda.is_available() else 'CPU (FP8 emulated)'}\n"
    )
    if "train" not in args.skip:
        bench_train(args.models, args.rows, args.seq, args.iters)
    if "rollout" not in args.skip:
        bench_rollout(args.models, args.prompts, args.new_tokens, args.iters)
    if "quantize" not in args.skip:
        bench_quantize(args.quant_sizes, args.iters, args.pow2_scale)


if __name__ == "__main__":
    main()
