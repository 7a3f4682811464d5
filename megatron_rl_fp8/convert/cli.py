"""``megatron-rl-fp8 convert hf-to-mcore | mcore-to-hf | export-fp8``."""

from __future__ import annotations

import argparse
import sys


def build_parser(prog: str = "megatron-rl-fp8 convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--out", required=True, help="Output directory (created atomically).")
        sp.add_argument("--overwrite", action="store_true", help="Replace a non-empty --out.")
        sp.add_argument("--no-progress", action="store_true", help="No progress bar.")

    a = sub.add_parser(
        "hf-to-mcore", allow_abbrev=False, help="HF safetensors -> Megatron dist checkpoint."
    )
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors).")
    a.add_argument(
        "--tp",
        type=int,
        default=1,
        help="Tensor-parallel size you will train with: sets the vocab padding "
        "(multiple of 128 * TP). Other tensors reshard to any TP/PP on load.",
    )
    a.add_argument(
        "--pp", type=int, default=1, help="Pipeline-parallel size (checked: divides layers)."
    )
    common(a)

    b = sub.add_parser(
        "mcore-to-hf", allow_abbrev=False, help="Megatron dist checkpoint -> HF safetensors."
    )
    b.add_argument(
        "--ckpt", required=True, help="Checkpoint dir (iter_XXXXXXX) or root with 'latest'."
    )
    b.add_argument(
        "--hf-config",
        required=True,
        help="HF directory whose config.json (and tokenizer files) describe the model.",
    )
    b.add_argument(
        "--max-shard-size", default="5GB", help="Largest safetensors shard (default 5GB)."
    )
    b.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="Cast weights (default: keep the checkpoint dtype).",
    )
    common(b)

    c = sub.add_parser(
        "export-fp8", allow_abbrev=False, help="Block-FP8 (128x128 E4M3) HF checkpoint for serving."
    )
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF model directory to quantize.")
    src.add_argument("--ckpt", help="Megatron dist checkpoint to quantize (needs --hf-config).")
    c.add_argument(
        "--hf-config", default=None, help="With --ckpt: HF config + tokenizer directory."
    )
    c.add_argument("--keep-first-layers", type=int, default=0, help="First N layers stay BF16.")
    c.add_argument("--keep-last-layers", type=int, default=0, help="Last N layers stay BF16.")
    c.add_argument(
        "--max-shard-size", default="5GB", help="Largest safetensors shard (default 5GB)."
    )
    common(c)
    return p


def run(args) -> dict:
    # lazy: start-up (`convert -h` parses without torch)
    from megatron_rl_fp8.convert import export_fp8, hf_to_mcore, mcore_to_hf

    show = not args.no_progress
    if args.command == "hf-to-mcore":
        return hf_to_mcore(
            args.hf,
            args.out,
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            overwrite=args.overwrite,
            progress=show,
        )
    if args.command == "mcore-to-hf":
        return mcore_to_hf(
            args.ckpt,
            args.out,
            hf_config_dir=args.hf_config,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            overwrite=args.overwrite,
            progress=show,
        )
    return export_fp8(
        args.out,
        hf_dir=args.hf,
        ckpt=args.ckpt,
        hf_config_dir=args.hf_config,
        keep_first_layers=args.keep_first_layers,
        keep_last_layers=args.keep_last_layers,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=show,
    )


def main(argv: list[str] | None = None, prog: str = "megatron-rl-fp8 convert") -> int:
    args = build_parser(prog).parse_args(argv)
    from megatron_rl_fp8.convert.errors import ConvertError  # lazy: start-up, as in run()

    try:
        stats = run(args)
    except ConvertError as e:
        print(f"convert error: {e}", file=sys.stderr)
        return 2
    if stats.get("rank", 0) == 0:
        for note in stats.get("notes", []):
            print(f"note: {note}")
        print(stats["summary"])
    return 0
