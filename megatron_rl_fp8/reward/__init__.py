"""Rewards: rule-based verifiers in a typed registry, and batch scoring into tensors."""

from megatron_rl_fp8.reward.verifiers import (
    FORMAT_CHECKS,
    VERIFIERS,
    FormatCheck,
    RewardConfig,
    Verifier,
    arithmetic_exact,
    arithmetic_format,
    compute_rewards,
    get_verifier,
    register_verifier,
)

__all__ = [
    "FORMAT_CHECKS",
    "VERIFIERS",
    "FormatCheck",
    "RewardConfig",
    "Verifier",
    "arithmetic_exact",
    "arithmetic_format",
    "compute_rewards",
    "get_verifier",
    "register_verifier",
]
