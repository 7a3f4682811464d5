"""FP8Config / RolloutFP8Config validation and the Transformer Engine / Megatron mapping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl_fp8.fp8.backend import should_emulate
from megatron_rl_fp8.fp8.config import FP8Config, RolloutFP8Config
from megatron_rl_fp8.fp8.te import have_te, held_region, megatron_fp8_kwargs, te_recipe


def test_defaults_and_help_metadata():
    cfg = FP8Config()
    assert not cfg.enabled and cfg.amax_history_len == 16 and cfg.keep_lm_head_bf16
    assert FP8Config(recipe="mxfp8").enabled
    assert FP8Config(format="hybrid").grad_format == "e5m2"
    assert FP8Config().grad_format == "e4m3"
    for cls in (FP8Config, RolloutFP8Config):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} lacks help"
    with pytest.raises(TypeError):
        FP8Config("blockwise")  # keyword-only


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"recipe": "fp8"}, "recipe"),
        ({"format": "e5m2"}, "format"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"margin": -1}, "margin"),
        ({"bf16_first_layers": -2}, "bf16_first_layers"),
        ({"bf16_last_layers": 1.5}, "bf16_last_layers"),
        ({"recipe": "tensorwise_delayed", "bf16_first_layers": 1}, "bf16_first_layers"),
    ],
)
def test_fp8config_validation_names_field_and_value(kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        FP8Config(**kwargs)
    bad = next(v for k, v in kwargs.items() if k == field or k == "bf16_first_layers")
    assert repr(bad) in str(e.value) or str(bad) in str(e.value)


def test_layer_uses_fp8():
    cfg = FP8Config(recipe="blockwise", bf16_first_layers=1, bf16_last_layers=2)
    uses = [cfg.layer_uses_fp8(i, 6) for i in range(1, 7)]
    assert uses == [False, True, True, True, False, False]
    assert not FP8Config().layer_uses_fp8(3, 6)
    with pytest.raises(ValueError, match="1-based"):
        cfg.layer_uses_fp8(0, 6)


def test_rollout_config():
    r = RolloutFP8Config(weight_quant="blockwise", weight_block=[128, 64])
    assert r.weight_block == (128, 64) and r.enabled and not r.pow2_scale and r.act_group == 128
    assert not RolloutFP8Config().enabled
    with pytest.raises(ValueError, match="weight_block"):
        RolloutFP8Config(weight_block=(128, 0))
    with pytest.raises(ValueError, match="act_group"):
        RolloutFP8Config(act_group=0)
    with pytest.raises(ValueError, match="weight_quant"):
        RolloutFP8Config(weight_quant="int8")


@pytest.mark.parametrize(
    "recipe, name",
    [
        ("tensorwise_delayed", "delayed"),
        ("tensorwise_current", "tensorwise"),
        ("blockwise", "blockwise"),
        ("mxfp8", "mxfp8"),
    ],
)
def test_megatron_kwargs(recipe, name):
    cfg = FP8Config(recipe=recipe, format="hybrid", amax_history_len=32, margin=1)
    fields = {"first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}
    kw = megatron_fp8_kwargs(cfg, available_fields=fields)
    assert kw == {
        "fp8": "hybrid",
        "fp8_recipe": name,
        "fp8_margin": 1,
        "fp8_amax_history_len": 32,
        "fp8_amax_compute_algo": "max",
        "first_last_layers_bf16": False,
    }


def test_megatron_kwargs_bf16_layers_and_errors():
    cfg = FP8Config(recipe="blockwise", bf16_first_layers=1, bf16_last_layers=2)
    fields = {"first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}
    kw = megatron_fp8_kwargs(cfg, available_fields=fields)
    assert kw["first_last_layers_bf16"] is True
    assert kw["num_layers_at_start_in_bf16"] == 1 and kw["num_layers_at_end_in_bf16"] == 2
    with pytest.raises(ValueError, match="upgrade megatron-core"):
        megatron_fp8_kwargs(cfg, available_fields=set())
    assert megatron_fp8_kwargs(FP8Config()) == {"fp8": None}
    with pytest.raises(ValueError, match="emulation"):
        megatron_fp8_kwargs(FP8Config(recipe="rowwise"))
    with pytest.raises(ValueError, match="keep_lm_head_bf16"):
        megatron_fp8_kwargs(FP8Config(recipe="blockwise", keep_lm_head_bf16=False))


def test_megatron_kwargs_accepted_by_installed_transformer_config():
    tc = pytest.importorskip("megatron.core.transformer")
    cfg = FP8Config(recipe="blockwise", format="hybrid", bf16_first_layers=1, bf16_last_layers=1)
    config = tc.TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        **megatron_fp8_kwargs(cfg),
    )
    assert config.fp8 == "hybrid" and config.fp8_recipe == "blockwise"
    assert config.first_last_layers_bf16 and config.num_layers_at_end_in_bf16 == 1


@pytest.mark.skipif(have_te(), reason="Transformer Engine is installed")
def test_te_recipe_without_te_raises_clear_import_error():
    with pytest.raises(ImportError, match=r"pip install megatron-rl-fp8\[gpu\]"):
        te_recipe(FP8Config(recipe="blockwise"))
    assert should_emulate(FP8Config(recipe="blockwise"))
    assert not should_emulate(FP8Config())


def test_te_recipe_rejects_unmappable_recipes_before_importing():
    with pytest.raises(ValueError, match="FP8 is off"):
        te_recipe(FP8Config())
    with pytest.raises(ValueError, match="rowwise"):
        te_recipe(FP8Config(recipe="rowwise"))
    assert should_emulate(FP8Config(recipe="rowwise"))


@pytest.mark.skipif(not have_te(), reason="needs Transformer Engine")
def test_te_recipe_classes():
    from transformer_engine.common import recipe as r

    d = te_recipe(FP8Config(recipe="tensorwise_delayed", format="hybrid", amax_history_len=8))
    assert isinstance(d, r.DelayedScaling) and d.amax_history_len == 8
    assert d.fp8_format == r.Format.HYBRID
    assert isinstance(te_recipe(FP8Config(recipe="tensorwise_current")), r.Float8CurrentScaling)
    assert isinstance(te_recipe(FP8Config(recipe="blockwise")), r.Float8BlockScaling)
    assert isinstance(te_recipe(FP8Config(recipe="mxfp8")), r.MXFP8BlockScaling)


class _Region:
    """An FP8 autocast region as the step uses it: entered once, exited once. Records the grad
    mode at the exit, which TE's ``autocast_exit`` reads to decide whether the outermost region
    updates the delayed scales (docs/gpu_contracts.md, TE-7)."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        self.events.append("enter")

    def __exit__(self, exc_type, exc, tb):
        self.events.append(("exit", torch.is_grad_enabled(), exc_type))
        return False


def test_held_region_updates_once_with_grad_on_and_skips_the_update_after_an_error():
    region = _Region()
    with torch.no_grad():  # a step reached from a no-grad caller still moves its scales after
        with held_region(region):
            assert region.events == ["enter"]
        assert not torch.is_grad_enabled()
    assert region.events == ["enter", ("exit", True, None)]
    # After an error no update: its amax all-reduce would wait for ranks that did not fail.
    region = _Region()
    with pytest.raises(RuntimeError, match="boom"):
        with held_region(region):
            raise RuntimeError("boom")
    assert region.events == ["enter", ("exit", False, RuntimeError)]
    assert torch.is_grad_enabled()
