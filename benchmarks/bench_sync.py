"""Weight-sync cost: the export path (HF rename/split -> FP8 quantize -> buckets -> shared-memory
bucket copy) against a plain memory copy of the same bytes, and the whole sync into SGLang engines.

    python benchmarks/bench_sync.py                       # export rows for 10M / 100M / 1B params
    python benchmarks/bench_sync.py --fleet 1 2 4          # the sync into 1, 2, 4 engines (.venv-sglang)
    python benchmarks/bench_sync.py --fleet 1 --transports distributed tensor   # both transports
    python benchmarks/bench_sync.py --quantizers           # rollout.fp8.quantizer: builtin vs modelopt
    python benchmarks/bench_sync.py --per-node             # per-node sync beside the broadcast

Weights are random BF16, Qwen3-shaped, given as the *full* Megatron state dict (what
``sync.gather.iter_full_params`` yields on the driver at TP=1, where it hands out the parameters
themselves without copies; TP/PP gathers add network time that this one-box benchmark does not
model). GB/s = BF16 input bytes / wall seconds for every row, so rows compare with the copy row.

``--per-node`` runs two trainer ranks (gloo) on two "nodes" of this host (``SLURMD_NODENAME``
n1, n2), one SGLang CPU engine on each, and times whole syncs of the same fleet both ways in one
run, alternating: the ``distributed`` broadcast from rank 0 to both engines, and the per-node sync
(``trainer/node_sync.py``: rank 0 relays every bucket to rank 1 over gloo, each rank pushes it to
its own node's engine over shared memory). Seconds from the sync's begin to its end on rank 0,
best of ``--reps`` (default 3) per row.

``--quantizers`` times only the quantization step of that path, ``quantize_for_rollout`` with
``rollout.fp8.quantizer`` = builtin and = modelopt, on Qwen3-8B's linear weights (``--small``: the
same shapes / 8, plus a ragged one) in bf16 (what the trainer holds) and float32, on ``--device``
(cuda when available). GB/s = input bytes / seconds (median on CUDA, best on a CPU); "codes
identical" compares the two quantizers' e4m3 codes bit for bit (and the scales, in the JSON):

    python benchmarks/bench_sync.py --quantizers --device cpu --threads 2 --small --json q.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import expected_hf_names
from megatron_rl_fp8.sync.buckets import ExportStats, export_for_rollout
from megatron_rl_fp8.sync.quantize import quantize_for_rollout

# name -> (hidden, layers, ffn, heads, groups, vocab); the exact parameter count is printed per row.
SHAPES = {
    "10M": (256, 6, 768, 4, 2, 8000),
    "100M": (768, 10, 2048, 12, 4, 32000),
    "1B": (2048, 16, 5632, 16, 8, 32000),
}

# Qwen3-8B linear weights [out, in]: hidden 4096, 32 query heads and 8 KV groups of 128, FFN 12288.
QWEN3_8B_LINEARS = {
    "q_proj / o_proj": (4096, 4096),
    "k_proj / v_proj": (1024, 4096),
    "gate_proj / up_proj": (12288, 4096),
    "down_proj": (4096, 12288),
}
SMALL_LINEARS = {
    **{name: (m // 8, n // 8) for name, (m, n) in QWEN3_8B_LINEARS.items()},
    "ragged": (200, 300),
}


def model_config(hidden, layers, ffn, heads, groups, vocab) -> ModelConfig:
    return ModelConfig(
        arch="qwen3",
        hidden_size=hidden,
        num_layers=layers,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )


def random_mcore_state(mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Full Megatron (local spec) BF16 state dict with random values."""
    from megatron_rl_fp8.models.hf_mapping import hf_state_to_mcore

    d, h = mc.kv_channels, mc.hidden_size
    shapes = {}
    for name in expected_hf_names(mc):
        if name.endswith("norm.weight"):
            shapes[name] = (d,) if ("q_norm" in name or "k_norm" in name) else (h,)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            shapes[name] = (mc.vocab_size, h)
        elif name.endswith("q_proj.weight"):
            shapes[name] = (mc.num_attention_heads * d, h)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            shapes[name] = (mc.num_query_groups * d, h)
        elif name.endswith("o_proj.weight"):
            shapes[name] = (h, mc.num_attention_heads * d)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            shapes[name] = (mc.ffn_hidden_size, h)
        elif name.endswith("down_proj.weight"):
            shapes[name] = (h, mc.ffn_hidden_size)
    gen = torch.Generator().manual_seed(0)
    hf = {n: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for n, s in shapes.items()}
    return hf_state_to_mcore(hf, mc)


