"""Write a tiny Hugging Face model folder and a chat-format task, to try ``model.hf_checkpoint``
on a CPU (megatron_rl_fp8/data/tiny_hf.py says what is in it; its weights are random).

    python scripts/make_tiny_hf_model.py [--out-dir runs/tiny_hf] [--experts 4]
    python -m megatron_rl_fp8 train examples/tiny_cpu_hf.yaml

``--experts N`` writes a Qwen3-MoE of N experts (top-2) instead of the dense Qwen3: the same
command trains it (add ``parallel.expert_model_parallel_size=2`` under torchrun with 2 ranks to
split its experts).

writes <out-dir>/model (config.json, model.safetensors, tokenizer, chat template,
generation_config.json) and <out-dir>/{train,val}.jsonl (verl's layout: a message-list prompt,
the answer at reward_model.ground_truth).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Runnable from a source checkout without installing the package.
from megatron_rl_fp8.data.tiny_hf import make_hf_model, write_chat_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("runs/tiny_hf"), help="where to write")
    parser.add_argument("--seed", type=int, default=0, help="weight and task seed")
    parser.add_argument(
        "--experts", type=int, default=None, help="a Qwen3-MoE of this many experts (top-2)"
    )
    args = parser.parse_args(argv)
    if args.experts is not None and args.experts < 2:
        parser.error(f"--experts must be at least 2 (top-2 routing), got {args.experts}")
    info = make_hf_model(args.out_dir / "model", seed=args.seed, experts=args.experts)
    write_chat_task(args.out_dir / "train.jsonl", 256, seed=args.seed)
    write_chat_task(args.out_dir / "val.jsonl", 32, seed=args.seed + 1)
    print(
        f"wrote {info['dir']} ({'Qwen3-MoE' if args.experts else 'Qwen3'}, vocab {info['vocab_size']}, end ids {info['eos_ids']}) and "
        f"{args.out_dir}/{{train,val}}.jsonl"
    )


if __name__ == "__main__":
    main()
