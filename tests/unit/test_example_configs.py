"""The GPU example configs load, fill their model section from the model's config.json and pass the
layout checks at the world size their header states. The checkpoints are not here, so their
config.json files are written from the models' published values (Qwen3-8B, Qwen3-32B)."""

from __future__ import annotations

import json

import pytest

from megatron_rl_fp8.config import EXAMPLES_DIR, load_config

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
SIZES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32},
    "32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64},
}  # fmt: skip


@pytest.mark.parametrize(
    "name, size, world",
    [
        ("qwen3_8b_grpo_math", "8b", 8),
        ("qwen3_8b_grpo_math_fp8", "8b", 8),
        ("qwen3_8b_tools_fp8", "8b", 8),
        ("qwen3_32b_dapo_math_fp8", "32b", 16),
    ],
)
def test_gpu_examples_validate_against_the_real_model_shapes(tmp_path, name, size, world):
    folder = tmp_path / size
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3, **SIZES[size]}))
    cfg = load_config(EXAMPLES_DIR / f"{name}.yaml", [f"model.hf_checkpoint={folder}"])
    cfg.validate(world)
    m = cfg.model
    assert m.hidden_size == SIZES[size]["hidden_size"] and m.num_query_groups == 8
    assert m.vocab_size == 151936 and m.kv_channels == 128 and m.params_dtype == "auto"
    assert cfg.sft.steps == 0 and cfg.task.name == "math" and cfg.tokenizer.chat_template
    assert cfg.fp8.enabled == name.endswith("fp8")
    assert (cfg.env.tools, cfg.env.tool_format) == (
        ("calculator", "hermes") if "tools" in name else (None, "calc")
    )
    assert cfg.loss.calib.enabled and cfg.loss.kl_coef == 0.0
    # The header's world size is the one the layout needs: one rank fewer does not divide.
    with pytest.raises(ValueError):
        cfg.validate(world - 1)


def test_train_your_own_doc_lists_every_field():
    from pathlib import Path

    from megatron_rl_fp8.config_utils import describe_fields

    doc = (Path(__file__).resolve().parents[2] / "docs" / "train_your_own.md").read_text()
    fields = [d.path for d in describe_fields(load_config(None))]
    wanted = [p for p in fields if p.split(".")[0] in ("tokenizer", "task", "reward", "env")]
    wanted += [p for p in fields if p.startswith(("optim.lr_", "optim.min_lr", "loss.kl_"))]
    wanted += ["model.hf_checkpoint", "model.load", "model.ref_checkpoint", "sft.steps"]
    assert len(wanted) > 20
    missing = [p for p in wanted if f"`{p}`" not in doc]
    assert not missing, f"docs/train_your_own.md does not describe {missing}"


@pytest.mark.parametrize(
    "study", sorted((EXAMPLES_DIR / "studies").glob("*.yaml")), ids=lambda p: p.stem
)
def test_shipped_study_files_validate(study, tmp_path):
    """Every arm of every committed study is a valid run (the study command checks the same
    before it starts anything)."""
    from megatron_rl_fp8.study.runner import load_study

    s = load_study(study, tmp_path / "out")
    assert s.runs and s.reference in s.arms


CALIB_KEYS = ("loss.calib.mode", "loss.calib.interval", "loss.calib.ema_decay")


@pytest.mark.parametrize(
    "study", sorted((EXAMPLES_DIR / "studies").glob("*.yaml")), ids=lambda p: p.stem
)
def test_calibrated_study_arms_pin_their_schedule(study, tmp_path):
    """A committed table must not move when a calibration default does: every arm that trains in
    FP8 with calibration names its mode, and (but the oracle, which calibrates every mini-batch)
    its interval and EMA."""
    import yaml

    from megatron_rl_fp8.study.runner import load_study

    s = load_study(study, tmp_path / "out")
    shared = yaml.safe_load(study.read_text()).get("overrides") or {}
    for run in s.runs:
        cal = run.config.loss.calib
        if run.config.fp8.recipe == "bf16" or not cal.enabled:
            continue
        given = {**shared, **s.arms[run.arm]}
        need = CALIB_KEYS[:1] if cal.mode == "oracle" else CALIB_KEYS
        missing = [k for k in need if k not in given]
        assert not missing, f"{study.name}: arm {run.arm} leaves {missing} to the defaults"


@pytest.mark.parametrize(
    "study", sorted((EXAMPLES_DIR / "studies").glob("*.yaml")), ids=lambda p: p.stem
)
def test_delayed_scaling_study_arms_pin_whether_the_step_holds_its_scales(study, tmp_path):
    """The same for ``fp8.scales_per_step``: its default ('auto') holds delayed scales for a step
    since 2026-12-07, and the tables made before it ran with moving scales."""
    import yaml

    from megatron_rl_fp8.study.runner import load_study

    s = load_study(study, tmp_path / "out")
    shared = yaml.safe_load(study.read_text()).get("overrides") or {}
    for run in s.runs:
        if run.config.fp8.enabled and run.config.fp8.spec.delayed:
            given = {**shared, **s.arms[run.arm]}
            assert "fp8.scales_per_step" in given, f"{study.name}: arm {run.arm}"
