"""How an FP8 tensor core sums: float32, or Hopper's limited-precision accumulator with promotion.

The emulated GEMMs (``emulation.py``) multiply dequantized FP8 operands; this module decides how
the products are summed (``FP8Config.accumulation``): ``fp32`` is a plain float32 matmul, ``hopper``
models the tensor core below.

Hopper's FP8 tensor cores do not accumulate in float32. DeepSeek-V3 (report section 3.3.2)
measured "around 14 bits" retained on H800, and a relative error near 2% at K = 4096; its kernels
therefore copy the tensor-core partial sums into float32 registers every N_C = 128 elements of K
(4 WGMMA instructions of K = 32). CUTLASS calls this *promotion*; cuBLAS does it unless *fast
accumulation* is on (``torch._scaled_mm(use_fast_accum=...)``; Transformer Engine's
``use_split_accumulator`` is the opposite flag). TE and torchao run the forward GEMM with fast
accumulation and the two backward GEMMs with promotion. Bit-level studies of tensor cores (Fasi
et al. 2021 for V100/A100; Khattak and Mikaitis 2025, arXiv:2512.07004, up to H100/B200) describe
multi-term adders that align the products to the largest exponent and truncate (round toward
zero); for Hopper's FP8 path the accumulator is reported as 13 explicit mantissa bits ("e8m13"),
and 13 bits also reproduce the one H200 measurement this project has (below).

The model, for one output element, with m = ``accum_mantissa_bits`` and u = 2^-m::

    y = 0                                           # float32: the promoted accumulator
    for each chunk of accum_chunk elements of K:    # the promotion interval (all of K if fast)
        acc = 0
        for each step of 32 elements in the chunk:  # one WGMMA instruction
            acc = trunc_m(acc + sum_step a_k b_k)   # float32 sum, then keep m bits, toward zero
        y = y + acc

It truncates the *running* sum after every 32-element instruction rather than rounding each
chunk's sum once, because that is where the hardware loses bits: every instruction writes its
result back into the narrow accumulator, so the error grows with the number of instructions per
promotion. A finer bit-level model (per instruction, the 32 products and the accumulator aligned
to the largest exponent among them and each truncated to 13 bits) needs all T*N*K products, far
too slow to train with; it is kept in ``tests/unit/test_fp8_accumulation.py`` as the reference.
On the shape that failed on an H200 (x 256x512, w 384x512, per-tensor e4m3, promotion every 128)
the finer model has an RMS error of 1.45e-4 and reproduces what the H200 showed (17-18% of
outputs off float32 accumulation by more than 1e-4, max 1.2e-3); this model has 1.45e-4 too, and
rounding each chunk's sum once only 5.8e-5. Where it departs: without promotion (fast
accumulation, K = 512-4096) its error is 1.3-2.4x the finer model's, because truncating the exact
running sum biases every step toward zero, where the finer model's per-product truncations
mostly cancel; its errors are also not the same element by element.

Cost: accum_chunk / 32 batched matmuls of K = 32 (each over all chunks at once) plus a bit mask
per step, 3-6x the float32 GEMM on 2 CPU cores at the tiny model's shapes, and a float32 buffer
of (K / accum_chunk) times the output.

Error bound (:func:`accumulation_error_bound`). Truncation to m bits loses less than one unit in
the m-th bit, i.e. at most u times the running sum, and the running sum at step s of chunk c is at
most A[c,s], the sum of |a_k b_k| over that chunk up to that step. Adding float32 rounding (terms
of order 2^-24, written out in the function) and summing over steps and chunks::

    |y_hopper - y_exact| <~ u * sum_c sum_s A[c,s]  <=  u * (accum_chunk / 32) * sum_k |a_k b_k|.

On average truncation loses u/2 times 1/mantissa of the running sum, a mantissa in [1, 2): between
a quarter and a half of the bound when all products have the same sign (the running sum then
equals A). With mixed signs the running sums, and so the errors, are smaller.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8.config import HOPPER_MMA_K, FP8Config

__all__ = ["accumulation_error_bound", "emulated_gemm", "hopper_matmul"]

Gemm = Literal["fprop", "dgrad", "wgrad"]

_FP32_EPS = 2.0**-24
"""Unit roundoff of float32 (round to nearest): the relative error of one float32 operation."""


def _truncate_mantissa(t: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 ``t`` toward zero to ``bits`` explicit mantissa bits, in place.

    Clearing the low ``23 - bits`` bits of an IEEE float32 drops exactly those mantissa bits
    (sign and exponent are untouched), which is truncation of the magnitude. NaNs stay NaN: the
    quiet bit is the top mantissa bit, which ``bits >= 1`` keeps.
    """
    if bits >= 23:
        return t
    # 0xFFF...F000...: keeps sign, exponent and the top `bits` mantissa bits. An int32 tensor, not
    # a Python int: a Python scalar sends bitwise_and_ down a path ~100x slower on CPU.
    mask = torch.tensor(-(1 << (23 - bits)), dtype=torch.int32, device=t.device)
    t.view(torch.int32).bitwise_and_(mask)
    return t


