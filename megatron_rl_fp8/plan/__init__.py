"""The memory planner: per-GPU memory of the actor's run from its config, whether it fits, and
which layouts of the same GPUs would (``megatron-rl-fp8 plan``; docs/plan.md).

``memory`` holds the estimate (a pure function of the config and the world: no GPU, no
torch.distributed, no Megatron), ``layouts`` the search over alternatives, ``cli`` the table.
"""

from megatron_rl_fp8.plan.layouts import alternatives
from megatron_rl_fp8.plan.memory import (
    CHUNKED_LOGPROBS,
    UNCHUNKED_LOGPROBS,
    Estimate,
    Layout,
    LogitsCost,
    World,
    estimate,
    layer_activation_bytes,
)

__all__ = [
    "CHUNKED_LOGPROBS",
    "UNCHUNKED_LOGPROBS",
    "Estimate",
    "Layout",
    "LogitsCost",
    "World",
    "alternatives",
    "estimate",
    "layer_activation_bytes",
]
