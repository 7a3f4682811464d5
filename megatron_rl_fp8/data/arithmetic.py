"""The embedded default task: integer addition and subtraction, e.g. ``"12+35="`` -> ``"47"``.

Why this task: a rule-based verifier scores it exactly, the answers are short (1-4 characters),
and the difficulty is tunable by operand length. The mix below is chosen so that a tiny 2-layer
transformer gets the easy part (one- and two-digit sums) after a short supervised warm start but
not the three-digit sums and the borrows of subtraction, leaving room for RL to improve reward.

Mix (per problem): 70% addition, 30% subtraction; each operand independently has 1 digit (30%),
2 digits (50%) or 3 digits (20%). Subtraction may go negative (``"7-15="`` -> ``"-8"``), which
exercises the sign handling of the verifier. Validation prompts are distinct and never appear in
the train file; train prompts may repeat (easy ones do, as in the mix above).

Everything is driven by one ``random.Random(seed)``: the same seed gives the same files byte for
byte (``scripts/make_tiny_task.py`` writes the shipped ones; a unit test regenerates and compares).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

DEFAULT_SEED = 20240607
DEFAULT_NUM_TRAIN = 20_000
DEFAULT_NUM_VAL = 256

ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "arithmetic"
DEFAULT_TRAIN_PATH = ASSETS_DIR / "train.jsonl"
DEFAULT_VAL_PATH = ASSETS_DIR / "val.jsonl"

_ADD_PROB = 0.7
# (cumulative probability, number of digits) for one operand.
_DIGIT_CDF = ((0.3, 1), (0.8, 2), (1.0, 3))


def _operand(rng: random.Random) -> int:
    u = rng.random()
    digits = next(d for p, d in _DIGIT_CDF if u < p)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problem(rng: random.Random) -> dict[str, str]:
    """One problem as ``{"prompt": "a+b=", "answer": "c"}`` (or ``a-b``)."""
    a, b = _operand(rng), _operand(rng)
    if rng.random() < _ADD_PROB:
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    return {"prompt": f"{a}-{b}=", "answer": str(a - b)}


def generate_splits(
    *,
    seed: int = DEFAULT_SEED,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_val: int = DEFAULT_NUM_VAL,
    sample: Callable[[random.Random], dict[str, str]] = sample_problem,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Sample ``(train, val)`` problem lists with no prompt in both; validation is drawn first.
    ``sample`` draws one problem (this task's by default; :mod:`.chain` passes its own).

    Validation prompts are distinct (each counts once in the held-out score). Train prompts may
    repeat: only 200 distinct one-digit-with-one-digit prompts exist, and forcing train to be
    distinct would thin the easy problems and skew the mix towards three-digit operands.
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train={num_train} and num_val={num_val} must both be >= 1")
    rng = random.Random(seed)
    val: list[dict[str, str]] = []
    val_prompts: set[str] = set()
    train: list[dict[str, str]] = []
    attempts = 0
    while len(val) < num_val or len(train) < num_train:
        attempts += 1
        if attempts > 50 * (num_train + num_val) + 1000:
            raise RuntimeError(f"could not draw the splits after {attempts} tries; ask for fewer")
        problem = sample(rng)
        if problem["prompt"] in val_prompts:
            continue
        if len(val) < num_val:
            val_prompts.add(problem["prompt"])
            val.append(problem)
        else:
            train.append(problem)
    return train, val


def write_jsonl(records: list[dict[str, str]], path: str | Path) -> Path:
    """Write one JSON object per line, with a fixed key order and ``\\n`` line ends."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n")
    return out


def write_task_files(
    out_dir: str | Path,
    *,
    seed: int = DEFAULT_SEED,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_val: int = DEFAULT_NUM_VAL,
    sample: Callable[[random.Random], dict[str, str]] = sample_problem,
) -> tuple[Path, Path]:
    """Generate and write ``train.jsonl`` and ``val.jsonl`` into ``out_dir``."""
    train, val = generate_splits(seed=seed, num_train=num_train, num_val=num_val, sample=sample)
    out = Path(out_dir)
    return write_jsonl(train, out / "train.jsonl"), write_jsonl(val, out / "val.jsonl")
