"""Throughput of the checkpoint converters next to a plain file copy of the same bytes.

Builds a synthetic BF16 HF checkpoint (random weights in a Qwen3-like shape, written straight
with safetensors, several shards), then times in one run:

* ``copy``: ``shutil.copyfile`` of every shard + fsync (the I/O yardstick: what moving the bytes
  costs without any conversion),
* ``hf-to-mcore``, ``mcore-to-hf`` and ``export-fp8`` (from the HF directory).

GB/s = checkpoint bytes (BF16 safetensors size) / wall time, so the rows compare directly.
Each conversion also reports its peak *anonymous* memory (RssAnon sampled every 10 ms; page cache
of memory-mapped files is not counted), which shows that streaming keeps memory near one tensor.
The source is in the page cache for every row (it was just written), so these are warm-cache
numbers; on a cold parallel filesystem all rows are bounded by the read bandwidth instead.

    python benchmarks/bench_convert.py                          # ~1 GB checkpoint
    python benchmarks/bench_convert.py --hidden 1024 --layers 4 # quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch


def _rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """Peak RssAnon above the level at entry, sampled in a thread."""

    def __enter__(self):
        self.base = _rss_anon_bytes()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon_bytes() - self.base)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def make_checkpoint(path: Path, args) -> int:
    from safetensors.torch import save_file

    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.hf_mapping import expected_hf_shapes, hf_config

    mc = ModelConfig(
        arch="qwen3",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn or int(2.75 * args.hidden),
        num_attention_heads=args.hidden // 128,
        num_query_groups=max(1, args.hidden // 512),
        head_dim=128,
        vocab_size=args.vocab,
        params_dtype="bfloat16",
    )
    path.mkdir(parents=True)
    cfg = hf_config(mc).to_dict()
    cfg["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = torch.Generator().manual_seed(0)
    shards, cur, size, limit = [], {}, 0, args.shard_mb * 2**20
    for name, shape in expected_hf_shapes(mc).items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if cur and size + t.numel() * 2 > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * 2
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        total += (path / fname).stat().st_size
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def copy_tree(src: Path, dst: Path) -> None:
    import os

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        shutil.copyfile(f, dst / f.name)
        fd = os.open(dst / f.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=0, help="default 2.75 x hidden")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--workdir", default=None, help="default: a temporary directory (removed)")
    args = p.parse_args()

    # Import cost is paid once per process, not per byte: take it out of the timed rows.
    import megatron.core.dist_checkpointing  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    from megatron_rl_fp8.convert import export_fp8, hf_to_mcore, mcore_to_hf

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        nbytes = make_checkpoint(root / "hf", args)
        print(
            f"checkpoint: {nbytes / 1e9:.3f} GB BF16 safetensors, hidden {args.hidden}, "
            f"{args.layers} layers, in {root}"
        )
        rows = []

        def timed(label, fn):
            with PeakAnon() as mem:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            rows.append((label, dt, nbytes / 1e9 / dt, mem.peak))

        timed("copy (shutil.copyfile + fsync)", lambda: copy_tree(root / "hf", root / "copy"))
        timed("hf-to-mcore", lambda: hf_to_mcore(root / "hf", root / "mcore", progress=False))
        timed(
            "mcore-to-hf",
            lambda: mcore_to_hf(
                root / "mcore", root / "back", hf_config_dir=root / "hf", progress=False
            ),
        )
        timed(
            "export-fp8 (from HF)",
            lambda: export_fp8(root / "fp8", hf_dir=root / "hf", progress=False),
        )
        copy_gbs = rows[0][2]
        print("| step | seconds | GB/s | vs copy | peak anon MB |")
        print("|---|---:|---:|---:|---:|")
        for label, dt, gbs, peak in rows:
            print(f"| {label} | {dt:.2f} | {gbs:.2f} | {gbs / copy_gbs:.2f} | {peak / 2**20:.0f} |")
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # the guard dist_checkpointing's multiprocessing needs
    main()
