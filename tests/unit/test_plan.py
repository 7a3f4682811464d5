"""The memory planner (megatron_rl_fp8/plan): hand-computed model state, the directions every knob
moves the estimate in, the alternative layouts, the CLI, and the GPU reference point."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import EXAMPLES_DIR, RunConfig
from megatron_rl_fp8.config_utils import from_dict
from megatron_rl_fp8.plan import UNCHUNKED_LOGPROBS, Layout, World, alternatives, estimate
from megatron_rl_fp8.plan.memory import GB
from megatron_rl_fp8.plan.model_bytes import fp8_linear_params, layer_activation_bytes, layer_params

# qwen3 (QK-norm), hidden 64, 4 query heads / 2 KV groups of 16, SwiGLU 128, vocab 256 (no
# padding at TP 1 or 2), untied output layer, bf16.
SMALL = dict(
    arch="qwen3",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    max_position_embeddings=512,
    params_dtype="bfloat16",
)
# Per layer: QKV 64 x (64 + 2 * 32) + proj 64 x 64 + FC1 64 x 256 + FC2 128 x 64 = 36864 linear
# weights; norms 2 x 64 + QK-norms 2 x 16 = 160. Two layers, embedding and output layer 256 x 64
# each, final norm 64.
SMALL_PARAMS = 2 * (36864 + 160) + 2 * 256 * 64 + 64


def make_cfg(model=None, **sections) -> RunConfig:
    """A RunConfig from sections (dicts), the small model by default."""
    data = {
        "model": {**SMALL, **(model or {})},
        "task": {"max_prompt_len": 128},
        "rollout": {"max_new_tokens": 128, "n_samples_per_prompt": 4},
        "train": {"micro_batch_size": 2, "prompts_per_step": 8, "updates_per_step": 1},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return from_dict(RunConfig, data)


def row(e, name: str, phase: str = "update") -> float:
    (c,) = [c for c in e.components if c.name == name]
    return c[phase]


def test_weights_gradients_and_optimizer_by_hand():
    e = estimate(make_cfg(), World(gpus_per_node=1))
    assert row(e, "weights") == SMALL_PARAMS * 2  # bf16
    assert row(e, "gradients") == SMALL_PARAMS * 4  # fp32 grad buffer
    assert row(e, "optimizer") == SMALL_PARAMS * 12  # fp32 main weights + Adam's two moments
    # An fp32 model is its own main copy: Adam only.
    fp32 = estimate(make_cfg({"params_dtype": "float32"}), World(gpus_per_node=1))
    assert row(fp32, "weights") == SMALL_PARAMS * 4 and row(fp32, "optimizer") == SMALL_PARAMS * 8
    # A tied output layer is the embedding at PP 1.
    tied = estimate(make_cfg({"tie_word_embeddings": True}), World(gpus_per_node=1))
    assert row(tied, "weights") == (SMALL_PARAMS - 256 * 64) * 2


def test_tensor_parallelism_halves_the_linear_weights():
    m = make_cfg().model
    norms = 160
    assert layer_params(m, 2) - norms == (layer_params(m, 1) - norms) / 2
    e = estimate(make_cfg(parallel={"tensor_model_parallel_size": 2}), World(gpus_per_node=2))
    # Layers split (norms replicated), embedding and output layer split along the vocabulary.
    assert row(e, "weights") == (2 * (36864 / 2 + 160) + 2 * 128 * 64 + 64) * 2


def test_distributed_optimizer_divides_the_optimizer_state_by_dp():
    world = World(gpus_per_node=4)
    plain = estimate(make_cfg(), world)
    sharded = estimate(make_cfg(parallel={"use_distributed_optimizer": True}), world)
    assert plain.layout.dp == 4
    assert row(sharded, "optimizer") == pytest.approx(row(plain, "optimizer") / 4)
    assert row(sharded, "gradients") == row(plain, "gradients")  # the grad buffer stays whole
    assert row(sharded, "weights") == row(plain, "weights")


def test_offload_removes_the_offloaded_optimizer_bytes():
    world = World(gpus_per_node=4)
    parallel = {"use_distributed_optimizer": True}
    on = estimate(make_cfg(parallel=parallel), world)
    half = estimate(
        make_cfg(
            parallel=parallel,
            memory={"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
        ),
        world,
    )
    full = estimate(make_cfg(parallel=parallel, memory={"optimizer_cpu_offload": True}), world)
    assert row(half, "optimizer") == pytest.approx(row(on, "optimizer") / 2)
    assert row(full, "optimizer") == 0
    assert on.total("update") - full.total("update") == pytest.approx(row(on, "optimizer"))


def test_sequence_and_context_parallelism_and_recompute_reduce_activations():
    world = World(gpus_per_node=4)
    # Eight layers: with two, full recompute's working set (one whole layer, recomputed in the
    # backward) would outweigh what it saves.
    cfg = make_cfg({"num_layers": 8}, parallel={"tensor_model_parallel_size": 2})

    def acts(spec="te", **layout):
        lay = dataclasses.replace(Layout(tp=2, dp=2), **layout)
        return row(estimate(cfg, world, layout=lay, spec=spec), "activations")

    assert acts(sequence_parallel=True) < acts()
    assert acts(cp=2, dp=1) < acts()
    assert acts(sequence_parallel=True, cp=2, dp=1) < acts(sequence_parallel=True)
    # Local spec, unfused attention: the s^2 scores are stored, and selective recompute drops
    # exactly them; torch's SDPA (the GPU default) keeps none.
    unfused = make_cfg({"num_layers": 8, "attention_backend": "unfused"})
    local = [
        row(
            estimate(unfused, world, layout=Layout(tp=2, dp=2, recompute=r), spec="local"),
            "activations",
        )
        for r in ("none", "selective", "full")
    ]
    assert local[0] > local[1] > local[2]
    assert local[0] > acts("local") > acts()
    assert acts(recompute="full") < acts()
    # Full recompute in chunks of two layers keeps fewer inputs but recomputes more at once.
    assert acts(recompute="full", recompute_num_layers=2) != acts(recompute="full")


def test_layer_activations_match_the_tensors_autograd_saves_on_the_cpu():
    """Hidden 256, 8 query / 2 KV heads of 32, SwiGLU 768, 64 tokens, fp32 local spec: the
    tensors one layer of the real actor saved for its backward (counted per storage through
    saved_tensors_hooks, as scripts/validate_plan.py's FirstLayerSaved does) came to 31824 bytes
    per token, 31488 of them in the terms the planner counts (norms 6144, QKV output and
    QK-norms 3840, attention 3072 + scores 2048, projection 1024, SwiGLU 12288, FC2 3072) and
    336 in small ones it leaves out (norm statistics, RoPE tables, the causal mask)."""
    m = make_cfg(
        {"hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 8, "head_dim": 32}
    ).model
    per_token = layer_activation_bytes(
        m, a=4, tp=1, sequence_parallel=False, seq=64, spec="local", fused_swiglu=False
    )
    assert per_token == 31488


def test_pipeline_stage_zero_holds_pp_micro_batches():
    cfg = make_cfg(
        {"num_layers": 4},
        parallel={"pipeline_model_parallel_size": 2},
        train={"prompts_per_step": 16},
    )
    e = estimate(cfg, World(gpus_per_node=2))
    assert e.stage == 0 and e.micro_batches_in_flight == 2


def test_alternative_layouts_fit_and_are_valid():
    cfg = make_cfg(
        {
            "num_layers": 8,
            "hidden_size": 1024,
            "ffn_hidden_size": 4096,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
        task={"max_prompt_len": 1024},
        rollout={"max_new_tokens": 3072, "n_samples_per_prompt": 8},
        train={"prompts_per_step": 16, "micro_batch_size": 4},
    )
    world = World(gpus_per_node=8, gpu_memory_gb=16)
    assert not estimate(cfg, world, spec="local").fits
    fits = alternatives(cfg, world, spec="local", logits=UNCHUNKED_LOGPROBS)
    assert fits
    ranks = [e.layout.model_parallel_size for e in fits]
    assert ranks == sorted(ranks)
    for e in fits:
        assert e.fits and e.peak <= world.gpu_memory_gb * GB
        lay = e.layout
        p = dataclasses.replace(
            cfg.parallel,
            tensor_model_parallel_size=lay.tp,
            pipeline_model_parallel_size=lay.pp,
            sequence_parallel=lay.sequence_parallel,
            use_distributed_optimizer=lay.distributed_optimizer,
        )
        recompute = {
            "none": {},
            "selective": {"recompute_granularity": "selective"},
            "full": dict(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            ),
        }[lay.recompute]
        memory = dataclasses.replace(cfg.memory, **recompute)
        dataclasses.replace(cfg, parallel=p, memory=memory).validate(world.size)
        # Re-planning the layout from its config gives the same answer.
        again = estimate(
            dataclasses.replace(cfg, parallel=p, memory=memory),
            world,
            spec="local",
            logits=UNCHUNKED_LOGPROBS,
        )
        assert again.peak == pytest.approx(e.peak)


def test_the_2b_gpu_reference_point():
    """benchmarks/bench_actor.py's 2.03B Qwen3 shape (28 layers, hidden 2048, ffn 6144, 16 / 8 heads
    of 128, vocab 151936, untied), local spec, bf16, 8 x 2048-token rows in micro-batches of 2,
    no recompute, plain DDP + Adam, the unchunked log-prob path it ran with:
    torch.cuda.max_memory_allocated was 82.4 GB on an H200. The planner's allocated bytes (no
    allowance: max_memory_allocated does not see it) come within 15%."""
    cfg = make_cfg(
        {
            "num_layers": 28,
            "hidden_size": 2048,
            "ffn_hidden_size": 6144,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 2048,
        },
        task={"max_prompt_len": 1024},
        rollout={"max_new_tokens": 1024, "n_samples_per_prompt": 2},
        train={"prompts_per_step": 4, "micro_batch_size": 2},
    )
    cfg.model.attention_backend = "unfused"  # measured before SDPA attention existed
    e = estimate(
        cfg, World(gpus_per_node=1, gpu_memory_gb=141), spec="local", logits=UNCHUNKED_LOGPROBS
    )
    assert e.layout == Layout()
    assert abs(row(e, "weights") / 2 / 2.03e9 - 1) < 0.01
    assert e.allocated("update") / GB == pytest.approx(82.4, rel=0.15)
    assert e.fits


@pytest.mark.parametrize(
    "args",
    [
        ["qwen3_8b_grpo_math_fp8.yaml", "--nodes", "2"],
        ["qwen3_32b_dapo_math_fp8.yaml", "--nodes", "2", "--gpu-memory-gb", "141"],
    ],
)
def test_cli_prints_the_table_for_the_gpu_examples(args, capsys):
    assert cli.main(["plan", str(EXAMPLES_DIR / args[0]), *args[1:]]) == 0
    out = capsys.readouterr().out
    for line in ("weights", "gradients", "optimizer", "activations", "logits", "SGLang", "total"):
        assert f"\n  {line}" in out
    assert "FITS" in out and "Layouts of the same 16 GPUs that fit" in out


@pytest.mark.parametrize(
    "args",
    [
        ["parallel.tensor_model_parallel_size=3"],
        ["train.no_such_key=1"],
        ["--nodes", "3"],
        # Issue 44 #9: refused before the table, not after it (or not at all).
        ["--gpu-memory-gb", "inf"],
        ["--time", "--fill", "0"],
        ["--time", "--fill", "-1"],
        ["--time", "--fill", "2"],
        ["--time", "--fill", "nan"],
        # Multi-turn flags: this run has no env.tools, and they are --time's.
        ["--time", "--turns", "2"],
        ["--time", "--inserted", "0.3"],
        ["--time", "--tool-s", "-1"],
        ["--turns", "1"],
        ["--top", "-1"],
        ["--nodes", "100000"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, capsys):
    path = str(EXAMPLES_DIR / "qwen3_8b_grpo_math_fp8.yaml")
    assert cli.main(["plan", path, *args]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("config error: ") and captured.out == ""


def test_flags_are_never_abbreviated(capsys):
    # Issue 44 #9: argparse's prefix matching took --gpus 8 for --gpus-per-node 8.
    path = str(EXAMPLES_DIR / "qwen3_8b_grpo_math_fp8.yaml")
    for argv in (["plan", path, "--gpus", "8"], ["study", path, "--job", "2"], ["train", "--conf"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
        assert "unrecognized arguments" in capsys.readouterr().err, argv


def test_cli_needs_the_shape_when_the_checkpoint_is_not_here(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("base: " + str(EXAMPLES_DIR / "qwen3_8b_grpo_math.yaml") + "\n")
    # The example states the shape: the missing checkpoint is a note.
    assert cli.main(["plan", str(config), "model.hf_checkpoint=/nowhere/Qwen3-8B"]) == 0
    assert "model.hf_checkpoint='/nowhere/Qwen3-8B' is not on this machine" in (
        capsys.readouterr().out
    )
    config.write_text("model:\n  hf_checkpoint: /nowhere/Qwen3-8B\n")
    assert cli.main(["plan", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "does not state the model's shape (model.arch, model.num_layers" in line


def test_the_estimate_imports_neither_torch_nor_megatron():
    import subprocess
    import sys

    code = (
        "import sys, megatron_rl_fp8.plan; "
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- FP8 weight copies --------------------------------------------------------------------------
SMALL_LINEARS = 36864  # one SMALL layer's four linear weights (see SMALL_PARAMS)


@pytest.mark.parametrize(
    "fp8, spec, update, logprobs",
    [
        # No TE (local spec): the torch backend, forward + transposed copies in the update,
        # the forward's only in the no-grad pass.
        ({"recipe": "blockwise"}, "local", 2, 1),
        # TE keeps both copies in its workspaces across steps.
        ({"recipe": "blockwise"}, "te", 2, 2),
        ({"recipe": "rowwise"}, "te", 2, 1),  # TE has no rowwise: auto takes torch
        ({"recipe": "tensorwise_delayed"}, "local", 0, 0),  # the torch backend caches nothing
        # torchao: one tensorwise copy serves fprop and dgrad; rowwise casts per call.
        ({"recipe": "tensorwise_current", "backend": "torchao"}, "local", 1, 1),
        ({"recipe": "rowwise", "backend": "torchao"}, "local", 0, 0),
        ({"recipe": "blockwise", "backend": "emulate"}, "te", 0, 0),
        ({"recipe": "bf16"}, "te", 0, 0),
    ],
)
def test_fp8_weight_copies_by_backend(fp8, spec, update, logprobs):
    e = estimate(make_cfg(fp8=fp8), World(gpus_per_node=1), spec=spec)
    assert row(e, "FP8 weight copies") == 2 * SMALL_LINEARS * update
    assert row(e, "FP8 weight copies", "logprobs") == 2 * SMALL_LINEARS * logprobs
    cpu = estimate(make_cfg(fp8=fp8), World(gpus_per_node=1, device="cpu"))
    assert row(cpu, "FP8 weight copies") == 0  # CPU runs emulate


def test_fp8_weight_copies_follow_the_layers_each_gpu_holds():
    """BF16 edge layers hold none; TP splits the linears; a pipeline stage counts its own layers
    and the last one an FP8 output layer."""
    plain = make_cfg(fp8={"recipe": "blockwise"})
    one = World(gpus_per_node=1)
    edges = estimate(make_cfg(fp8={"recipe": "blockwise", "bf16_first_layers": 1}), one, spec="te")
    assert row(edges, "FP8 weight copies") == 2 * SMALL_LINEARS
    tp2 = estimate(plain, World(gpus_per_node=2), layout=Layout(tp=2), spec="te")
    assert row(tp2, "FP8 weight copies") == 2 * SMALL_LINEARS  # two layers, half of each
    head = make_cfg(fp8={"recipe": "blockwise", "keep_lm_head_bf16": False, "backend": "torch"})
    pp2 = estimate(head, World(gpus_per_node=2), layout=Layout(pp=2), spec="local")
    assert pp2.stage == 0  # the worst stage (two micro-batches in flight): its one layer
    assert row(pp2, "FP8 weight copies") == 2 * SMALL_LINEARS
    # The last stage: its layer and the 256 x 64 output layer.
    assert fp8_linear_params(head.model, head.fp8, 1, 2, 1) == SMALL_LINEARS + 256 * 64


# One SMALL layer's four linear inputs per token: QKV and FC1 64 each, projection 64, FC2 128.
SMALL_LINEAR_INPUTS = 2 * 64 + 64 + 128
MICRO_BATCH_TOKENS = 2 * 256


def test_torch_backend_tensorwise_inputs_are_planned_at_one_byte():
    """The torch backend's tensorwise recipes keep the linears' inputs as FP8 codes (measured
    against the real actor in tests/distributed/test_fp8_actor.py): 1 byte instead of bf16's 2
    per element, on the FP8 layers only; TE (counted as bf16), other recipes and the CPU's
    emulation unchanged."""
    one = World(gpus_per_node=1)

    def acts(spec="local", world=one, layout=None, **fp8):
        return row(estimate(make_cfg(fp8=fp8), world, layout=layout, spec=spec), "activations")

    saved = MICRO_BATCH_TOKENS * SMALL_LINEAR_INPUTS  # one byte of each, per FP8 layer
    for recipe in ("tensorwise_current", "tensorwise_delayed"):
        assert acts(recipe=recipe) == acts(recipe="rowwise") - 2 * saved
        if recipe == "tensorwise_current":  # Megatron forbids BF16 edge layers under delayed
            assert acts(recipe=recipe, bf16_first_layers=1) == acts(recipe="rowwise") - saved
        assert acts("te", recipe=recipe) == acts("te", recipe="rowwise")  # auto: TE
        cpu = World(gpus_per_node=1, device="cpu")
        assert acts(world=cpu, recipe=recipe) == acts(world=cpu, recipe="rowwise")
    assert acts("te", recipe="tensorwise_current", backend="torch") < acts("te", recipe="rowwise")
    # Full recompute, one layer per chunk: the layers' inputs are kept, one layer recomputed at
    # a time: an FP8 layer's is the smaller, a BF16 first layer's sets the peak.
    full = Layout(recompute="full", recompute_num_layers=1)
    assert (
        acts(layout=full, recipe="tensorwise_current")
        == acts(layout=full, recipe="rowwise") - saved
    )
    edge = acts(layout=full, recipe="tensorwise_current", bf16_first_layers=1)
    assert edge == acts(layout=full, recipe="rowwise")


def test_fp8_weight_copies_are_what_the_torch_backend_caches():
    """The torch backend's cache inside one forward / backward schedule holds 2 bytes per weight
    element (forward and transposed codes; shapes aligned to 16, so no padding), 1 after a
    no-grad forward: the planner's numbers for it."""
    import torch

    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch

    def cached_bytes(linear):
        return sum(
            op.codes.numel() * op.codes.element_size() for _, op in linear.weights.entries.values()
        )

    for recipe in ("tensorwise_current", "rowwise"):
        linear = FP8LinearTorch(FP8Config(recipe=recipe))
        w = torch.randn(96, 64, requires_grad=True)
        x = torch.randn(32, 64, requires_grad=True)
        with linear.weight_cache():
            linear(x, w).sum().backward()
            assert cached_bytes(linear) == 2 * w.numel(), recipe
        with linear.weight_cache(), torch.no_grad():
            linear(x, w)
            assert cached_bytes(linear) == w.numel(), recipe


