"""Weight-sync cost: the export path (HF rename/split -> FP8 quantize -> buckets -> shared-memory
bucket copy) against a plain memory copy of the same bytes, and SGLang's update latency per bucket.

    python tools/bench_sync.py                       # export rows for 10M / 100M / 1B params
    python tools/bench_sync.py --sglang               # + SGLang CPU server updates (needs .venv-sglang)

Weights are random BF16, Qwen3-shaped, given as the *full* Megatron state dict (what
``sync.gather.iter_full_params`` yields on the driver at TP=1, where it hands out the parameters
themselves without copies; TP/PP gathers add network time that this one-box benchmark does not
model). GB/s = BF16 input bytes / wall seconds for every row, so rows compare with the copy row.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import expected_hf_names
from megatron_rl_fp8.sync.buckets import ExportStats, export_for_rollout

# name -> (hidden, layers, ffn, heads, groups, vocab); the exact parameter count is printed per row.
SHAPES = {
    "10M": (256, 6, 768, 4, 2, 8000),
    "100M": (768, 10, 2048, 12, 4, 32000),
    "1B": (2048, 16, 5632, 16, 8, 32000),
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
    from megatron_rl_fp8.rollout.sglang.transports import _flatten

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
                _flatten(bucket.tensors)  # the tensor transport's copy into one shared buffer
            best = min(best, time.perf_counter() - t0)
        rows.append(
            {"step": label, "s": best, "buckets": stats.buckets, "out_gb": stats.bytes_out / 1e9}
        )
    for r in rows:
        r["gbps"] = nbytes / 1e9 / r["s"]
        r["vs_copy"] = rows[0]["s"] / r["s"]
    return rows


def bench_sglang(state, mc: ModelConfig, bucket_mb: float, transports, python: str) -> list[dict]:
    import tempfile

    from megatron_rl_fp8.models.hf_mapping import hf_config
    from megatron_rl_fp8.rollout.base import RolloutConfig, SGLangConfig
    from megatron_rl_fp8.rollout.sglang import SGLangEngine

    rows = []
    with tempfile.TemporaryDirectory() as work:
        cfg = RolloutConfig(
            sglang=SGLangConfig(
                python=python,
                transport=transports[0],
                bucket_mb=bucket_mb,
                work_dir=work,
                dtype="bfloat16",
                startup_timeout_s=600,
            )
        )
        eng = SGLangEngine(cfg, hf_config(mc), pad_token_id=0, eos_token_id=2)
        try:
            t0 = time.perf_counter()
            eng.update_weights(
                export_for_rollout(state.items(), mc, eng.fp8, **eng.export_options), version=0
            )
            rows.append({"transport": "first sync (write + launch)", "s": time.perf_counter() - t0})
            for v, transport in enumerate(transports, start=1):
                eng.cfg.transport = transport
                eng.bucket_times.clear()
                t0 = time.perf_counter()
                eng.update_weights(
                    export_for_rollout(state.items(), mc, eng.fp8, **eng.export_options), version=v
                )
                total = time.perf_counter() - t0
                pushed = sum(b for b, _ in eng.bucket_times)
                per = [s for _, s in eng.bucket_times]
                rows.append(
                    {
                        "transport": transport,
                        "s": total,
                        "buckets": len(per),
                        "bucket_s": sum(per) / len(per) if per else float("nan"),
                        "push_gbps": pushed / 1e9 / sum(per) if per else float("nan"),
                    }
                )
        finally:
            eng.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--sglang", action="store_true", help="also time SGLang CPU server updates")
    ap.add_argument("--sglang-size", default="100M", choices=list(SHAPES))
    ap.add_argument("--sglang-bucket-mb", type=float, default=64)
    ap.add_argument("--sglang-python", default=".venv-sglang/bin/python")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
    if args.sglang:
        mc = model_config(*SHAPES[args.sglang_size])
        state = random_mcore_state(mc)
        n = sum(t.numel() for t in state.values())
        print(
            f"\nSGLang CPU server, {args.sglang_size} ({n / 1e6:.0f}M params, bf16), "
            f"bucket_mb={args.sglang_bucket_mb}"
        )
        print("| transport | total s | buckets | s / bucket | push GB/s |")
        print("|---|---:|---:|---:|---:|")
        for r in bench_sglang(
            state, mc, args.sglang_bucket_mb, ["tensor", "distributed", "disk"], args.sglang_python
        ):
            print(
                f"| {r['transport']} | {r['s']:.2f} | {r.get('buckets', '')} | "
                f"{r.get('bucket_s', float('nan')):.3f} | {r.get('push_gbps', float('nan')):.2f} |"
            )


if __name__ == "__main__":
    main()
