"""FP8 rollout weights on the sync path: HF-named tensors in, what an FP8 serving engine loads out.

The rollout engine serves W8A8: every linear weight inside the transformer layers travels as e4m3
codes plus a float32 ``<name>_scale_inv`` (one per 128x128 block, or one per tensor), the layout
SGLang and vLLM read for DeepSeek-style block-FP8 checkpoints. Embeddings, norms, biases and the LM
head stay in full precision (serving engines keep them unquantized too; ``modules_to_not_convert``).

Who quantizes is ``rollout.fp8.quantizer``: NVIDIA Model Optimizer's ``FP8QTensor`` (the default,
:func:`modelopt_quantize`) or this project's ``quantize_blockwise`` / ``quantize_per_tensor``, the
reference it is tested against. Both run on the device the weight lives on and give identical
codes and scales (tests/unit/test_rollout_quantizer.py).

Both directions stream one tensor at a time, so the full model is never held twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.fp8.quantize import (
    dequantize_blockwise,
    dequantize_per_tensor,
    quantize_blockwise,
    quantize_per_tensor,
    round_up_pow2,
)

SCALE_SUFFIX = "_scale_inv"
# Linear weights of the transformer layers (Llama / Qwen2 / Qwen3 HF names).
_FP8_LINEARS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def is_fp8_weight(name: str) -> bool:
    """Whether the rollout engine receives ``name`` (an HF parameter name) as FP8."""
    return name.startswith("model.layers.") and name.endswith(_FP8_LINEARS)


def quantize_for_rollout(
    named: Iterable[tuple[str, torch.Tensor]], cfg: RolloutFP8Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine's tensors: FP8 codes followed by ``<name>_scale_inv`` for each linear
    weight when ``cfg`` enables FP8, every other tensor unchanged."""
    for name, t in named:
        if not cfg.enabled or not is_fp8_weight(name):
            yield name, t
            continue
        if cfg.quantizer == "modelopt":
            codes, scale_inv = modelopt_quantize(t, cfg)
        elif cfg.weight_quant == "blockwise":
            codes, scale_inv = quantize_blockwise(
                t, block=cfg.weight_block, pow2_scale=cfg.pow2_scale
            )
        else:
            codes, scale_inv = quantize_per_tensor(t)
        yield name, codes
        yield name + SCALE_SUFFIX, scale_inv


MODELOPT_MISSING = (
    "rollout.fp8.quantizer=modelopt needs NVIDIA Model Optimizer: pip install nvidia-modelopt "
    "(or set rollout.fp8.quantizer=builtin)"
)
_MODELOPT_BAND_ELEMS = 1 << 26
"""Largest piece of a weight (elements) given to modelopt in one call; bigger weights go in bands of
whole block-rows (blocks never straddle a band, so the result is the same). modelopt holds about
four float32 copies of its input at once (the input, a clone for the amax, the scales expanded to
full size, the quotient): ~2 GB for a Qwen3-32B MLP weight (131M elements) in one call, ~1 GB in
bands of 64Mi elements. Qwen3-8B's largest weight (50M) takes one call."""


def modelopt_quantize(t: torch.Tensor, cfg: RolloutFP8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, float32 scale_inv)`` of one weight by NVIDIA Model Optimizer's
    ``FP8QTensor.quantize``, on ``t``'s device, with the builtin quantizers' shapes, dtypes and
    values: blockwise ``scale_inv`` is ``[ceil(rows/bm), ceil(cols/bn)]``, per-tensor a 0-d tensor.

    modelopt computes ``scale = amax / 448`` and ``codes = e4m3(x / scale)``, which is the builtin
    rule operation for operation, so codes and scales come out bit-identical. Around that call:

    * The weight is cast to float32 first: modelopt computes scales in the input's dtype, so a bf16
      weight would get bf16 scales (SGLang reads float32 ``weight_scale_inv``), and codes divided
      by the rounded scale (~3% of them differ from the float32 result).
    * An all-zero block (or weight) has amax 0, so modelopt returns scale 0 and NaN codes (0 / 0);
      such results are quantized again with scale 1 there (the builtin rule), giving zero codes.
    * ``pow2_scale`` (blockwise only, as for the builtin): modelopt has no power-of-two option, so
      its scales are rounded up to powers of two (the builtin's rounding of the same float32
      value) and the weight is quantized again with them: exact, at the cost of a second pass.
    """
    try:  # lazy: optional dependency (nvidia-modelopt); its absence is the error below
        from modelopt.torch.quantization.qtensor import FP8QTensor
    except ImportError as e:
        raise ImportError(MODELOPT_MISSING) from e

    def call(w: torch.Tensor, block_sizes: dict | None, pow2: bool):
        w = w.detach().float()  # no copy for a float32 weight
        qt, scale = FP8QTensor.quantize(w, block_sizes=block_sizes)
        # Host sync: one bool over the (small) scale tensor per call, to spot all-zero blocks.
        if pow2 or bool((scale == 0).any()):
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            scale = round_up_pow2(scale) if pow2 else scale
            qt, scale = FP8QTensor.quantize(w, scale, block_sizes=block_sizes)
        # ``_quantized_data`` is how modelopt's own HF export reads the codes; for ragged shapes it
        # is a view into the padded result, hence the copy.
        return qt._quantized_data.contiguous(), scale

    if cfg.weight_quant == "per_tensor":
        return call(t, None, False)
    if t.dim() != 2:
        raise ValueError(
            f"blockwise rollout quantization expects a 2D weight [out, in], got {tuple(t.shape)}"
        )
    bm, bn = cfg.weight_block
    block_sizes = {-2: bm, -1: bn}
    m, n = t.shape
    band = max(1, _MODELOPT_BAND_ELEMS // (bm * n)) * bm
    if m <= band:
        return call(t, block_sizes, cfg.pow2_scale)
    codes = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=t.device)
    scale_inv = torch.empty(-(-m // bm), -(-n // bn), dtype=torch.float32, device=t.device)
    for i in range(0, m, band):
        c, s = call(t[i : i + band], block_sizes, cfg.pow2_scale)
        codes[i : i + band].copy_(c)
        scale_inv[i // bm : i // bm + s.shape[0]].copy_(s)
    return codes, scale_inv


def dequantize_weight(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Full-precision weight from FP8 codes and their scales (per-tensor or blockwise)."""
    if scale_inv.dim() < 2:  # per-tensor (0-d); blockwise scales are [row blocks, col blocks]
        return dequantize_per_tensor(codes, scale_inv.reshape(()), dtype=dtype)
    return dequantize_blockwise(codes, scale_inv, block=block, dtype=dtype)


def dequantize_stream(
    named: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`quantize_for_rollout` for engines that cannot load FP8 (CPU servers):
    each FP8 weight is held until its scale arrives, then yielded dequantized."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base not in pending:
                raise ValueError(f"{name} arrived without its FP8 weight {base}")
            yield base, dequantize_weight(pending.pop(base), t, block, dtype)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            pending[name] = t
        else:
            yield name, t
    if pending:
        raise ValueError(f"FP8 weights without a {SCALE_SUFFIX}: {sorted(pending)[:5]}")
