"""Knobs of the metric loggers (``logging.*``): ``metrics.jsonl`` is always written; TensorBoard
and Weights & Biases are switched on here. The loggers themselves are
:class:`~megatron_rl_fp8.metrics.logger.MetricsLogger`."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field

# What W&B itself rejects (wandb_settings: project names, run tags), checked here so a typo fails
# when the config is read rather than once the run has started.
_PROJECT_BAD_CHARS = "/\\#?%:"
_PROJECT_MAX_LEN = 128
_TAG_MAX_LEN = 64


@dataclasses.dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases run of a training run (``logging.wandb.*``)."""

    enabled: bool = field(
        False,
        help="Log every step's metrics to Weights & Biases (needs: pip install "
        "'megatron-rl-fp8[wandb]'). The W&B run id is kept in <output_dir>/wandb_run_id, so a "
        "resumed training run continues the same W&B run.",
    )
    project: str = field("megatron-rl-fp8", help="W&B project.")
    entity: str | None = field(None, help="W&B entity (user or team); null = your default.")
    name: str | None = field(None, help="W&B run name; null = the output directory's name.")
    group: str | None = field(None, help="W&B group, to show related runs together.")
    tags: list[str] = field(default_factory=list, help="W&B run tags.")
    mode: Literal["online", "offline"] = field(
        "online",
        help="'online' uploads as it runs (needs `wandb login`); 'offline' writes the run under "
        "<dir>/wandb/ only, for `wandb sync` later (machines without internet).",
    )
    dir: str | None = field(
        None, help="Parent of W&B's local 'wandb/' folder; null = the run's output directory."
    )

    def __post_init__(self):
        check_literals(self, "logging.wandb")
        if not self.project or len(self.project) > _PROJECT_MAX_LEN:
            raise ValueError(
                f"logging.wandb.project={self.project!r} must be 1 to {_PROJECT_MAX_LEN} "
                "characters long"
            )
        bad = sorted(set(self.project) & set(_PROJECT_BAD_CHARS))
        if bad:
            raise ValueError(
                f"logging.wandb.project={self.project!r} contains {''.join(bad)!r}; W&B project "
                f"names cannot contain any of {_PROJECT_BAD_CHARS!r}"
            )
        for name in ("entity", "name", "group", "dir"):
            if getattr(self, name) == "":
                raise ValueError(
                    f"logging.wandb.{name} is an empty string; use null for the default"
                )
        for i, tag in enumerate(self.tags):
            if not isinstance(tag, str) or not 1 <= len(tag) <= _TAG_MAX_LEN:
                raise ValueError(
                    f"logging.wandb.tags[{i}]={tag!r} must be a string of 1 to {_TAG_MAX_LEN} "
                    "characters (a W&B limit)"
                )


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Where step metrics go besides ``<output_dir>/metrics.jsonl`` (always written)."""

    tensorboard: bool = field(
        False,
        help="Also write TensorBoard event files under <output_dir>/tensorboard (needs: pip "
        "install 'megatron-rl-fp8[tensorboard]').",
    )
    wandb: WandbConfig = field(default_factory=WandbConfig, help="Weights & Biases.")
