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
        ({"parallel": {"pipeline_model_parallel_size": 2}, "model": {"num_layers": 3}}, 2,
         "num_layers=3 is not divisible"),
        ({"parallel": {"tensor_model_parallel_size": 4}}, 4, "num_query_groups=2 must both be divisible"),
        ({"train": {"micro_batch_size": 48}}, 1, "multiple of data-parallel size"),
    ],
)
def test_impossible_layouts(overrides, world, message):
    base = load_config()
    data = {k: v for k, v in overrides.items()}
    cfg = from_dict(RunConfig, {**{"model": vars(base.model)}, **data}) if "model" not in data else \
        from_dict(RunConfig, data)
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