def _chunking(k: int, chunk: int | None) -> tuple[int, int, int]:
    """(padded K, number of chunks, instruction steps per chunk) for contraction length ``k``."""
    if chunk is None:  # fast accumulation: one chunk spanning all of K
        chunk = max(HOPPER_MMA_K, -(-k // HOPPER_MMA_K) * HOPPER_MMA_K)
    if chunk < HOPPER_MMA_K or chunk % HOPPER_MMA_K:
        raise ValueError(
            f"chunk={chunk} is not valid; give a positive multiple of {HOPPER_MMA_K} "
            "(or None for no promotion)"
        )
    n_chunks = max(1, -(-k // chunk))
    return n_chunks * chunk, n_chunks, chunk // HOPPER_MMA_K


def hopper_matmul(
    a: torch.Tensor, b: torch.Tensor, *, chunk: int | None = 128, mantissa_bits: int = 13
) -> torch.Tensor:
    """``a @ b`` ([M, K] x [K, N], float32) accumulated the way a Hopper FP8 tensor core does.

    Within each ``chunk`` of K (None: all of K, i.e. fast accumulation) the running sum is
    truncated to ``mantissa_bits`` after every 32-element instruction step; chunk results are
    added in float32 (see the module docstring). A ragged K is zero-padded: zero products leave
    every partial sum unchanged and truncation is idempotent, so padding changes nothing. No
    autograd: the emulated linear's backward supplies straight-through gradients.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"hopper_matmul needs [M, K] x [K, N], got {tuple(a.shape)} x {tuple(b.shape)}"
        )
    if not 1 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits={mantissa_bits} is not valid; it must be in 1..23")
    m, k = a.shape
    n = b.shape[1]
    kp, n_chunks, n_steps = _chunking(k, chunk)
    with torch.no_grad():
        a = F.pad(a.detach().float(), (0, kp - k))
        b = F.pad(b.detach().float(), (0, 0, 0, kp - k))
        # Step s of every chunk at once: [n_chunks, M, 32] x [n_chunks, 32, N].
        a_steps = a.reshape(m, n_chunks, n_steps, HOPPER_MMA_K).permute(2, 1, 0, 3).contiguous()
        b_steps = b.reshape(n_chunks, n_steps, HOPPER_MMA_K, n).transpose(0, 1).contiguous()
        acc = torch.bmm(a_steps[0], b_steps[0])
        _truncate_mantissa(acc, mantissa_bits)
        for s in range(1, n_steps):
            acc.add_(torch.bmm(a_steps[s], b_steps[s]))
            _truncate_mantissa(acc, mantissa_bits)
        return acc.sum(dim=0)  # the promoted float32 accumulator


def accumulation_error_bound(
    a: torch.Tensor, b: torch.Tensor, *, chunk: int | None = 128, mantissa_bits: int = 13
) -> torch.Tensor:
    """Elementwise bound on ``|hopper_matmul(a, b) - a @ b|`` (exact product), float64 [M, N].

    For one output element let p_k = a_k b_k, A[c,s] = sum of |p_k| over chunk c up to and
    including instruction step s, A[c] its value at the chunk's last step, g = 32, u =
    2^-mantissa_bits, eps = 2^-24 and gamma_n = n eps / (1 - n eps). Step s computes
    acc = trunc(fl(acc + fl(sum_step p_k))): the float32 dot product of 32 terms errs by at most
    gamma_g times its sum of |p_k| (Higham, Accuracy and Stability, 3.1), the float32 add by eps
    and the truncation by u, relative to a running sum of at most A[c,s] plus the error so far.
    Unrolled over the n_s steps of a chunk (rho = (1 + u + eps)^n_s covers the compounding)::

        |err_c| <= rho * ((u + eps) * sum_s A[c,s] + gamma_g * A[c])

    and the float32 sum of the n_c chunk results adds gamma_{n_c} times their magnitudes::

        bound = (1 + gamma_{n_c}) * sum_c |err_c| + gamma_{n_c} * sum_c A[c]

    The leading term is u * sum_c sum_s A[c,s] <= u * (chunk / 32) * sum_k |p_k|. It costs a
    float64 buffer of K/32 times the output: for tests and analysis, not for training.
    """
    m, k = a.shape
    n = b.shape[1]
    kp, n_chunks, n_steps = _chunking(k, chunk)
    u, eps = 2.0**-mantissa_bits, _FP32_EPS

    def gamma(count: int) -> float:
        return count * eps / (1 - count * eps)

    abs_a = F.pad(a.detach().double().abs(), (0, kp - k))
    abs_b = F.pad(b.detach().double().abs(), (0, 0, 0, kp - k))
    steps = kp // HOPPER_MMA_K
    # Sum of |p_k| per instruction step: [steps, M, N], then prefix sums within each chunk.
    per_step = torch.bmm(
        abs_a.reshape(m, steps, HOPPER_MMA_K).transpose(0, 1), abs_b.reshape(steps, HOPPER_MMA_K, n)
    )
    prefix = per_step.view(n_chunks, n_steps, m, n).cumsum(dim=1)
    chunk_abs = prefix[:, -1]  # A[c]
    rho = (1 + u + eps) ** n_steps
    err_c = rho * ((u + eps) * prefix.sum(dim=1) + gamma(HOPPER_MMA_K) * chunk_abs)
    return (1 + gamma(n_chunks)) * err_c.sum(dim=0) + gamma(n_chunks) * chunk_abs.sum(dim=0)


def emulated_gemm(a: torch.Tensor, b: torch.Tensor, config: FP8Config, gemm: Gemm) -> torch.Tensor:
    """``a @ b`` for one of a linear layer's three FP8 GEMMs, accumulated as ``config`` says.

    ``accumulation='fp32'`` is the plain float32 matmul. ``'hopper'`` promotes every
    ``accum_chunk`` elements of K, except in fprop with ``accum_fast_fprop`` (TE's and torchao's
    default), which promotes never; blockwise scales force promotion in every GEMM.
    """
    if config.accumulation == "fp32":
        return a @ b
    fast = gemm == "fprop" and config.fprop_fast_accum
    chunk = None if fast else config.accum_chunk
    return hopper_matmul(a, b, chunk=chunk, mantissa_bits=config.accum_mantissa_bits)
