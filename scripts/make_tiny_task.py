"""Regenerate the shipped assets of the embedded default task, deterministically.

Writes, under megatron_rl_fp8/data/assets/ (or --out-dir):
  tokenizer/   tokenizer.json, tokenizer_config.json, special_tokens_map.json  (char tokenizer)
  arithmetic/  train.jsonl, val.jsonl                                          (disjoint prompts)
  chain/       train.jsonl, val.jsonl             (the long-answer task, its own seed and sizes)
  calculator/  train.jsonl, val.jsonl             (the tool-use task, its own seed and sizes)

The same seed gives the same bytes; tests/unit/test_data_assets.py checks the shipped files
against a fresh run, so rerun this script after changing the vocabulary or the task mix.

    python scripts/make_tiny_task.py [--out-dir DIR] [--seed N] [--num-train N] [--num-val N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Runnable from a source checkout without installing the package.
from megatron_rl_fp8.data.arithmetic import (
    DEFAULT_NUM_TRAIN,
    DEFAULT_NUM_VAL,
    DEFAULT_SEED,
    write_task_files,
)
from megatron_rl_fp8.data.calculator import write_calculator_files
from megatron_rl_fp8.data.chain import write_chain_files
from megatron_rl_fp8.data.tokenizer import VOCAB_SIZE, write_tokenizer_files

ASSETS = Path(__file__).resolve().parents[1] / "megatron_rl_fp8" / "data" / "assets"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ASSETS, help="assets root to write")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="arithmetic task seed")
    parser.add_argument("--num-train", type=int, default=DEFAULT_NUM_TRAIN, help="train prompts")
    parser.add_argument("--num-val", type=int, default=DEFAULT_NUM_VAL, help="held-out prompts")
    # The chain and calculator tasks' files keep their own seeds and sizes (data/chain.py,
    # data/calculator.py).
    args = parser.parse_args(argv)

    tok_dir = write_tokenizer_files(args.out_dir / "tokenizer")
    train, val = write_task_files(
        args.out_dir / "arithmetic", seed=args.seed, num_train=args.num_train, num_val=args.num_val
    )
    chain = write_chain_files(args.out_dir / "chain")
    calculator = write_calculator_files(args.out_dir / "calculator")
    print(f"tokenizer ({VOCAB_SIZE} ids) -> {tok_dir}")
    for path in (train, val, *chain, *calculator):
        print(f"{path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
