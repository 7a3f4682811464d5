"""The memory planner: per-GPU memory of the actor's run from its config, whether it fits, and
which layouts of the same GPUs would (``megatron-rl-fp8 plan``; docs/plan.md); and the step-time
model, what each phase of a step costs (``plan --time``; docs/scaling.md).

``memory`` holds the estimate (a pure function of the config and the world: no GPU, no
torch.distributed, no Megatron), ``model_bytes`` the per-piece counts it adds up, ``layouts`` the
search over alternatives, ``time`` the step-time model on top of them, ``hardware`` and
``presets`` its GPU and model parameter sets, ``cli`` the tables.
"""

from megatron_rl_fp8.plan.layouts import alternatives
from megatron_rl_fp8.plan.memory import Estimate, Layout, World, estimate
from megatron_rl_fp8.plan.model_bytes import (
    CHUNKED_LOGPROBS,
    UNCHUNKED_LOGPROBS,
    LogitsCost,
    layer_activation_bytes,
)
from megatron_rl_fp8.plan.time import Efficiency, Fleet, Prediction, predict

__all__ = [
    "CHUNKED_LOGPROBS",
    "UNCHUNKED_LOGPROBS",
    "Efficiency",
    "Estimate",
    "Fleet",
    "Layout",
    "LogitsCost",
    "Prediction",
    "World",
    "alternatives",
    "estimate",
    "layer_activation_bytes",
    "predict",
]
