"""The actor's training step at a ~2B Qwen3 shape: tokens/s, MFU and peak memory per configuration.

The project's own ``Actor`` (Megatron GPTModel, local layer spec unless Transformer Engine is
installed, Megatron DDP and Adam), TP = PP = 1, one process or one per GPU under torchrun (data
parallel), bf16 parameters with float32 main weights and gradients. The default batch is 8 rows x
2048 tokens (over all ranks) in micro-batches of 2, a token-mean NLL loss, one optimizer step per
timed step. ``--varlen`` gives the rows lengths spread evenly from a quarter of ``--seq`` to all of
it (right-padded, as RL responses are); tokens/s then counts real tokens only.

``--fp8`` runs the step per FP8 backend and recipe, side by side with BF16: a comma-separated list
of ``bf16``, ``RECIPE`` (``fp8.backend: auto``) or ``BACKEND:RECIPE`` (``te``, ``torch``,
``torchao`` or ``emulate``; see ``megatron_rl_fp8/fp8/backend.py``), e.g. ``bf16,
torch:tensorwise_current,torch:rowwise,torchao:tensorwise_current``; a ``+compile`` suffix sets
``fp8.compile_casts`` (the torch backend's casts, or torchao's whole call, through
``torch.compile``; the compile happens in the warm-up steps, untimed).
An entry this machine cannot run is skipped with its reason. The
"vs base" columns compare each row with the ``bf16`` row of its configuration (the first row when
there is none).

``--configs`` runs several configurations side by side in one process (``CONFIGS``): ``base``,
``unfused`` (Megatron's unfused attention instead of torch's SDPA, ``model.attention_backend``;
the same on the CPU, where it is the default), ``selective`` / ``recompute`` (Megatron's
selective core-attention and full uniform 1-layer
activation recomputation), ``distopt`` (distributed optimizer with overlapped gradient
reduction: it shards only over DP ranks, so run it under torchrun), ``budget``
(``train.max_tokens_per_gpu`` = micro-batch x seq: packs short rows, with ``--varlen``), ``all``.

``--profile N`` runs one more step per row under torch.profiler and prints where its device
time goes: the N kernels with the most self time and each kind's share (GEMM, attention, norm,
loss, optimizer, communication, other: ``KERNEL_KINDS``, by kernel name), the answer to "what do
attention, norms and the loss cost next to the GEMMs" (issue 17). On the CPU: operators.

Model: the Qwen3-1.7B block (28 layers, hidden 2048, 16 query / 8 KV heads of 128, SwiGLU 6144,
vocab 151936) with an untied output layer, 2.03B parameters; ``--shape`` takes a larger model's
layers instead (``megatron_rl_fp8/plan/presets.py``: qwen3-8b, qwen3-14b, qwen2.5-32b, qwen3-32b),
``--layers`` fewer of them, so that its GEMM shapes run on one GPU. Throughput in model FLOPs
(PaLM's convention, no recompute, causal attention counted in full; ``plan/measure.py:
flops_per_token``, the step-time model's count):

    FLOPs per token = 6 * (linear weights, output layer included)
                      + 12 * layers * seq * heads * head_dim

MFU divides that by ``--peak-tflops`` (dense BF16; default 989 for H100 / H200, the datasheet's
dense number; other GPUs need the flag; under torchrun it is per GPU). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (parameters, gradients and Adam state
included), the largest over ranks, in GB of 10^9 bytes; on the CPU, the peak of live tensor
bytes in the second step from PyTorch's profiler (allocations since the build: the same things).

    python benchmarks/bench_actor.py                          # on a GPU node
    python benchmarks/bench_actor.py --peak-tflops 2250 --json out.json
    python benchmarks/bench_actor.py --cpu-smoke              # 2 layers on the CPU: tests the script
    python benchmarks/bench_actor.py --varlen --configs base,selective,recompute,budget
    python benchmarks/bench_actor.py --fp8 bf16,torch:tensorwise_current,torch:rowwise,torch:blockwise
    python benchmarks/bench_actor.py --shape qwen3-8b --layers 8 --fp8 bf16,torch:tensorwise_current
    python benchmarks/bench_actor.py --configs base,unfused --profile 15
    torchrun --nproc-per-node 8 benchmarks/bench_actor.py --rows 64 --configs base,distopt,all --varlen
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.plan.measure import flops_per_token, peak_bytes, preset_model

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense BF16 tensor-core peak by GPU name fragment (NVIDIA datasheets, SXM, without sparsity)."""

_FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
_DISTOPT = {"use_distributed_optimizer": True, "overlap_grad_reduce": True}
CONFIGS = {
    "base": {},
    "unfused": {"model": {"attention_backend": "unfused"}},
    "selective": {"memory": {"recompute_granularity": "selective"}},
    "recompute": {"memory": _FULL},
    "distopt": {"parallel": _DISTOPT},
    "budget": {"budget": True},
    "all": {"memory": _FULL, "parallel": _DISTOPT, "budget": True},
}
"""Name -> ModelConfig / MemoryConfig / ParallelConfig fields and whether a token budget groups
the rows."""


def model_config(
    cpu_smoke: bool, seq: int, *, cpu_small: bool = False, shape: str = "2b", layers: int = 0
):
    """The benchmarked model: ``shape`` '2b' (``BENCH_ACTOR_2B``) or a ``plan.presets`` name,
    ``layers`` (0: the shape's own) deep; ``cpu_small`` / ``cpu_smoke`` models of their own."""
    if cpu_small:  # ~19M parameters: big enough on the CPU for the configurations to differ
        return ModelConfig(
            arch="qwen3",
            num_layers=4,
            hidden_size=384,
            ffn_hidden_size=1024,
            num_attention_heads=6,
            num_query_groups=2,
            head_dim=64,
            vocab_size=16384,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
        )
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
    return preset_model(shape, seq, layers=layers)


def peak_tflops(arg: float | None) -> float | None:
    if arg is not None:
        return arg
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def parse_fp8(text: str) -> list[tuple[str, dict]]:
    """``--fp8`` entries -> (label, FP8Config kwargs); raises ValueError naming a bad entry."""
    from megatron_rl_fp8.fp8.config import FP8Config

    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        backend, _, recipe = entry.rpartition(":")
        recipe, plus, compiled = recipe.partition("+")
        if plus and compiled != "compile":
            raise ValueError(f"--fp8 entry {entry!r}: the only suffix is '+compile'")
        kwargs = {"recipe": recipe, "backend": backend or "auto"}
        if plus:
            kwargs["compile_casts"] = True
        try:
            FP8Config(**kwargs)
        except ValueError as e:
            raise ValueError(f"--fp8 entry {entry!r}: {e}") from None
        out.append((entry, kwargs))
    if not out:
        raise ValueError("--fp8 is empty; give e.g. bf16,torch:tensorwise_current")
    return out


