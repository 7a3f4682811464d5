"""Which task a run trains on, and where its prompts come from.

``TaskConfig()`` with no arguments is the embedded default: the shipped arithmetic prompts
(``data/assets/arithmetic/{train,val}.jsonl``) and their length limits. Point ``train_path`` /
``val_path`` at your own JSONL or Parquet files to train on other prompts with the same verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.data.arithmetic import DEFAULT_TRAIN_PATH, DEFAULT_VAL_PATH
from megatron_rl_fp8.data.dataset import SUPPORTED_SUFFIXES, PromptDataset

TaskName = Literal["arithmetic"]


@dataclass(kw_only=True)
class TaskConfig:
    """Prompt source and length limits for one task."""

    name: TaskName = field(
        default="arithmetic",
        help="Task; picks the reward verifier (megatron_rl_fp8.reward.VERIFIERS).",
    )
    train_path: str | None = field(
        default=None,
        help="Train prompts (.jsonl or .parquet); None = the shipped train.jsonl.",
    )
    val_path: str | None = field(
        default=None,
        help="Held-out prompts (.jsonl or .parquet); None = the shipped val.jsonl.",
    )
    prompt_field: str = field(
        default="prompt",
        help="Name of the prompt field in the files.",
    )
    answer_field: str = field(
        default="answer",
        help="Name of the reference-answer field in the files.",
    )
    max_prompt_len: int = field(
        default=16,
        help="Max prompt tokens including <bos> (shipped prompts need at most 9).",
    )
    max_response_len: int = field(
        default=8,
        help="Max generated tokens including <eos> (shipped answers need at most 5).",
    )
    seed: int = field(
        default=0,
        help="Seed of the epoch-wise shuffle of the train prompts.",
    )

    def __post_init__(self) -> None:
        check_literals(self, "TaskConfig")
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
        return DEFAULT_TRAIN_PATH if self.train_path is None else Path(self.train_path)

    @property
    def resolved_val_path(self) -> Path:
        """The validation file actually read (the shipped one when ``val_path`` is None)."""
        return DEFAULT_VAL_PATH if self.val_path is None else Path(self.val_path)


def build_datasets(cfg: TaskConfig) -> tuple[PromptDataset, PromptDataset]:
    """Train (shuffled with ``cfg.seed``) and val (file order) datasets for ``cfg``."""
    common = {"prompt_field": cfg.prompt_field, "answer_field": cfg.answer_field}
    train = PromptDataset.from_file(cfg.resolved_train_path, seed=cfg.seed, shuffle=True, **common)
    val = PromptDataset.from_file(cfg.resolved_val_path, seed=cfg.seed, shuffle=False, **common)
    return train, val
