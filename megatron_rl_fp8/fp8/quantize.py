"""FP8 quantization by granularity: per tensor, per row, 1xG groups, 2D blocks, MXFP8.

An FP8 tensor is a pair ``(codes, scale_inv)`` with ``x ~= codes.float() * scale_inv``, where
``codes`` has an FP8 dtype and one float32 ``scale_inv`` is shared by a set of elements. The
recipes differ only in which elements share a scale:

=================  ===================================  ====================================
granularity        elements per scale                   used by
=================  ===================================  ====================================
per tensor         the whole tensor                     TE delayed / current scaling
per row            one row along the contraction dim    torchao "rowwise"
1 x 128 groups     128 consecutive elements of a row    DeepSeek-V3 / TE blockwise (activ.)
128 x 128 blocks   a 128x128 tile                       DeepSeek-V3 / TE blockwise (weights)
MXFP8              32 consecutive elements, pow2 scale  OCP MX spec, Blackwell tensor cores
=================  ===================================  ====================================

Why small groups: one outlier sets the scale for everything it shares a scale with, pushing small
neighbours into the subnormal range (or to zero). Finer groups confine the damage; the price is
more scales to store and to apply in the GEMM epilogue.

Scale rule (all but MXFP8): ``scale_inv = amax / fp8_max``, so the largest element maps exactly
to +-fp8_max and nothing saturates. With ``pow2_scale`` the scale is rounded *up* to a power of
two, which keeps ``amax / scale_inv <= fp8_max`` and makes rescaling exact (only the exponent
changes); this is TE's default for blockwise scales.

MXFP8 scale rule (OCP Microscaling spec v1.0, section 6.3): the shared E8M0 exponent is
``floor(log2(amax)) - emax_elem`` with ``emax_elem = 8`` for e4m3 (15 for e5m2). Then
``amax / scale_inv`` lies in [256, 512) for e4m3, so elements above 448 *saturate* to +-448
(the spec leaves overflow handling to the implementation; we clamp, as hardware does). This
loses at most 1/8 relative on those few largest elements, in exchange for never wasting the top
binade. (Transformer Engine instead rounds ``amax / 448`` up to a power of two, which never
saturates but may leave the top binade unused; we follow the spec, as the MX paper does.)
The exponent is clamped to E8M0's range [-127, 127].

Zero (all-zero) groups get ``scale_inv = 1`` so that ``0 / scale_inv`` is 0 rather than NaN.

Fake quantization ("quantize-dequantize") returns ``codes * scale_inv`` in the input dtype and
is what the CPU training path runs: the GEMM then happens in float32 on exactly the values the
FP8 hardware would see. Its gradient is the straight-through estimator: the rounding step is
treated as identity in the backward pass (the backward GEMMs quantize gradients themselves).
All arithmetic is done in float32 regardless of input dtype; ragged shapes are zero-padded up to
whole groups (padding never changes an amax because |0| <= anything).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8.formats import FP8_DTYPES, FP8_EMAX, FP8_MAX, check_format

__all__ = [
    "compute_scale_inv",
    "fake_quant_tensor",
    "fake_quant_rows",
    "fake_quant_groups",
    "fake_quant_blocks",
    "fake_quant_mxfp8",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_per_tensor",
    "dequantize_per_tensor",
]

E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


# ----------------------------------------------------------------------------------------------
# scales
# ----------------------------------------------------------------------------------------------
def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (s > 0), computed exactly via frexp (no log2 rounding error)."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # s already a power of two: keep it
    return torch.ldexp(torch.ones_like(s), exp)


def compute_scale_inv(amax: torch.Tensor, fmt: str = "e4m3", *, mode: str = "amax") -> torch.Tensor:
    """float32 ``scale_inv`` per amax entry, so that ``x / scale_inv`` fits the FP8 range.

    ``mode``: "amax" (``amax / fp8_max``), "pow2" (that, rounded up to a power of two) or "mx"
    (OCP MX shared exponent ``2^(floor(log2 amax) - emax_elem)``). Zero amax gives 1.
    """
    check_format(fmt)
    amax = amax.float()
    nonzero = amax > 0
    if mode == "mx":
        _, exp = torch.frexp(amax)  # floor(log2(amax)) == exp - 1 for amax > 0
        shared = (exp - 1 - FP8_EMAX[fmt]).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        scale_inv = torch.ldexp(torch.ones_like(amax), shared)
    elif mode in ("amax", "pow2"):
        scale_inv = amax / FP8_MAX[fmt]
        if mode == "pow2":
            scale_inv = round_up_pow2(torch.where(nonzero, scale_inv, torch.ones_like(amax)))
    else:
        raise ValueError(f"mode={mode!r} is not valid; choose 'amax', 'pow2' or 'mx'")
    # A zero group quantizes to zeros with any scale; 1 avoids 0/0 = NaN.
    return torch.where(nonzero, scale_inv, torch.ones_like(scale_inv))


def to_codes(x: torch.Tensor, scale_inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scale, saturate and cast to FP8. ``x / scale_inv`` promotes bf16/fp16 x to float32."""
    fmax = FP8_MAX[fmt]
    # Division by scale_inv is what DeepSeek's reference and the serving engines' inverse
    # (fp8 * scale_inv) assume. modelopt multiplies by 448/amax instead: the codes agree except
    # for one-ulp round-half ties (see tests/unit/test_fp8_modelopt.py). The clamp matters:
    # torch's cast to e4m3fn maps out-of-range values to NaN instead of saturating.
    if x.dtype in (torch.bfloat16, torch.float16):
        # A 0-d float32 scale does not promote a bf16 x: the division would run in bf16.
        x = x.float()
    y = torch.div(x, scale_inv)
    return y.clamp_(-fmax, fmax).to(FP8_DTYPES[fmt])


