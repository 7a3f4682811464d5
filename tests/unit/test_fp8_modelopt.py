"""Cross-check our FP8 quantizers against NVIDIA Model Optimizer where both cover a granularity.

modelopt's eager FP8 fake quant computes ``q = cast(x * (448/amax))`` and dequantizes with
``q * (1 / (448/amax))``. We compute ``cast(x / (amax/448))`` and ``q * (amax/448)``. The FP8
codes agree (a one-ulp difference in the float32 scale could flip a round-half-even tie, which
random data does not hit); the dequantized values may differ by one float32 ulp of the scale, so
the comparison of dequantized values uses a 2-ulp relative tolerance and the codes are compared
exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.fp8.quantize import fake_quant_blocks, fake_quant_tensor, quantize_blockwise

mtq = pytest.importorskip("modelopt.torch.quantization")

F32_ULP2 = 2 * 2.0**-23


def _modelopt_weight_fake_quant(
    cfg_name: str, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake-quantized weight, amax per scale group) from modelopt's weight quantizer."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    model = torch.nn.Sequential(lin)
    mtq.quantize(model, getattr(mtq, cfg_name), lambda m: m(torch.zeros(1, weight.shape[1])))
    wq = model[0].weight_quantizer
    with torch.no_grad():
        return wq(weight), wq.amax.detach().clone()


def _weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # Columns spanning 4 decades so block scales genuinely differ.
    return torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])


def test_per_tensor_matches_modelopt_fp8_default():
    w = _weight((96, 160), seed=0)
    ref, amax = _modelopt_weight_fake_quant("FP8_DEFAULT_CFG", w)
    assert amax.numel() == 1 and amax.item() == w.abs().max().item()
    ours = fake_quant_tensor(w)
    scale = 448.0 / amax
    e4m3 = torch.float8_e4m3fn
    assert torch.equal((ref * scale).to(e4m3), (ours * scale).to(e4m3))
    assert torch.allclose(ours, ref, rtol=F32_ULP2, atol=0)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_blockwise_128x128_matches_modelopt_2d_block_cfg(shape):
    w = _weight(shape, seed=1)
    ref, amax = _modelopt_weight_fake_quant("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", w)
    fp8, scale_inv = quantize_blockwise(w)
    mb, nb = scale_inv.shape
    # Same per-block amax (modelopt stores one per 128x128 block, ragged edges included).
    assert torch.equal(amax.flatten(), (scale_inv * 448).flatten()) or torch.allclose(
        amax.flatten(), (scale_inv * 448).flatten(), rtol=F32_ULP2, atol=0
    )
    # Identical FP8 codes: recover modelopt's codes from its dequantized output.
    amax_full = (scale_inv * 448).repeat_interleave(128, 0).repeat_interleave(128, 1)
    amax_full = amax_full[: shape[0], : shape[1]]
    ref_codes = (ref * (448.0 / amax_full)).to(torch.float8_e4m3fn)
    assert torch.equal(ref_codes.view(torch.uint8), fp8.view(torch.uint8))
    assert torch.allclose(fake_quant_blocks(w, (128, 128)), ref, rtol=F32_ULP2, atol=0)
