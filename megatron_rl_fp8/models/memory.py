"""Activation memory: Megatron's activation recomputation, as its users know it.

A transformer layer keeps its activations from the forward pass until the backward pass needs
them; at 8B-32B with long responses they, not the weights, decide whether a micro-batch fits.
Recomputation trades them for compute (Megatron's own options, passed through unchanged):

* ``full``: keep only each recomputed layer's *input*; the layer's forward runs again during the
  backward pass (~1/3 more compute for the recomputed layers). ``recompute_method`` picks which:
  ``uniform`` recomputes every layer, in chunks of ``recompute_num_layers`` layers checkpointed
  together; ``block`` recomputes the first ``recompute_num_layers`` layers of each pipeline stage
  only (the rest keep their activations: use the memory you have).
* ``selective``: recompute only the parts whose activations are large and cheap to recompute
  (``recompute_modules``, default the core attention's ``[b, heads, s, s]`` scores), ~no extra
  compute; with fused attention (Transformer Engine) those are not stored anyway.

The gradients are the same with or without recomputation: the recomputed forward is the same
arithmetic on the same inputs (tests/distributed/test_recompute.py checks bit equality).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field

RecomputeModule = Literal["core_attn", "layernorm", "mlp"]


@dataclasses.dataclass(kw_only=True)
class MemoryConfig:
    """Activation recomputation (Megatron's TransformerConfig fields) and optimizer offload
    (its OptimizerConfig fields) of the actor."""

    recompute_granularity: Literal["full", "selective"] | None = field(
        None, help="null = keep all activations; full = recompute whole layers; selective = parts."
    )
    recompute_method: Literal["uniform", "block"] | None = field(
        None,
        help="full only: uniform = every layer, in chunks of recompute_num_layers; block = the "
        "first recompute_num_layers layers of each pipeline stage.",
    )
    recompute_num_layers: int | None = field(
        None, help="full only: the chunk size (uniform) or the layers per stage (block)."
    )
    recompute_modules: list[RecomputeModule] = field(
        default_factory=lambda: ["core_attn"],
        help="selective only: which parts are recomputed (core_attn, layernorm, mlp).",
    )

    optimizer_cpu_offload: bool = field(
        False,
        help="Keep (a fraction of) the fp32 main weights and Adam state in host memory and run "
        "their update on the CPU (Megatron's HybridDeviceOptimizer, as its precision-aware "
        "optimizer). Needs parallel.use_distributed_optimizer and Transformer Engine.",
    )
    optimizer_offload_fraction: float = field(
        1.0, help="With optimizer_cpu_offload: the share of the optimizer state kept on the host."
    )

    def __post_init__(self):
        check_literals(self, "memory")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                "memory.optimizer_offload_fraction must be in [0, 1], got "
                f"{self.optimizer_offload_fraction}"
            )
        for m in self.recompute_modules:
            if m not in ("core_attn", "layernorm", "mlp"):
                raise ValueError(
                    f"memory.recompute_modules: {m!r} is not one of core_attn, layernorm, mlp"
                )
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ValueError(
                "memory.recompute_granularity=full needs memory.recompute_method (uniform or "
                "block) and memory.recompute_num_layers (e.g. uniform with 1: every layer)"
            )
        if not full and (self.recompute_method, self.recompute_num_layers) != (None, None):
            raise ValueError(
                "memory.recompute_method and memory.recompute_num_layers apply to "
                f"recompute_granularity=full only (it is {self.recompute_granularity}); set "
                "them to null"
            )
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(
                f"memory.recompute_num_layers must be >= 1, got {self.recompute_num_layers}"
            )

    def check_layers(self, layers_per_stage: int) -> str | None:
        """What is wrong with ``recompute_num_layers`` for stages of ``layers_per_stage`` layers
        (None when nothing is)."""
        n = self.recompute_num_layers
        if n is not None and n > layers_per_stage:
            return (
                f"memory.recompute_num_layers={n} exceeds the {layers_per_stage} layers of each "
                "pipeline stage (model.num_layers / parallel.pipeline_model_parallel_size)"
            )
        return None

    def check_backend(self, *, use_te: bool) -> None:
        """Megatron recomputes layernorm and mlp with a checkpoint that reads Transformer Engine's
        FP8 state: without TE (CPU, local spec) only core_attn can be recomputed selectively.
        Its optimizer offload runs only as the precision-aware optimizer, which needs TE."""
        if self.optimizer_cpu_offload and not use_te:
            raise ValueError(
                "memory.optimizer_cpu_offload needs Transformer Engine on GPUs (Megatron offloads "
                "through its precision-aware optimizer, which TE provides); without it use "
                "parallel.use_distributed_optimizer alone, or more data-parallel ranks"
            )
        if self.recompute_granularity != "selective" or use_te:
            return
        needs_te = [m for m in self.recompute_modules if m != "core_attn"]
        if needs_te:
            raise ValueError(
                f"memory.recompute_modules={self.recompute_modules}: {needs_te} need Transformer "
                "Engine (Megatron recomputes them with TE's FP8 state); without it use "
                "[core_attn], or recompute_granularity=full"
            )

    def optimizer_kwargs(self) -> dict:
        """The OptimizerConfig fields of this section."""
        if not self.optimizer_cpu_offload:
            return {}
        return {
            "optimizer_cpu_offload": True,
            "optimizer_offload_fraction": self.optimizer_offload_fraction,
            "use_precision_aware_optimizer": True,
        }

    def megatron_kwargs(self) -> dict:
        """The TransformerConfig fields of this section."""
        if self.recompute_granularity is None:
            return {}
        kwargs = {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }
        if self.recompute_granularity == "selective":
            kwargs["recompute_modules"] = list(self.recompute_modules)
        return kwargs
