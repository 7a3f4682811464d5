"""One description per FP8 training recipe (``fp8.recipe``): what every part of the project that
depends on the recipe reads, so that a new recipe is one entry here plus its kernels.

A :class:`RecipeSpec` says how the recipe scales (which elements share a scale, whether the scale
comes from an amax history), what runs it (the backends, the Transformer Engine recipe class and
Megatron-Core's name for it, the GPU it needs), what the numerics allow with it (the hybrid
format, Hopper-style accumulation, BF16 first/last layers, fast forward accumulation), the shapes
Transformer Engine wants of its operands, and the planner's constants (the linear layers' FP8
speed-up and the FP8 weight copies each GPU backend keeps). ``FP8Config`` takes its accepted
values, its help text and its backend checks from :data:`RECIPES`; ``plan/`` reads the speed and
bytes from here; the kernels (``emulation.py``, ``torch_backend.py``, ``torchao_backend.py``,
``te.py``) dispatch on :attr:`RecipeSpec.granularity` and :attr:`RecipeSpec.delayed`.

This module imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BACKENDS",
    "BACKEND_RECIPES",
    "FP8_MIN_CAPABILITY",
    "GRANULARITY",
    "PLAN_RECIPE",
    "RECIPES",
    "RECIPE_NAMES",
    "RecipeSpec",
    "backends_for",
    "fp8_training",
    "planned_recipe",
    "recipe_help",
    "recipe_spec",
]

Granularity = Literal["none", "tensor", "row", "block", "mx", "nvfp4"]

BACKENDS = ("te", "torch", "torchao", "emulate")
"""The backends that run FP8 GEMMs (``fp8.backend`` besides ``auto``; ``fp8/backend.py``)."""

FP8_MIN_CAPABILITY = (8, 9)
"""First compute capability with FP8 tensor cores (Ada); Hopper is 9.0, Blackwell 10.0."""

TE_FP8_ROWS = 8
TE_FP8_COLS = 16
"""Transformer Engine's FP8 GEMM shape rule (``transformer_engine/pytorch/utils.py:
assert_dim_for_fp8_exec``, TE 2.x main read 2026-12-01; called on the input and the weight by
``module/linear.py``, ``layernorm_linear.py`` and ``layernorm_mlp.py`` whenever FP8 is on): the
product of all dims but the last a multiple of ``TE_FP8_ROWS``, the last dim a multiple of
``TE_FP8_COLS``; anything else raises ValueError at the first FP8 forward."""

TE_MXFP8_BLOCK = 32
"""MXFP8 quantizes 1x32 blocks along both dims (``tensor/mxfp8_tensor.py:
MXFP8Quantizer.is_quantizable``, ``csrc/quantizer.cpp``; Megatron's ``fp8_utils.get_fp8_align_size``
gives 32 for it): both the leading dims' product and the last dim multiples of 32."""


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """What the project knows about one ``fp8.recipe``."""

    name: str
    help: str
    """The recipe's sentence in ``fp8.recipe``'s help."""
    granularity: Granularity
    """Which elements share a scale: one per tensor, per row of the contraction dim, per 1x128 /
    128x128 block, per 32-element MX block (E8M0 scales), NVFP4's 16-element blocks; ``none``
    for BF16. The emulation and the torch backend pick their quantizers by it."""
    delayed: bool = False
    """The scale comes from an amax history of past steps (``fp8.amax_history_len``), not from the
    tensor itself: the weight's scale moves every call, so no backend caches FP8 weight codes,
    and a study's calibration pass must leave the histories alone."""
    backends: tuple[str, ...] = ()
    """The backends (of :data:`BACKENDS`) that run it."""
    te_recipe: str | None = None
    """Transformer Engine's recipe class (``transformer_engine.common.recipe``), None without one."""
    megatron_name: str | None = None
    """Megatron-Core's ``TransformerConfig.fp8_recipe`` for it."""
    torchao_name: str | None = None
    """torchao's ``Float8LinearConfig.from_recipe_name`` name, None where torchao has none."""
    min_capability: tuple[int, int] = FP8_MIN_CAPABILITY
    """The GPU compute capability whose tensor cores run it (any GPU backend)."""
    te_min_capability: tuple[int, int] | None = None
    te_min_cuda: tuple[int, int] | None = None
    """What Transformer Engine's own gate for the recipe asks beyond ``min_capability``, when it
    asks more (compute capability, the CUDA toolkit torch was built with)."""
    te_align: tuple[int, int] = (TE_FP8_ROWS, TE_FP8_COLS)
    """(leading dims' product, last dim) multiples Transformer Engine's GEMMs need of an operand."""
    hybrid: bool = True
    """Whether ``fp8.format: hybrid`` (e5m2 gradients) is a meaning for it."""
    hopper_accumulation: bool = True
    """Whether the emulation's ``accumulation: hopper`` models it (Hopper has FP8 tensor cores for
    it; MX and FP4 tensor cores are Blackwell's, which accumulate differently)."""
    split_accumulation: bool = False
    """Every GEMM promotes its partial sums to float32 at the scales' period (128 elements of K):
    no fast forward accumulation, and ``accum_chunk`` must divide 128 (TE asserts
    ``use_split_accumulator`` for all three GEMMs of ``Float8BlockScaling``)."""
    bf16_edge_layers: bool = True
    """Whether ``fp8.bf16_first_layers`` / ``bf16_last_layers`` may be set (Megatron-Core forbids
    them under delayed scaling)."""
    plan_speedup: float | None = None
    """FP8 / BF16 time of the linear layers' forward + backward, quantization included, in the
    planner's step-time model (``plan/time.py``); ``plan_speedup_source`` says where it comes
    from. None: the planner has no speed for it."""
    plan_speedup_source: str = ""
    torchao_keeps_weight: bool = False
    """The torchao backend casts the weight once per schedule and both GEMMs read that copy (one
    scale per tensor serves fprop and dgrad); otherwise it casts per call."""

    @property
    def enabled(self) -> bool:
        """Whether it runs any GEMM in FP8 (every recipe but ``bf16``)."""
        return self.granularity != "none"

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor: the same codes serve a GEMM's transposed operand (wgrad, dgrad)."""
        return self.granularity == "tensor"

    @property
    def torch_keeps_weight(self) -> bool:
        """The torch backend caches each weight's FP8 codes for a forward/backward schedule."""
        return not self.delayed


