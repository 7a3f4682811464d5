"""Which task a run trains on, and where its prompts come from.

``TaskConfig()`` with no arguments is the embedded default: the shipped arithmetic prompts
(``data/assets/arithmetic/{train,val}.jsonl``) and their length limits. Point ``train_path`` /
``val_path`` at your own JSONL or Parquet files, ``name`` at a registered verifier (``gsm8k``,
``math``, ...) and the field paths at where your records keep the prompt and the answer.

:func:`build_datasets` reads and checks every record at start-up, before any compute: a malformed
record is a one-line :class:`DataError` naming ``file:line`` and the field; a prompt longer than
``max_prompt_len`` tokens (after the chat template) is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl_fp8.config_utils import field
from megatron_rl_fp8.data.arithmetic import DEFAULT_TRAIN_PATH, DEFAULT_VAL_PATH
from megatron_rl_fp8.data.calculator import CALC_TRAIN_PATH, CALC_VAL_PATH
from megatron_rl_fp8.data.chain import CHAIN_TRAIN_PATH, CHAIN_VAL_PATH
from megatron_rl_fp8.data.dataset import SUPPORTED_SUFFIXES, DataError, PromptDataset, load_records

if TYPE_CHECKING:
    from megatron_rl_fp8.data.prompts import PromptEncoder

SHIPPED_FILES: dict[str, tuple[Path, Path]] = {
    "chain": (CHAIN_TRAIN_PATH, CHAIN_VAL_PATH),
    "calculator": (CALC_TRAIN_PATH, CALC_VAL_PATH),
}
"""Task name -> the (train, val) files read when the paths are None; any other name reads the
default arithmetic files."""


@dataclass(kw_only=True)
class TaskConfig:
    """Prompt source and length limits for one task."""

    name: str = field(
        default="arithmetic",
        help="Task; picks the reward verifier: arithmetic, chain (worked multi-step sums, "
        "answers of 24-64 tokens), calculator (products, with env.tools: calculator), gsm8k, "
        "math, or any name registered "
        "with megatron_rl_fp8.reward.register_verifier (reward.function overrides it).",
    )
    train_path: str | None = field(
        default=None,
        help="Train prompts (.jsonl or .parquet); None = the shipped train.jsonl (of the chain "
        "or calculator task for those names, else of the arithmetic task).",
    )
    val_path: str | None = field(
        default=None,
        help="Held-out prompts (.jsonl or .parquet); None = the shipped val.jsonl (as train_path).",
    )
    prompt_field: str = field(
        default="prompt",
        help="Field holding the prompt (a string or a chat message list); dotted paths reach "
        "nested fields.",
    )
    answer_field: str = field(
        default="answer",
        help="Field holding the reference answer; dotted paths reach nested fields "
        "(verl's parquet files: reward_model.ground_truth).",
    )
    max_prompt_len: int = field(
        default=16,
        help="Max prompt tokens after the chat template (and <bos>); longer prompts are dropped "
        "at start-up and counted (shipped prompts need at most 9).",
    )
    max_response_len: int = field(
        default=8,
        help="Max generated tokens including <eos> (shipped answers need at most 5).",
    )
    seed: int | None = field(
        default=None,
        help="Seed of the epoch-wise shuffle of the train prompts. null = train.seed.",
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TaskConfig.name is empty; give a verifier name such as 'math'")
        for attr in ("train_path", "val_path"):
            value = getattr(self, attr)
            if value is not None and Path(value).suffix not in SUPPORTED_SUFFIXES:
                raise ValueError(
                    f"TaskConfig.{attr}={value!r} must end in one of {SUPPORTED_SUFFIXES}, or be "
                    "None for the shipped task file"
                )
        for attr in ("prompt_field", "answer_field"):
            if not getattr(self, attr):
                raise ValueError(f"TaskConfig.{attr} is empty; give the field name the files use")
        for attr in ("max_prompt_len", "max_response_len"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 2:
                raise ValueError(
                    f"TaskConfig.{attr}={value!r} must be an int >= 2 (it counts <bos>/<eos> too)"
                )

    @property
    def resolved_train_path(self) -> Path:
        """The train file actually read (the shipped one when ``train_path`` is None)."""
        if self.train_path is None:
            return SHIPPED_FILES.get(self.name, (DEFAULT_TRAIN_PATH, DEFAULT_VAL_PATH))[0]
        return Path(self.train_path)

    @property
    def resolved_val_path(self) -> Path:
        """The validation file actually read (the shipped one when ``val_path`` is None)."""
        if self.val_path is None:
            return SHIPPED_FILES.get(self.name, (DEFAULT_TRAIN_PATH, DEFAULT_VAL_PATH))[1]
        return Path(self.val_path)


def _encoded(cfg: TaskConfig, path: Path, encoder: PromptEncoder) -> tuple[list[dict], int]:
    """The records of ``path`` with their ``prompt_ids``; over-long ones dropped and counted."""
    kept, dropped = [], 0
    for r in load_records(path, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field):
        try:
            ids = encoder.encode(r["prompt"])
        except ValueError as e:
            raise DataError(f"{r['where']}: field {cfg.prompt_field!r}: {e}") from None
        if len(ids) > cfg.max_prompt_len:
            dropped += 1
            continue
        kept.append({**r, "prompt_ids": ids})
    if not kept:
        raise DataError(
            f"every prompt of {path} is longer than task.max_prompt_len={cfg.max_prompt_len} "
            "tokens (after the chat template); raise task.max_prompt_len"
        )
    return kept, dropped


def build_datasets(
    cfg: TaskConfig, encoder: PromptEncoder
) -> tuple[PromptDataset, PromptDataset, dict[str, int]]:
    """Train (shuffled with ``cfg.seed``) and val (file order) datasets for ``cfg``, every prompt
    encoded by ``encoder``, and the counts of over-long prompts dropped from each."""
    train_path, val_path = cfg.resolved_train_path, cfg.resolved_val_path
    train_records, train_dropped = _encoded(cfg, train_path, encoder)
    val_records, val_dropped = _encoded(cfg, val_path, encoder)
    train = PromptDataset(train_records, seed=cfg.seed, shuffle=True, source=str(train_path))
    val = PromptDataset(val_records, seed=cfg.seed, shuffle=False, source=str(val_path))
    return train, val, {"train": train_dropped, "val": val_dropped}
