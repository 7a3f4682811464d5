"""The tool-use task (``task.name: calculator``, issue 46): products a tiny model cannot work out
in its head but can get from a calculator, ``"437*86="`` -> ``"37582"``.

A trajectory that uses the tool (``env.tools: calculator``, ``env.tool_format: calc``) reads::

    policy    calc(437*86)<eos>
    inserted  =37582\\n
    policy    37582<eos>

and the reward scores the last turn (``arithmetic``'s verifier: its leading integer). The SFT warm
start shows the tool on about half the train problems (the record's ``sft_turns``: policy turns
and inserted texts in turn, the inserted ones out of the loss) and a bare answer on the rest,
so the base policy calls the tool some of the time and RL has the share of calls to raise.

Mix: the first factor has 3 digits, the second 2, uniformly. Files are written by
``scripts/make_tiny_task.py`` with the default task's seed-for-bytes guarantee
(:mod:`.arithmetic`) and shipped in ``data/assets/calculator/``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_rl_fp8.data.arithmetic import ASSETS_DIR, generate_splits

CALC_SEED = 20261206
CALC_NUM_TRAIN = 8_000
CALC_NUM_VAL = 256
CALC_DIR = ASSETS_DIR.parent / "calculator"
CALC_TRAIN_PATH = CALC_DIR / "train.jsonl"
CALC_VAL_PATH = CALC_DIR / "val.jsonl"
# "999*99=" with <bos>; "calc(999*99)<eos>" + "=98901\n" + "98901<eos>".
CALC_MAX_PROMPT_LEN = 1 + 7
CALC_MAX_RESPONSE_LEN = 32
SFT_TOOL_SHARE = 0.5


def tool_turns(prompt: str, answer: str) -> list[str]:
    """The SFT trace of a call: policy turn, inserted answer, policy turn (what
    ``rollout/turns.py`` makes of the same trajectory with the ``calc`` format)."""
    return [f"calc({prompt.removesuffix('=')})", f"={answer}\n", answer]


def sample_product(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


def write_calculator_files(
    out_dir: str | Path,
    *,
    seed: int = CALC_SEED,
    num_train: int = CALC_NUM_TRAIN,
    num_val: int = CALC_NUM_VAL,
) -> tuple[Path, Path]:
    """Write this task's ``train.jsonl`` (with ``sft_turns`` on about half the problems) and
    ``val.jsonl`` into ``out_dir``."""
    train, val = generate_splits(
        seed=seed, num_train=num_train, num_val=num_val, sample=sample_product
    )
    rng = random.Random(seed + 1)
    for r in train:
        if rng.random() < SFT_TOOL_SHARE:
            r["sft_turns"] = tool_turns(r["prompt"], r["answer"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in (("train.jsonl", train), ("val.jsonl", val)):
        path = out / name
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        paths.append(path)
    return paths[0], paths[1]
