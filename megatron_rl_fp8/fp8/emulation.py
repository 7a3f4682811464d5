"""Emulated FP8 linear layers: the CPU stand-in for Transformer Engine's FP8 GEMMs.

A linear layer runs three GEMMs per step, and under FP8 each one reads FP8 operands:

    fprop  y  = x  @ W^T     contraction over K (hidden in)     operands x [T,K], W [N,K]
    dgrad  dx = dy @ W       contraction over N (hidden out)    operands dy [T,N], W [N,K]
    wgrad  dW = dy^T @ x     contraction over T (tokens)        operands dy [T,N], x [T,K]

The rule that decides how each operand is quantized: **scales must be shared along the
contraction dimension** of the GEMM the operand feeds, because only then does a scale factor out
of every partial dot product and can be applied once in the epilogue. So the same tensor is
quantized differently for different GEMMs (TE keeps a "rowwise" and a "columnwise" FP8 copy):

=====================  ==================  ===========================  =====================
recipe                 x (fprop / wgrad)   W (fprop / dgrad)            dy (dgrad / wgrad)
=====================  ==================  ===========================  =====================
tensorwise_delayed     one scale, from the amax history of that tensor (see DelayedScalingState)
tensorwise_current     one scale, from the tensor's own amax
rowwise                per row along K/T   per row along K/N            per row along N/T
blockwise              1x128 along K/T     128x128 tiles (both GEMMs)   1x128 along N/T
mxfp8                  32 along K/T        32 along K/N                 32 along N/T
=====================  ==================  ===========================  =====================

Forward operands are e4m3. Gradients are e5m2 under the "hybrid" format (more range, since
gradients span many decades) and e4m3 otherwise. The emulation dequantizes every operand to
float32 and multiplies; by default (``accumulation='fp32'``) it also sums in float32, so the result
is the exact product of the FP8 operands up to float32 rounding. A real FP8 tensor core sums less
precisely than that; ``accumulation='hopper'`` models how (next section). Bias is added in float32
(TE adds it in the GEMM epilogue, not in FP8), and the bias gradient is the float32 sum of the
unquantized output gradient.

Accumulation on Hopper (``FP8Config.accumulation='hopper'``)
-----------------------------------------------------------
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

Delayed scaling in the emulation departs from TE in one place: TE starts with scale 1 before any
amax is recorded, so its first step may saturate; here the first step uses the tensor's own amax.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8.config import HOPPER_MMA_K, FP8Config
from megatron_rl_fp8.fp8.formats import FP8_MAX, check_format
from megatron_rl_fp8.fp8.quantize import (
    compute_scale_inv,
    fake_quant_blocks,
    fake_quant_groups,
    fake_quant_mxfp8,
    fake_quant_rows,
    fake_quant_tensor,
)

__all__ = [
    "BLOCK_GROUP",
    "BLOCK_WEIGHT",
    "MX_BLOCK",
    "DelayedScalingState",
    "FP8LinearEmulator",
    "accumulation_error_bound",
    "emulated_gemm",
    "fp8_linear",
    "hopper_matmul",
    "quantize_operand",
    "quantization_error",
]

BLOCK_GROUP = 128
"""Group size of 1D (1x128) activation / gradient scales under the blockwise recipe."""
BLOCK_WEIGHT = (128, 128)
"""Weight tile under the blockwise recipe."""
MX_BLOCK = 32
"""Elements per E8M0 scale under MXFP8."""

OperandRole = Literal["input", "weight", "grad_output"]
_ROLES = ("input", "weight", "grad_output")
Gemm = Literal["fprop", "dgrad", "wgrad"]

_FP32_EPS = 2.0**-24
"""Unit roundoff of float32 (round to nearest): the relative error of one float32 operation."""


class DelayedScalingState:
    """Amax history of one tensor (input, weight or output gradient of one layer).

    Delayed scaling picks this step's scale from *past* amaxes, so the GEMM need not wait for a
    reduction over the tensor it is about to quantize (on a GPU that saves a pass over memory).
    The history lives on the tensor's device and is never read on the host, so updating it does
    not force a CPU-GPU sync.
    """

    def __init__(self, history_len: int = 16, compute_algo: str = "max", margin: int = 0):
        if history_len < 1:
            raise ValueError(f"history_len={history_len} is not valid; it must be >= 1")
        if compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"compute_algo={compute_algo!r} is not valid; use 'max' or 'most_recent'"
            )
        self.history_len = history_len
        self.compute_algo = compute_algo
        self.margin = margin
        self.history: torch.Tensor | None = None  # float32 ring buffer [history_len]
        self.num_updates = 0

    def amax(self) -> torch.Tensor | None:
        """The amax the next scale is derived from, or None before the first update."""
        if self.history is None or self.num_updates == 0:
            return None
        if self.compute_algo == "most_recent":
            return self.history[(self.num_updates - 1) % self.history_len]
        filled = min(self.num_updates, self.history_len)
        return self.history[:filled].max()

    def scale_inv(self, fmt: str) -> torch.Tensor | None:
        """``amax * 2^margin / fp8_max`` from the history (None before the first update)."""
        amax = self.amax()
        if amax is None:
            return None
        return compute_scale_inv(amax * (2.0**self.margin), fmt)

    def update(self, amax: torch.Tensor) -> None:
        """Record this step's amax (a 0-d tensor), overwriting the oldest entry."""
        amax = amax.detach().float().reshape(())
        if self.history is None or self.history.device != amax.device:
            self.history = torch.zeros(self.history_len, dtype=torch.float32, device=amax.device)
        self.history[self.num_updates % self.history_len] = amax
        self.num_updates += 1

    def scale_inv_then_update(self, t: torch.Tensor, fmt: str) -> torch.Tensor:
        """Scale for quantizing ``t`` now (from history; t's own amax on the first step), then
        record t's amax, in TE's order."""
        amax_now = t.detach().abs().amax().float()
        s = self.scale_inv(fmt)
        if s is None:
            s = compute_scale_inv(amax_now * (2.0**self.margin), fmt)
        self.update(amax_now)
        return s