def bench_export(
    state: dict[str, torch.Tensor], mc: ModelConfig, bucket_mb: float, repeats: int = 2
) -> list[dict]:
    """Best of ``repeats`` for every row (the first pass also pays first-touch page faults)."""
    from megatron_rl_fp8.rollout.sglang.transports import flatten_per_dtype

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = [t.clone() for t in state.values()]
        best = min(best, time.perf_counter() - t0)
        del copies
    rows.append({"step": "copy (clone every tensor)", "s": best})
    cases = [
        ("export bf16", RolloutFP8Config(), None),
        ("export fp8 blockwise", RolloutFP8Config(weight_quant="blockwise"), None),
        (
            "export fp8 -> bf16 values (CPU server)",
            RolloutFP8Config(weight_quant="blockwise"),
            torch.bfloat16,
        ),
    ]
    for label, fp8, deq in cases:
        best = float("inf")
        for _ in range(repeats):
            stats = ExportStats()
            t0 = time.perf_counter()
            for bucket in export_for_rollout(
                state.items(), mc, fp8, bucket_mb=bucket_mb, dequantize_to=deq, stats=stats
            ):
                flatten_per_dtype(
                    bucket.tensors
                )  # the tensor transport's copy into one shared buffer
            best = min(best, time.perf_counter() - t0)
        rows.append(
            {"step": label, "s": best, "buckets": stats.buckets, "out_gb": stats.bytes_out / 1e9}
        )
    for r in rows:
        r["gbps"] = nbytes / 1e9 / r["s"]
        r["vs_copy"] = rows[0]["s"] / r["s"]
    return rows


def bench_fleet(
    state, mc: ModelConfig, bucket_mb: float, counts, python: str, transports=("distributed",)
) -> list[dict]:
    """The production sync (``SGLangFleet.update_weights``: export -> the transport's pushes of
    every bucket to every engine -> version checks) into fleets of ``counts`` CPU engines, per
    transport, without and with FP8 (on CPU the FP8-rounded values travel in the serving dtype;
    best of 2 syncs each)."""
    import tempfile

    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.rollout.config import RolloutConfig
    from megatron_rl_fp8.rollout.sglang import SGLangFleet
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for n in counts:
        with tempfile.TemporaryDirectory() as work:
            cfg = RolloutConfig(
                engine="sglang",
                sglang=SGLangConfig(
                    python=python,
                    num_engines=n,
                    bucket_mb=bucket_mb,
                    work_dir=work,
                    dtype="bfloat16",
                    startup_timeout_s=900,
                ),
            )
            t0 = time.perf_counter()
            fleet = SGLangFleet(cfg, hf_config(mc), pad_token_id=0, eos_token_id=2)
            start = time.perf_counter() - t0
            try:
                version = 0
                for transport, (label, fp8) in itertools.product(
                    transports,
                    (
                        ("bf16", RolloutFP8Config()),
                        ("fp8 blockwise", RolloutFP8Config(weight_quant="blockwise")),
                    ),
                ):
                    fleet.cfg.transport = transport
                    best = float("inf")
                    for _ in range(2):
                        t0 = time.perf_counter()
                        fleet.update_weights(
                            export_for_rollout(state.items(), mc, fp8, **fleet.export_options),
                            version=version,
                        )
                        best = min(best, time.perf_counter() - t0)
                        version += 1
                    rows.append(
                        {
                            "engines": n,
                            "transport": transport,
                            "weights": label,
                            "s": best,
                            "gbps": nbytes / 1e9 / best,
                            "start_s": start,
                        }
                    )
            finally:
                fleet.shutdown()
    return rows