def make_batch(args, vocab: int) -> dict[str, torch.Tensor]:
    """All ranks' rows: random tokens; with ``args.varlen`` right-padded to lengths spread
    evenly over [seq / 4, seq]."""
    ids = torch.randint(4, vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(args.rows, args.seq)
    if args.varlen:
        lengths = torch.linspace(args.seq // 4, args.seq, args.rows).round().long()
        mask = (torch.arange(args.seq) < lengths[:, None]).float()
        ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": mask}


def run(args) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.backend import resolve_backend
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.memory import MemoryConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.batch import rows_for_rank
    from megatron_rl_fp8.trainer.config import OptimConfig

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA GPU: bench_actor measures a GPU training step (use --cpu-smoke "
            "to test the script on CPU)"
        )
    mc = model_config(
        args.cpu_smoke, args.seq, cpu_small=args.cpu_small, shape=args.shape, layers=args.layers
    )
    groups = parallel.initialize(parallel.ParallelConfig(), seed=1)
    on_gpu = groups.device.type == "cuda"
    batch = make_batch(args, mc.vocab_size)
    if args.rows % groups.dp_size:
        raise SystemExit(f"--rows {args.rows} must be a multiple of the {groups.dp_size} ranks")
    local = rows_for_rank(batch, groups.dp_rank, groups.dp_size)
    tokens = batch["loss_mask"].sum().item()  # real tokens of all ranks
    fpt, params = flops_per_token(mc, args.seq)
    peak = peak_tflops(args.peak_tflops)
    results = []

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / tokens, {}

    runs = []
    for name in args.configs:
        for label, kwargs in args.fp8:
            fp8 = FP8Config(**kwargs)
            try:
                backend = resolve_backend(fp8)
            except ValueError as e:
                if groups.rank == 0:
                    print(f"{name} / {label}: skipped: {e}", flush=True)
                continue
            runs.append((name, label, fp8, backend))

    try:
        for name, label, fp8, backend in runs:
            spec = CONFIGS[name]
            parallel_cfg = parallel.ParallelConfig(**spec.get("parallel", {}))
            parallel.init_model_parallel(parallel_cfg, seed=1)  # same weights for every config
            # On the CPU the profiler's allocation trace stands in for the allocator's peak
            # (scripts/validate_plan.py): from before the build, so weights and Adam count.
            profiler = (
                contextlib.nullcontext()
                if on_gpu
                else profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            )
            with profiler as prof:
                t0 = time.perf_counter()
                actor = Actor(
                    dataclasses.replace(mc, **spec.get("model", {})),
                    OptimConfig(),
                    groups,
                    fp8=fp8,
                    memory=MemoryConfig(**spec.get("memory", {})),
                    parallel=parallel_cfg,
                )
                build_s = time.perf_counter() - t0
                budget = args.micro_batch * args.seq if spec.get("budget") else None
                # The first step allocates Adam's state; the peak is read in the second, the
                # steady state (the timed steps' peak on a GPU).
                for window in ("bench/first", "bench/step"):
                    with record_function(window):
                        actor.train_step(local, args.micro_batch, nll, max_tokens=budget)
            if groups.rank == 0:
                print(f"{name} / {label}: {actor.describe()}", flush=True)

            def step(actor=actor, budget=budget) -> float:
                t = time.perf_counter()
                _, _, ok = actor.train_step(local, args.micro_batch, nll, max_tokens=budget)
                if on_gpu:
                    torch.cuda.synchronize()  # the step's kernels, not just their launches
                if not ok:
                    raise RuntimeError("the optimizer skipped the step (non-finite gradients)")
                return time.perf_counter() - t

            # The steps above allocated Adam's state; more untimed steps autotune kernels.
            for _ in range(args.warmup - 2):
                step()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            seconds = statistics.median(step() for _ in range(args.steps))
            profiled = profile_step(step, on_gpu, args.profile) if args.profile else None
            peak_mem = None if on_gpu else peak_bytes(prof, ["bench/step"])["bench/step"] / 1e9
            if on_gpu:
                mem = torch.tensor([torch.cuda.max_memory_allocated() / 1e9], device=groups.device)
                torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MAX)
                peak_mem = mem.item()
            achieved = fpt * tokens / seconds / 1e12
            results.append(
                {
                    "config": name,
                    "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                    "ranks": groups.dp_size,
                    "params_b": params / 1e9,
                    "shape": "cpu" if args.cpu_smoke else args.shape,
                    "layers": mc.num_layers,
                    "hidden": mc.hidden_size,
                    "fp8": label,
                    "fp8_recipe": fp8.recipe,
                    "fp8_backend": backend,
                    "rows": args.rows,
                    "seq": args.seq,
                    "real_tokens": tokens,
                    "micro_batch": args.micro_batch,
                    "max_tokens_per_gpu": budget,
                    "build_s": build_s,
                    "step_s": seconds,
                    "tokens_per_s": tokens / seconds,
                    "model_tflops": achieved,
                    "peak_tflops": peak,
                    "mfu": achieved / (peak * groups.dp_size) if peak else None,
                    "peak_mem_gb": peak_mem,
                    "profile": profiled,
                }
            )
            del actor, step
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    finally:
        parallel.destroy()
    return results


# Where a step's device time goes, by kernel (GPU) or operator (CPU) name: the first pattern
# that occurs in the lower-cased name wins. Norms, RoPE, the loss's elementwise work and casts
# are "other" unless their kernels say so.
KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam", "_foreach")),
    ("loss", ("log_softmax", "logsoftmax", "logsumexp", "cross_entropy", "nll")),
    ("attention", ("flash", "fmha", "attention", "softmax", "baddbmm", "aten::bmm")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "aten::mm", "aten::addmm")),
    ("norm", ("norm",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pats in KERNEL_KINDS if any(p in low for p in pats)), "other")