def test_fp8_weight_copies_are_what_the_torchao_backend_caches():
    """torchao under tensorwise: one float8 copy of the weight per schedule, used by both GEMMs
    (1 byte per element, with or without the backward); rowwise: none."""
    import torch

    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.torchao_backend import FP8LinearTorchAO

    for recipe, want in (("tensorwise_current", 1), ("rowwise", 0)):
        linear = FP8LinearTorchAO(FP8Config(recipe=recipe))
        w = torch.randn(96, 64, requires_grad=True)
        x = torch.randn(32, 64, requires_grad=True)
        for grad in (True, False):
            with linear.weight_cache(), torch.set_grad_enabled(grad):
                y = linear(x, w)
                if grad:
                    y.sum().backward()
                held = linear.weights.entries.values()
                assert sum(c._data.numel() * c._data.element_size() for _, c in held) == (
                    want * w.numel()
                ), (recipe, grad)


def test_tensor_transport_engines_open_contexts_on_the_sending_gpu():
    # NC-5 (issue 43 #5): with the tensor transport every colocated engine TP process on the
    # sending rank's node, but the one on its own GPU, opens a CUDA context on that GPU.
    from megatron_rl_fp8.rollout.sglang.sizing import CUDA_CONTEXT_GB

    def contexts(transport, nodes=1, **sg):
        rollout = {"engine": "sglang", "placement": "colocated"}
        sglang = {"transport": transport, "num_engines": 0, "mem_fraction_static": 0.3, **sg}
        cfg = make_cfg(rollout={**rollout, "sglang": sglang})
        e = estimate(cfg, World(gpus_per_node=8, nodes=nodes))
        return row(e, "IPC contexts") / (CUDA_CONTEXT_GB * GB), e

    n, e = contexts("tensor")  # 8 engines of TP 1 on the node: 7 others
    assert n == 7 and row(e, "IPC contexts", "logprobs") == row(e, "IPC contexts")
    assert any("CUDA context" in note for note in e.notes)
    assert e.allocated("update") == e.total("update") - sum(
        row(e, r) for r in ("allowance", "SGLang", "IPC contexts")
    )  # other processes' memory: not the trainer's max_memory_allocated
    assert contexts("tensor", tp_size=2)[0] == 7  # 4 engines x 2 ranks, one on the GPU itself
    assert contexts("tensor", nodes=2)[0] == 7  # per-node sync: each node's own engines
    assert contexts("distributed")[0] == 0  # NCCL: no handle into the trainer's GPU
