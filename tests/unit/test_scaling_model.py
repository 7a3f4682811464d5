"""The step-time model (megatron_rl_fp8/plan/time.py): FLOPs by hand and against bench_actor's
convention, the fit to the measured actor step, the directions nodes / batch / precision move the
phases, memory from the planner, presets, and the ``plan --time`` CLI."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import EXAMPLES_DIR, load_config, read_config_dict
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.plan import Layout, World, estimate
from megatron_rl_fp8.plan.hardware import GPUS, get_gpu
from megatron_rl_fp8.plan.measure import flops_per_token, preset_model
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
from tests.scripts import load_script

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


def test_flops_split_is_the_measured_convention():
    for m, seq in ((TINY, 256), (preset_model("2b", 2048), 2048)):
        lin, attn = train_flops_per_token(m, seq)
        assert lin + attn == pytest.approx(flops_per_token(m, seq)[0], rel=1e-12)


def test_the_fitted_reference_step_is_reproduced():
    """The non-GEMM cost is fitted to bench_actor's measured 2.03B step on an H200; the model must
    give that step back (forward + backward = 3 forwards, plus Adam)."""
    m = preset_model("2b", 2048)
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
    # Tensorwise pays for its calibration shadow; at the paper's interval of 20 the training phase
    # as a whole is faster (at the default 5 it is not: docs/scaling.md).
    paper = config(1, 256, "loss.calib.interval=20")
    fp8 = predict(paper, w, gpu, "fp8", recipe="tensorwise_current")
    train = ("old_logprobs", "shadow", "update")
    assert sum(fp8.phases[p] for p in train) < sum(bf16.phases[p] for p in train)
    # FP8 rollout: fewer weight bytes per decode step; the sync pays the quantization.
    rollout = predict(cfg, w, gpu, "fp8-rollout")
    assert rollout.phases["rollout"] < bf16.phases["rollout"]
    assert rollout.detail["sync/quantize"] > 0 == bf16.detail["sync/quantize"]
    assert rollout.phases["shadow"] == 0 < fp8.phases["shadow"]


def test_the_oracle_pays_a_bf16_forward_per_mini_batch_every_step():
    """calibrate: (BF16 pi_old + per later mini-batch a BF16 and an FP8 pass) / interval;
    oracle: BF16 pi_old + per later mini-batch a BF16 pass, every step (the example has 4
    mini-batches per step, so 3/4 of the batch is a later one)."""
    w, gpu = world(), GPUS["H200"]
    calibrated = predict(config(1, 256), w, gpu, "fp8")
    oracle = predict(config(1, 256, "loss.calib.mode=oracle"), w, gpu, "fp8")
    u = config(1, 256).train.updates_per_step
    later = (u - 1) / u
    # The old-logprob pass is one FP8 forward of the batch (no KL reference here).
    fp8_forward = oracle.phases["old_logprobs"]
    bf16_forward = oracle.phases["shadow"] / (1 + later)
    assert bf16_forward > fp8_forward
    per_calibration = bf16_forward + later * (bf16_forward + fp8_forward)
    interval = config(1, 256).loss.calib.interval
    assert calibrated.phases["shadow"] == pytest.approx(per_calibration / interval, rel=1e-12)
    assert oracle.phases["update"] == calibrated.phases["update"]


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


def test_a_delta_sync_trades_the_link_for_encode_and_apply():
    """``rollout.delta_sync`` prices the sync off the node as encode + the delta's share of the
    bytes on the link + apply (docs/delta_sync.md): slower over InfiniBand, faster on a link
    slow enough, and equal to the full sync where the two lines cross."""
    w, gpu, eff = world(), GPUS["H200"], EFFICIENCY
    run = ("rollout.placement=dedicated",)
    full = predict(config(1, 64, *run), w, gpu, "fp8-rollout")
    delta = predict(config(1, 64, *run, "rollout.delta_sync=true"), w, gpu, "fp8-rollout")
    sent = full.detail["sync/transfer"] * gpu.ib_bytes_s * eff.ib
    assert delta.detail["sync/transfer_full"] == full.detail["sync/transfer"]
    expected = (
        2 * sent / eff.delta_encode_bytes_s + eff.delta_fraction * full.detail["sync/transfer"]
    )
    assert math.isclose(delta.detail["sync/transfer"], expected, rel_tol=1e-9)
    assert delta.phases["sync"] > full.phases["sync"]  # over InfiniBand: never pays
    cross = (1 - eff.delta_fraction) * eff.delta_encode_bytes_s / 2  # bytes/s where they meet
    for link, faster in ((cross / 2, True), (cross * 2, False)):
        cfg = config(1, 64, *run, "rollout.delta_sync=true")
        d = predict(cfg, w, gpu, "fp8-rollout", engine_link=link).detail
        assert (d["sync/transfer"] < d["sync/transfer_full"]) == faster, link
    colocated = predict(config(1, 64, "rollout.delta_sync=true"), w, gpu, "fp8-rollout")
    assert "sync/transfer_full" not in colocated.detail  # on the senders' node: no delta


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
        (["--delta-fraction", "2"], "--delta-fraction"),
        (["--engine-link-gbps", "0"], "--engine-link-gbps"),
    ],
)
def test_cli_bad_gpu_or_preset_is_one_line(args, field, capsys):
    assert cli.main(["plan", str(EXAMPLE), "--time", *args]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert field in line
    assert out == ""  # refused before any table


def test_cli_engines_the_time_model_refuses_are_one_line_before_any_table(capsys):
    args = ["plan", str(EXAMPLE), "--time", "rollout.placement=dedicated"]
    assert cli.main([*args, "rollout.sglang.num_engines=0"]) == 2  # the example's 0: colocated
    out, err = capsys.readouterr()
    assert out == "" and "rollout.sglang.num_engines=0" in err


@pytest.mark.parametrize(
    "preset, gpu, nodes, engines, tp",
    [
        ("qwen3-8b", "H200", 1, 8, 1),  # every GPU of the node, CUDA IPC
        ("qwen3-8b", "H200", 2, 16, 1),  # every GPU of both: the per-node sync
        ("qwen3-14b", "H200", 4, 16, 2),
        ("qwen3-32b", "H100", 1, 1, 8),
        ("qwen3-32b", "H100", 2, 2, 8),  # no GPU 0 kept free, so TP 8 fits
    ],
)
def test_scaling_tables_engines_are_the_launchers_placement(preset, gpu, nodes, engines, tp):
    """docs/scaling.md's scenario: an engine on every TP group of every node, the count the
    placement function gives, and the launcher places them there (on several nodes synced per
    node: transport=tensor)."""
    from megatron_rl_fp8.launch.layout import plan_layout
    from megatron_rl_fp8.launch.slurm import SlurmEnv
    from megatron_rl_fp8.rollout.sglang import placement

    cfg = _scaling_model().case_config(preset, gpu, nodes)
    sg = cfg.rollout.sglang
    assert (sg.num_engines, sg.tp_size, sg.transport) == (engines, tp, "tensor")
    slots = placement.colocated_engines(nodes=nodes, gpus_per_node=8, engine_tp=tp)
    assert len(slots) == engines
    env = SlurmEnv(nodes=tuple(f"n{i}" for i in range(nodes)), gpus_per_node=8, job_id=0)
    placed = plan_layout(cfg, env).engines
    assert [(e.node_index, e.gpus) for e in placed] == [(s.node_index, s.gpus) for s in slots]
    # One more engine is refused: the node's GPUs run out.
    more = dataclasses.replace(cfg.rollout.sglang, num_engines=engines + 1)
    cfg.rollout = dataclasses.replace(cfg.rollout, sglang=more)
    with pytest.raises(ConfigError):
        plan_layout(cfg, env)


def _scaling_model():
    return load_script("scripts/scaling_model.py")


DEDICATED = ("rollout.placement=dedicated", "rollout.sglang.transport=distributed")


def test_pipelined_step_by_hand():
    """max(rollout + reward, old logprobs + shadow + update) + sync + checkpoint, and the waits."""
    real = predict(config(1, 64, *DEDICATED), world(), GPUS["H200"], "bf16")
    phases = dict(
        rollout=30.0, tools=1.5, reward=0.5, old_logprobs=5.0, shadow=1.0, update=20.0, sync=0.5,
        checkpoint=0.25,
    )  # fmt: skip
    sync = dataclasses.replace(real, phases=phases)
    assert sync.pipeline == "sync"
    assert sync.step_s == sync.sync_step_s == 58.75
    assert (sync.bottleneck, sync.trainer_wait_s, sync.engine_wait_s) == (None, 0.0, 0.0)

    rollout_bound = dataclasses.replace(sync, pipeline="one_step_off")
    assert (rollout_bound.rollout_side_s, rollout_bound.trainer_side_s) == (32.0, 26.0)
    assert rollout_bound.step_s == 32.0 + 0.5 + 0.25
    assert rollout_bound.sync_step_s == 58.75
    assert rollout_bound.bottleneck == "rollout"
    assert (rollout_bound.trainer_wait_s, rollout_bound.engine_wait_s) == (6.0, 0.0)

    trainer_bound = dataclasses.replace(rollout_bound, phases={**phases, "update": 40.0})
    assert trainer_bound.step_s == 46.0 + 0.75
    assert trainer_bound.bottleneck == "trainer"
    assert (trainer_bound.trainer_wait_s, trainer_bound.engine_wait_s) == (0.0, 14.0)


@pytest.mark.parametrize("precision", ["bf16", "fp8-rollout", "fp8"])
@pytest.mark.parametrize("engines, longer", [(4, "trainer"), (1, "rollout")])
def test_one_step_off_keeps_the_phases_and_overlaps_the_two_sides(precision, engines, longer):
    """Four TP 2 engines: the trainer side is the longer (the engines wait); one: the rollout."""
    w, gpu = world(), GPUS["H200"]
    run = ("model.hf_checkpoint=null", *DEDICATED, f"rollout.sglang.num_engines={engines}")
    sync = predict(load_config(EXAMPLE, list(run)), w, gpu, precision)
    piped = predict(load_config(EXAMPLE, [*run, "train.pipeline=one_step_off"]), w, gpu, precision)
    assert piped.pipeline == "one_step_off" and sync.pipeline == "sync"
    assert piped.phases == sync.phases  # each side's work does not change
    p = piped.phases
    rollout, trainer = p["rollout"] + p["reward"], p["old_logprobs"] + p["shadow"] + p["update"]
    assert piped.step_s == pytest.approx(max(rollout, trainer) + p["sync"] + p["checkpoint"])
    assert piped.sync_step_s == pytest.approx(sync.step_s)
    assert sync.step_s == pytest.approx(sum(p.values()))  # sync: the sum, as before
    assert sync.bottleneck is None and sync.trainer_wait_s == sync.engine_wait_s == 0.0
    assert piped.bottleneck == longer
    waits = {"trainer": piped.engine_wait_s, "rollout": piped.trainer_wait_s}
    assert waits.pop(longer) == pytest.approx(abs(rollout - trainer))
    assert waits.popitem()[1] == 0.0
    assert piped.step_s < sync.step_s
    assert piped.tokens_per_s == pytest.approx(piped.tokens / piped.step_s)


def test_one_step_off_with_colocated_engines_is_refused():
    """RunConfig.validate refuses the config; predict refuses a colocated ``fleet`` argument."""
    from megatron_rl_fp8.plan.time import planned_fleet

    cfg = config(1, 64, *DEDICATED, "train.pipeline=one_step_off")
    fleet = dataclasses.replace(planned_fleet(cfg, world())[0], placement="colocated")
    with pytest.raises(ConfigError, match="train.pipeline=one_step_off"):
        predict(cfg, world(), GPUS["H200"], "bf16", fleet=fleet)


def test_cli_plan_time_one_step_off(capsys):
    engines = "rollout.sglang.num_engines=4"  # dedicated engines need a count
    base = ["plan", str(EXAMPLE), "--time", "--gpu", "H200", "--top", "0", *DEDICATED, engines]
    assert cli.main([*base, "train.pipeline=one_step_off"]) == 0
    out = capsys.readouterr().out
    for words in (
        "engines, overlapping the trainer:",
        "trainer, overlapping the engines:",
        "then in turn (nothing overlaps):",
        "step: max(sides) + sync + ckpt",
        "bottleneck",
        "trainer waits for the rollout",
        "engines wait for the trainer",
        "sync step (sum of the phases)",
        "speed-up vs sync",
    ):
        assert words in out
    # The synchronous table of a dedicated run says what pipelining would give.
    assert cli.main([*base, "train.pipeline=sync"]) == 0
    out = capsys.readouterr().out
    assert "trainer waits" not in out
    assert "note: train.pipeline=one_step_off would overlap rollout with training" in out


def test_cli_plan_one_step_off_colocated_is_the_configs_one_line(capsys):
    # The example's engines are colocated: RunConfig.validate refuses the pair.
    args = ["plan", str(EXAMPLE), "--time", "train.pipeline=one_step_off"]
    assert cli.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.pipeline=one_step_off" in line and "rollout.placement=dedicated" in line


@pytest.mark.parametrize(
    "preset, nodes, engine_nodes, engines, tp",
    [("qwen3-8b", 1, 1, 8, 1), ("qwen3-14b", 8, 2, 16, 1), ("qwen3-32b", 2, 1, 4, 2)],
)
def test_scaling_pipelined_cases_are_dedicated_and_one_step_off(
    preset, nodes, engine_nodes, engines, tp
):
    cfg = _scaling_model().dedicated_config(preset, "H200", nodes, engine_nodes)
    sg = cfg.rollout.sglang
    assert (cfg.rollout.placement, cfg.train.pipeline) == ("dedicated", "one_step_off")
    assert (sg.num_engines, sg.tp_size) == (engines, tp)


def test_scaling_doc_pipelined_table_is_up_to_date():
    """docs/scaling.md's pipelined table is what `python scripts/scaling_model.py` prints now."""
    sm = _scaling_model()
    cases = [
        (e, sm.make_pipelined_case(p, sm.PIPELINE_GPU, n, e))
        for p in PRESETS
        for n, e in sm.PIPELINE_NODES
    ]
    assert sm.pipeline_table(cases) in sm.DOC.read_text(), "run python scripts/scaling_model.py"