def quantize_operand(
    t: torch.Tensor,
    recipe: str,
    role: OperandRole,
    dim: int,
    fmt: str = "e4m3",
    *,
    scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize one GEMM operand as ``recipe`` prescribes; float32 out, no autograd.

    ``dim`` is the contraction dim of the GEMM the operand feeds (scales are shared along it).
    ``scale_inv`` is used by the tensorwise recipes when given (delayed scaling); otherwise the
    tensor's own amax sets the scale. "bf16" rounds to bfloat16 (the unquantized baseline).
    """
    if role not in _ROLES:
        raise ValueError(f"role={role!r} is not valid; choose one of {list(_ROLES)}")
    check_format(fmt)
    with torch.no_grad():
        t = t.detach()
        if recipe == "bf16":
            return t.to(torch.bfloat16).float()
        if recipe in ("tensorwise_delayed", "tensorwise_current"):
            return fake_quant_tensor(t.float(), fmt, scale_inv=scale_inv)
        if recipe == "rowwise":
            return fake_quant_rows(t.float(), fmt, dim=dim)
        if recipe == "blockwise":
            if role == "weight":
                # 128x128 tiles are symmetric under transpose: one copy serves fprop and dgrad.
                return fake_quant_blocks(t.float(), BLOCK_WEIGHT, fmt)
            return fake_quant_groups(t.float(), BLOCK_GROUP, fmt, dim=dim)
        if recipe == "mxfp8":
            return fake_quant_mxfp8(t.float(), fmt, dim=dim, block=MX_BLOCK)
    raise ValueError(
        f"recipe={recipe!r} is not valid; choose one of 'bf16', 'tensorwise_delayed', "
        "'tensorwise_current', 'rowwise', 'blockwise', 'mxfp8'"
    )


# ----------------------------------------------------------------------------------------------
# accumulation: float32, or Hopper's limited-precision accumulator with promotion
# ----------------------------------------------------------------------------------------------
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
        raise ValueError(f"chunk={chunk} is not valid; give a positive multiple of {HOPPER_MMA_K} "
                         "(or None for no promotion)")
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
        raise ValueError(f"hopper_matmul needs [M, K] x [K, N], got {tuple(a.shape)} x "
                         f"{tuple(b.shape)}")
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
    per_step = torch.bmm(abs_a.reshape(m, steps, HOPPER_MMA_K).transpose(0, 1),
                         abs_b.reshape(steps, HOPPER_MMA_K, n))
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
    fast = gemm == "fprop" and config.accum_fast_fprop and config.recipe != "blockwise"
    chunk = None if fast else config.accum_chunk
    return hopper_matmul(a, b, chunk=chunk, mantissa_bits=config.accum_mantissa_bits)


class _FP8LinearFn(torch.autograd.Function):
    """y = q(x) @ q(W)^T + b with FP8-quantized backward GEMMs (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, emulator: FP8LinearEmulator):  # noqa: D102
        recipe = emulator.config.recipe
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        sx = sw = None
        if recipe == "tensorwise_delayed":
            sx = emulator.input_state.scale_inv_then_update(x2, "e4m3")
            sw = emulator.weight_state.scale_inv_then_update(weight, "e4m3")
        qx = quantize_operand(x2, recipe, "input", dim=-1, fmt="e4m3", scale_inv=sx)
        qw = quantize_operand(weight, recipe, "weight", dim=-1, fmt="e4m3", scale_inv=sw)
        y = emulated_gemm(qx, qw.t(), emulator.config, "fprop")
        if bias is not None:
            y = y + bias.detach().float()
        ctx.emulator = emulator
        ctx.x_shape = x.shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.per_tensor = recipe in ("tensorwise_delayed", "tensorwise_current")
        if ctx.per_tensor:
            # One scale per tensor is the same along every dim: the backward GEMMs reuse the
            # forward FP8 operands (and, for delayed scaling, the forward scales) as TE does.
            ctx.save_for_backward(qx, qw)
        else:
            ctx.save_for_backward(x2.detach(), weight.detach())
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        emulator: FP8LinearEmulator = ctx.emulator
        recipe = emulator.config.recipe
        gfmt = emulator.config.grad_format
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        a, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).float()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]

        sg = None
        if recipe == "tensorwise_delayed":
            sg = emulator.grad_state.scale_inv_then_update(g2, gfmt)

        cfg = emulator.config
        dx = dw = db = None
        if ctx.per_tensor:
            qg = quantize_operand(g2, recipe, "grad_output", dim=-1, fmt=gfmt, scale_inv=sg)
            if need_dx:
                dx = emulated_gemm(qg, w, cfg, "dgrad")
            if need_dw:
                dw = emulated_gemm(qg.t(), a, cfg, "wgrad")
        else:
            if need_dx:  # dgrad: contraction over N (dim -1 of dy, dim 0 of W)
                qg_n = quantize_operand(g2, recipe, "grad_output", dim=-1, fmt=gfmt)
                qw_n = quantize_operand(w, recipe, "weight", dim=0, fmt="e4m3")
                dx = emulated_gemm(qg_n, qw_n, cfg, "dgrad")
            if need_dw:  # wgrad: contraction over tokens T (dim 0 of dy and of x)
                qg_t = quantize_operand(g2, recipe, "grad_output", dim=0, fmt=gfmt)
                qx_t = quantize_operand(a, recipe, "input", dim=0, fmt="e4m3")
                dw = emulated_gemm(qg_t.t(), qx_t, cfg, "wgrad")
        if need_db:
            db = g2.sum(dim=0).to(b_dtype)
        if dx is not None:
            dx = dx.to(x_dtype).reshape(ctx.x_shape)
        if dw is not None:
            dw = dw.to(w_dtype)
        return dx, dw, db, None


