"""A 4-bit emulation for precision studies only: NVFP4's number grid (``fp8.recipe: nvfp4``).

Not a training path: no backend runs FP4 GEMMs here, and the recipe is refused everywhere but
``backend: emulate``. It exists so a study can push the quantization noise past what FP8 gives
(issue 42's noise axis) and see whether the clip statistics, entropy and accuracy respond.

NVFP4 as NVIDIA's Blackwell recipe defines it, and as emulated here:

* **values** are E2M1: sign, 2 exponent bits, 1 mantissa bit, magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; rounding is to nearest, ties to the even code (``round_e2m1``);
* **16 consecutive elements** along the GEMM's contraction dim share a block scale stored in
  **E4M3** (so the block scale itself is rounded: 3 mantissa bits);
* a **per-tensor float32 scale** ``amax / (6 * 448)`` puts the block scales into E4M3's range:
  the block scale is ``round_e4m3(block_amax / 6 / s_tensor)``, the decoded value
  ``q * block_scale * s_tensor``. A value can exceed 6 after the block scale is rounded down;
  it saturates to +-6, as the hardware clamps.

Every operand (input, weight, output gradient) of all three GEMMs is quantized this way, with
round-to-nearest. NVIDIA's training recipe also applies random Hadamard transforms and stochastic
rounding to gradients and keeps some layers in higher precision; none of that is emulated: this
is the grid and the scales, the noise floor of a naive 4-bit pipeline.
"""

from __future__ import annotations

import torch

from megatron_rl_fp8.fp8.formats import E4M3_MAX, FP8_DTYPES

E2M1_MAX = 6.0
NVFP4_BLOCK = 16


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, already scaled) rounded to the nearest E2M1 value, ties to the even code;
    magnitudes above 6 saturate to +-6.

    The grid's step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], and within each range the codes
    count the steps, so ``torch.round`` (half to even) in units of the step is E2M1's rounding.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    q = torch.where(
        a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2)
    )
    return q.copysign(x)


def _qdq_last(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    pad = (-n) % block
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xv = xp.reshape(*xp.shape[:-1], xp.shape[-1] // block, block)
    amax = xv.abs().amax()
    if amax == 0:
        return torch.zeros_like(x)
    s_tensor = amax / (E2M1_MAX * E4M3_MAX)
    wanted = (xv.abs().amax(dim=-1, keepdim=True) / E2M1_MAX / s_tensor).clamp(max=E4M3_MAX)
    scale = wanted.to(FP8_DTYPES["e4m3"]).float() * s_tensor
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    deq = torch.where(scale > 0, round_e2m1(xv / safe) * scale, torch.zeros_like(xv))
    return deq.reshape(xp.shape)[..., :n]


def fake_quant_nvfp4(x: torch.Tensor, *, dim: int = -1, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """Quantize-dequantize ``x`` on NVFP4's grid, ``block`` elements along ``dim`` per E4M3 scale
    (module docstring); float32 out, no autograd."""
    with torch.no_grad():
        xf = x.detach().float()
        d = dim % xf.dim()
        if d == xf.dim() - 1:
            return _qdq_last(xf, block)
        return _qdq_last(xf.movedim(d, -1), block).movedim(-1, d)
