"""FP8 delta syncs against full ones (issue 48, ``sync/delta.py``): bytes and seconds per sync on
real optimizer steps, side by side in one run.

    python benchmarks/bench_delta_sync.py [--sizes tiny 100M] [--lrs 1e-6 1e-5] [--steps 5]

For each model size and learning rate: a Qwen3-shaped transformers model (random init; ``tiny``
is the tiny CPU job's shape, ``100M`` bench_sync.py's) takes ``--steps`` Adam steps on a
next-token loss over random tokens; after each, its weights go through the rollout export
(``sync.buckets.rollout_stream``: block-FP8 codes + float32 scales, the rest as is), are
delta-encoded against the previous step's (``DeltaSender``) and applied by a receiver
(``DeltaReceiver``). Printed per step: the share of FP8 codes that changed, full vs delta
megabytes (the delta: int32 positions + new values, or the whole tensor where smaller; and how
much of it is the FP8 codes'), the encode and apply seconds of a sync without digests, and what
a verifying sync adds (a CRC-32 of every tensor, on each side); the first (full) sync is left
out. ``--pow2``: power-of-two block scales (UE8M0).

``--relay``: the same steps through the per-node sync's relay itself (``sync/relay.py``), two
gloo ranks on this host, each step's buckets sent both ways in one run: full, and as a delta
(``rollout.delta_sync``: encoded on rank 0, applied to rank 1's copy, no digests, full
buckets rebuilt for the engines). Seconds from the stream's start to rank 1's last bucket, and
the megabytes broadcast. Over loopback the link is nearly free, so these seconds are the
encode / apply cost; ``plan --time`` prices the bytes over a real link.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.sync.buckets import rollout_stream
from megatron_rl_fp8.sync.delta import DeltaReceiver, DeltaSender, TensorDelta, digest

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


def train_step(model, opt, vocab: int, gen: torch.Generator) -> None:
    """One Adam step on a next-token loss over random tokens."""
    ids = torch.randint(0, vocab, (4, 64), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def run(size: str, lr: float, steps: int, pow2: bool) -> list[dict]:
    model, vocab = build(size)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    fp8 = RolloutFP8Config(weight_quant="blockwise", pow2_scale=pow2)
    sender, receiver = DeltaSender(), DeltaReceiver()
    receiver.apply(sender.encode(export(model, fp8), version=0))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        train_step(model, opt, vocab, gen)
        named = export(model, fp8)
        t0 = time.perf_counter()
        sync = sender.encode(named, version=step, verify=False)  # a sync without digests
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        receiver.apply(sync)
        apply_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name, _ in named:  # what a verifying sync adds: a digest on each side
            digest(receiver.tensors[name])
        digest_s = time.perf_counter() - t0
        codes = [t for t in sync.tensors.values() if isinstance(t, TensorDelta)]
        fp8_codes = [t for t in codes if t.dtype == torch.float8_e4m3fn]
        changed = sum(t.positions.numel() for t in fp8_codes)
        total = sum(t.numel for t in fp8_codes) or 1
        fp8_delta = sum(t.nbytes for t in fp8_codes) / 2**20
        rows.append(
            dict(
                size=size, lr=lr, step=step, density=changed / total,
                full_mb=sync.full_nbytes / 2**20, delta_mb=sync.nbytes / 2**20,
                fp8_delta_mb=fp8_delta, encode_s=encode_s, apply_s=apply_s, digest_s=digest_s,
            )
        )  # fmt: skip
    return rows


def _relay_rank(rank: int, port: int, size: str, lr: float, steps: int, pow2: bool, out) -> None:
    """One rank of ``--relay``: rank 0 trains and sends, rank 1 receives."""
    import os

    import torch.distributed as dist

    from megatron_rl_fp8.sync.buckets import Bucket
    from megatron_rl_fp8.sync.relay import DeltaLink, relay
    from megatron_rl_fp8.sync.timing import SyncTimes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    link = DeltaLink(verify=False)  # a sync between two verifying ones
    fp8 = RolloutFP8Config(weight_quant="blockwise", pow2_scale=pow2)
    model = opt = None
    if rank == 0:
        model, vocab = build(size)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(steps + 1):
        buckets = None
        if rank == 0:
            if step:
                train_step(model, opt, vocab, gen)
            named = export(model, fp8)
            buckets = [Bucket(i, named[i : i + 8]) for i in range(0, len(named), 8)]
        row = dict(size=size, lr=lr, step=step)
        for mode in ("full", "delta"):
            times = SyncTimes()
            dist.barrier()
            t0 = time.perf_counter()
            link.version = step
            stream = relay(
                buckets, src=0, group=group, device=torch.device("cpu"), times=times,
                delta=link if mode == "delta" else None,
            )  # fmt: skip
            collections.deque(stream, maxlen=0)  # rank 1 applies each bucket as it comes
            dist.barrier()
            row[f"{mode}_s"] = time.perf_counter() - t0
            row[f"{mode}_mb"] = times.relay_mb
            if mode == "delta" and rank == 1:
                assert link.failure is None, link.failure
        if rank == 0 and step:
            rows.append(row)
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def run_relay(size: str, lr: float, steps: int, pow2: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from megatron_rl_fp8.parallel import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (free_port(), size, lr, steps, pow2, out)
    procs = [ctx.Process(target=_relay_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=sorted(SIZES))
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pow2", action="store_true", help="power-of-two (UE8M0) block scales")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--relay", action="store_true", help="through sync/relay.py, full vs delta")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    columns = RELAY_COLUMNS if args.relay else COLUMNS
    print(
        " ".join(f"{title:>{len(title) if i > 2 else 5}}" for i, (title, _) in enumerate(columns))
    )
    for size in args.sizes:
        for lr in args.lrs:
            rows = (run_relay if args.relay else run)(size, lr, args.steps, args.pow2)
            for r in rows:
                print(" ".join(cell(r) for _, cell in columns))


# (title, the row's cell) of each printed column
_KEY = [(" size", lambda r: f"{r['size']:>5}"), ("     lr", lambda r: f"{r['lr']:>7.0e}"),
        ("step", lambda r: f"{r['step']:>4}")]  # fmt: skip
_MB = [("  full MB", lambda r: f"{r['full_mb']:>9.2f}"),
       (" delta MB", lambda r: f"{r['delta_mb']:>9.2f}")]  # fmt: skip
COLUMNS = [
    *_KEY,
    ("codes changed", lambda r: f"{r['density']:>13.4%}"),
    *_MB,
    ("of it FP8", lambda r: f"{r['fp8_delta_mb']:>9.2f}"),
    ("delta/full", lambda r: f"{r['delta_mb'] / r['full_mb']:>10.3f}"),
    (" encode s", lambda r: f"{r['encode_s']:>9.3f}"),
    (" apply s", lambda r: f"{r['apply_s']:>8.3f}"),
    ("digests s", lambda r: f"{r['digest_s']:>9.3f}"),
]
RELAY_COLUMNS = [
    *_KEY,
    *_MB,
    ("  full s", lambda r: f"{r['full_s']:>8.3f}"),
    (" delta s", lambda r: f"{r['delta_s']:>8.3f}"),
    ("delta/full s", lambda r: f"{r['delta_s'] / r['full_s']:>12.2f}"),
]


if __name__ == "__main__":
    main()
