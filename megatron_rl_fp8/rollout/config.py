"""``rollout.*``: how completions are sampled, and by which engine; each registered engine with
settings of its own adds its section, ``rollout.<engine name>`` (``EngineSpec.settings``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.rollout.receiver import parse_address
from megatron_rl_fp8.rollout.registry import ENGINES, choices, engine_spec, sections


@dataclasses.dataclass(kw_only=True)
class _Engine:
    engine: str = field(
        "local",
        help=f"The rollout engine, by its registered name ({choices()}), or package.module:SPEC "
        "for an engine of your own (an EngineSpec, rollout/registry.py).",
    )


# The engines' own sections, right after ``engine`` (the order ``config`` prints them in).
_EngineSections = dataclasses.make_dataclass(
    "_EngineSections",
    [
        (name, settings, field(default_factory=settings, help=help))
        for name, settings, help in sections()
    ],
    bases=(_Engine,),
    kw_only=True,
)
_EngineSections.__module__ = __name__


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(_EngineSections):
    """How completions are sampled."""

    placement: Literal["dedicated", "colocated"] = field(
        "dedicated",
        help="Where server engines run: dedicated = GPUs of their own (other nodes, or GPUs of "
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
    routing_replay: Literal["none", "measure", "replay"] = field(
        "none",
        help="Mixture-of-experts models: the engines return the experts they routed each token "
        "to. measure = the trainer reports how often its own routers choose another expert set "
        "(moe/routing_mismatch); replay = its passes also replay the engine's experts (rollout "
        "routing replay, R3), so old and new log-probs are those of the routes sampled from.",
    )
    delta_sync: bool = field(
        False,
        help="Per-node weight syncs (engines on several nodes, trainer/node_sync.py): each "
        "pipeline stage's sender sends the other nodes' relay ranks only the elements that "
        "changed since the last sync (FP8 codes, block scales and BF16 tensors alike; the whole "
        "tensor where that is smaller). Each relay rank keeps its node's copy in host memory, "
        "applies the delta and pushes full tensors to its engines; a relay rank on another "
        "version gets a full sync, with the reason logged. Costs host memory for one copy of "
        "the exported weights on every stage sender and relay rank; no effect on other syncs. "
        "docs/delta_sync.md says when it pays.",
    )
    delta_verify_every: int = field(
        10,
        help="With delta_sync: every K-th sync (the first included) carries a CRC-32 of each "
        "tensor, which the relay ranks check after applying (a mismatch fails the sync, and its "
        "rerun goes in full); 0 = never. Each check reads the exported weights once on the "
        "sender and once on every relay rank (~2-3 GB/s per core).",
    )
    delta_receivers: list[str] = field(
        default_factory=list,
        help="Engines on nodes no trainer rank runs on (or outside the cluster): NODE=HOST:PORT "
        "per such node (NODE as the engine's settings name the engines' nodes), where a delta receiver "
        "runs beside them (`megatron-rl-fp8 receiver --port PORT`). Each stage's sender streams "
        "it the delta sync over TCP; it applies it and pushes full tensors to its engines. "
        "Needs delta_sync. docs/delta_sync.md.",
    )
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
        if self.delta_verify_every < 0:
            raise ValueError(
                f"rollout.delta_verify_every must be >= 0 (0 = never), got {self.delta_verify_every}"
            )
        if self.delta_receivers and not self.delta_sync:
            raise ValueError(
                "rollout.delta_receivers needs rollout.delta_sync=true (a receiver keeps its "
                "node's copy and takes deltas)"
            )
        for entry in self.delta_receivers:
            parse_address(entry)
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        spec = engine_spec(self.engine)
        if self.placement not in spec.placements:
            others = {s.name: 0 for s in ENGINES.values() if self.placement in s.placements}
            raise ValueError(
                f"rollout.placement={self.placement} is not a placement rollout.engine="
                f"{self.engine} runs with (it runs {', '.join(spec.placements)}); set "
                f"rollout.placement={spec.placements[0]} or an engine that does ({', '.join(others)})"
            )
        if spec.check is not None:
            spec.check(self)
