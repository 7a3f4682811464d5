"""Rollout engines: the contract (``base``), the in-process CPU engine (``local``), and the
factory the trainer calls so the engine kind is one config value."""

from __future__ import annotations

from megatron_rl_fp8.rollout.base import Completion, RolloutConfig, RolloutEngine


def build_engine(cfg: RolloutConfig, hf_cfg, *, pad_token_id: int, eos_token_id: int) -> RolloutEngine:
    """The engine named by ``cfg.engine``, ready for its first ``update_weights``."""
    if cfg.engine == "local":
        from megatron_rl_fp8.rollout.local import LocalEngine

        return LocalEngine(hf_cfg, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                           fp8=cfg.fp8)
    raise ValueError(f"rollout.engine={cfg.engine!r} is not a known engine")


__all__ = ["Completion", "RolloutConfig", "RolloutEngine", "build_engine"]
