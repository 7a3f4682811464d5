"""The ``torch`` FP8 backend: Megatron's local linears with real FP8 GEMMs via ``torch._scaled_mm``.

Where Transformer Engine is absent (it cannot be installed on every GPU box), FP8 still runs on
the tensor cores: each linear's three GEMMs (see ``emulation.py`` for the table)

    fprop  y  = x  @ W^T     a = x   [T, K]   b = W   [N, K]    contraction K
    dgrad  dx = dy @ W       a = dy  [T, N]   b = W^T [K, N]    contraction N
    wgrad  dW = dy^T @ x     a = dy^T [N, T]  b = x^T [K, T]    contraction T

are computed as ``a @ b^T`` by ``torch._scaled_mm(a8, b8.t(), scale_a, scale_b)`` on FP8 codes.
Every operand is stored row-major as [rows, contraction], so ``b8.t()`` is the column-major second
operand cuBLAS requires, and every scale is shared along the contraction dim (``emulation.py``
explains why). The codes are exactly those the emulation uses (same ``amax / fp8_max`` scales, same
rounding), so the emulation predicts this backend up to accumulation order and bf16 output
rounding. Scale layouts handed to the GEMM, per recipe:

=====================  ======================  ===========================================
recipe                 scale_a                 scale_b
=====================  ======================  ===========================================
tensorwise_*           0-d float32             0-d float32
rowwise                [M, 1]                  [1, N] (the [N, 1] row scales, transposed)
blockwise (fprop,      [M, K/128] 1x128,       [K4, N/128] view of the contiguous [N/128, K4]
dgrad)                 column-major strides    128x128 block scales (K4: K/128 rounded up to 4)
blockwise (wgrad)      [M, K/128] 1x128,       [N, K/128] 1x128, column-major strides
                       column-major strides
=====================  ======================  ===========================================

Blockwise GEMMs go through ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128``
/ ``BlockWise128x128`` (torch 2.11 has it; CPU torch runs only the first two rows). Operands are
zero-padded to the GEMM's alignment (16; 128 along block-scaled dims) before quantization, which
changes no amax; outputs are sliced back. Forward operands are e4m3; ``format: hybrid`` quantizes
the output gradient to e5m2. GEMM outputs are bf16 (cast to the input's dtype); the bias is added
after the GEMM in that dtype, and its gradient is the emulation's. The forward GEMM uses fast
accumulation when ``accum_fast_fprop`` (as torchao does) except under blockwise scaling, whose
GEMMs all accumulate split (``FP8Config.fprop_fast_accum``); dgrad and wgrad never do.

Provenance of the blockwise layouts: 1x128 x 128x128 was measured on the H200 (PLATFORM_NOTES) at
shapes whose K/128 is a multiple of 4; the padding to 4 and the 1x128 x 1x128 (wgrad) layout follow
torch's own ``scaled_mm`` samples and are first exercised on a GPU by
``tests/gpu/test_fp8_torch_backend.py``.

Caching: inside :meth:`FP8LinearTorch.weight_cache` (the actor opens it around each forward /
backward schedule, during which the weights do not change) the quantized weight is made once and
reused by every micro-batch. Delayed scaling never caches: its weight scale follows the amax
history, which moves with each call, as in the emulation.

Casts: each operand's quantization is six to eight eager kernels that each pass over the tensor
(abs, amax, the float32 copy of a bf16 input, divide, saturate, cast; a transposed or unaligned
operand adds a copy): memory-bound passes that can eat what the FP8 GEMM saves (not yet
measured on a GPU).
``fp8.compile_casts`` runs :func:`quantize_gemm_operand` through ``torch.compile`` (one function
per process, dynamic shapes, no graph breaks): inductor fuses each recipe's cast into one C++
kernel on the CPU (its output code read with ``run_and_get_code``, torch 2.13: tensorwise,
rowwise, rowwise of a transposed view, blockwise), a reduction and an elementwise pass at most,
with the same codes and scales.

Tensor and pipeline parallelism: each rank quantizes its own weight shard and its own activations,
so every scale (tensorwise included) is per local shard, as in the emulation. Under sequence
parallelism (``sp_group``) the linear all-gathers its sequence-split input itself, as FP8 (as TE
does): each rank quantizes its own rows with the scales the whole sequence gives them (per
tensor: the amax all-reduced over the group first, one float; per row or 1x128 group: their
own), and the codes (1 byte per element instead of 2 for a bf16 input) and row scales are
gathered: the codes and scales the linear has without SP, bit for bit. For its backward it keeps
only this rank's rows (tensorwise: their FP8 codes, half what Megatron's own GEMM keeps; other
recipes: the input in its dtype, as Megatron) and gathers them again for wgrad.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8Linear, OperandRole
from megatron_rl_fp8.fp8.quantize import compute_scale_inv, to_codes
from megatron_rl_fp8.fp8.recipes import BACKEND_RECIPES, GRANULARITY
from megatron_rl_fp8.fp8.weight_cache import WeightCache

__all__ = [
    "ALIGN",
    "BLOCK",
    "FP8LinearTorch",
    "FP8Operand",
    "compiled_quantize",
    "fp8_mm",
    "quantize_gemm_operand",
    "transpose_operand",
]

ALIGN = 16
"""cuBLAS FP8 GEMMs want every dim a multiple of 16 (16 bytes of e4m3)."""
BLOCK = 128
"""Block size of the blockwise recipe: 1x128 activation / gradient groups, 128x128 weight tiles."""


class FP8Operand(NamedTuple):
    """One GEMM operand: FP8 ``codes`` [rows, contraction] (zero-padded) and float32 ``scale_inv``
    (``x ~= codes * scale_inv``) of the shape its ``granularity`` gives (see module table)."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    granularity: str  # "tensor", "row", "group" (1x128) or "block" (128x128)