# ----------------------------------------------------------------------------------------------
# shape helpers: pad to whole groups and view as [..., n_groups, group]
# ----------------------------------------------------------------------------------------------
def _pad_last(x: torch.Tensor, group: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % group
    return F.pad(x, (0, pad)) if pad else x


def _pad_last2(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    pad_m = (-x.shape[-2]) % block[0]
    pad_n = (-x.shape[-1]) % block[1]
    return F.pad(x, (0, pad_n, 0, pad_m)) if (pad_m or pad_n) else x


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise ValueError(f"block={block!r} is not valid; give two positive ints, e.g. (128, 128)")
    return int(block[0]), int(block[1])


def _qdq_groups(xf: torch.Tensor, group: int, fmt: str, mode: str) -> torch.Tensor:
    """Fake-quant x (any float dtype) in 1 x ``group`` groups along the last dim -> float32."""
    n = xf.shape[-1]
    xp = _pad_last(xf, group)
    xv = xp.reshape(*xp.shape[:-1], xp.shape[-1] // group, group)
    scale_inv = compute_scale_inv(xv.abs().amax(dim=-1, keepdim=True), fmt, mode=mode)
    deq = to_codes(xv, scale_inv, fmt).float().mul_(scale_inv)
    return deq.reshape(xp.shape)[..., :n]


def _qdq_blocks(xf: torch.Tensor, block: tuple[int, int], fmt: str, mode: str) -> torch.Tensor:
    """Fake-quant x in ``block`` tiles over the last two dims -> float32."""
    m, n = xf.shape[-2:]
    bm, bn = block
    xp = _pad_last2(xf, block)
    lead = xp.shape[:-2]
    xv = xp.reshape(*lead, xp.shape[-2] // bm, bm, xp.shape[-1] // bn, bn)
    amax = xv.abs().amax(dim=(-3, -1), keepdim=True)
    scale_inv = compute_scale_inv(amax, fmt, mode=mode)
    deq = to_codes(xv, scale_inv, fmt).float().mul_(scale_inv)
    return deq.reshape(xp.shape)[..., :m, :n]


# ----------------------------------------------------------------------------------------------
# fake quantization with straight-through gradients
# ----------------------------------------------------------------------------------------------
class _StraightThrough(torch.autograd.Function):
    """y = qdq(x) in the forward pass; dy/dx = identity in the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor]):  # noqa: D102
        return qdq(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def _apply(x: torch.Tensor, qdq_f32: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run a float32 quantize-dequantize, return x's dtype, attach the STE when grads flow."""
    dtype = x.dtype

    def qdq(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return qdq_f32(t.detach()).to(dtype)

    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, qdq)
    return qdq(x)


TensorFn = Callable[[torch.Tensor], torch.Tensor]


def _along(dim: int, fn: TensorFn) -> TensorFn:
    """Apply a last-dim quantizer along ``dim`` by moving that dim last and back."""

    def run(t: torch.Tensor) -> torch.Tensor:
        d = dim % t.dim()
        if d == t.dim() - 1:
            return fn(t)
        return fn(t.movedim(d, -1)).movedim(-1, d)

    return run


def fake_quant_tensor(
    x: torch.Tensor, fmt: str = "e4m3", *, scale_inv: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Per-tensor fake quant. ``scale_inv`` given (delayed scaling) or from x's own amax."""
    check_format(fmt)

    def qdq(t: torch.Tensor) -> torch.Tensor:
        s = (
            compute_scale_inv(t.abs().amax(), fmt)
            if scale_inv is None
            else torch.as_tensor(scale_inv, dtype=torch.float32, device=t.device)
        )
        return to_codes(t, s, fmt).float() * s

    return _apply(x, qdq)


def fake_quant_rows(x: torch.Tensor, fmt: str = "e4m3", *, dim: int = -1) -> torch.Tensor:
    """One scale per row: amax taken along ``dim`` (per token for activations when dim=-1)."""
    check_format(fmt)

    def qdq(t: torch.Tensor) -> torch.Tensor:
        s = compute_scale_inv(t.abs().amax(dim=-1, keepdim=True), fmt)
        return to_codes(t, s, fmt).float() * s

    return _apply(x, _along(dim, qdq))


def fake_quant_groups(
    x: torch.Tensor, group: int = 128, fmt: str = "e4m3", *, dim: int = -1, pow2_scale: bool = False
) -> torch.Tensor:
    """One scale per ``group`` consecutive elements along ``dim`` (1x128 activation groups)."""
    check_format(fmt)
    if group < 1:
        raise ValueError(f"group={group} is not valid; it must be >= 1 (128 for DeepSeek-style)")
    mode = "pow2" if pow2_scale else "amax"
    return _apply(x, _along(dim, lambda t: _qdq_groups(t, group, fmt, mode)))


def fake_quant_blocks(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    fmt: str = "e4m3",
    *,
    pow2_scale: bool = False,
) -> torch.Tensor:
    """One scale per ``block`` tile of the last two dims (128x128 weight blocks)."""
    check_format(fmt)
    block = _check_block(block)
    if x.dim() < 2:
        raise ValueError(
            f"fake_quant_blocks needs a tensor with >= 2 dims, got shape {tuple(x.shape)}"
        )
    mode = "pow2" if pow2_scale else "amax"
    return _apply(x, lambda t: _qdq_blocks(t, block, fmt, mode))


def fake_quant_mxfp8(
    x: torch.Tensor, fmt: str = "e4m3", *, dim: int = -1, block: int = 32
) -> torch.Tensor:
    """MXFP8: ``block`` (32) consecutive elements along ``dim`` share an E8M0 power-of-two scale."""
    check_format(fmt)
    return _apply(x, _along(dim, lambda t: _qdq_groups(t, block, fmt, "mx")))


# ----------------------------------------------------------------------------------------------
# real FP8 weights for the rollout engine
# ----------------------------------------------------------------------------------------------
_CPU_CHUNK_ELEMS = 1 << 22
"""Elements per band in CPU quantize_blockwise (16 MiB of float32 temporaries). Measured on a
2-core box: 1-4 Mi elements are equally fast and ~2x faster than one whole-tensor pass; the
larger end issues fewer ops, which degrades less when the cores are shared."""


def _blockwise_codes(wv: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and [mb, 1, nb, 1] scale_inv for a [mb, bm, nb, bn] block view."""
    # amax in the input dtype is exact (max of |x| loses nothing), and skips a float32 copy.
    amax = wv.abs().amax(dim=(1, 3), keepdim=True)
    scale_inv = compute_scale_inv(amax, "e4m3", mode=mode)
    return to_codes(wv, scale_inv, "e4m3"), scale_inv


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2D weight to e4m3 with one float32 scale per ``block`` tile.

    Returns ``(fp8_weight, scale_inv)``: ``fp8_weight`` is ``torch.float8_e4m3fn`` of the
    weight's shape, ``scale_inv`` is float32 of shape ``[ceil(M/bm), ceil(N/bn)]`` with
    ``scale_inv = block_amax / 448`` (rounded up to a power of two if ``pow2_scale``), so that
    ``weight ~= fp8_weight.float() * scale_inv`` expanded over each block. This is the layout
    SGLang / vLLM load as ``weight_scale_inv`` for DeepSeek-V3 style block-FP8 checkpoints.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_blockwise expects a 2D weight [out, in], got shape {tuple(weight.shape)}; "
            "reshape stacked (e.g. MoE expert) weights to 2D per matrix first"
        )
    if not weight.is_floating_point():
        raise ValueError(f"quantize_blockwise expects a floating point weight, got {weight.dtype}")
    bm, bn = _check_block(block)
    m, n = weight.shape
    w = weight.detach()
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        w = w.float()
    wp = _pad_last2(w, (bm, bn))
    mb, nb = wp.shape[0] // bm, wp.shape[1] // bn
    wv = wp.view(mb, bm, nb, bn)
    mode = "pow2" if pow2_scale else "amax"
    if wv.device.type != "cpu":
        codes, scale_inv = _blockwise_codes(wv, mode)
    else:
        # On CPU, whole-tensor float32 temporaries of a large weight are fresh allocations that
        # page-fault on every call and stream through DRAM several times; bands of block-rows
        # that stay cache-sized (still one vectorised op per band, no per-block loop)
        # run several times faster. The arithmetic is identical.
        rows = max(1, _CPU_CHUNK_ELEMS // (bm * wp.shape[1]))
        codes = torch.empty(wv.shape, dtype=torch.float8_e4m3fn)
        scale_inv = torch.empty(mb, 1, nb, 1, dtype=torch.float32)
        for i in range(0, mb, rows):
            c, s = _blockwise_codes(wv[i : i + rows], mode)
            codes[i : i + rows].copy_(c)
            scale_inv[i : i + rows].copy_(s)
    codes = codes.view(wp.shape)
    if wp.shape != w.shape:
        codes = codes[:m, :n].contiguous()
    return codes, scale_inv.view(mb, nb)


def dequantize_blockwise(
    fp8_weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``fp8.float() * scale_inv`` per block."""
    bm, bn = _check_block(block)
    if fp8_weight.dim() != 2:
        raise ValueError(f"dequantize_blockwise expects a 2D weight, got {tuple(fp8_weight.shape)}")
    m, n = fp8_weight.shape
    mb, nb = -(-m // bm), -(-n // bn)
    if tuple(scale_inv.shape) != (mb, nb):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {(m, n)} with "
            f"block {(bm, bn)}; expected {(mb, nb)}"
        )
    wp = _pad_last2(fp8_weight.float(), (bm, bn))
    out = wp.view(mb, bm, nb, bn) * scale_inv.float().view(mb, 1, nb, 1)
    return out.view(wp.shape)[:m, :n].to(dtype)


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: ``(fp8_weight, scale_inv)`` with 0-d float32 ``scale_inv = amax / 448``."""
    if not weight.is_floating_point():
        raise ValueError(f"quantize_per_tensor expects a floating point weight, got {weight.dtype}")
    w = weight.detach()
    scale_inv = compute_scale_inv(w.abs().amax(), "e4m3")
    return to_codes(w, scale_inv, "e4m3"), scale_inv


def dequantize_per_tensor(
    fp8_weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_tensor`."""
    return (fp8_weight.float() * scale_inv.float()).to(dtype)
