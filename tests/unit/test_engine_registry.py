"""The rollout engine registry (rollout/registry.py): built-in engines found by their folders, a
plugin engine loaded from ``package.module:SPEC``, and the settings each spec answers for."""

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.registry import (
    ENGINES,
    LOCAL,
    EngineSpec,
    engine_spec,
    error_labels,
    register_engine,
)
from tests.recording_engine import RECORDING


def _spec(name="x", **kw):
    return EngineSpec(name=name, help="h", build=lambda *a, **k: None, **kw)


def test_built_in_engines_register_themselves():
    assert list(ENGINES)[:2] == ["local", "sglang"]  # local here, sglang by its folder's spec.py
    assert LOCAL.in_process and LOCAL.placements == ("dedicated",)
    sglang = ENGINES["sglang"]
    assert not sglang.in_process and set(sglang.placements) == {"dedicated", "colocated"}
    assert "sglang error" in error_labels()


def test_the_restart_policy_is_the_engines():
    cfg = load_config(None, ["rollout.sglang.max_restarts=5"])
    assert ENGINES["sglang"].max_restarts(cfg.rollout) == 5
    assert LOCAL.max_restarts(cfg.rollout) == 0


def test_a_plugin_engine_is_loaded_and_registered_once():
    assert engine_spec("tests.recording_engine:RECORDING") is RECORDING
    assert ENGINES["recording"] is RECORDING and engine_spec("recording") is RECORDING
    assert register_engine(RECORDING) is RECORDING  # the same spec again: no-op
    cfg = load_config(None, ["rollout.engine=tests.recording_engine:RECORDING"])
    assert cfg.rollout.engine == "tests.recording_engine:RECORDING"


def test_names_and_placements_are_checked():
    with pytest.raises(ValueError, match="already registered"):
        register_engine(_spec("local"))
    with pytest.raises(ValueError, match="EngineSpec.name"):
        _spec("two words")
    with pytest.raises(ValueError, match="placement 'nearby'"):
        _spec(placements=("nearby",))
    with pytest.raises(TypeError, match="takes an EngineSpec"):
        register_engine("local")


@pytest.mark.parametrize(
    "value, says",
    [
        ("vllm", "is not a registered engine (local, sglang"),
        ("no_such_module_here:SPEC", "importing 'no_such_module_here' failed"),
        ("tests.recording_engine:RECORDINGS", "has no attribute 'RECORDINGS'"),
        ("tests.recording_engine:RecordingEngine", "is a type, not an EngineSpec"),
        ("a:b:c", "is not a registered engine"),
    ],
)
def test_a_bad_engine_is_one_config_error_naming_the_setting(value, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"rollout.engine={value}"])
    msg = str(e.value)
    assert "rollout.engine" in msg and says in msg and "\n" not in msg


def test_placements_the_engine_does_not_run_with_are_refused():
    with pytest.raises(ConfigError, match="rollout.placement=colocated is not a placement"):
        load_config(None, ["rollout.placement=colocated"])
    load_config(None, ["rollout.engine=sglang", "rollout.placement=colocated"])
