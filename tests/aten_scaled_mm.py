"""ATen's CUDA-only block-scaled ``torch.nn.functional.scaled_mm``, as its preconditions are
written in ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` (pytorch main, read 2026-12-01), for the
CPU tests of the torch FP8 backend, where CPU torch has no block-scaled kernel.

:func:`block_scaled_mm` checks, before it computes anything, what ATen checks on the GPU:

* ``check_deepseek_recipe`` (the dispatch table's acceptance test): both operands
  ``float8_e4m3fn``, one float32 scale each, the recipe pair 1x128 x 128x128, 128x128 x 1x128 or
  1x128 x 1x128;
* ``_scaled_block1x128_block128x128``: ``scale_a`` [M, ceil(K/128)] with strides (1, M);
  ``scale_b`` [round_up(ceil(K/128), 4), ceil(N/128)] with strides (1, round_up(ceil(K/128), 4));
* ``_scaled_block1x128_block1x128``: ``scale_a`` [M, ceil(K/128)] strides (1, M); ``scale_b``
  [N, ceil(K/128)] strides (1, N);
* cuBLASLt's FP8 layout: ``mat_a`` row-major, ``mat_b`` column-major;

then returns the product of the dequantized operands in ``output_dtype``, and appends each call's
recipes and ``use_fast_accum`` to :data:`CALLS`. (``_check_deepseek_support``, the SM90 /
cuBLASLt >= 12.9 rule, is the backend selection's: ``fp8/backend.py``.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[dict] = []
"""One entry per :func:`block_scaled_mm` call: ``recipes`` (a, b) and ``fast_accum``."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def block_scaled_mm(
    a, b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype, use_fast_accum=False, **_
):
    st = F.ScalingType
    m, k = a.shape
    n = b.shape[1]
    kb = -(-k // 128)
    # check_deepseek_recipe
    assert a.dtype == b.dtype == torch.float8_e4m3fn, (
        f"check_deepseek_recipe: both operands must be float8_e4m3fn, got {a.dtype}, {b.dtype}"
    )
    assert scale_a.dtype == scale_b.dtype == torch.float32
    pair = (recipe_a, recipe_b)
    assert pair in (
        (st.BlockWise1x128, st.BlockWise128x128),
        (st.BlockWise128x128, st.BlockWise1x128),
        (st.BlockWise1x128, st.BlockWise1x128),
    ), pair
    assert recipe_a == st.BlockWise1x128, "this backend never passes a 128x128 first operand"
    assert a.is_contiguous() and b.t().is_contiguous(), "mat_a row-major, mat_b column-major"
    assert k % 128 == 0, "the backend pads K to the block"
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), (
        scale_a.shape,
        scale_a.stride(),
    )
    deq_a = a.float() * scale_a.repeat_interleave(128, dim=1)
    if recipe_b == st.BlockWise128x128:
        k4 = _round_up(kb, 4)
        assert n % 128 == 0 and scale_b.shape == (k4, n // 128), scale_b.shape
        assert scale_b.stride() == (1, k4), scale_b.stride()
        sb = scale_b[:kb].repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        assert scale_b.shape == (n, kb) and scale_b.stride() == (1, n), scale_b.stride()
        sb = scale_b.t().repeat_interleave(128, dim=0)
    CALLS.append({"recipes": pair, "fast_accum": use_fast_accum})
    return (deq_a @ (b.float() * sb)).to(output_dtype)
