import pytest

from megatron_rl_fp8.config import RunConfig, load_config, parse_override
from megatron_rl_fp8.config_utils import ConfigError, from_dict


def test_default_example_loads_and_validates():
    cfg = load_config()
    cfg.validate(world_size=1)
    assert cfg.model.arch == "qwen3"


def test_unknown_key_names_the_section_and_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'lrr' in optim; valid keys: .*lr"):
        from_dict(RunConfig, {"optim": {"lrr": 1.0}})


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="'modle' in the top level"):
        from_dict(RunConfig, {"modle": {}})


def test_bad_type_names_the_field():
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer, got 'ten'"):
        from_dict(RunConfig, {"train": {"steps": "ten"}})
    with pytest.raises(ConfigError, match=r"model\.arch: 'gpt2' is not one of"):
        from_dict(RunConfig, {"model": {"arch": "gpt2"}})


def test_field_validation_is_reported_with_its_section():
    with pytest.raises(ConfigError, match=r"rollout.*temperature must be > 0"):
        from_dict(RunConfig, {"rollout": {"temperature": 0.0}})


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"parallel": {"tensor_model_parallel_size": 2}}, 3, "world size 3 is not divisible"),
        (
            {"parallel": {"pipeline_model_parallel_size": 2}, "model": {"num_layers": 3}},
            2,
            "num_layers=3 is not divisible",
        ),
        (
            {"parallel": {"tensor_model_parallel_size": 4}},
            4,
            "num_query_groups=2 must both be divisible",
        ),
        ({"train": {"micro_batch_size": 48}}, 1, "multiple of data-parallel size"),
    ],
)
def test_impossible_layouts(overrides, world, message):
    base = load_config()
    data = {k: v for k, v in overrides.items()}
    cfg = (
        from_dict(RunConfig, {**{"model": vars(base.model)}, **data})
        if "model" not in data
        else from_dict(RunConfig, data)
    )
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=world)


def test_overrides_parse_numbers_and_reject_junk(tmp_path):
    assert parse_override("optim.lr=1e-3") == ("optim.lr", 1e-3)
    assert parse_override("train.steps=5") == ("train.steps", 5)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("train.steps")
    cfg = load_config(None, ["train.steps=5", "loss.eps_high=0.28"])
    assert cfg.train.steps == 5 and cfg.loss.eps_high == 0.28