class FP8LinearEmulator:
    """Per-layer FP8 GEMM emulation: ``emulator(x, weight, bias) -> y``.

    Holds the delayed-scaling amax histories of one linear layer, so create one per layer (a
    Megatron linear wrapper owns it). ``enabled=False`` (or recipe "bf16") gives a plain
    ``F.linear`` (BF16 first/last layers, the LM head).
    """

    def __init__(self, config: FP8Config, *, enabled: bool = True):
        self.config = config
        self.enabled = enabled and config.enabled
        make = lambda: DelayedScalingState(  # noqa: E731
            config.amax_history_len, config.amax_compute_algo, config.margin
        )
        self.input_state = make()
        self.weight_state = make()
        self.grad_state = make()

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, weight, bias)
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)} ([out, in])"
            )
        return _FP8LinearFn.apply(x, weight, bias, self)

    def __repr__(self) -> str:
        return (
            f"FP8LinearEmulator(recipe={self.config.recipe!r}, "
            f"format={self.config.format!r}, accumulation={self.config.accumulation!r}, "
            f"enabled={self.enabled})"
        )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe_state: FP8LinearEmulator,
) -> torch.Tensor:
    """Functional form of :class:`FP8LinearEmulator` (``recipe_state`` holds config + history)."""
    return recipe_state(x, weight, bias)


def quantization_error(
    tensor: torch.Tensor, recipe: str, *, role: OperandRole = "weight", fmt: str = "e4m3"
) -> dict[str, float]:
    """How much ``recipe`` distorts ``tensor`` (quantized for the forward GEMM, along dim -1).

    Keys: ``rel_error`` (||q - x|| / ||x||), ``max_abs_error``, ``amax``, ``underflow_frac``
    (share of nonzero elements flushed to zero: the outlier damage fine scales prevent) and
    ``saturated_frac`` (share hitting +-fp8_max at the scaled level; only MXFP8 can clip).
    Returns Python floats, which costs one host sync: call it on metric steps only.
    """
    x = tensor.detach().float()
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"quantization_error needs a non-empty tensor, got shape {tuple(x.shape)}")
    q = quantize_operand(x, recipe, role, dim=-1, fmt=fmt)
    diff = q - x
    norm = x.norm()
    nonzero = x != 0
    n_nonzero = nonzero.sum().clamp_min(1)
    rel = diff.norm() / norm.clamp_min(torch.finfo(torch.float32).tiny)
    saturated = _mx_saturated(x, fmt).sum() if recipe == "mxfp8" else x.new_zeros(())
    stats = torch.stack(
        [
            rel,
            diff.abs().max(),
            x.abs().max(),
            (nonzero & (q == 0)).sum() / n_nonzero,
            saturated / x.numel(),
        ]
    )
    rel, max_abs, amax, underflow, sat = stats.tolist()  # the one host sync
    return {
        "rel_error": rel,
        "max_abs_error": max_abs,
        "amax": amax,
        "underflow_frac": underflow,
        "saturated_frac": sat,
    }


def _mx_saturated(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Mask (over padded MX blocks) of elements whose scaled magnitude exceeds fp8_max."""
    n = x.shape[-1]
    pad = (-n) % MX_BLOCK
    xp = F.pad(x, (0, pad)) if pad else x
    xv = xp.reshape(*xp.shape[:-1], -1, MX_BLOCK).abs()
    scale_inv = compute_scale_inv(xv.amax(dim=-1, keepdim=True), fmt, mode="mx")
    return xv / scale_inv > FP8_MAX[fmt]