def profile_step(step, on_gpu: bool, top: int) -> dict:
    """One ``step()`` under torch.profiler: the ``top`` kernels (GPU) or operators (CPU) by self
    time, and each kind's share of the step's device (CPU: operator) time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        step()
    if on_gpu:  # kernels (where a torch lists none as CUDA events: whatever has device time)
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA] or [
            e for e in prof.key_averages() if e.self_device_time_total > 0
        ]
        times = {e.key: e.self_device_time_total for e in events}
    else:  # leaf work: aten operators' self time
        times = {e.key: e.self_cpu_time_total for e in prof.key_averages() if "::" in e.key}
    total = sum(times.values()) or 1.0
    kinds: dict[str, float] = {}
    for name, t in times.items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + t / total
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": total / 1e3,
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top": [
            {"name": n[:120], "ms": t / 1e3, "share": t / total, "kind": kernel_kind(n)}
            for n, t in ranked
        ],
    }


def profile_markdown(r: dict) -> str:
    prof = r["profile"]
    kinds = ", ".join(f"{k} {v:.1%}" for k, v in prof["kinds"].items())
    unit = "kernel" if r["device"] != "cpu" else "operator"
    lines = [
        f"{r['config']} / {r['fp8']}: one step's {prof['total_ms']:.1f} ms of {unit} time: {kinds}",
        "",
        f"| {unit} | kind | ms | share |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| `{t['name']}` | {t['kind']} | {t['ms']:.2f} | {t['share']:.1%} |" for t in prof["top"]
    ]
    return "\n".join(lines)


def _base(results: list[dict], r: dict) -> dict:
    """The row ``r`` is compared with: its configuration's BF16 row, else the first row."""
    return next(
        (b for b in results if b["config"] == r["config"] and b["fp8_recipe"] == "bf16"),
        results[0],
    )


