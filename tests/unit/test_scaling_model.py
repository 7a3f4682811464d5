"""The step-time model (megatron_rl_fp8/plan/time.py): FLOPs by hand and against bench_actor's
convention, the fit to the measured actor step, the directions nodes / batch / precision move the
phases, memory from the planner, presets, and the ``plan --time`` CLI."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import EXAMPLES_DIR, load_config, read_config_dict
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.plan import Layout, World, estimate
from megatron_rl_fp8.plan.hardware import GPUS, get_gpu
from megatron_rl_fp8.plan.model_bytes import stage_params
from megatron_rl_fp8.plan.presets import PRESETS, preset_overrides
from megatron_rl_fp8.plan.time import (
    EFFICIENCY,
    REFERENCE_GPU,
    linear_weights,
    optimizer_seconds,
    predict,
    train_flops_per_token,
    trainer_pass_seconds,
)

TOOLS = Path(__file__).resolve().parents[2] / "tools"
EXAMPLE = EXAMPLES_DIR / "qwen3_8b_grpo_math_fp8.yaml"

# hidden 64, 4 query heads / 2 KV groups of 16, SwiGLU 128, vocab 256, 2 layers (test_plan's SMALL)
TINY = ModelConfig(
    arch="qwen3",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def config(nodes: int = 1, prompts: int = 64, *extra: str):
    """Qwen3-8B GRPO (the FP8 example), TP 4, one TP 2 engine per 2 GPUs of the world."""
    return load_config(
        EXAMPLE,
        [
            "model.hf_checkpoint=null",
            f"train.prompts_per_step={prompts}",
            f"rollout.sglang.num_engines={4 * nodes}",
            *extra,
        ],
    )


def world(nodes: int = 1, gpu: str = "H200") -> World:
    return World(nodes=nodes, gpu_memory_gb=GPUS[gpu].memory_gb)


def test_flops_by_hand():
    # Per layer: QKV 64 x (64 + 2 x 32) + proj 64 x 64 + FC1 64 x 256 + FC2 128 x 64 = 36864;
    # two layers and the output layer 64 x 256.
    assert linear_weights(TINY) == 2 * 36864 + 64 * 256
    lin, attn = train_flops_per_token(TINY, 256)
    assert lin == 6 * 90112
    assert attn == 12 * 2 * 256 * 64  # layers x seq x heads x head_dim


def test_flops_are_bench_actors_convention():
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_actor import flops_per_token, model_config
    finally:
        sys.path.remove(str(TOOLS))
    for m, seq in ((TINY, 256), (model_config(False, 2048), 2048)):
        lin, attn = train_flops_per_token(m, seq)
        assert lin + attn == pytest.approx(flops_per_token(m, seq)[0], rel=1e-12)


def test_the_fitted_reference_step_is_reproduced():
    """The non-GEMM cost is fitted to bench_actor's measured 2.03B step on an H200; the model must
    give that step back (forward + backward = 3 forwards, plus Adam)."""
    sys.path.insert(0, str(TOOLS))
    try:
        from bench_actor import model_config
    finally:
        sys.path.remove(str(TOOLS))
    m = model_config(False, 2048)
    lay = Layout()
    step = trainer_pass_seconds(
        m,
        REFERENCE_GPU,
        lay,
        tokens=8 * 2048,
        seq=2048,
        forwards=3,
        fp8_speedup=1.0,
        bubble=1.0,
        eff=EFFICIENCY,
    ) + optimizer_seconds(stage_params(m, 1, 1, 0), REFERENCE_GPU, EFFICIENCY)
    assert step == pytest.approx(EFFICIENCY.actor_step_s, rel=1e-9)


@pytest.mark.parametrize("precision", ["bf16", "fp8-rollout", "fp8"])
def test_more_nodes_never_slow_the_compute_phases(precision):
    preds = [predict(config(n), world(n), GPUS["H200"], precision) for n in (1, 2, 4, 8)]
    for phase in ("rollout", "old_logprobs", "shadow", "update"):
        times = [p.phases[phase] for p in preds]
        assert all(b <= a for a, b in zip(times, times[1:])), (phase, times)
    steps = [p.step_s for p in preds]
    assert steps[-1] < steps[0]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_bigger_batch_takes_longer(precision):
    preds = [predict(config(1, p), world(), GPUS["H100"], precision) for p in (16, 64, 256)]
    for phase in ("rollout", "reward", "old_logprobs", "update"):
        times = [p.phases[phase] for p in preds]
        assert times[0] < times[1] < times[2], (phase, times)


def test_fp8_training_is_faster_at_large_token_counts():
    cfg, w, gpu = config(1, 256), world(), GPUS["H200"]
    bf16 = predict(cfg, w, gpu, "bf16")
    for recipe in ("tensorwise_current", "blockwise"):
        fp8 = predict(cfg, w, gpu, "fp8", recipe=recipe)
        assert fp8.phases["update"] < bf16.phases["update"]
        assert fp8.phases["old_logprobs"] < bf16.phases["old_logprobs"]
    # Tensorwise pays for its calibration shadow; the training phase as a whole is faster.
    fp8 = predict(cfg, w, gpu, "fp8", recipe="tensorwise_current")
    train = ("old_logprobs", "shadow", "update")
    assert sum(fp8.phases[p] for p in train) < sum(bf16.phases[p] for p in train)
    # FP8 rollout: fewer weight bytes per decode step; the sync pays the quantization.
    rollout = predict(cfg, w, gpu, "fp8-rollout")
    assert rollout.phases["rollout"] < bf16.phases["rollout"]
    assert rollout.detail["sync/quantize"] > 0 == bf16.detail["sync/quantize"]
    assert rollout.phases["shadow"] == 0 < fp8.phases["shadow"]


def test_memory_is_the_planners_estimate():
    cfg, w = config(2), world(2, "H100")
    pred = predict(cfg, w, GPUS["H100"], "fp8")
    assert pred.memory == estimate(cfg, w)
    assert pred.memory.peak == estimate(cfg, w).peak


def test_dedicated_engines_add_gpus_and_sync_over_infiniband():
    w, gpu = world(), GPUS["H200"]
    colocated = predict(config(1), w, gpu, "bf16")
    dedicated = predict(config(1, 64, "rollout.placement=dedicated"), w, gpu, "bf16")
    assert (colocated.gpus, dedicated.gpus) == (8, 8 + 4 * 2)  # 4 engines of TP 2
    assert dedicated.detail["sync/transfer"] > colocated.detail["sync/transfer"]
    assert dedicated.phases["rollout"] == colocated.phases["rollout"]


def test_presets_match_the_examples_shapes():
    for name, example in (
        ("qwen3-8b", "qwen3_8b_grpo_math.yaml"),
        ("qwen3-32b", "qwen3_32b_dapo_math_fp8.yaml"),
    ):
        model = read_config_dict(EXAMPLES_DIR / example).get("model")
        assert {k: model[k] for k in PRESETS[name]} == PRESETS[name]
    cfg = load_config(EXAMPLE, ["model.hf_checkpoint=null", *preset_overrides("qwen2.5-32b")])
    assert cfg.model.qkv_bias and cfg.model.ffn_hidden_size == 27648


def test_unknown_gpu_and_preset_are_config_errors():
    with pytest.raises(ConfigError, match="--gpu='A100'"):
        get_gpu("A100")
    with pytest.raises(ConfigError, match="--model='llama-70b'"):
        preset_overrides("llama-70b")
    assert get_gpu("h200") is GPUS["H200"]


def test_cli_plan_time_prints_the_table(capsys):
    args = ["plan", str(EXAMPLE), "--time", "--gpu", "H200", "--fill", "0.5", "--top", "1"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "141 GB each" in out  # --gpu sets the memory
    assert "seconds per step (H200)" in out
    for word in ("bf16", "fp8-rollout", "fp8", "rollout (generation)", "BF16 shadow", "tokens/s"):
        assert word in out
    assert cli.main(["plan", str(EXAMPLE), "--model", "qwen3-14b", "--time", "--top", "0"]) == 0
    assert "40 layers, hidden 5120" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, field",
    [
        (["--gpu", "A100"], "--gpu"),
        (["--model", "llama-70b"], "--model"),
        (["--fill", "2"], "--fill"),
    ],
)
def test_cli_bad_gpu_or_preset_is_one_line(args, field, capsys):
    assert cli.main(["plan", str(EXAMPLE), "--time", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert field in line


@pytest.mark.parametrize(
    "preset, gpu, nodes, engines, tp, transport",
    [
        ("qwen3-8b", "H200", 1, 8, 1, "tensor"),  # one node: every GPU, CUDA IPC
        ("qwen3-8b", "H200", 2, 14, 1, "distributed"),  # GPU 0 of each node stays free
        ("qwen3-14b", "H200", 4, 12, 2, "distributed"),
        ("qwen3-32b", "H100", 1, 1, 8, "tensor"),
        ("qwen3-32b", "H100", 2, 2, 4, "distributed"),  # TP 8 would leave no engine off GPU 0
    ],
)
def test_scaling_tables_engines_are_what_the_launcher_accepts(
    preset, gpu, nodes, engines, tp, transport
):
    """docs/scaling.md's scenario: the most colocated engines the launcher's placement takes."""
    from megatron_rl_fp8.launch.layout import plan_layout
    from megatron_rl_fp8.launch.slurm import SlurmEnv

    sys.path.insert(0, str(TOOLS))
    try:
        from scaling_model import case_config
    finally:
        sys.path.remove(str(TOOLS))
    cfg = case_config(preset, gpu, nodes)
    sg = cfg.rollout.sglang
    assert (sg.num_engines, sg.tp_size, sg.transport) == (engines, tp, transport)
    env = SlurmEnv(nodes=tuple(f"n{i}" for i in range(nodes)), gpus_per_node=8, job_id=0)
    placed = plan_layout(cfg, env).engines
    assert len(placed) == engines and all(len(e.gpus) == tp for e in placed)
    if nodes > 1:
        assert all(0 not in e.gpus for e in placed)
    # One more engine is refused (on one node the GPUs run out; on several, GPU 0 is reached).
    more = dataclasses.replace(cfg.rollout.sglang, num_engines=engines + 1)
    cfg.rollout = dataclasses.replace(cfg.rollout, sglang=more)
    with pytest.raises(ConfigError):
        plan_layout(cfg, env)
