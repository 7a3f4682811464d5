"""The study-only NVFP4 emulation: E2M1 rounding by hand (every tie), the two-level scales against
a per-block float64 reference written from the spec, the emulated linear's three GEMMs, and the
config refusing what the emulation is not (another backend, e5m2 gradients, Hopper accumulation)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator, quantize_operand
from megatron_rl_fp8.fp8.fp4_emulation import fake_quant_nvfp4, round_e2m1

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "x, want",
    [
        # every tie goes to the even code (0, 1.0, 2.0, 4.0 have even codes 0, 2, 4, 6)
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        # off-tie values, saturation, sign
        (0.26, 0.5),
        (2.6, 3.0),
        (5.1, 6.0),
        (7.0, 6.0),
        (1e9, 6.0),
        (-0.3, -0.5),
        (-4.9, -4.0),
        (-100.0, -6.0),
    ],
)
def test_round_e2m1_by_hand(x, want):
    assert round_e2m1(torch.tensor([x])).item() == want


def test_round_e2m1_is_nearest_on_a_dense_sweep():
    x = torch.linspace(-7, 7, 20001, dtype=torch.float32)
    got = round_e2m1(x).double()
    grid = torch.tensor(GRID + [-g for g in GRID], dtype=torch.float64)
    dist = (x.double().clamp(-6, 6)[:, None] - grid[None, :]).abs()
    assert torch.equal((x.double().clamp(-6, 6) - got).abs(), dist.min(dim=1).values)


def reference_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Block by block, as the recipe is written: per-tensor scale amax / (6 * 448), each block's
    E4M3-rounded scale, E2M1 values; last dim, the tail block shorter."""
    x = x.double()
    s_tensor = x.abs().max() / (6 * 448)
    out = torch.zeros_like(x)
    for start in range(0, x.shape[-1], block):
        v = x[..., start : start + block]
        wanted = (v.abs().amax(dim=-1, keepdim=True) / 6 / s_tensor).clamp(max=448).float()
        scale = wanted.to(torch.float8_e4m3fn).double() * s_tensor
        q = torch.where(scale > 0, v / torch.where(scale > 0, scale, 1.0), 0.0)
        out[..., start : start + block] = round_e2m1(q.float()).double() * scale
    return out


def test_fake_quant_matches_the_per_block_reference():
    x = _randn(7, 75, seed=1) * torch.logspace(-3, 1, 75)  # ragged, magnitudes over 4 decades
    x[2, 40] = 300.0  # an outlier sets the tensor scale
    x[5, :16] = 0.0  # an all-zero block
    got = fake_quant_nvfp4(x)
    assert torch.allclose(got.double(), reference_nvfp4(x), rtol=1e-6, atol=0)
    assert torch.equal(got[5, :16], torch.zeros(16))
    # Along dim 0 is along the last dim of the transpose.
    assert torch.equal(fake_quant_nvfp4(x, dim=0), fake_quant_nvfp4(x.t().contiguous()).t())


def test_nvfp4_is_much_noisier_than_fp8():
    x = _randn(64, 256, seed=2)
    err = {
        r: ((quantize_operand(x, r, "input", -1) - x).norm() / x.norm()).item()
        for r in ("blockwise", "nvfp4")
    }
    # E2M1 has 1 mantissa bit (FP8 e4m3: 3): roughly 4x the error, ~0.1 against ~0.02.
    assert err["nvfp4"] > 3 * err["blockwise"] and 0.05 < err["nvfp4"] < 0.2


def test_emulated_linear_quantizes_all_three_gemms():
    cfg = FP8Config(recipe="nvfp4", backend="emulate")
    x = _randn(30, 48, seed=3).requires_grad_(True)
    w = (_randn(40, 48, seed=4) * 0.1).requires_grad_(True)
    g = _randn(30, 40, seed=5)
    y = FP8LinearEmulator(cfg)(x, w, None)
    y.backward(g)
    q = lambda t, dim: fake_quant_nvfp4(t.detach(), dim=dim).double()  # noqa: E731
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, q(x, -1) @ q(w, -1).T) < 1e-5
    assert rel(x.grad, q(g, -1) @ q(w, 0)) < 1e-5
    assert rel(w.grad, q(g, 0).T @ q(x, 0)) < 1e-5


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"backend": "te"}, "cannot run recipe='nvfp4'"),
        ({"backend": "torch"}, "cannot run recipe='nvfp4'"),
        ({"format": "hybrid"}, "format='hybrid' is not valid with recipe='nvfp4'"),
        ({"accumulation": "hopper"}, "accumulation='hopper' is not valid with recipe='nvfp4'"),
    ],
)
def test_config_refuses_what_the_emulation_is_not(settings, message):
    with pytest.raises(ValueError, match=message):
        FP8Config(recipe="nvfp4", **settings)
