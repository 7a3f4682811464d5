"""Mapping FP8Config onto Transformer Engine recipes and Megatron-Core TransformerConfig kwargs.

Pure functions: nothing here runs a GEMM, and Transformer Engine / Megatron are imported only
inside the functions that need them, so the mapping is unit-testable on a CPU box.

Each recipe's TE recipe class and Megatron ``fp8_recipe`` name are its ``te_recipe`` and
``megatron_name`` in ``fp8/recipes.py`` (DelayedScaling "delayed", Float8CurrentScaling
"tensorwise", Float8BlockScaling "blockwise", MXFP8BlockScaling "mxfp8"; rowwise has none).

``format`` maps to TE's ``Format.E4M3`` / ``Format.HYBRID`` and Megatron's ``fp8="e4m3"`` /
``"hybrid"``. TE's Float8BlockScaling uses power-of-two scales by default (unless
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``); the emulation uses exact ``amax/448`` scales, which
differ from TE's by less than one bit of precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Iterator
from typing import Any

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.recipes import RECIPES, TE_FP8_COLS, TE_FP8_ROWS, TE_MXFP8_BLOCK

__all__ = [
    "INSTALL_HINT",
    "MEGATRON_RECIPE_NAMES",
    "TE_FP8_COLS",
    "TE_FP8_ROWS",
    "TE_MXFP8_BLOCK",
    "have_te",
    "held_region",
    "te_fp8_off",
    "te_step_scales",
    "te_fp8_align",
    "te_fp8_dims_problem",
    "fp8_weight_shapes",
    "megatron_fp8_kwargs",
    "te_recipe",
]

INSTALL_HINT = "pip install megatron-rl-fp8[gpu]"

MEGATRON_RECIPE_NAMES: dict[str, str] = {
    name: spec.megatron_name for name, spec in RECIPES.items() if spec.megatron_name
}
"""FP8Config.recipe -> Megatron-Core's ``TransformerConfig.fp8_recipe`` name."""

_BY_MEGATRON_NAME = {spec.megatron_name: spec for spec in RECIPES.values() if spec.megatron_name}


def te_fp8_align(recipe: str | None) -> tuple[int, int]:
    """(leading dims' product, last dim) multiples TE's FP8 GEMMs need under ``recipe`` (an
    ``FP8Config.recipe`` or Megatron ``fp8_recipe`` name; None: TE's default rule). A linear's
    input is [S, B, hidden] (under sequence parallelism this rank's S / TP), so the actor pads
    every micro-batch's sequence length for it (``trainer/schedule.py: seq_multiple``), and the
    model's widths per TP rank are checked at config validation (:func:`fp8_weight_shapes`)."""
    spec = RECIPES.get(recipe) or _BY_MEGATRON_NAME.get(recipe)
    return spec.te_align if spec is not None else (TE_FP8_ROWS, TE_FP8_COLS)


def te_fp8_dims_problem(shape, recipe: str | None = None) -> str | None:
    """Why TE would refuse an FP8 GEMM operand of ``shape`` under ``recipe`` (None: it would not)."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    need_rows, need_cols = te_fp8_align(recipe)
    if rows % need_rows or cols % need_cols:
        under = f" under {recipe}" if (need_rows, need_cols) != (TE_FP8_ROWS, TE_FP8_COLS) else ""
        return (
            f"shape {list(shape)} (leading dims' product {rows}, last dim {cols}): "
            f"Transformer Engine's FP8 GEMMs{under} need "
            f"the product of the leading dims a multiple of {need_rows} and the last dim a "
            f"multiple of {need_cols}"
        )
    return None


def fp8_weight_shapes(model, tp: int) -> dict[str, tuple[int, int]]:
    """Each FP8 linear's weight shape [out, in] on one of ``tp`` tensor-parallel ranks for the
    GPT ``model`` (a ``ModelConfig``): fused QKV and gate/up are column-parallel (their out dim
    split), the attention output and down projections row-parallel (their in dim split)."""
    d, h = model.hidden_size, model.kv_channels
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * h
    return {
        "linear_qkv": (qkv // tp, d),
        "linear_proj": (d, model.num_attention_heads * h // tp),
        "linear_fc1": (2 * model.ffn_hidden_size // tp, d),
        "linear_fc2": (d, model.ffn_hidden_size // tp),
    }


def have_te() -> bool:
    """Whether Transformer Engine is importable (checked without importing it: TE's import
    initialises CUDA and is slow)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _require_te_mappable(config: FP8Config, what: str) -> None:
    if not config.enabled:
        raise ValueError(
            f"FP8Config.recipe='bf16' has no {what}: FP8 is off. Check FP8Config.enabled first"
        )
    if config.spec.te_recipe is None:
        runs_on = " or ".join(
            repr(b) + (" (the emulation)" if b == "emulate" else "") for b in config.spec.backends
        )
        raise ValueError(
            f"FP8Config.recipe={config.recipe!r} has no {what} (Transformer Engine has no such "
            f"FP8 recipe); it runs on FP8Config.backend {runs_on}. With TE use 'blockwise' "
            "(finer, 1x128) or 'tensorwise_current'"
        )