def _granularity(recipe: str, role: OperandRole) -> str:
    gran = GRANULARITY.get(recipe)
    if gran in ("tensor", "row"):
        return gran
    if gran == "block":
        return "block" if role == "weight" else "group"
    raise ValueError(
        f"FP8Config.recipe={recipe!r} has no torch-backend GEMM; use "
        f"{', '.join(repr(r) for r in BACKEND_RECIPES['torch'])}, or backend 'emulate'"
    )


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pad_r, pad_c = (-t.shape[0]) % rows, (-t.shape[1]) % cols
    return F.pad(t, (0, pad_c, 0, pad_r)) if (pad_r or pad_c) else t


def quantize_gemm_operand(
    t: torch.Tensor,
    recipe: str,
    role: OperandRole,
    fmt: str = "e4m3",
    *,
    scale_inv: torch.Tensor | None = None,
) -> FP8Operand:
    """Quantize a 2D operand [rows, contraction] for :func:`fp8_mm`, scales along its last dim.

    ``scale_inv`` (tensorwise only) overrides the tensor's own amax (delayed scaling). Pads rows
    to 16 (128 for 128x128 weight tiles) and the contraction dim to 16 (128 under blockwise).
    """
    if t.dim() != 2:
        raise ValueError(f"quantize_gemm_operand needs a 2D tensor, got shape {tuple(t.shape)}")
    gran = _granularity(recipe, role)
    with torch.no_grad():
        # Contiguous: elementwise ops keep a transposed input's strides, and cuBLAS needs the
        # codes row-major (the second operand is handed over as codes.t(), column-major).
        t = _pad2(
            t.detach(),
            BLOCK if gran == "block" else ALIGN,
            BLOCK if gran in ("block", "group") else ALIGN,
        ).contiguous()
        r, c = t.shape
        if gran == "tensor":
            s = compute_scale_inv(t.abs().amax(), fmt) if scale_inv is None else scale_inv.float()
            return FP8Operand(to_codes(t, s, fmt), s, gran)
        if gran == "row":
            s = compute_scale_inv(t.abs().amax(dim=1, keepdim=True), fmt)  # [R, 1]
            return FP8Operand(to_codes(t, s, fmt), s, gran)
        if gran == "group":
            tv = t.reshape(r, c // BLOCK, BLOCK)
            s = compute_scale_inv(tv.abs().amax(dim=-1, keepdim=True), fmt)  # [R, C/128, 1]
            return FP8Operand(to_codes(tv, s, fmt).reshape(r, c), s.reshape(r, c // BLOCK), gran)
        tv = t.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
        s = compute_scale_inv(tv.abs().amax(dim=(1, 3), keepdim=True), fmt)
        codes = to_codes(tv, s, fmt).reshape(r, c)
        return FP8Operand(codes, s.reshape(r // BLOCK, c // BLOCK).contiguous(), gran)


COMPILED_GRAPHS = 64
"""Graphs the compiled quantizer may keep (Dynamo's default is 8 per function). Each recipe x
role x format, each scale source (own amax or delayed), each layout (the backward quantizes
transposed views) and aligned vs padded shapes is a graph of its own: a rowwise linear with the
hybrid format alone needs 6 to 12."""


@functools.cache
def compiled_quantize():
    """:func:`quantize_gemm_operand` compiled once per process (``fp8.compile_casts``); raises
    Dynamo's per-function graph limit to :data:`COMPILED_GRAPHS` where it is lower."""
    import torch._dynamo  # lazy: ~2 s to import; only fp8.compile_casts needs it

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, COMPILED_GRAPHS)
    return torch.compile(quantize_gemm_operand, dynamic=True, fullgraph=True)


def transpose_operand(op: FP8Operand) -> FP8Operand:
    """The same tensor as [contraction, rows]: valid for scales that do not depend on the
    direction (per tensor; 128x128 tiles, whose grid transposes), a contiguous FP8 copy."""
    if op.granularity == "tensor":
        return FP8Operand(op.codes.t().contiguous(), op.scale_inv, op.granularity)
    if op.granularity == "block":
        return FP8Operand(op.codes.t().contiguous(), op.scale_inv.t().contiguous(), "block")
    raise ValueError(
        f"a {op.granularity!r}-scaled operand cannot be transposed (its scales run along the "
        "contraction dim); quantize the transposed tensor instead"
    )


def fp8_mm(
    a: FP8Operand, b: FP8Operand, *, fast_accum: bool = False, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """``a @ b^T`` over the shared (last) contraction dim on FP8 tensor cores -> [Ra, Rb]."""
    if a.codes.shape[1] != b.codes.shape[1]:
        raise ValueError(
            f"contraction dims differ: a is {tuple(a.codes.shape)}, b is {tuple(b.codes.shape)}"
        )
    if a.granularity in ("tensor", "row"):
        # Row scales of b are [N, 1]; _scaled_mm wants them as [1, N] (a contiguous view).
        sb = b.scale_inv if b.granularity == "tensor" else b.scale_inv.t()
        return torch._scaled_mm(
            a.codes,
            b.codes.t(),
            scale_a=a.scale_inv,
            scale_b=sb,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    if a.codes.dtype != torch.float8_e4m3fn or b.codes.dtype != torch.float8_e4m3fn:
        # ATen's check_deepseek_recipe (ScaledBlas.cpp) matches e4m3 x e4m3 only; anything else
        # falls through to an opaque "invalid scaling configuration" on the GPU.
        raise ValueError(
            f"a block-scaled FP8 GEMM takes e4m3 operands only, got {a.codes.dtype} and "
            f"{b.codes.dtype} (FP8Config.format='hybrid' cannot run blockwise on this backend)"
        )
    scaling = F.ScalingType
    # 1x128 scales: [rows, C/128] with column-major strides; 128x128: [C/128, N/128] as the
    # transposed view of the contiguous [N/128, C/128] grid (the layouts measured on the H200),
    # its C/128 padded to a multiple of 4 as torch's own blockwise samples do (a no-op at the
    # measured shapes; the padded scales meet no data).
    sa = a.scale_inv.t().contiguous().t()
    if b.granularity == "block":
        kb = b.scale_inv.shape[1]
        grid = F.pad(b.scale_inv, (0, (-kb) % 4)) if kb % 4 else b.scale_inv
        sb, recipe_b = grid.t(), scaling.BlockWise128x128
    else:
        sb, recipe_b = b.scale_inv.t().contiguous().t(), scaling.BlockWise1x128
    return F.scaled_mm(
        a.codes,
        b.codes.t(),
        sa,
        scaling.BlockWise1x128,
        sb,
        recipe_b,
        output_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _gather_rows(t: torch.Tensor, group, rows: int | None = None, fill: float = 0) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0 in rank order (the sequence-parallel all-gather),
    rows of ``fill`` appended up to ``rows``; FP8 codes travel as bytes (a zero byte is FP8 +0)."""
    import torch.distributed as dist  # lazy: docs/architecture.md keeps fp8/ module tops free of it

    src = t.contiguous()
    wire = src.view(torch.uint8) if src.element_size() == 1 else src
    n = dist.get_world_size(group) * wire.shape[0]
    out = torch.full((rows or n, *wire.shape[1:]), fill, dtype=wire.dtype, device=wire.device)
    dist.all_gather_into_tensor(out[:n], wire, group=group)
    return out.view(src.dtype)


def _gathered_input(
    linear: FP8LinearTorch, x2: torch.Tensor, group
) -> tuple[FP8Operand, torch.Tensor]:
    """The fprop operand of a sequence-split input, gathered as FP8: this rank's rows ``x2`` are
    quantized with the scales the whole sequence gives them (per tensor: the amax all-reduced over
    ``group`` first; per row or 1x128 group: their own) and every rank's codes and scales are
    all-gathered: 1 byte per element on the wire instead of the input's 2 or 4, and the operand
    the whole-sequence linear makes, bit for bit. Returns it and this rank's codes."""
    import torch.distributed as dist  # lazy: docs/architecture.md keeps fp8/ module tops free of it

    recipe, spec = linear.config.recipe, linear.config.spec
    sx = None
    if spec.per_tensor:
        amax = x2.detach().abs().amax().float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        if spec.delayed:
            sx = linear.input_state.scale_inv_then_update(x2, "e4m3", amax=amax)
        else:
            sx = compute_scale_inv(amax, "e4m3")
    local = linear.quantize(x2, recipe, "input", "e4m3", scale_inv=sx)
    m = x2.shape[0]
    rows = -(-dist.get_world_size(group) * m // ALIGN) * ALIGN  # padded as the whole would be
    codes = _gather_rows(local.codes[:m], group, rows=rows)
    scale_inv = local.scale_inv
    if local.granularity != "tensor":  # one scale per row or per 1x128 group of a row
        scale_inv = _gather_rows(scale_inv[:m], group, rows=rows, fill=1.0)  # 1: zero rows' scale
    return FP8Operand(codes, scale_inv, local.granularity), local.codes[:m]


def _reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of dim 0 of the sum of every rank's ``t`` (the sequence-parallel
    reduce-scatter of the input gradient)."""
    import torch.distributed as dist  # lazy: docs/architecture.md keeps fp8/ module tops free of it

    out = t.new_empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]))
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


class _ScaledMMLinearFn(torch.autograd.Function):
    """y = x @ W^T + b with all three GEMMs on FP8 codes (see the module docstring). With
    ``sp_group``, x is this rank's part of a sequence split along dim 0: it is quantized and
    all-gathered as FP8, only this rank's part is kept for the backward (as FP8 codes under
    tensorwise scaling, gathered again there), and the input gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear: FP8LinearTorch, sp_group=None):  # noqa: D102
        cfg = linear.config
        recipe, delayed = cfg.recipe, cfg.spec.delayed
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        world = 1 if sp_group is None else torch.distributed.get_world_size(sp_group)
        x_shape = (x.shape[0] * world, *x.shape[1:])  # the whole sequence's
        t, n = x2.shape[0] * world, weight.shape[0]
        sw = None
        if delayed:
            sw = linear.weight_state.scale_inv_then_update(weight, "e4m3")
        if sp_group is not None:
            qx, x8 = _gathered_input(linear, x2, sp_group)
        else:
            sx = None
            if delayed:
                sx = linear.input_state.scale_inv_then_update(x2, "e4m3")
            qx = linear.quantize(x2, recipe, "input", "e4m3", scale_inv=sx)
            x8 = qx.codes
        qw = linear.weight_operand(weight, "fprop", scale_inv=sw)
        y = fp8_mm(qx, qw, fast_accum=cfg.fprop_fast_accum)[:t, :n].to(x.dtype)
        if bias is not None:
            y = y + bias.detach().to(x.dtype)
        ctx.linear = linear
        ctx.shapes = (x_shape, t, n, k)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.per_tensor = cfg.spec.per_tensor
        ctx.sp_group = sp_group
        ctx.padded_rows = qx.codes.shape[0]
        if ctx.per_tensor:
            # One scale per tensor holds along every dim: the backward GEMMs reuse the forward
            # codes (and, under delayed scaling, the forward scales), as TE does; under SP only
            # this rank's rows.
            ctx.save_for_backward(x8, qx.scale_inv, qw.codes, qw.scale_inv, weight)
        else:
            ctx.save_for_backward(x2.detach(), weight)
        return y.reshape(*x_shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        linear: FP8LinearTorch = ctx.linear
        cfg = linear.config
        recipe, gfmt = cfg.recipe, cfg.grad_format
        x_shape, t, n, k = ctx.shapes
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = grad_out.reshape(-1, n)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        group = ctx.sp_group
        if ctx.per_tensor:
            x8, sx, w8, sw, weight = ctx.saved_tensors
            if group is not None and need_dw:
                x8 = _gather_rows(x8, group, rows=ctx.padded_rows)
            sg = None
            if cfg.spec.delayed:
                sg = linear.grad_state.scale_inv_then_update(g2.float(), gfmt)
            qg = linear.quantize(g2, recipe, "grad_output", gfmt, scale_inv=sg)
            if need_dx:
                wt = linear.weights.fetch(
                    weight, "dgrad", lambda: transpose_operand(FP8Operand(w8, sw, "tensor"))
                )
                dx = fp8_mm(qg, wt)[:t, :k]
            if need_dw:
                xt = transpose_operand(FP8Operand(x8, sx, "tensor"))
                dw = fp8_mm(transpose_operand(qg), xt)[:n, :k]
        else:
            x2, weight = ctx.saved_tensors
            if group is not None and need_dw:
                x2 = _gather_rows(x2, group)
            if need_dx:  # contraction over N: dy along its rows, W^T [K, N]
                qg = linear.quantize(g2, recipe, "grad_output", gfmt)
                dx = fp8_mm(qg, linear.weight_operand(weight, "dgrad"))[:t, :k]
            if need_dw:  # contraction over tokens: dy^T [N, T], x^T [K, T]
                qgt = linear.quantize(g2.t(), recipe, "grad_output", gfmt)
                qxt = linear.quantize(x2.t(), recipe, "input", "e4m3")
                dw = fp8_mm(qgt, qxt)[:n, :k]
        if need_db:
            db = g2.float().sum(dim=0).to(b_dtype)
        if dx is not None:
            dx = dx.to(x_dtype).reshape(x_shape)
            if group is not None:
                dx = _reduce_scatter_rows(dx, group)
        if dw is not None:
            dw = dw.to(w_dtype)
        return dx, dw, db, None, None


class FP8LinearTorch(FP8Linear):
    """Per-layer real-FP8 GEMMs: ``linear(x, weight, bias) -> y``, the torch backend's sibling
    of :class:`~megatron_rl_fp8.fp8.emulation.FP8LinearEmulator` (same call, same config).

    Holds the layer's delayed-scaling amax histories and, inside :meth:`weight_cache`, its
    quantized weight. ``enabled=False`` (or recipe 'bf16') gives a plain ``F.linear``.
    """

    _function = _ScaledMMLinearFn
    gathers_sequence = True

    def __init__(self, config: FP8Config, *, enabled: bool = True):
        if config.enabled:
            for role in ("input", "weight"):
                _granularity(config.recipe, role)  # a recipe this backend lacks fails here
        super().__init__(config, enabled=enabled)
        # quantize_gemm_operand's signature, eager or compiled (fp8.compile_casts)
        self.quantize = compiled_quantize() if config.compile_casts else quantize_gemm_operand
        self.weights = WeightCache(enabled=config.spec.torch_keeps_weight)

    def weight_cache(self):
        """Reuse the quantized weight across calls inside the block (:class:`WeightCache`)."""
        return self.weights.scope()

    def weight_operand(
        self, weight: torch.Tensor, layout: str, *, scale_inv: torch.Tensor | None = None
    ) -> FP8Operand:
        """``weight`` quantized for the fprop GEMM ([N, K]) or the dgrad GEMM ([K, N])."""
        w = weight if layout == "fprop" else weight.t()
        return self.weights.fetch(
            weight,
            layout,
            lambda: self.quantize(w, self.config.recipe, "weight", "e4m3", scale_inv=scale_inv),
        )

    def __repr__(self) -> str:
        return (
            f"FP8LinearTorch(recipe={self.config.recipe!r}, format={self.config.format!r}, "
            f"enabled={self.enabled})"
        )
