"""What trusting a checkpoint costs: manifest hashing at save, and each resume verification, next
to the save and the load themselves (megatron_rl_fp8/checkpoint/).

One gloo rank saves a real dist checkpoint (``--tensors`` float32 ShardedTensors totalling
``--mb`` MB) and times, median of ``--repeat`` runs:

* ``save``: ``checkpoint.save`` in full (dist_checkpointing write + manifest + rename),
* ``manifest hashing``: the crc32 part of that save (every file read back once),
* ``load``: ``checkpoint.load`` into a fresh state dict,
* ``verify sizes`` / ``verify full``: ``find_resumable`` with either mode.

Every read is from the page cache (the checkpoint was just written), so hashing and loading are
CPU-bound here; on a cold parallel file system both are bounded by read bandwidth instead, and the
full/load ratio moves towards 1 (both read every byte once).

    python benchmarks/bench_checkpoint.py              # 256 MB
    python benchmarks/bench_checkpoint.py --mb 64      # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _state(n: int, numel: int, fill: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def t(i):
        if not fill:
            return torch.zeros(numel)
        return torch.randn(numel, generator=torch.Generator().manual_seed(i))

    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t(i)) for i in range(n)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=int, default=256, help="checkpoint size in MB (float32 data)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_rl_fp8 import checkpoint
    from megatron_rl_fp8.parallel import cpu_compat, free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    cpu_compat.enable()  # Megatron's writer stages tensors through torch.cuda calls

    hashing = [0.0]
    plain = checkpoint.file_checksum

    def timed_checksum(path):
        t0 = time.perf_counter()
        try:
            return plain(path)
        finally:
            hashing[0] += time.perf_counter() - t0

    checkpoint.file_checksum = timed_checksum
    numel = args.mb * 2**20 // 4 // args.tensors
    saved = _state(args.tensors, numel, fill=True)
    times: dict[str, list[float]] = {}

    def clock(label, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(label, []).append(time.perf_counter() - t0)
        return out

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        path = root / "iter_0000001"
        for _ in range(args.repeat):
            hashing[0] = 0.0
            clock("save", lambda: checkpoint.save(root, "iter_0000001", saved, {"step": 1}))
            times.setdefault("manifest hashing (in save)", []).append(hashing[0])
            loaded, _ = clock(
                "load", lambda: checkpoint.load(path, _state(args.tensors, numel, fill=False))
            )
            assert all(torch.equal(loaded[k], saved[k].data) for k in saved)
            del loaded
            clock("verify sizes", lambda: checkpoint.find_resumable(root, verify="sizes"))
            clock("verify full", lambda: checkpoint.find_resumable(root, verify="full"))
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        nfiles = len(list(path.iterdir()))
    dist.destroy_process_group()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"checkpoint: {nbytes / 1e6:.0f} MB in {nfiles} files, {args.tensors} tensors, one rank, "
        f"median of {args.repeat}, torch threads {torch.get_num_threads()}"
    )
    print("| step | ms | GB/s | vs load |")
    print("|---|---:|---:|---:|")
    for label, dt in med.items():
        gbs = f"{nbytes / dt / 1e9:.2f}" if label != "verify sizes" else "-"
        print(f"| {label} | {dt * 1e3:.1f} | {gbs} | {dt / med['load']:.3f} |")
    print(
        f"full verify / load = {med['verify full'] / med['load']:.2f}; "
        f"manifest hashing / save = {med['manifest hashing (in save)'] / med['save']:.2f}"
    )


if __name__ == "__main__":
    main()