def te_recipe(config: FP8Config) -> Any:
    """The Transformer Engine recipe object for ``config`` (for ``te.fp8_autocast``).

    Raises ValueError for 'bf16' / 'rowwise' and ImportError (with the install command) when
    Transformer Engine is not installed.
    """
    _require_te_mappable(config, "Transformer Engine recipe")
    try:
        from transformer_engine.common import recipe as te_recipes  # lazy: optional dependency
    except (ImportError, OSError) as e:  # OSError: TE installed but its CUDA libraries absent
        raise ImportError(
            f"FP8Config.recipe={config.recipe!r} on the Transformer Engine path needs "
            f"transformer_engine (GPU only): `{INSTALL_HINT}`. Without TE, set "
            f"FP8Config.backend to 'torch' (FP8 GPU) or 'emulate'. (Import error: {e})"
        ) from e
    fmt = te_recipes.Format.HYBRID if config.format == "hybrid" else te_recipes.Format.E4M3
    recipe_class = getattr(te_recipes, config.spec.te_recipe)
    if config.spec.delayed:
        return recipe_class(
            fp8_format=fmt,
            amax_history_len=config.amax_history_len,
            amax_compute_algo=config.amax_compute_algo,
            margin=config.margin,
        )
    return recipe_class(fp8_format=fmt)


def _transformer_config_fields() -> set[str]:
    # lazy: fp8/ imports no Megatron at module top (docs/architecture.md: its CPU tests and the
    # config checks load without Megatron-Core, ~6 s)
    from megatron.core.transformer import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


def megatron_fp8_kwargs(
    config: FP8Config, *, available_fields: set[str] | None = None
) -> dict[str, Any]:
    """Megatron-Core ``TransformerConfig`` kwargs for ``config`` (TE path).

    ``{"fp8": None}`` when FP8 is off. ``available_fields`` defaults to the installed
    TransformerConfig's fields; BF16 first/last layers need ``first_last_layers_bf16`` and
    ``num_layers_at_{start,end}_in_bf16`` (Megatron-Core >= 0.13) and raise ValueError without.
    """
    if not config.enabled:
        return {"fp8": None}
    _require_te_mappable(config, "Megatron-Core fp8_recipe")
    if not config.keep_lm_head_bf16:
        raise ValueError(
            "FP8Config.keep_lm_head_bf16=False cannot run on Transformer Engine: Megatron-Core's "
            "output layer is not a Transformer Engine module and always runs in BF16. Set it to "
            "True, or FP8Config.backend='torch' or 'emulate'"
        )
    fields = _transformer_config_fields() if available_fields is None else available_fields
    kwargs: dict[str, Any] = {
        "fp8": config.format,
        "fp8_recipe": MEGATRON_RECIPE_NAMES[config.recipe],
        "fp8_margin": config.margin,
        "fp8_amax_history_len": config.amax_history_len,
        "fp8_amax_compute_algo": config.amax_compute_algo,
    }
    bf16_layers = {
        "first_last_layers_bf16": bool(config.bf16_first_layers or config.bf16_last_layers),
        "num_layers_at_start_in_bf16": config.bf16_first_layers,
        "num_layers_at_end_in_bf16": config.bf16_last_layers,
    }
    if bf16_layers["first_last_layers_bf16"]:
        missing = sorted(k for k in bf16_layers if k not in fields)
        if missing:
            raise ValueError(
                "FP8Config.bf16_first_layers/bf16_last_layers="
                f"{config.bf16_first_layers}/{config.bf16_last_layers} need Megatron-Core's "
                f"{missing} (Megatron-Core >= 0.13); upgrade megatron-core or set both to 0"
            )
        kwargs.update(bf16_layers)
    elif "first_last_layers_bf16" in fields:
        kwargs["first_last_layers_bf16"] = False
    return kwargs


@contextlib.contextmanager
def held_region(region) -> Iterator[None]:
    """Run the block inside ``region``, an FP8 autocast that updates the delayed scales when it
    exits as the outermost region with grad enabled (TE's ``autocast_exit``): exited with grad on
    after the block, so the update runs once, here; after an error exited with grad off, so no
    rank waits in the update's amax all-reduce for a rank that failed."""
    import torch

    region.__enter__()
    try:
        yield
    except BaseException as err:
        with torch.no_grad():
            region.__exit__(type(err), err, err.__traceback__)
        raise
    with torch.enable_grad():
        region.__exit__(None, None, None)


def te_step_scales(megatron_config) -> contextlib.AbstractContextManager:
    """The forwards inside the block take the delayed scales it began with, on Transformer
    Engine (``fp8.scales_per_step``; docs/gpu_contracts.md, TE-7): Megatron's own FP8 autocast for
    the whole model (its recipe and amax-reduction group) opened around them, so the per-block
    regions Megatron opens inside are nested and leave the scales alone; TE's casts max-accumulate
    every forward's amaxes into the history's newest row, and the scales move once, when the
    block ends. No effect where ``megatron_config.fp8`` is unset (BF16)."""
    from megatron.core.fp8_utils import get_fp8_context

    return held_region(get_fp8_context(megatron_config))


def te_fp8_off() -> contextlib.AbstractContextManager:
    """A region where Transformer Engine's modules run unquantized, also inside an enabled one
    (the BF16 shadow and the reference policy inside a step whose scales are held): Megatron opens
    no region for a model without ``fp8``, so TE's enclosing state would otherwise apply."""
    import transformer_engine.pytorch as te

    region = getattr(te, "autocast", None)  # TE >= 2.20; fp8_autocast is its deprecated alias
    return region(enabled=False) if region is not None else te.fp8_autocast(enabled=False)
