"""Rollout engines: the contract (``base``), their config (``config``: ``rollout.*``) and errors
(``errors``), the in-process CPU engine (``local``), the SGLang engines (``sglang``), and the
factory the trainer calls so the engine kind is one config value.

Importing the package imports no torch: the SGLang fleet's answer process
(``sglang/answers.py``) imports ``sglang.http`` through it and starts in a fraction of a second.
The configs load on first use."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from megatron_rl_fp8.rollout.base import Completion, RolloutEngine

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.config import RolloutConfig
    from megatron_rl_fp8.rollout.sglang.config import SGLangConfig

_LAZY = {"RolloutConfig": "config", "SGLangConfig": "sglang.config"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_engine(
    cfg: RolloutConfig,
    hf_cfg,
    *,
    pad_token_id: int,
    eos_token_id: int | Iterable[int],
    output_dir: str | None = None,
    device=None,
    dtype=None,
    pipeline_model_parallel_size: int = 1,
) -> RolloutEngine:
    """The engine named by ``cfg.engine``, ready for its first ``update_weights``.

    ``output_dir`` (the run's ``train.output_dir``) is where SGLang engines keep their logs,
    unless ``rollout.sglang.work_dir`` says otherwise. ``device`` and
    ``dtype`` place the in-process engine (the trainer passes its own: the GPU and bf16 on GPU
    runs); a server engine chooses its own. ``pipeline_model_parallel_size``: the trainer's, whose
    stages' sending ranks (this torchrun job's) a colocated SGLang fleet keeps its engines off."""
    if cfg.engine == "local":
        # lazy: torch and transformers (the package imports no torch: see the docstring)
        from megatron_rl_fp8.rollout.local import LocalEngine

        kw = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        return LocalEngine(
            hf_cfg, pad_token_id=pad_token_id, eos_token_id=eos_token_id, fp8=cfg.fp8, **kw
        )
    if cfg.engine == "sglang":
        # No sglang import here: the server runs in its own interpreter (rollout.sglang.python).
        # lazy: torch (the package imports no torch: see the docstring)
        from megatron_rl_fp8.rollout.sglang.fleet import SGLangFleet
        from megatron_rl_fp8.rollout.sglang.sender import Senders

        return SGLangFleet(
            cfg,
            hf_cfg,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            output_dir=output_dir,
            senders=Senders.from_env(pipeline_model_parallel_size),
        )
    raise ValueError(f"rollout.engine={cfg.engine!r} is not a known engine")


__all__ = ["Completion", "RolloutConfig", "RolloutEngine", "SGLangConfig", "build_engine"]
