"""Mixture-of-experts settings (issue 47): the model's MoE fields and the expert-parallel layout
are checked in one line each."""

import pytest

from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.gpt import moe_config

TINY = EXAMPLES_DIR / "tiny_cpu.yaml"


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.expert_model_parallel_size=2"], 2, "needs a mixture-of-experts model"),
        (["model.num_experts=6", "parallel.expert_model_parallel_size=4"], 4, "divisible by"),
        (["model.num_experts=4", "parallel.expert_model_parallel_size=4"], 2, "must divide the"),
    ],
)
def test_bad_expert_layouts_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(TINY, overrides).validate(world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "fields, message",
    [({"num_experts": 1}, "num_experts=1"), ({"num_experts": 4, "moe_topk": 5}, "moe_topk=5"),
     ({"num_experts": 4, "moe_aux_loss_coeff": -1.0}, "moe_aux_loss_coeff"),
     ({"num_experts": 4, "moe_z_loss_coeff": -1.0}, "moe_z_loss_coeff")],
)  # fmt: skip
def test_bad_moe_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_moe_config_routes_as_qwen3_moe():
    m = ModelConfig(num_experts=8, moe_topk=2, ffn_hidden_size=96, moe_aux_loss_coeff=0.001)
    c = moe_config(m, use_te=False)
    assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (8, 2, 96)
    assert c["moe_router_load_balancing_type"] == "aux_loss" and not c["moe_grouped_gemm"]
    assert (
        moe_config(ModelConfig(num_experts=8), use_te=True)["moe_router_load_balancing_type"]
        == "none"
    )
    assert c["moe_z_loss_coeff"] is None  # Megatron's "off"
    assert moe_config(ModelConfig(num_experts=8, moe_z_loss_coeff=1e-3), use_te=False)[
        "moe_z_loss_coeff"
    ] == pytest.approx(1e-3)
