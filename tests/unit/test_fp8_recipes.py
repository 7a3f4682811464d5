"""fp8/recipes.py, the one description per recipe: its names agree with the libraries that take
them (Megatron-Core's ``fp8_recipe``, torchao's recipe names), and its entries are consistent with
one another and with what reads them (the config, the backends, the planner)."""

import dataclasses

import pytest

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.recipes import (
    BACKEND_RECIPES,
    BACKENDS,
    RECIPE_NAMES,
    RECIPES,
    backends_for,
    fp8_training,
    planned_recipe,
    recipe_help,
    recipe_spec,
)
from megatron_rl_fp8.plan.time import EFFICIENCY


def test_megatron_names_are_megatron_cores():
    from megatron.core.enums import Fp8Recipe

    have = {r.value for r in Fp8Recipe}
    names = {s.megatron_name for s in RECIPES.values() if s.megatron_name}
    assert names and names <= have, names - have


def test_torchao_names_are_torchaos():
    config = pytest.importorskip("torchao.float8.config")
    have = {n.value for n in config.Float8LinearRecipeName}
    names = {s.torchao_name for s in RECIPES.values() if s.torchao_name}
    assert names and names <= have, names - have


def test_entries_agree_with_each_other():
    for name, s in RECIPES.items():
        assert s.name == name
        assert set(s.backends) <= set(BACKENDS), name
        # Transformer Engine runs exactly the recipes it has a class and a Megatron name for.
        assert ("te" in s.backends) == (s.te_recipe is not None) == (s.megatron_name is not None)
        assert ("torchao" in s.backends) == (s.torchao_name is not None), name
        assert not s.torchao_keeps_weight or s.per_tensor, name  # one scale serves both GEMMs
        if not s.enabled:
            assert not s.backends and s.plan_speedup is None
            continue
        assert "emulate" in s.backends, f"{name}: the emulation runs every recipe"
        # Whatever a GPU backend runs, the planner can price.
        if set(s.backends) - {"emulate"}:
            assert s.plan_speedup and s.plan_speedup_source, name
        assert name in recipe_help()


def test_what_is_derived_from_the_entries():
    assert RECIPE_NAMES == tuple(RECIPES) and RECIPE_NAMES[0] == "bf16"
    for backend, recipes in BACKEND_RECIPES.items():
        assert all(backend in backends_for(r) for r in recipes)
    assert dict(EFFICIENCY.fp8_linear_speedup) == {
        n: s.plan_speedup for n, s in RECIPES.items() if s.plan_speedup
    }
    assert planned_recipe("bf16") == "blockwise" and planned_recipe("rowwise") == "rowwise"
    # A run read back from disk: no recipe, BF16, FP8, a recipe a later version added.
    assert [fp8_training(r) for r in (None, "bf16", "mxfp8", "fp6_future")] == [
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="fp8.recipe='fp6'.*choose one of 'bf16'"):
        recipe_spec("fp6")


def test_config_reads_the_entry():
    """The config's checks come from the entry's fields, for any recipe that has them."""
    assert FP8Config(recipe="blockwise").fprop_fast_accum is False  # split accumulation
    assert FP8Config(recipe="tensorwise_current").fprop_fast_accum is True
    for name, s in RECIPES.items():
        if s.enabled and not s.bf16_edge_layers:
            with pytest.raises(ValueError, match=f"recipe='{name}'"):
                FP8Config(recipe=name, bf16_first_layers=1)
        if s.enabled and not s.hybrid:
            with pytest.raises(ValueError, match="format='hybrid'"):
                FP8Config(recipe=name, format="hybrid", backend="emulate")
        if s.enabled and not s.hopper_accumulation:
            with pytest.raises(ValueError, match="accumulation='hopper'"):
                FP8Config(recipe=name, accumulation="hopper", backend="emulate")
        for backend in set(BACKENDS) - set(s.backends):
            if s.enabled:
                with pytest.raises(ValueError, match=f"cannot run recipe='{name}'"):
                    FP8Config(recipe=name, backend=backend)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["blockwise"].plan_speedup = 2.0  # type: ignore[misc]
