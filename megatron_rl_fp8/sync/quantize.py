"""FP8 rollout weights on the sync path: HF-named tensors in, what an FP8 serving engine loads out.

The rollout engine serves W8A8: every linear weight inside the transformer layers travels as e4m3
codes plus a float32 ``<name>_scale_inv`` (one per 128x128 block, or one per tensor), the layout
SGLang and vLLM read for DeepSeek-style block-FP8 checkpoints. Embeddings, norms, biases and the LM
head stay in full precision (serving engines keep them unquantized too; ``modules_to_not_convert``).

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
        if cfg.weight_quant == "blockwise":
            codes, scale_inv = quantize_blockwise(
                t, block=cfg.weight_block, pow2_scale=cfg.pow2_scale
            )
        else:
            codes, scale_inv = quantize_per_tensor(t)
        yield name, codes
        yield name + SCALE_SUFFIX, scale_inv


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