_MEASURED_TENSORWISE = (
    "torchao 0.18 float8 + torch.compile, four Qwen3-8B blocks, 8192 tokens, H200 "
    "(PLATFORM_NOTES, 2026-11-30)"
)
_ASSUMED_BLOCKWISE = (
    "NOT measured here: the calibrated-clipping paper's blockwise 10-20% training-phase gain "
    "(docs/scaling.md), ASSUMPTION"
)

RECIPES: dict[str, RecipeSpec] = {
    spec.name: spec
    for spec in (
        RecipeSpec(name="bf16", help="turns FP8 off.", granularity="none"),
        RecipeSpec(
            name="tensorwise_delayed",
            help="one scale per tensor from an amax history (TE DelayedScaling).",
            granularity="tensor",
            delayed=True,
            backends=("te", "torch", "emulate"),
            te_recipe="DelayedScaling",
            megatron_name="delayed",
            bf16_edge_layers=False,
            plan_speedup=1.44,
            plan_speedup_source=_MEASURED_TENSORWISE,
        ),
        RecipeSpec(
            name="tensorwise_current",
            help="one scale per tensor from its own amax (TE Float8CurrentScaling).",
            granularity="tensor",
            backends=("te", "torch", "torchao", "emulate"),
            te_recipe="Float8CurrentScaling",
            megatron_name="tensorwise",
            torchao_name="tensorwise",
            torchao_keeps_weight=True,
            plan_speedup=1.44,
            plan_speedup_source=_MEASURED_TENSORWISE,
        ),
        RecipeSpec(
            name="rowwise",
            help="one scale per row along the GEMM contraction dim (torch and torchao backends "
            "and emulation; no TE recipe).",
            granularity="row",
            backends=("torch", "torchao", "emulate"),
            torchao_name="rowwise",
            plan_speedup=1.10,
            plan_speedup_source=_MEASURED_TENSORWISE,
        ),
        RecipeSpec(
            name="blockwise",
            help="1x128 activation/gradient groups and 128x128 weight blocks (TE "
            "Float8BlockScaling, DeepSeek-V3).",
            granularity="block",
            backends=("te", "torch", "emulate"),
            te_recipe="Float8BlockScaling",
            megatron_name="blockwise",
            # TE's own gate (pytorch/quantization.py: _compute_fp8_block_scaling_support).
            te_min_capability=(9, 0),
            te_min_cuda=(12, 9),
            split_accumulation=True,
            plan_speedup=1.15,
            plan_speedup_source=_ASSUMED_BLOCKWISE,
        ),
        RecipeSpec(
            name="mxfp8",
            help="32-element blocks with power-of-two E8M0 scales (Blackwell).",
            granularity="mx",
            backends=("te", "emulate"),
            te_recipe="MXFP8BlockScaling",
            megatron_name="mxfp8",
            min_capability=(10, 0),
            te_align=(TE_MXFP8_BLOCK, TE_MXFP8_BLOCK),
            hopper_accumulation=False,
            plan_speedup=1.15,
            plan_speedup_source="as blockwise, ASSUMPTION (needs Blackwell)",
        ),
        RecipeSpec(
            name="nvfp4",
            help="a study-only emulation of NVFP4's grid (E2M1 values, 16-element blocks with "
            "E4M3 scales; fp8/fp4_emulation.py), backend 'emulate' only.",
            granularity="nvfp4",
            backends=("emulate",),
            hybrid=False,
            hopper_accumulation=False,
        ),
    )
}
"""Every ``fp8.recipe``, in the order the help lists them."""

