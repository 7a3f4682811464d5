"""The planner on mixture-of-experts models (issue 47, item 6): parameters and active FLOPs of
Qwen3-30B-A3B against its published counts, expert parallelism's split of the experts and of
their optimizer state, the MoE layer's activations against what autograd saves on the CPU, the
EP all-to-all in the step time, and the Qwen3-30B-A3B example laid out as the plan's first
choice."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.plan import Layout, World, alternatives, estimate
from megatron_rl_fp8.plan.memory import GB
from megatron_rl_fp8.plan.model_bytes import (
    DEFAULT_LOGPROBS,
    layer_activation_bytes,
    layer_params,
    stage_expert_params,
    stage_params,
)
from megatron_rl_fp8.plan.time import active_linear_weights, linear_weights, train_flops_per_token
from tests.unit.test_plan import make_cfg, row

A3B = EXAMPLES_DIR / "qwen3_30b_a3b_dapo_math_fp8.yaml"
H200_X16 = World(gpus_per_node=8, nodes=2, gpu_memory_gb=141)


def _a3b():
    return load_config(A3B, ["model.hf_checkpoint=null"]).model


def test_qwen3_30b_a3b_has_its_published_total_and_active_parameters():
    """Qwen's model card: 30.5B parameters, 3.3B activated. The embedding counts in both, the
    output layer too; of the 128 experts a token multiplies 8."""
    m = _a3b()
    total = stage_params(m, tp=1, pp=1, stage=0)
    active = active_linear_weights(m) + m.hidden_size * m.padded_vocab_size()
    assert 30.4e9 < total < 30.6e9 and 3.30e9 < active < 3.40e9
    # Every expert is stored (and synced); a token's FLOPs count its top-8 only.
    experts = 48 * 128 * 3 * 768 * 2048
    assert linear_weights(m) - active_linear_weights(m) == 48 * 120 * 3 * 768 * 2048
    assert train_flops_per_token(m, 1024)[0] == 6 * active_linear_weights(m)
    assert stage_expert_params(m, 1, 1) == experts


def test_expert_parallelism_splits_the_experts_and_their_optimizer_state():
    """EP 4 holds a quarter of each layer's experts (TP 2 halves each expert as well); the router
    and norms stay whole. The distributed optimizer shards the experts' states over DP x CP / EP
    ranks, the rest over DP x CP."""
    moe = {"num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 32}
    m = make_cfg(moe).model
    experts = 8 * 3 * 32 * 64
    dense = 64 * (64 + 2 * 32) + 64 * 64  # QKV, projection
    router, norms = 64 * 8, 2 * 64 + 2 * 16
    assert layer_params(m, 1) == dense + experts + router + norms
    assert layer_params(m, 2, ep=4) == dense / 2 + experts / 8 + router + norms
    base = dict(parallel={"use_distributed_optimizer": True})
    ep1 = estimate(
        make_cfg(moe, **base),
        World(gpus_per_node=8),
        layout=Layout(dp=8, distributed_optimizer=True),
    )
    ep4 = estimate(
        make_cfg(moe, **base),
        World(gpus_per_node=8),
        layout=Layout(dp=8, ep=4, distributed_optimizer=True),
    )
    params1, params4 = row(ep1, "weights") / 2, row(ep4, "weights") / 2
    assert params1 - params4 == pytest.approx(2 * experts * 3 / 4)
    # Optimizer: 12 bytes per parameter over 8 ranks; the experts' over 8 / 4 = 2 ranks: the same
    # bytes for an expert whichever EP holds it.
    assert row(ep1, "optimizer") == pytest.approx(12 * params1 / 8)
    assert row(ep4, "optimizer") == pytest.approx(12 * (params4 + 2 * experts / 4 * 3) / 8)


@pytest.mark.parametrize("experts, topk, counted", [(4, 2, 27464), (8, 4, 38796)])
def test_moe_layer_activations_by_hand(experts, topk, counted):
    """Hidden 256, 8 query / 2 KV heads of 32, expert width 192, 64 tokens, fp32 local spec: the
    dense layer's terms with f = k x 192 (SwiGLU unfused: 5 a f, the expert's probability-scaled
    output one more), FC1's k permuted copies, the router's input and routing. What autograd
    saved for the real layer: 27796 and 39128 bytes per token
    (tests/distributed/test_plan_moe_measured.py), the 332 left being the small tensors the dense
    count leaves out too."""
    m = make_cfg(
        {"hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 8, "head_dim": 32,
         "num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": 192}
    ).model  # fmt: skip
    per_token = layer_activation_bytes(
        m, a=4, tp=1, sequence_parallel=False, seq=64, spec="local", fused_swiglu=False
    )
    h, f = 256, topk * 192
    dense_part = 31488 - 4 * 4 * 768 - 4 * 768 - 2 * 4 * h  # the dense layer without its MLP
    router = 4 * h + 24 * topk + 5 * experts + 4
    assert per_token == counted == dense_part + (1 + topk) * 4 * h + router + 6 * 4 * f


def test_the_a3b_example_fits_and_is_the_plans_first_choice():
    cfg = load_config(A3B, ["model.hf_checkpoint=null"]).validate(16, this_machine=False)
    e = estimate(cfg, H200_X16)
    assert e.fits and e.layout.ep == 8 and e.layout.dp == 16
    best = alternatives(cfg, H200_X16, spec="te", logits=DEFAULT_LOGPROBS)[0]
    assert (
        dataclasses.replace(best.layout, recompute_modules=e.layout.recompute_modules) == e.layout
    )
    # Without recomputation the top-8 experts' activations do not fit, nor does EP 1.
    assert not estimate(cfg, H200_X16, layout=dataclasses.replace(e.layout, recompute="none")).fits
    assert not estimate(cfg, H200_X16, layout=dataclasses.replace(e.layout, ep=1)).fits
    assert row(e, "weights") / GB == pytest.approx(10.33, abs=0.01)


def test_cli_plans_the_a3b_example_with_its_step_breakdown(capsys):
    rc = cli.main(["plan", str(A3B), "--nodes", "2", "--time", "--gpu", "H200"])
    out = capsys.readouterr().out
    assert rc == 0 and "FITS" in out and "(EP 8)" in out and "3.35B active" in out
    for phase in ("rollout (generation)", "old_logprobs", "update", "sync", "step"):
        assert phase in out


def test_the_ep_all_to_all_costs_update_time():
    from megatron_rl_fp8.plan.hardware import GPUS
    from megatron_rl_fp8.plan.time import predict

    cfg = load_config(A3B, ["model.hf_checkpoint=null"]).validate(16, this_machine=False)
    lay = Layout.from_config(cfg, H200_X16.size)
    within = predict(cfg, H200_X16, GPUS["H200"], "fp8", layout=lay)
    across = predict(cfg, H200_X16, GPUS["H200"], "fp8", layout=dataclasses.replace(lay, ep=16))
    assert across.phases["update"] > within.phases["update"]


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    bad = load_config(A3B, ["model.hf_checkpoint=null", "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="sequence_parallel"):
        bad.validate(16, this_machine=False)
