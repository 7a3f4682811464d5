"""FP8 knobs: one dataclass for the trainer side, one for the rollout side.

The trainer side (``FP8Config``) says how Megatron's linear layers run their GEMMs: which scaling
recipe, which element formats, which layers stay in BF16, which backend runs them, and (emulation
only) how the tensor core's limited-precision accumulation is modelled. Four backends run the
same recipes: Transformer Engine (``te.py``), real FP8 GEMMs through ``torch._scaled_mm``
(``torch_backend.py``), torchao's float8 matmul (``torchao_backend.py``) and the
quantize-dequantize emulation (``emulation.py``); ``backend.py`` picks one for this machine. The rollout side (``RolloutFP8Config``) says how synced weights are
quantized for the serving engine (W8A8 blockwise, DeepSeek-V3 style).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.fp8.recipes import (
    BACKENDS,
    RECIPE_NAMES,
    RecipeSpec,
    backends_for,
    recipe_help,
    recipe_spec,
)

Recipe = Literal[RECIPE_NAMES]  # the accepted values of fp8.recipe: fp8/recipes.py
Format = Literal["e4m3", "hybrid"]
AmaxComputeAlgo = Literal["max", "most_recent"]
RolloutWeightQuant = Literal["bf16", "blockwise", "per_tensor"]
RolloutQuantizer = Literal["modelopt", "builtin"]
Accumulation = Literal["fp32", "hopper"]
Backend = Literal[("auto", *BACKENDS)]


HYBRID_BLOCKWISE = (
    "ATen's block-scaled scaled_mm takes e4m3 operands only (ScaledBlas.cpp: "
    "check_deepseek_recipe), and 'hybrid' quantizes the backward's gradients to e5m2 under "
    "recipe='blockwise'; use format 'e4m3', or backend 'te' or 'emulate'"
)
"""Why the torch backend refuses ``recipe='blockwise'`` with ``format='hybrid'``."""


HOPPER_MMA_K = 32
"""Elements of K one Hopper FP8 tensor-core instruction contracts (``wgmma.mma_async`` m64nNk32 for
e4m3/e5m2): the granularity at which a kernel can promote its partial sums to float32."""


def _check_non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} is not valid; it must be an integer >= 0")


@dataclass(kw_only=True)
class FP8Config:
    """How the trainer's linear layers run in FP8 (forward and backward GEMMs)."""

    recipe: Recipe = field(
        default="bf16",
        help=recipe_help(),
    )
    format: Format = field(
        default="e4m3",
        help="'e4m3' everywhere, or 'hybrid': e4m3 for weights/activations in the forward "
        "pass and e5m2 (more range, less precision) for gradients in the backward pass.",
    )
    amax_history_len: int = field(
        default=16,
        help="Delayed scaling: how many past amax values each tensor remembers.",
    )
    amax_compute_algo: AmaxComputeAlgo = field(
        default="max",
        help="Delayed scaling: derive the scale from the 'max' of the history (safe "
        "against spikes) or the 'most_recent' entry (tracks drift faster).",
    )
    scales_per_step: bool | Literal["auto"] = field(
        default="auto",
        before=False,  # runs saved before 2026-12-07 moved their scales within a step
        help="Delayed scaling: every forward pass of an RL step (old logprobs, calibration, the "
        "updates) quantizes activations and weights with the scales the step began with; their "
        "amaxes still enter the history, which sets the next step's scales. Without it a "
        "micro-batch's update forward takes other scales than its old-logprob pass (other "
        "micro-batches moved the history) and its ratios shift together (docs/reproduction.md). "
        "On TE one FP8 autocast region spans the step (docs/gpu_contracts.md, TE-7). 'auto': on "
        "for a delayed recipe, off elsewhere; true insists (refused on recipes without history).",
    )
    margin: int = field(
        default=0,
        help="Delayed scaling: extra headroom, scale = fp8_max / amax / 2^margin. Raise "
        "it if amax grows between steps and values saturate.",
    )
    bf16_first_layers: int = field(
        default=0,
        help="Number of leading transformer layers kept in BF16 (sensitive layers).",
    )
    bf16_last_layers: int = field(
        default=0,
        help="Number of trailing transformer layers kept in BF16.",
    )
    keep_lm_head_bf16: bool = field(
        default=True,
        help="Keep the output projection (LM head) in BF16: its logits feed the log "
        "ratios directly, so FP8 noise there lands straight in the importance ratio. "
        "Megatron's TE path never runs the LM head in FP8, so False needs backend torch or "
        "emulate.",
    )
    backend: Backend = field(
        default="auto",
        help="What runs the FP8 GEMMs. 'te': Transformer Engine (GPU, TE installed). 'torch': "
        "real FP8 GEMMs through torch._scaled_mm on the local layer spec (GPU with FP8 tensor "
        "cores, compute capability >= 8.9; no TE needed). 'torchao': the same linears through "
        "torchao's float8 training matmul (tensorwise_current / rowwise; pip install torchao). "
        "'emulate': quantize-dequantize in PyTorch on any device (numerics, CI). 'auto': te "
        "where TE and an FP8 GPU exist and TE has the recipe, else torch on an FP8 GPU, else "
        "emulate (never torchao: choose it).",
    )
    compile_casts: bool = field(
        default=False,
        help="Backend torch only: run each operand's cast (amax, scale, saturate, FP8 cast, "
        "padding) as one torch.compile'd function instead of six to eight eager kernels that "
        "each read the whole tensor. Same codes and scales (tests check bit equality); the first "
        "step pays the compile (seconds to a minute). Off by default until measured on a GPU: "
        "benchmarks/bench_actor.py --fp8 torch:tensorwise_current,torch:tensorwise_current+compile.",
    )
    emulate: bool = field(
        default=False,
        help="Alias of backend='emulate' (kept so older configs load): true forces the "
        "PyTorch emulation even where Transformer Engine and a GPU exist.",
    )
    accumulation: Accumulation = field(
        default="fp32",
        help="Emulation only: how FP8 GEMMs accumulate. 'fp32' sums in float32 (exact up "
        "to float32 rounding; the default). 'hopper' models Hopper FP8 tensor cores, whose "
        "accumulator keeps only accum_mantissa_bits and is promoted to float32 every "
        "accum_chunk elements of K (see fp8/accumulation.py). Real GPUs (TE) always do what "
        "their hardware does; this changes only the emulated GEMMs.",
    )
    accum_chunk: int = field(
        default=128,
        help="accumulation='hopper': promotion interval, in elements of the contraction "
        "dim: partial sums move to float32 every accum_chunk elements (128 = 4 WGMMA "
        "instructions, as CUTLASS, cuBLAS without fast accumulation and DeepSeek-V3 do). A "
        "multiple of 32; for recipe='blockwise' a divisor of 128 (its scales change every "
        "128 elements, which forces a promotion).",
    )
    accum_mantissa_bits: int = field(
        default=13,
        help="accumulation='hopper': explicit mantissa bits the tensor-core accumulator "
        "keeps between promotions (1..23; float32 has 23). 13 is what bit-level studies of "
        "H100 FP8 MMA report (DeepSeek-V3 measured 'around 14 bits' retained on H800).",
    )
    accum_fast_fprop: bool = field(
        default=True,
        help="The forward GEMM runs with fast accumulation (no promotion: under "
        "accumulation='hopper' all of K accumulates at accum_mantissa_bits; on the torch and "
        "torchao backends, use_fast_accum of the real GEMM), as Transformer Engine "
        "(use_split_accumulator=False for fprop) and torchao (use_fast_accum=True for the "
        "output) do by default; dgrad and wgrad always promote. Ignored by "
        "recipe='blockwise', whose per-block scales need promotion in every GEMM (TE's "
        "Float8BlockScaling requires split accumulation).",
    )

    def __post_init__(self) -> None:
        check_literals(self, "FP8Config")
        if (
            not isinstance(self.amax_history_len, int)
            or isinstance(self.amax_history_len, bool)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"FP8Config.amax_history_len={self.amax_history_len!r} is not valid; "
                "it must be an integer >= 1 (1 = use only the previous step's amax)"
            )
        _check_non_negative_int("FP8Config.margin", self.margin)
        self._check_scales_per_step()
        _check_non_negative_int("FP8Config.bf16_first_layers", self.bf16_first_layers)
        _check_non_negative_int("FP8Config.bf16_last_layers", self.bf16_last_layers)
        self._check_accumulation()
        self._check_backend()
        # Megatron-Core rejects this pair in TransformerConfig; catching it here means the error
        # appears at config load, before any process group or model exists.
        bf16_edges = self.bf16_first_layers or self.bf16_last_layers
        if bf16_edges and not self.spec.bf16_edge_layers:
            raise ValueError(
                "FP8Config.bf16_first_layers/bf16_last_layers="
                f"{self.bf16_first_layers}/{self.bf16_last_layers} is not supported with "
                f"recipe={self.recipe!r} (Megatron-Core forbids BF16 first/last layers under "
                "delayed scaling); use recipe='tensorwise_current' or set both to 0"
            )

    def _check_scales_per_step(self) -> None:
        if not isinstance(self.scales_per_step, bool) and self.scales_per_step != "auto":
            raise ValueError(
                f"FP8Config.scales_per_step={self.scales_per_step!r} is not valid; use true, "
                "false or 'auto'"
            )
        if self.scales_per_step is not True or not self.enabled:
            return
        if not self.spec.delayed:
            raise ValueError(
                f"FP8Config.scales_per_step=true has no effect with recipe={self.recipe!r} (it "
                "keeps no amax history); use recipe 'tensorwise_delayed', or 'auto'"
            )

    def _check_backend(self) -> None:
        if not isinstance(self.emulate, bool):
            raise ValueError(
                f"FP8Config.emulate={self.emulate!r} is not valid; use true or false (or set "
                "backend: emulate)"
            )
        if self.emulate and self.backend not in ("auto", "emulate"):
            raise ValueError(
                f"FP8Config.emulate=True contradicts backend={self.backend!r}; emulate is an alias "
                "of backend='emulate': drop one of them"
            )
        if self.emulate:
            self.backend = "emulate"
        # Keep the alias in step, so a config written back to YAML reads the same.
        self.emulate = self.backend == "emulate"
        if self.enabled and self.backend == "te" and not self.keep_lm_head_bf16:
            raise ValueError(
                "FP8Config.keep_lm_head_bf16=False cannot run on backend='te' (Megatron's output "
                "layer is not a TE module); set it to true, or use backend 'torch' or 'emulate'"
            )
        if self.format == "hybrid" and not self.spec.hybrid:
            raise ValueError(
                f"FP8Config.format='hybrid' is not valid with recipe={self.recipe!r}: every "
                "operand, gradients included, is on one grid; use format 'e4m3'"
            )
        if self.backend == "torch" and self.spec.granularity == "block" and self.format == "hybrid":
            raise ValueError(
                f"FP8Config.format='hybrid' cannot run on backend='torch': {HYBRID_BLOCKWISE}"
            )
        if not isinstance(self.compile_casts, bool):
            raise ValueError(
                f"FP8Config.compile_casts={self.compile_casts!r} is not valid; use true or false"
            )
        if self.compile_casts and self.backend in ("te", "emulate"):
            raise ValueError(
                f"FP8Config.compile_casts=True applies to backends 'torch' and 'torchao' only (got "
                f"backend={self.backend!r}); set it to false, or use backend 'torch', 'torchao' or "
                "'auto'"
            )
        if self.enabled and self.backend != "auto":
            can = backends_for(self.recipe)
            if self.backend not in can:
                raise ValueError(
                    f"FP8Config.backend={self.backend!r} cannot run recipe={self.recipe!r}; "
                    f"use backend {' or '.join(repr(b) for b in can)} (or 'auto')"
                )

    def _check_accumulation(self) -> None:
        chunk = self.accum_chunk
        if (
            not isinstance(chunk, int)
            or isinstance(chunk, bool)
            or chunk < HOPPER_MMA_K
            or chunk % HOPPER_MMA_K
        ):
            raise ValueError(
                f"FP8Config.accum_chunk={chunk!r} is not valid; it must be a positive multiple of "
                f"{HOPPER_MMA_K} (one FP8 tensor-core instruction contracts {HOPPER_MMA_K} "
                "elements, and promotion happens between instructions); the hardware default is 128"
            )
        bits = self.accum_mantissa_bits
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 23:
            raise ValueError(
                f"FP8Config.accum_mantissa_bits={bits!r} is not valid; it must be an integer in "
                "1..23 (23 = float32, i.e. no loss; 13 models Hopper)"
            )
        if not isinstance(self.accum_fast_fprop, bool):
            raise ValueError(
                f"FP8Config.accum_fast_fprop={self.accum_fast_fprop!r} is not valid; "
                "use true or false"
            )
        if self.accumulation != "hopper":
            return
        if not self.spec.hopper_accumulation:
            raise ValueError(
                f"FP8Config.accumulation='hopper' is not valid with recipe={self.recipe!r}: "
                "Hopper has no MX or FP4 tensor cores, and Blackwell's accumulate differently; "
                f"use accumulation='fp32' with {self.recipe}"
            )
        if self.spec.split_accumulation and 128 % chunk:
            raise ValueError(
                f"FP8Config.accum_chunk={chunk} is not valid with recipe={self.recipe!r} and "
                "accumulation='hopper': the 1x128 / 128x128 scales change every 128 elements of "
                "K, so a blockwise GEMM promotes at least that often; use 32, 64 or 128"
            )

    @property
    def enabled(self) -> bool:
        """True when any GEMM runs in FP8 (recipe is not 'bf16')."""
        return self.spec.enabled

    @property
    def spec(self) -> RecipeSpec:
        """The recipe's description (``fp8/recipes.py``)."""
        return recipe_spec(self.recipe)

    @property
    def fprop_fast_accum(self) -> bool:
        """Whether the forward GEMM accumulates fast (no promotion): ``accum_fast_fprop``, never
        under 'blockwise', whose per-block scales need split accumulation (TE's
        ``Float8BlockScaling`` asserts ``use_split_accumulator`` for all three GEMMs). The
        emulation's 'hopper' accumulation and the torch / torchao backends' real GEMMs read this."""
        return self.accum_fast_fprop and not self.spec.split_accumulation

    @property
    def grad_format(self) -> str:
        """Element format for gradients in the backward pass: e5m2 under 'hybrid', else e4m3."""
        return "e5m2" if self.format == "hybrid" else "e4m3"

    def layer_uses_fp8(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer ``layer_number`` (1-based, Megatron's convention) runs FP8.

        The first ``bf16_first_layers`` and last ``bf16_last_layers`` layers stay in BF16.
        """
        if not 1 <= layer_number <= num_layers:
            raise ValueError(
                f"layer_number={layer_number} is outside 1..num_layers={num_layers}; "
                "pass Megatron's 1-based global layer number"
            )
        if not self.enabled:
            return False
        return self.bf16_first_layers < layer_number <= num_layers - self.bf16_last_layers


@dataclass(kw_only=True)
class RolloutFP8Config:
    """How synced weights are quantized for the rollout engine (W8A8, e4m3)."""

    weight_quant: RolloutWeightQuant = field(
        default="bf16",
        help="'bf16': no FP8 rollout (default). 'blockwise': one float32 scale per "
        "weight_block tile (what block-FP8 serving engines read as 'weight_scale_inv') and "
        "1 x act_group dynamic activation scales; 'per_tensor': one scale per weight (engines "
        "that take per-tensor FP8 hot updates only: the in-process one; docs/gpu_contracts.md "
        "SG-4).",
    )
    weight_block: tuple[int, int] = field(
        default=(128, 128),
        help="Weight tile (rows, cols) sharing one scale. Serving kernels expect "
        "(128, 128); other sizes are for numerics studies.",
    )
    pow2_scale: bool = field(
        default=False,
        help="Round each weight scale_inv up to a power of two. Exact rescaling and "
        "matches TE's default blockwise scales; costs up to one bit of precision.",
    )
    act_group: int = field(
        default=128,
        help="Activation group size along the hidden dim (1 x act_group scales).",
    )
    quantizer: RolloutQuantizer = field(
        default="modelopt",
        help="Who quantizes the synced weights, on the device they live on. 'modelopt': NVIDIA "
        "Model Optimizer's FP8QTensor.quantize (needs nvidia-modelopt). 'builtin': this "
        "project's quantize_blockwise / quantize_per_tensor, the reference modelopt is tested "
        "against; equally exact (identical codes and scales), no extra dependency.",
    )

    def __post_init__(self) -> None:
        check_literals(self, "RolloutFP8Config")
        block = tuple(self.weight_block) if isinstance(self.weight_block, (list, tuple)) else None
        if (
            block is None
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
        ):
            raise ValueError(
                f"RolloutFP8Config.weight_block={self.weight_block!r} is not valid; "
                "give two positive integers, e.g. (128, 128)"
            )
        # YAML gives lists; normalise so equality and hashing behave.
        self.weight_block = block  # type: ignore[assignment]
        group = self.act_group
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ValueError(
                f"RolloutFP8Config.act_group={self.act_group!r} is not valid; "
                "it must be a positive integer (128 for serving kernels)"
            )

    @property
    def enabled(self) -> bool:
        """True when rollout weights are sent as FP8 (weight_quant is not 'bf16')."""
        return self.weight_quant != "bf16"