RECIPE_NAMES: tuple[str, ...] = tuple(RECIPES)

GRANULARITY: dict[str, str] = {name: s.granularity for name, s in RECIPES.items()}
"""recipe -> how its scales are shared: a plain dict the kernels dispatch on (torch.compile
traces through a dict lookup; ``fp8/torch_backend.py: quantize_gemm_operand``)."""

BACKEND_RECIPES: dict[str, tuple[str, ...]] = {
    b: tuple(name for name, s in RECIPES.items() if b in s.backends) for b in BACKENDS
}
"""Which recipes each backend runs. TE has no per-row recipe; the torch backend runs tensorwise /
rowwise through ``torch._scaled_mm`` and blockwise through ``torch.nn.functional.scaled_mm``
(delayed scaling keeps its amax histories itself), but not MXFP8; torchao's float8 training has
dynamic tensorwise and rowwise scaling only; the emulation runs all."""


def recipe_spec(recipe: str) -> RecipeSpec:
    """The description of ``recipe`` (an ``fp8.recipe`` value; ``FP8Config`` has checked it)."""
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ValueError(
            f"fp8.recipe={recipe!r} is not valid; choose one of "
            + ", ".join(repr(r) for r in RECIPE_NAMES)
        ) from None


def backends_for(recipe: str) -> list[str]:
    """The backends (``te``, ``torch``, ``torchao``, ``emulate``) that can run ``recipe``."""
    return list(recipe_spec(recipe).backends)


PLAN_RECIPE = "blockwise"
"""The recipe the planner prices FP8 training at when the config trains in BF16 (the paper's)."""


def planned_recipe(recipe: str) -> str:
    """The recipe the planner prices a config's FP8 training at: its own, or :data:`PLAN_RECIPE`
    under ``bf16``."""
    return recipe if recipe_spec(recipe).enabled else PLAN_RECIPE


def fp8_training(recipe: str | None) -> bool:
    """Whether a run's ``fp8.recipe`` (from its saved config; None without one, a name this
    version does not know counts as FP8) trains any GEMM in FP8."""
    return recipe is not None and (recipe not in RECIPES or RECIPES[recipe].enabled)


def recipe_help() -> str:
    """``fp8.recipe``'s help text: one sentence per recipe."""
    return "Scaling recipe. " + " ".join(f"'{s.name}': {s.help}" for s in RECIPES.values())