def markdown(results: list[dict]) -> str:
    """One row per configuration and FP8 setting; the ratios are against the configuration's BF16
    row (else the first row), measured in this run."""
    lines = [
        "| config | device x ranks | params | fp8 | rows x seq (mb / budget) | s/step | "
        "tokens/s | vs base | MFU | peak GB | vs base |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        base = _base(results, r)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "- (pass --peak-tflops)"
        mem = f"{r['peak_mem_gb']:.3g}"
        mem_ratio = f"{r['peak_mem_gb'] / base['peak_mem_gb']:.2f}x"
        batching = r["max_tokens_per_gpu"] or r["micro_batch"]
        model = _params(r["params_b"])
        if r.get("shape") not in (None, "2b", "cpu"):
            model += f" ({r['shape']}, {r['layers']} layers)"
        lines.append(
            f"| {r['config']} | {r['device']} x {r['ranks']} | {model} | "
            f"{r['fp8']} | {r['rows']} x {r['seq']} ({batching}) | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{mfu} | {mem} | {mem_ratio} |"
        )
    return "\n".join(lines)


def _params(billions: float) -> str:
    return f"{billions:.2f}B" if billions >= 0.1 else f"{billions * 1e3:.2f}M"


def main(argv: list[str] | None = None) -> int:
    from megatron_rl_fp8.plan.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="a 2-layer model, 4 rows x 16 tokens, on the CPU: tests the script",
    )
    p.add_argument(
        "--cpu-small",
        action="store_true",
        help="a ~19M-parameter model (4 layers, hidden 384, vocab 16384), 8 rows x 256 tokens, "
        "on the CPU: the configurations' relative costs where no GPU is at hand",
    )
    p.add_argument(
        "--shape",
        default="2b",
        choices=["2b", *PRESETS],
        help="the model's layer shape: 2b (the Qwen3-1.7B block, 28 layers) or a preset's "
        "(Qwen3-8B ...: megatron-rl-fp8 plan --time lists them); with --layers",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="layers (default: the shape's own). One GPU holds about 16 bytes per parameter "
        "(bf16 weights, fp32 main weights, gradients, Adam): qwen3-8b fits with 8-16 layers",
    )
    p.add_argument("--rows", type=int, help="sequences per step (default 8; smoke 4)")
    p.add_argument(
        "--seq", type=int, help="tokens per sequence (default 2048; small 256; smoke 16)"
    )
    p.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2)")
    p.add_argument(
        "--fp8",
        help="comma-separated FP8 settings run side by side: bf16, RECIPE (backend auto) or "
        "BACKEND:RECIPE with BACKEND te, torch or emulate (e.g. "
        "bf16,torch:tensorwise_current,torch:rowwise); default: --fp8-recipe",
    )
    p.add_argument(
        "--fp8-recipe",
        default="bf16",
        help="one FP8Config.recipe with backend auto (bf16 = off); --fp8 runs several",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense BF16 peak for MFU (default: 989 on H100/H200)",
    )
    p.add_argument(
        "--configs",
        default="base",
        help=f"comma-separated, run side by side in this order: {', '.join(CONFIGS)}",
    )
    p.add_argument(
        "--varlen",
        action="store_true",
        help="rows of lengths spread over [seq/4, seq], right-padded (RL-like)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, one more under torch.profiler: the N kernels (CPU: "
        "operators) with the most self time and each kind's share (GEMM, attention, norm, loss, "
        "optimizer, communication, other)",
    )
    p.add_argument("--json", type=Path, help="also write the results (a list) to this JSON file")
    args = p.parse_args(argv)
    if args.profile < 0:
        p.error(f"--profile {args.profile}: give how many kernels to list (0: no profile)")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.layers < 0:
        p.error(f"--layers {args.layers}: give a positive number of layers (0: the shape's own)")
    if (args.cpu_smoke or args.cpu_small) and (args.shape != "2b" or args.layers):
        p.error("--shape / --layers set the GPU model; --cpu-smoke and --cpu-small have their own")
    try:
        args.fp8 = parse_fp8(args.fp8 if args.fp8 is not None else args.fp8_recipe)
    except ValueError as e:
        p.error(str(e))
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.cpu_small:
        args.seq = args.seq or 256
    elif args.cpu_smoke:
        args.rows, args.seq = args.rows or 4, args.seq or 16
        args.steps = min(args.steps, 2)
    args.rows, args.seq = args.rows or 8, args.seq or 2048
    args.cpu_smoke = args.cpu_smoke or args.cpu_small  # both run on the CPU
    results = run(args)
    if not results:
        raise SystemExit("bench_actor: no --fp8 entry can run on this machine (see above)")
    if int(os.environ.get("RANK", 0)) == 0:
        print(markdown(results))
        for r in results:
            if r["profile"]:
                print("\n" + profile_markdown(r))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
