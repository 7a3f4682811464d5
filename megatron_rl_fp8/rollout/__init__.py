"""Rollout engines: the contract (``base``), their config (``config``: ``rollout.*``), errors
(``errors``) and registry (``registry``: an engine's name -> its :class:`EngineSpec`), the
in-process CPU engine (``local``), the server engines (one folder each), and the factory the
trainer calls so the engine kind is one config value.

Importing the package imports no torch: a server engine's helper processes (the SGLang fleet's
answer process) import its modules through it and start in a fraction of a second. The config
loads on first use."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from megatron_rl_fp8.rollout.base import Completion, RolloutEngine
from megatron_rl_fp8.rollout.registry import EngineSpec, engine_spec, register_engine

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.config import RolloutConfig

_LAZY = {"RolloutConfig": "config"}


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

    The engine's registered spec builds it (``rollout/registry.py``). ``output_dir`` (the run's
    ``train.output_dir``) is where server engines keep their logs. ``device`` and ``dtype``
    place the in-process engine (the trainer passes its own: the GPU and bf16 on GPU runs); a
    server engine chooses its own. ``pipeline_model_parallel_size``: the trainer's, whose
    stages' sending ranks (this torchrun job's) a colocated fleet keeps its engines off."""
    return engine_spec(cfg.engine).build(
        cfg,
        hf_cfg,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        output_dir=output_dir,
        device=device,
        dtype=dtype,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )


__all__ = [
    "Completion",
    "EngineSpec",
    "RolloutConfig",
    "RolloutEngine",
    "build_engine",
    "engine_spec",
    "register_engine",
]
