"""Rewards: rule-based verifiers in a typed registry, and batch scoring into tensors.

``Rewarder`` (``pool.py``) is what the trainer uses: it scores a batch in worker processes with a
per-sample timeout. ``compute_rewards`` scores in the calling process (quick checks, evals).
"""

from megatron_rl_fp8.reward.math_tasks import (
    extract_gsm8k_answer,
    gsm8k_exact,
    gsm8k_format,
    last_boxed_content,
    math_boxed,
    math_format,
)
from megatron_rl_fp8.reward.pool import Rewarder
from megatron_rl_fp8.reward.verifiers import (
    FORMAT_CHECKS,
    VERIFIERS,
    WORKER_PRELOADS,
    BatchRewardFn,
    FormatCheck,
    RewardConfig,
    ScoreJob,
    Verifier,
    arithmetic_exact,
    arithmetic_format,
    compute_rewards,
    get_verifier,
    load_reward_function,
    make_score_job,
    register_verifier,
)

__all__ = [
    "FORMAT_CHECKS",
    "VERIFIERS",
    "WORKER_PRELOADS",
    "BatchRewardFn",
    "FormatCheck",
    "RewardConfig",
    "Rewarder",
    "ScoreJob",
    "Verifier",
    "arithmetic_exact",
    "arithmetic_format",
    "compute_rewards",
    "extract_gsm8k_answer",
    "get_verifier",
    "gsm8k_exact",
    "gsm8k_format",
    "last_boxed_content",
    "load_reward_function",
    "make_score_job",
    "math_boxed",
    "math_format",
    "register_verifier",
]