def multi_turn(*extra: str):
    """The Qwen3-8B example as a tool-using job: hermes calls, up to 4 turns, 8 tool workers."""
    return config(1, 64, "env.tools=calculator", "env.tool_format=hermes", "env.max_turns=4",
                  "env.num_workers=8", *extra)  # fmt: skip


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_single_turn_run_plans_as_before_multi_turn(precision):
    base = predict(config(), world(), GPUS["H200"], precision)
    same = predict(config(), world(), GPUS["H200"], precision, turns=1, inserted=0.0, tool_s=5.0)
    assert same.phases == base.phases and base.phases["tools"] == 0
    assert base.detail["rollout/inserted_tokens"] == base.detail["rollout/turn_requests"] == 0


def test_multi_turn_tokens_turns_and_tool_calls_by_hand():
    cfg = multi_turn()
    rows = 64 * cfg.rollout.n_samples_per_prompt
    new = cfg.rollout.max_new_tokens
    one = predict(cfg, world(), GPUS["H200"], "fp8", turns=1, fill=0.5)
    # Defaults: env.max_turns turns, nothing inserted, tools free.
    most = predict(cfg, world(), GPUS["H200"], "fp8", fill=0.5)
    assert most.phases["tools"] == 0
    assert most.detail["rollout/turn_requests"] == pytest.approx(3 * EFFICIENCY.turn_request_s)
    p = predict(cfg, world(), GPUS["H200"], "fp8", fill=0.5, turns=2.5, inserted=0.25, tool_s=0.2)
    d = p.detail
    assert d["rollout/sampled_tokens"] == pytest.approx(rows * 0.5 * new * 0.75)
    assert d["rollout/inserted_tokens"] == pytest.approx(rows * 0.5 * new * 0.25)
    assert d["rollout/turn_requests"] == pytest.approx(1.5 * EFFICIENCY.turn_request_s)
    # rows x 1.5 later-turn calls over 8 workers, each 0.2 s.
    assert p.phases["tools"] == pytest.approx(rows * 1.5 * 0.2 / 8)
    # The answers are prefilled, not decoded: less decode, more prefill than one turn of the
    # same length; the trainer trains on every token either way.
    assert d["rollout/decode"] < one.detail["rollout/decode"]
    assert d["rollout/prefill"] > one.detail["rollout/prefill"]
    assert d["rollout/decode_steps"] == math.ceil(new * 0.75)
    assert p.tokens == one.tokens
    for ph in ("old_logprobs", "update", "sync"):
        assert p.phases[ph] == one.phases[ph]
    # One worker: a later turn's calls run one after another.
    serial = predict(multi_turn("env.num_workers=0"), world(), GPUS["H200"], "fp8", turns=2,
                     inserted=0.1, tool_s=0.2)  # fmt: skip
    assert serial.phases["tools"] == pytest.approx(rows * 0.2)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"turns": 5}, "--turns 5"), ({"turns": 0.5}, "--turns 0.5"),
     ({"turns": 2, "inserted": 1.0}, "--inserted 1"), ({"turns": 1, "inserted": 0.2}, "--inserted"),
     ({"tool_s": float("nan")}, "--tool-s")],
)  # fmt: skip
def test_multi_turn_inputs_out_of_range_are_one_line(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        predict(multi_turn(), world(), GPUS["H200"], "fp8", **kwargs)


def test_cli_plan_time_multi_turn(capsys):
    path = str(EXAMPLE)
    args = ["env.tools=calculator", "env.max_turns=3", "--turns", "2", "--inserted", "0.2"]
    assert (
        cli.main(["plan", path, "model.hf_checkpoint=null", "--time", *args, "--tool-s", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "tool calls" in out and "multi-turn (calculator): 2 turns per trajectory" in out
    assert cli.main(["plan", path, "model.hf_checkpoint=null", "--time"]) == 0
    assert "tool calls" not in capsys.readouterr().out
