"""FP8 delta syncs against full ones (issue 48, ``sync/delta.py``): bytes and seconds per sync on
real optimizer steps, side by side in one run.

    python benchmarks/bench_delta_sync.py [--sizes tiny 100M] [--lrs 1e-6 1e-5] [--steps 5]

For each model size and learning rate: a Qwen3-shaped transformers model (random init; ``tiny``
is the tiny CPU job's shape, ``100M`` bench_sync.py's) takes ``--steps`` Adam steps on a
next-token loss over random tokens; after each, its weights go through the rollout export
(``sync.buckets.rollout_stream``: block-FP8 codes + float32 scales, the rest as is), are
delta-encoded against the previous step's (``DeltaSender``) and applied by a receiver
(``DeltaReceiver``, digests checked). Printed per step: the share of FP8 codes that changed,
full vs delta megabytes (the delta: int32 positions + new values, or the whole tensor where
smaller), and the encode and apply seconds; the first (full) sync is left out. ``--pow2``:
power-of-two block scales (UE8M0).
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.sync.buckets import rollout_stream
from megatron_rl_fp8.sync.delta import DeltaReceiver, DeltaSender, TensorDelta

# name -> (hidden, layers, ffn, heads, groups, vocab)
SIZES = {"tiny": (128, 2, 512, 4, 2, 53), "100M": (768, 10, 2048, 12, 4, 32000)}


def build(size: str):
    import transformers

    hidden, layers, ffn, heads, groups, vocab = SIZES[size]
    mc = ModelConfig(
        arch="qwen3", hidden_size=hidden, num_layers=layers, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, vocab_size=vocab,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
    return model, vocab


def export(model, fp8: RolloutFP8Config):
    state = ((n, p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items())
    return list(rollout_stream(state, fp8))


def run(size: str, lr: float, steps: int, pow2: bool) -> list[dict]:
    model, vocab = build(size)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    fp8 = RolloutFP8Config(weight_quant="blockwise", pow2_scale=pow2)
    sender, receiver = DeltaSender(), DeltaReceiver()
    receiver.apply(sender.encode(export(model, fp8), version=0))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        ids = torch.randint(0, vocab, (4, 64), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        named = export(model, fp8)
        t0 = time.perf_counter()
        sync = sender.encode(named, version=step)
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        receiver.apply(sync)
        apply_s = time.perf_counter() - t0
        codes = [t for t in sync.tensors.values() if isinstance(t, TensorDelta)]
        fp8_codes = [t for t in codes if t.dtype == torch.float8_e4m3fn]
        changed = sum(t.positions.numel() for t in fp8_codes)
        total = sum(t.numel for t in fp8_codes) or 1
        rows.append(
            dict(
                size=size, lr=lr, step=step, density=changed / total,
                full_mb=sync.full_nbytes / 2**20, delta_mb=sync.nbytes / 2**20,
                encode_s=encode_s, apply_s=apply_s,
            )
        )  # fmt: skip
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=sorted(SIZES))
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pow2", action="store_true", help="power-of-two (UE8M0) block scales")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{'size':>5} {'lr':>7} {'step':>4} {'codes changed':>13} {'full MB':>9} "
        f"{'delta MB':>9} {'delta/full':>10} {'encode s':>9} {'apply s':>8}"
    )
    for size in args.sizes:
        for lr in args.lrs:
            for r in run(size, lr, args.steps, args.pow2):
                print(
                    f"{r['size']:>5} {r['lr']:>7.0e} {r['step']:>4} {r['density']:>13.4%} "
                    f"{r['full_mb']:>9.2f} {r['delta_mb']:>9.2f} "
                    f"{r['delta_mb'] / r['full_mb']:>10.3f} {r['encode_s']:>9.3f} "
                    f"{r['apply_s']:>8.3f}"
                )


if __name__ == "__main__":
    main()
