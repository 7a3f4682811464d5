"""The ``torchao`` FP8 backend: Megatron's local linears through torchao's float8 training matmul.

torchao (``pip install torchao``, the ``[gpu]`` extra) is where the seed paper's FP8 training speed
came from: ``torchao.float8``'s ``matmul_with_hp_or_float8_args`` is the autograd function inside
its ``Float8Linear``. It takes the high-precision input and the transposed weight, casts each GEMM
operand to float8 as its ``Float8LinearConfig`` says and runs the three GEMMs (fprop, dgrad,
wgrad) through ``torch._scaled_mm``. This backend calls it from each Megatron linear in place of
the emulation (same slot, same call as :class:`~megatron_rl_fp8.fp8.torch_backend.FP8LinearTorch`)::

    recipe              torchao recipe   scales                                  grad_output
    tensorwise_current  "tensorwise"     one per tensor, amax / fp8 max           e5m2 (hybrid) or e4m3
    rowwise             "rowwise"        per row along the contraction dim,      e4m3
                                         rounded up to powers of two (torchao's)

Not run here: delayed scaling (torchao dropped it), blockwise and MXFP8 (not in its float8
training configs); those are the ``torch`` backend's or TE's. Weight cache: under tensorwise
scaling the fprop and dgrad GEMMs read the same weight codes (one scale, transposed), so inside
the actor's :meth:`FP8LinearTorchAO.weight_cache` the weight is cast once per forward / backward
schedule and handed to torchao already in float8 (its matmul takes float8 arguments as cast; the
gradient reaches the weight through :class:`_AsCast`), bit for bit the per-call result. Rowwise
casts the weight along a different axis for each GEMM, so it is cast per call, as torchao does.
Differences from the ``torch`` backend, by design of torchao: the backward keeps the bf16 input
and casts it again (no saved FP8 codes), rowwise scales are powers of two (the emulation's are
not: its codes differ, its error is of the same order). The inner dim of each GEMM is
zero-padded to 16 by torchao (``pad_inner_dim``), so any token count runs. The forward GEMM
uses fast accumulation when ``fp8.accum_fast_fprop``, the two backward GEMMs never (torchao's
defaults).

``torch.compile`` fuses torchao's casts (its measured 1.44x on the H200 was compiled):
``fp8.compile_casts`` compiles the whole call, casts and GEMMs together.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8Linear
from megatron_rl_fp8.fp8.recipes import RECIPES
from megatron_rl_fp8.fp8.weight_cache import WeightCache
from megatron_rl_fp8.utils.imports import module_exists

INSTALL_HINT = "pip install torchao (or the project's [gpu] extra)"

TORCHAO_RECIPES = {name: s.torchao_name for name, s in RECIPES.items() if s.torchao_name}
"""This project's recipe -> torchao's float8 recipe name (``fp8/recipes.py``)."""


def have_torchao() -> bool:
    """Whether torchao is importable (without importing it)."""
    return module_exists("torchao")


def _import():
    try:  # lazy: optional dependency (torchao, the `gpu` extra)
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise ImportError(f"fp8.backend=torchao needs torchao: {INSTALL_HINT} ({e})") from e
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


def _cast_weight_t(weight: torch.Tensor, mm, ao):
    """``weight.t()`` as torchao's forward casts it (``cast_config_weight``), without autograd."""
    # lazy: optional dependency (torchao; _import() above checked it is there)
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import GemmInputRole

    cast = ao.cast_config_weight
    with torch.no_grad():
        return hp_tensor_to_float8_dynamic(
            weight.t(),
            cast.target_dtype,
            mm,
            gemm_input_role=GemmInputRole.WEIGHT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
            round_scales_to_power_of_2=ao.round_scales_to_power_of_2,
        )


class _AsCast(torch.autograd.Function):
    """``weight.t()`` already cast (a cached torchao ``Float8TrainingTensor``) in this graph: a
    new float8 tensor on the cached codes, whose gradient goes to ``weight`` (transposed back),
    as torchao's own differentiable cast passes it through."""

    @staticmethod
    def forward(ctx, weight, cast_t):  # noqa: D102
        return type(cast_t)(
            cast_t._data,
            cast_t._scale,
            cast_t._orig_dtype,
            cast_t._linear_mm_config,
            cast_t._gemm_input_role,
            cast_t._axiswise_dim,
        )

    @staticmethod
    def backward(ctx, grad_t):  # noqa: D102
        return grad_t.t(), None


