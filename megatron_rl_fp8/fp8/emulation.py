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
nvfp4 (study only)     16 along K/T        16 along K/N                 16 along N/T
=====================  ==================  ===========================  =====================

``nvfp4`` is not FP8: a 4-bit grid for precision studies (``fp4_emulation.py``).

Forward operands are e4m3. Gradients are e5m2 under the "hybrid" format (more range, since
gradients span many decades) and e4m3 otherwise. The emulation dequantizes every operand to
float32 and multiplies; by default (``accumulation='fp32'``) it also sums in float32, so the result
is the exact product of the FP8 operands up to float32 rounding. A real FP8 tensor core sums less
precisely than that; ``accumulation='hopper'`` models how (next section). Bias is added in float32
(TE adds it in the GEMM epilogue, not in FP8), and the bias gradient is the float32 sum of the
unquantized output gradient.

How the hardware's limited-precision accumulation is modelled: ``accumulation.py``.

Delayed scaling in the emulation departs from TE in one place: TE starts with scale 1 before any
amax is recorded, so its first step may saturate; here the first step uses the tensor's own amax.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8.accumulation import emulated_gemm
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.formats import FP8_MAX, check_format
from megatron_rl_fp8.fp8.fp4_emulation import fake_quant_nvfp4
from megatron_rl_fp8.fp8.quantize import (
    compute_scale_inv,
    fake_quant_blocks,
    fake_quant_groups,
    fake_quant_mxfp8,
    fake_quant_rows,
    fake_quant_tensor,
)
from megatron_rl_fp8.fp8.recipes import GRANULARITY, RECIPES

__all__ = [
    "BLOCK_GROUP",
    "BLOCK_WEIGHT",
    "MX_BLOCK",
    "DelayedScalingState",
    "FP8LinearEmulator",
    "fp8_linear",
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
        # (amax,) while pinned (``fp8.scales_per_step``): scales stay as they were at pin();
        # amaxes are still recorded. None: not pinned.
        self.pinned: tuple[torch.Tensor | None] | None = None

    def amax(self) -> torch.Tensor | None:
        """The amax the next scale is derived from, or None before the first update."""
        if self.history is None or self.num_updates == 0:
            return None
        if self.compute_algo == "most_recent":
            return self.history[(self.num_updates - 1) % self.history_len]
        filled = min(self.num_updates, self.history_len)
        return self.history[:filled].max()

    def pin(self) -> None:
        """Keep the scale the history gives now until :meth:`unpin`, while later passes still
        record their amaxes (before any update: each pass uses its own amax, as unpinned)."""
        amax = self.amax()
        self.pinned = (None if amax is None else amax.clone(),)

    def unpin(self) -> None:
        self.pinned = None

    def scale_inv(self, fmt: str) -> torch.Tensor | None:
        """``amax * 2^margin / fp8_max`` from the history, or from the pinned amax (None before
        the first update)."""
        amax = self.amax() if self.pinned is None else self.pinned[0]
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

    def state_dict(self) -> dict:
        """The history and its position (a checkpoint carries them: without them a resumed run
        would start its scales from the first step's amaxes again)."""
        return {"history": self.history, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict, device: torch.device | str) -> None:
        """Continue from ``state`` (:meth:`state_dict`), the history on ``device``, where the
        tensors it scales live (a history elsewhere would be restarted by the next update)."""
        history = state["history"]
        if history is not None and history.shape != (self.history_len,):
            raise ValueError(
                f"amax history of length {history.shape[0]} does not fit "
                f"amax_history_len={self.history_len}"
            )
        self.history = None if history is None else history.to(device, torch.float32)
        self.num_updates = int(state["num_updates"])

    def scale_inv_then_update(
        self, t: torch.Tensor, fmt: str, *, amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scale for quantizing ``t`` now (from history; t's own amax on the first step), then
        record t's amax, in TE's order. ``amax`` stands for t's where it is known already (the
        amax of a sequence-split tensor, reduced over the ranks that hold its parts)."""
        amax_now = t.detach().abs().amax().float() if amax is None else amax.float()
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
        gran = GRANULARITY.get(recipe)
        if gran == "none":
            return t.to(torch.bfloat16).float()
        if gran == "tensor":
            return fake_quant_tensor(t.float(), fmt, scale_inv=scale_inv)
        if gran == "row":
            return fake_quant_rows(t.float(), fmt, dim=dim)
        if gran == "block":
            if role == "weight":
                # 128x128 tiles are symmetric under transpose: one copy serves fprop and dgrad.
                return fake_quant_blocks(t.float(), BLOCK_WEIGHT, fmt)
            return fake_quant_groups(t.float(), BLOCK_GROUP, fmt, dim=dim)
        if gran == "mx":
            return fake_quant_mxfp8(t.float(), fmt, dim=dim, block=MX_BLOCK)
        if gran == "nvfp4":
            return fake_quant_nvfp4(t, dim=dim)
    raise ValueError(
        f"recipe={recipe!r} is not valid; choose one of {', '.join(repr(r) for r in RECIPES)}"
    )


class _FP8LinearFn(torch.autograd.Function):
    """y = q(x) @ q(W)^T + b with FP8-quantized backward GEMMs (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, emulator: FP8LinearEmulator):  # noqa: D102
        recipe, spec = emulator.config.recipe, emulator.config.spec
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        sx = sw = None
        if spec.delayed:
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
        ctx.per_tensor = spec.per_tensor
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
        if emulator.config.spec.delayed:
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


class FP8Linear:
    """What every per-layer FP8 linear shares: ``linear(x, weight, bias) -> y`` through the
    autograd function ``_function`` (the backend's GEMMs), the layer's delayed-scaling amax
    histories, and ``enabled=False`` (or recipe "bf16") giving a plain ``F.linear`` (BF16
    first/last layers, the LM head). One per layer: a Megatron linear wrapper owns it."""

    _function: type[torch.autograd.Function]
    gathers_sequence = False
    """Whether a call may pass ``sp_group``: the linear then all-gathers a sequence-parallel
    input itself and keeps only this rank's part for its backward (the torch backend)."""

    def __init__(self, config: FP8Config, *, enabled: bool = True):
        self.config = config
        self.enabled = enabled and config.enabled
        make = lambda: DelayedScalingState(  # noqa: E731
            config.amax_history_len, config.amax_compute_algo, config.margin
        )
        self.input_state = make()
        self.weight_state = make()
        self.grad_state = make()

    def scaling_states(self) -> dict[str, DelayedScalingState]:
        """The layer's delayed-scaling state per GEMM operand role."""
        return {"input": self.input_state, "weight": self.weight_state,
                "grad_output": self.grad_state}  # fmt: skip

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        sp_group=None,
    ) -> torch.Tensor:
        """``sp_group`` (where ``gathers_sequence``): x is this rank's part of a sequence split
        along dim 0 over that process group; the output covers the whole sequence."""
        if sp_group is not None and not (self.enabled and self.gathers_sequence):
            raise ValueError(
                f"{self!r} does not gather a sequence-parallel input: all-gather it first"
            )
        if not self.enabled:
            return F.linear(x, weight, bias)
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)} ([out, in])"
            )
        if sp_group is None:
            return self._function.apply(x, weight, bias, self)
        return self._function.apply(x, weight, bias, self, sp_group)


class FP8LinearEmulator(FP8Linear):
    """Per-layer FP8 GEMM emulation: quantize-dequantize around a high-precision GEMM."""

    _function = _FP8LinearFn

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
    mx = GRANULARITY.get(recipe) == "mx"
    saturated = _mx_saturated(x, fmt).sum() if mx else x.new_zeros(())
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