def test_missing_or_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_yaml_round_trip(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_base_include_merges_sections(tmp_path):
    (tmp_path / "parent.yaml").write_text(
        "train:\n  steps: 7\n  seed: 3\nfp8:\n  recipe: rowwise\n"
    )
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.seed=4"])
    assert (cfg.train.steps, cfg.train.seed, cfg.fp8.recipe) == (9, 4, "rowwise")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml.*base of"):
        load_config(tmp_path / "orphan.yaml")


def test_shipped_precision_modes_differ_only_in_fp8():
    from megatron_rl_fp8.config import EXAMPLES_DIR
    from megatron_rl_fp8.config_utils import to_dict

    modes = {
        name: to_dict(load_config(EXAMPLES_DIR / f"{name}.yaml"))
        for name in ("tiny_cpu", "tiny_cpu_fp8_rollout", "tiny_cpu_fp8")
    }
    for d in modes.values():
        d["train"].pop("output_dir")
    bf16, rollout_only, full = (
        modes["tiny_cpu"],
        modes["tiny_cpu_fp8_rollout"],
        modes["tiny_cpu_fp8"],
    )
    assert bf16["fp8"]["recipe"] == "bf16" and bf16["rollout"]["fp8"]["weight_quant"] == "bf16"
    assert rollout_only["fp8"]["recipe"] == "bf16"
    assert rollout_only["rollout"]["fp8"]["weight_quant"] == "blockwise"
    assert full["fp8"]["recipe"] == "blockwise"
    assert full["rollout"]["fp8"]["weight_quant"] == "blockwise"
    for d in (rollout_only, full):
        assert {k: v for k, v in d.items() if k not in ("fp8", "rollout")} == {
            k: v for k, v in bf16.items() if k not in ("fp8", "rollout")
        }


def test_calibration_needs_two_updates_per_step():
    with pytest.raises(ConfigError, match="updates_per_step >= 2"):
        load_config(None, ["fp8.recipe=blockwise", "train.updates_per_step=1"]).validate()
    load_config(
        None, ["fp8.recipe=blockwise", "train.updates_per_step=1", "loss.calib.enabled=false"]
    ).validate()


def test_every_setting_has_help_and_the_config_command_shows_it(capsys):
    from megatron_rl_fp8.cli import main
    from megatron_rl_fp8.config_utils import describe_fields

    docs = describe_fields(load_config(None, []))
    assert len(docs) > 80 and all(d.help for d in docs), [d.path for d in docs if not d.help]
    assert main(["config", "examples/tiny_cpu_fp8.yaml", "optim.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    for d in docs:
        assert f" {d.path} = " in out, d.path
    assert "* optim.lr = 0.0003  (default: 0.0001)" in out
    assert "* fp8.recipe = 'blockwise'  (default: 'bf16')" in out
    assert "  loss.calib.ema_decay = " in out  # nested sections are walked
    assert main(["config", "examples/tiny_cpu.yaml", "optim.lrr=1"]) == 2


def test_token_budget_lifts_the_micro_batch_divisibility():
    # tiny_cpu: 128 rows per step, sft.batch_size 64; 48 divides neither.
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        load_config(None, ["train.micro_batch_size=48"]).validate(world_size=1)
    budget = ["train.micro_batch_size=48", "train.max_tokens_per_gpu=512"]
    load_config(None, budget).validate(world_size=2)  # rows still split over DP and updates
    with pytest.raises(ConfigError, match=r"data-parallel size \(3\)"):
        load_config(None, budget).validate(world_size=3)
    with pytest.raises(ConfigError, match="max_tokens_per_gpu must be >= 1"):
        load_config(None, ["train.max_tokens_per_gpu=0"])


@pytest.mark.parametrize(
    "data, path, shown",
    [
        ({"sft": {"lr": float("nan")}}, "sft.lr", "nan"),
        ({"loss": {"eps_high": float("inf")}}, "loss.eps_high", "inf"),
        ({"optim": {"adam_eps": float("-inf")}}, "optim.adam_eps", "-inf"),
        ({"guard": {"max_entropy_rise": float("nan")}}, "guard.max_entropy_rise", "nan"),  # or None
        ({"optim": {"lr": 10**400}}, "optim.lr", str(10**400)),  # an int past float's range
    ],
)
def test_every_float_field_must_be_finite(data, path, shown):
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, data)
    assert str(e.value) == f"{path}: expected a finite number, got {shown}"


@pytest.mark.parametrize("raw", [".nan", "nan", "NaN", ".inf", "inf", "-inf", "-.inf"])
def test_non_finite_override_spellings_are_all_refused(raw):
    with pytest.raises(ConfigError, match=r"^rollout\.temperature: expected a finite number"):
        load_config(None, [f"rollout.temperature={raw}"])


def test_empty_config_file_is_refused_but_an_empty_mapping_means_defaults(tmp_path):
    for text in ("", "\n", "# only a comment\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"is empty \(or only comments\).*write \{\}"):
            load_config(path)
    (tmp_path / "child.yaml").write_text("base: empty.yaml\ntrain:\n  steps: 2\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml' \(the base of .*child\.yaml'\) is empty"):
        load_config(tmp_path / "child.yaml")
    path.write_text("{}\n")
    assert load_config(path) == from_dict(RunConfig, {})


def test_config_file_errors_are_one_line_and_name_the_file(tmp_path):
    cases = {
        "dir.yaml": None,
        "binary.yaml": b"train:\n  steps: 1\n\xff\xfe\n",
        "flow.yaml": b"train: {steps: 1\n",
        "tab.yaml": b"train:\n\tsteps: 1\n",
        "control.yaml": b"train:\n  steps: 1\x01\n",
        "list.yaml": b"- train\n",
        "keys.yaml": b"1: a\nb: 2\n",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        with pytest.raises(ConfigError) as e:
            load_config(path)
        message = str(e.value)
        assert "\n" not in message, message
        if name == "keys.yaml":  # mixed key types: sorted without a TypeError
            assert message.startswith("unknown key(s) 1, 'b' in the top level")
        else:
            assert message.startswith(f"config file {str(path)!r} "), message
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path / "dir.yaml")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff on line 3\)"):
        load_config(tmp_path / "binary.yaml")
    with pytest.raises(
        ConfigError,
        match=r"not valid YAML: line 2, column 1: while parsing a flow mapping; expected",
    ):
        load_config(tmp_path / "flow.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML: line 2: character #x0001"):
        load_config(tmp_path / "control.yaml")


def test_null_seeds_follow_train_seed():
    """A study seed is an RL seed: the prompt order and the sampling follow train.seed; the tiny
    job fixes sft.seed (one base policy); an explicit seed is kept."""
    cfg = load_config("examples/tiny_cpu.yaml", ["train.seed=5"])
    assert (cfg.task.seed, cfg.rollout.seed, cfg.sft.seed) == (5, 5, 1)
    cfg = load_config("examples/tiny_cpu.yaml", ["train.seed=5", "sft.seed=null", "rollout.seed=7"])
    assert (cfg.task.seed, cfg.rollout.seed, cfg.sft.seed) == (5, 7, 5)
    # What config.yaml records reads back as the same run.
    again = load_config(None, [])
    assert again.rollout.seed == again.train.seed == 1


@pytest.mark.parametrize(
    "overrides, idle, active",
    [
        # BF16 training: no calibration knob and no scale history acts.
        ([], ["loss.calib.", "fp8.scales_per_step"], []),
        # Nominal FP8 (calibration off): its knobs are idle, the switch itself is not.
        (
            ["fp8.recipe=blockwise", "loss.calib.enabled=false"],
            ["loss.calib.mode", "loss.calib.interval", "fp8.scales_per_step"],
            ["loss.calib.enabled", "loss.calib.", "fp8.recipe"],
        ),
        # Calibrated FP8 with a delayed recipe: everything acts.
        (["fp8.recipe=tensorwise_delayed"], [], ["loss.calib.mode", "fp8.scales_per_step"]),
    ],
)
def test_idle_settings_name_what_acts_on_nothing_in_the_run(overrides, idle, active):
    cfg = load_config("examples/tiny_cpu.yaml", overrides)
    got = cfg.idle_settings()
    assert all(p in got for p in idle), got
    assert not any(p in got for p in active), got
    assert "fp8.recipe" not in got and "loss.calib.enabled" not in got
