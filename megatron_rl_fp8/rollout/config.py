"""``rollout.*``: how completions are sampled, and by which engine (its own section:
``rollout.sglang``, the SGLang engines' :class:`~.sglang.config.SGLangConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """How completions are sampled."""

    engine: Literal["local", "sglang"] = field(
        "local",
        help="local = in-process transformers engine on the driver rank (CPU boxes); "
        "sglang = SGLang engines (one or a fleet behind sglang-router) launched by the driver "
        "rank or attached to, synced from the ranks holding the weights "
        "(rollout.sglang; install: scripts/install_sglang_cpu.sh on CPU).",
    )
    sglang: SGLangConfig = field(
        default_factory=SGLangConfig, help="The SGLang engines (used when engine is sglang)."
    )
    placement: Literal["dedicated", "colocated"] = field(
        "dedicated",
        help="Where SGLang engines run: dedicated = GPUs of their own (other nodes, or GPUs of "
        "this node after the trainer's); colocated = on the trainer's GPUs, releasing their "
        "memory while the trainer trains and resuming it for the sync and the rollout.",
    )
    offload_trainer: bool = field(
        True,
        help="Colocated placement: the trainer's weights, gradients and optimizer state wait in "
        "host memory while the engines generate (on CPU the same copies run, so the path is "
        "exercised).",
    )
    n_samples_per_prompt: int = field(8, help="Group size: completions sampled per prompt (GRPO).")
    temperature: float = field(1.0, help="Sampling temperature (logprobs use the same).")
    top_p: float = field(1.0, help="Nucleus sampling mass; 1.0 keeps logprobs unbiased.")
    max_new_tokens: int = field(8, help="Longest completion in tokens.")
    seed: int | None = field(
        None,
        help="Base seed of sampling; step s samples with seed + s (resumable). null = "
        "train.seed, so a study's seeds vary the rollouts.",
    )
    fp8: RolloutFP8Config = field(
        default_factory=RolloutFP8Config,
        help="FP8 rollout numerics: how synced weights are quantized (and activations, in the "
        "in-process engine). weight_quant=bf16 keeps the rollout in full precision.",
    )

    def __post_init__(self):
        check_literals(self, "rollout")
        if self.n_samples_per_prompt < 1:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}"
            )
        if self.temperature <= 0:
            raise ValueError(
                f"rollout.temperature must be > 0, got {self.temperature}; "
                "use a small value such as 1e-3 for near-greedy sampling"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.placement == "colocated" and self.engine != "sglang":
            raise ValueError(
                "rollout.placement=colocated applies to SGLang engines; the local engine "
                "always runs inside the trainer (set rollout.engine=sglang or placement=dedicated)"
            )
        if self.engine == "sglang" and self.fp8.weight_quant == "per_tensor":
            # SGLang 0.5.23 (layers/quantization/fp8.py, Fp8LinearMethod.
            # process_weights_after_loading), run at start-up on the placeholder weights: a
            # per-tensor FP8 linear's weight becomes a transposed Parameter without weight_loader
            # (its scale a per-channel one on SM89+), so no hot update can land in it: fused
            # qkv / gate_up loads fail and a square o_proj would take its codes untransposed.
            # Block-quantized layers keep their loadable parameters. Checked against SGLang's
            # code in tests/unit/test_sglang_contracts.py.
            raise ValueError(
                "rollout.fp8.weight_quant=per_tensor is not supported with rollout.engine=sglang: "
                "SGLang's per-tensor FP8 layers replace their weight by a transposed Parameter "
                "without a weight_loader at start-up, so synced weights cannot be loaded into "
                "them; use rollout.fp8.weight_quant=blockwise (or rollout.engine=local for "
                "per-tensor numerics)"
            )