def torchao_config(config: FP8Config):
    """(torchao ``Float8LinearConfig``, ``LinearMMConfig``) for ``config``'s recipe and format:
    the same two objects for every linear of a run (a compiled call guards on them: one graph
    for all the layers, not one per linear)."""
    if config.recipe not in TORCHAO_RECIPES:
        raise ValueError(
            f"FP8Config.recipe={config.recipe!r} has no torchao float8 recipe; use "
            f"{' or '.join(map(repr, TORCHAO_RECIPES))}, or backend 'torch' / 'emulate'"
        )
    return _configs(config.recipe, config.format, config.fprop_fast_accum)


@functools.cache
def _configs(recipe: str, fmt: str, fast_fprop: bool):
    global _MATMUL
    Float8LinearConfig, _MATMUL, LinearMMConfig, ScaledMMConfig = _import()
    ao = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    grad_dtype = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    ao = dataclasses.replace(
        ao,
        cast_config_grad_output=dataclasses.replace(
            ao.cast_config_grad_output, target_dtype=grad_dtype
        ),
        cast_config_grad_output_for_grad_weight=dataclasses.replace(
            ao.cast_config_grad_output_for_grad_weight, target_dtype=grad_dtype
        ),
        pad_inner_dim=True,
    )
    gemm = lambda fast: ScaledMMConfig(False, fast, False, True)  # noqa: E731
    mm = LinearMMConfig(gemm(fast_fprop), gemm(False), gemm(False))
    return ao, mm


_MATMUL = None  # torchao's matmul_with_hp_or_float8_args, set when the first config is built


def _matmul(x2: torch.Tensor, weight_t: torch.Tensor, mm, ao) -> torch.Tensor:
    return _MATMUL.apply(x2, weight_t, mm, ao)


@functools.cache
def _compiled_matmul():
    return torch.compile(_matmul, dynamic=True)


class _TorchAOCall:
    """The ``_function`` of :class:`FP8LinearTorchAO`: torchao's autograd function does the work,
    this only flattens the tokens and adds the bias."""

    @staticmethod
    def apply(x, weight, bias, linear: FP8LinearTorchAO):  # noqa: D102
        k = x.shape[-1]
        matmul = _compiled_matmul() if linear.config.compile_casts else _matmul
        if linear.weights.active:  # inside weight_cache(), tensorwise
            cast_t = linear.weights.fetch(
                weight, "fprop", lambda: _cast_weight_t(weight, linear.mm_config, linear.ao_config)
            )
            weight_t = _AsCast.apply(weight, cast_t)
        else:
            weight_t = weight.t()
        y = matmul(x.reshape(-1, k), weight_t, linear.mm_config, linear.ao_config)
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.to(y.dtype)


class FP8LinearTorchAO(FP8Linear):
    """Per-layer torchao float8 GEMMs: ``linear(x, weight, bias) -> y``, the sibling of the
    emulator and the torch backend (same call, same config; ``enabled=False`` is ``F.linear``)."""

    _function = _TorchAOCall

    def __init__(self, config: FP8Config, *, enabled: bool = True):
        super().__init__(config, enabled=enabled)
        self.ao_config = self.mm_config = None
        if config.enabled:
            self.ao_config, self.mm_config = torchao_config(config)
        # Tensorwise: one weight cast serves fprop and dgrad (module docstring).
        self.weights = WeightCache(enabled=config.spec.torchao_keeps_weight)

    def weight_cache(self):
        """Cast the weight once inside the block (:class:`WeightCache`; tensorwise only)."""
        return self.weights.scope()

    def __repr__(self) -> str:
        return (
            f"FP8LinearTorchAO(recipe={self.config.recipe!r}, format={self.config.format!r}, "
            f"enabled={self.enabled})"
        )
