"""The long-answer task: a chain of additions and subtractions solved step by step.

``"12+35-7+40+3="`` -> ``"12+35=47,47-7=40,40+40=80,80+3=83"``: the answer is the worked solution,
one step per operator, each step the running total, the operator, the next operand and the new
total; the final total (after the last ``=``) is what the verifier (``chain``) scores.

Why this task: on the shipped arithmetic task answers are at most 5 tokens, so an FP8 error in
one token's probability cannot compound along the sequence. Here a response runs 24-64 tokens
(median 40, with ``<eos>``), each step's total is read by the next, and a sequence-level
importance ratio is the product of 4-5 steps' worth of per-token ratios: the response-length axis
of the precision study (issue 42). Each step is a one- or two-digit sum a small model can learn,
so the task stays trainable while the chain gets long.

Mix (per problem): 5 or 6 operands, equally likely; each operand has 1 or 2 digits (half each);
each operator is ``+`` (60%) or ``-`` (40%); totals may go negative (``"3-15=-12"``);
the rare solution over 63 characters is drawn again, so every answer fits 64 tokens with ``<eos>``. The files
are written by ``scripts/make_tiny_task.py`` with the same seed-for-bytes guarantee as the default
task (:mod:`.arithmetic`), and shipped in ``data/assets/chain/``.
"""

from __future__ import annotations

import random
from pathlib import Path

from megatron_rl_fp8.data.arithmetic import ASSETS_DIR, write_task_files

CHAIN_SEED = 20261203
CHAIN_NUM_TRAIN = 8_000
CHAIN_NUM_VAL = 256
CHAIN_DIR = ASSETS_DIR.parent / "chain"
CHAIN_TRAIN_PATH = CHAIN_DIR / "train.jsonl"
CHAIN_VAL_PATH = CHAIN_DIR / "val.jsonl"
# The limits a config for this task needs: the longest prompt with <bos> (6 two-digit operands,
# 5 operators, "="), and the longest solution with <eos> (longer ones are drawn again).
CHAIN_MAX_PROMPT_LEN = 1 + 6 * 2 + 5 + 1
CHAIN_MAX_RESPONSE_LEN = 64

_OPERANDS = (5, 6)
_ADD_PROB = 0.6


def _operand(rng: random.Random) -> int:
    return rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def solution(prompt: str) -> str:
    """The worked solution of a chain prompt such as ``"12+35-7="``: ``"12+35=47,47-7=40"``."""
    body = prompt.removesuffix("=")
    terms: list[tuple[str, int]] = []
    number, op = "", "+"
    for ch in body:
        if ch in "+-" and number:
            terms.append((op, int(number)))
            number, op = "", ch
        else:
            number += ch
    terms.append((op, int(number)))
    total = terms[0][1]
    steps = []
    for op, value in terms[1:]:
        new = total + value if op == "+" else total - value
        steps.append(f"{total}{op}{value}={new}")
        total = new
    return ",".join(steps)


def sample_chain(rng: random.Random) -> dict[str, str]:
    """One problem as ``{"prompt": "a+b-c...=", "answer": "<worked solution>"}``."""
    while True:
        n = rng.choice(_OPERANDS)
        prompt = str(_operand(rng))
        for _ in range(n - 1):
            prompt += ("+" if rng.random() < _ADD_PROB else "-") + str(_operand(rng))
        prompt += "="
        answer = solution(prompt)
        if len(answer) < CHAIN_MAX_RESPONSE_LEN:
            return {"prompt": prompt, "answer": answer}


def write_chain_files(
    out_dir: str | Path,
    *,
    seed: int = CHAIN_SEED,
    num_train: int = CHAIN_NUM_TRAIN,
    num_val: int = CHAIN_NUM_VAL,
) -> tuple[Path, Path]:
    """Generate and write this task's ``train.jsonl`` and ``val.jsonl`` into ``out_dir``."""
    return write_task_files(
        out_dir, seed=seed, num_train=num_train, num_val=num_val, sample=sample_chain
    )