def _seconds(fns: dict, device: torch.device, reps: int) -> dict[str, float]:
    """Wall seconds per call of each function: one untimed call each first (which also pays
    modelopt's import and CUDA's first launches), then ``reps`` rounds that time the functions in
    turn, so load from other processes hits them alike. The median on CUDA; the best round on a
    CPU, where a shared box's stalls are one-sided noise (as the export rows above)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()  # timing needs the previous kernels finished
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    pick = statistics.median if device.type == "cuda" else min
    return {k: pick(v) for k, v in times.items()}


def bench_quantizers(shapes: dict, device: torch.device, reps: int) -> list[dict]:
    """builtin vs modelopt through ``quantize_for_rollout`` (the run path), per shape and dtype."""
    name = "model.layers.0.mlp.up_proj.weight"  # any FP8-eligible HF name

    def quantize(w: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = RolloutFP8Config(weight_quant="blockwise", quantizer=quantizer)
        (_, codes), (_, scale_inv) = quantize_for_rollout([(name, w)], cfg)
        return codes, scale_inv

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for linear, shape in shapes.items():
        w32 = 0.02 * torch.randn(shape, generator=gen, device=device)
        for dtype in (torch.bfloat16, torch.float32):
            w = w32.to(dtype)
            seconds = _seconds(
                {q: lambda q=q, w=w: quantize(w, q) for q in ("builtin", "modelopt")}, device, reps
            )
            (c_b, s_b), (c_m, s_m) = quantize(w, "builtin"), quantize(w, "modelopt")
            differ = int((c_b.view(torch.uint8) != c_m.view(torch.uint8)).sum())  # host sync
            nbytes = w.numel() * w.element_size()
            rows.append(
                {
                    "linear": linear,
                    "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                    "builtin_s": seconds["builtin"],
                    "modelopt_s": seconds["modelopt"],
                    "builtin_gbps": nbytes / 1e9 / seconds["builtin"],
                    "modelopt_gbps": nbytes / 1e9 / seconds["modelopt"],
                    "ratio": seconds["modelopt"] / seconds["builtin"],
                    "codes_differ": differ,
                    "scales_identical": bool(torch.equal(s_b, s_m)),
                }
            )
    return rows


def print_quantizers(rows: list[dict]) -> None:
    print(
        "| weight | shape | input | builtin GB/s | modelopt GB/s | modelopt/builtin time "
        "| codes identical (differing) |"
    )
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        m, n = r["shape"]
        print(
            f"| {r['linear']} | {m}x{n} | {r['dtype']} | {r['builtin_gbps']:.2f} | "
            f"{r['modelopt_gbps']:.2f} | {r['ratio']:.2f} | "
            f"{r['codes_differ'] == 0} ({r['codes_differ']}) |"
        )
    ratios = [r["ratio"] for r in rows]
    print(f"modelopt/builtin time ratio: {min(ratios):.2f}-{max(ratios):.2f}")


def _per_node_rank(rank: int, world: int, port: int, size: str, bucket_mb: float, python: str,
                   reps: int, out) -> None:  # fmt: skip
    """One rank of ``--per-node``: rank 0 drives the fleet and exports; both push."""
    import os
    import tempfile

    import torch.distributed as dist

    os.environ.update(SLURMD_NODENAME=f"n{rank + 1}", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.parallel import Groups
    from megatron_rl_fp8.rollout.config import RolloutConfig
    from megatron_rl_fp8.rollout.sglang import SGLangFleet
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
    from megatron_rl_fp8.rollout.sglang.sender import WeightSender
    from megatron_rl_fp8.trainer.node_sync import NodeSync

    mc = model_config(*SHAPES[size])
    state = random_mcore_state(mc) if rank == 0 else None
    # A DP 2 trainer: rank 0 is the stage's sender, rank 1 n2's relay rank.
    node_sync = NodeSync(Groups(None, None, None, 0, 1, 0, 1, rank, 2, True, True, rank=rank))
    sender = None if rank == 0 else WeightSender()
    with tempfile.TemporaryDirectory() as work:
        fleet = None
        if rank == 0:
            cfg = RolloutConfig(engine="sglang", sglang=SGLangConfig(
                python=python, num_engines=2, bucket_mb=bucket_mb, work_dir=work,
                dtype="bfloat16", startup_timeout_s=900))  # fmt: skip
            fleet = SGLangFleet(cfg, hf_config(mc), pad_token_id=0, eos_token_id=2)
            fleet.engines[1].node = "n2"  # what the launcher's engine_nodes says on a cluster
            sender = fleet.sender
        rows, version = [], 0
        try:
            weights = (("bf16", RolloutFP8Config()),
                       ("fp8 blockwise", RolloutFP8Config(weight_quant="blockwise")))  # fmt: skip
            for (label, fp8), _, transport in itertools.product(
                weights, range(reps), ("distributed", "tensor")
            ):
                if rank == 0:
                    fleet.cfg.transport = transport
                dist.barrier()
                t0 = time.perf_counter()
                plan = fleet.begin_sync(version) if rank == 0 else None
                box = [plan]
                dist.broadcast_object_list(box, src=0)
                plan = box[0]

                def export(times, fp8=fp8, plan=plan):
                    return export_for_rollout(state.items(), mc, fp8, **plan.export_options)

                if transport == "tensor":
                    error, times = node_sync.push(plan, export=export, sender=lambda: sender)
                else:
                    error = sender.push(plan, export(None)) if rank == 0 else None
                errors: list = [None] * world
                dist.all_gather_object(errors, error)
                if rank == 0:
                    fleet.end_sync(plan, errors)
                    rows.append({"weights": label, "transport": transport,
                                 "s": time.perf_counter() - t0})  # fmt: skip
                version += 1
        finally:
            if fleet is not None:
                fleet.shutdown()
            dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def bench_per_node(size: str, bucket_mb: float, python: str, reps: int) -> list[dict]:
    """``--per-node``: best seconds per sync by (weights, transport)."""
    import torch.multiprocessing as mp

    from megatron_rl_fp8.parallel import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (2, free_port(), size, bucket_mb, python, reps, out)
    procs = [ctx.Process(target=_per_node_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["weights"], r["transport"])
        best[key] = min(best.get(key, float("inf")), r["s"])
    return [{"weights": w, "transport": t, "s": s} for (w, t), s in best.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--sglang-size", default="100M", choices=list(SHAPES))
    ap.add_argument("--sglang-bucket-mb", type=float, default=64)
    ap.add_argument("--sglang-python", default=".venv-sglang/bin/python")
    ap.add_argument(
        "--fleet",
        type=int,
        nargs="+",
        metavar="N",
        help="instead of the export rows: the production sync into N SGLang CPU engines "
        "(one fleet per N; model --sglang-size, buckets --sglang-bucket-mb)",
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["distributed"],
        choices=["distributed", "tensor"],
        help="--fleet: rollout.sglang.transport values to time",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--quantizers",
        action="store_true",
        help="instead of the export rows: rollout.fp8.quantizer builtin vs modelopt",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="--quantizers: Qwen3-8B shapes / 8")
    ap.add_argument("--reps", type=int, help="--quantizers: timed rounds (10 on cuda, 5 on cpu)")
    ap.add_argument("--json", type=Path, help="--quantizers: also write the rows to this file")
    ap.add_argument(
        "--per-node",
        action="store_true",
        help="instead of the export rows: the per-node sync beside the broadcast, 2 ranks and "
        "2 engines (model --sglang-size, buckets --sglang-bucket-mb, best of --reps, default 3)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.per_node:
        mc = model_config(*SHAPES[args.sglang_size])
        n = sum(t.numel() for t in random_mcore_state(mc).values())
        print(
            f"2 ranks on 2 nodes of one host (gloo), one SGLang CPU engine per node, "
            f"{args.sglang_size} ({n / 1e6:.0f}M params, bf16), bucket_mb={args.sglang_bucket_mb}"
        )
        rows = bench_per_node(args.sglang_size, args.sglang_bucket_mb, args.sglang_python,
                              args.reps or 3)  # fmt: skip
        print("| weights | sync | s / sync | per-node / broadcast |")
        print("|---|---|---:|---:|")
        by = {(r["weights"], r["transport"]): r["s"] for r in rows}
        for (w, t), sec in by.items():
            name = "per node (relay + shared memory)" if t == "tensor" else "broadcast (gloo)"
            ratio = f"{sec / by[(w, 'distributed')]:.2f}x" if t == "tensor" else ""
            print(f"| {w} | {name} | {sec:.2f} | {ratio} |")
        return
    if args.quantizers:
        device = torch.device(args.device)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"{where}, threads={torch.get_num_threads()}, torch {torch.__version__}")
        reps = args.reps or (10 if device.type == "cuda" else 5)
        rows = bench_quantizers(SMALL_LINEARS if args.small else QWEN3_8B_LINEARS, device, reps)
        print_quantizers(rows)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps({"device": where, "reps": reps, "rows": rows}, indent=1)
            )
        return
    if args.fleet:
        mc = model_config(*SHAPES[args.sglang_size])
        state = random_mcore_state(mc)
        n = sum(t.numel() for t in state.values())
        print(
            f"SGLang CPU engines behind sglang-router, {args.sglang_size} ({n / 1e6:.0f}M params, "
            f"bf16), bucket_mb={args.sglang_bucket_mb}, threads={torch.get_num_threads()}"
        )
        print("| engines | transport | weights | s / sync | GB/s (bf16 in) | fleet start s |")
        print("|---:|---|---|---:|---:|---:|")
        rows = bench_fleet(
            state, mc, args.sglang_bucket_mb, args.fleet, args.sglang_python, args.transports
        )
        for r in rows:
            print(
                f"| {r['engines']} | {r['transport']} | {r['weights']} | {r['s']:.2f} | "
                f"{r['gbps']:.3f} | {r['start_s']:.0f} |"
            )
        return
    print(f"threads={torch.get_num_threads()} bucket_mb={args.bucket_mb}")
    print("| model | params | step | seconds | GB/s (bf16 in) | vs copy | buckets |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for size in args.sizes:
        mc = model_config(*SHAPES[size])
        state = random_mcore_state(mc)
        n = sum(t.numel() for t in state.values())
        for r in bench_export(state, mc, args.bucket_mb):
            print(
                f"| {size} | {n / 1e6:.0f}M | {r['step']} | {r['s']:.2f} | {r['gbps']:.2f} | "
                f"{r['vs_copy']:.2f} | {r.get('buckets', '')} |"
            )
        del state


if __name__ == "__main__":
    main()
