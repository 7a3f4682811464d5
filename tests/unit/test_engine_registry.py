"""The rollout engine registry (rollout/registry.py): built-in engines found by their folders, a
plugin engine loaded from ``package.module:SPEC``, and the settings each spec answers for."""

import dataclasses

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.launching import Placement
from megatron_rl_fp8.rollout.registry import (
    ENGINES,
    LOCAL,
    EngineSpec,
    Fleet,
    GpuShare,
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


# -- the planner reaches an engine through its spec alone -----------------------------------------
def _toy_fleet(cfg, hosts):
    return Fleet(
        engines=hosts.nodes * 3,
        tp=2,
        placement=cfg.placement,
        mem_fraction=0.25,
        count_setting="rollout.toy.count",
        tp_setting="rollout.toy.tp",
        memory_setting="rollout.toy.memory",
        count_note="three per node",
    )


def _toy_share(cfg, hosts):
    gb = 7.0 if hosts.on_gpu and cfg.placement == "colocated" else 0.0
    return (GpuShare("toy engine", gb * 1e9, f"toy holds {gb:g} GB" if gb else None),)


TOY = _spec(
    "toy",
    placements=("dedicated", "colocated"),
    fleet=_toy_fleet,
    trainer_gpu_share=_toy_share,
    launched_beside_trainer=lambda cfg, hosts: False,
)


def _toy_config(monkeypatch, *overrides):
    from megatron_rl_fp8.config import EXAMPLES_DIR

    monkeypatch.setitem(ENGINES, "toy", TOY)
    return load_config(
        EXAMPLES_DIR / "qwen3_32b_dapo_math_fp8.yaml",
        ["model.hf_checkpoint=null", "rollout.engine=toy", "train.pipeline=sync", *overrides],
    )


def test_the_planner_counts_what_an_engines_spec_says_it_holds(monkeypatch):
    from megatron_rl_fp8.plan.memory import World, estimate

    cfg = _toy_config(monkeypatch, "rollout.placement=colocated")
    e = estimate(cfg, World(nodes=2))
    toy = next(c for c in e.components if c.name == "toy engine")
    assert toy.update == toy.logprobs == 7e9 and toy.outside
    assert "SGLang" not in {c.name for c in e.components}
    assert e.allocated("update") == e.total("update") - 7e9 - 4e9  # less the runtime allowance
    assert "toy holds 7 GB" in e.notes
    dedicated = estimate(_toy_config(monkeypatch, "rollout.placement=dedicated"), World(nodes=2))
    assert next(c for c in dedicated.components if c.name == "toy engine").update == 0


def test_the_step_time_model_plans_the_engines_fleet_and_names_its_settings(monkeypatch):
    from megatron_rl_fp8.plan.hardware import GPUS
    from megatron_rl_fp8.plan.memory import World
    from megatron_rl_fp8.plan.time import planned_fleet, predict

    cfg = _toy_config(monkeypatch, "rollout.placement=colocated")
    fleet, note = planned_fleet(cfg, World(nodes=2))
    assert (fleet.engines, fleet.tp, note) == (6, 2, None)
    crowded = dataclasses.replace(fleet, engines=9)  # 18 GPUs of engines on 16
    with pytest.raises(ConfigError, match=r"rollout.toy.count \(9\) x rollout.toy.tp \(2\)"):
        predict(cfg, World(nodes=2), GPUS["H100"], "bf16", fleet=crowded)
    starved = dataclasses.replace(fleet, mem_fraction=0.01)
    with pytest.raises(ConfigError, match="rollout.toy.memory=0.01 leaves no KV cache"):
        predict(cfg, World(nodes=2), GPUS["H100"], "bf16", fleet=starved)


def test_an_in_process_engine_is_planned_as_the_first_engine_with_a_fleet():
    from megatron_rl_fp8.plan.memory import World
    from megatron_rl_fp8.plan.time import planned_fleet

    cfg = load_config(None, ["rollout.sglang.num_engines=2"])
    fleet, note = planned_fleet(cfg, World(nodes=1))
    assert fleet == ENGINES["sglang"].fleet(cfg.rollout, World(nodes=1).hosts)
    assert fleet.engines == 2
    assert "rollout.engine=local runs inside the trainer" in note and "sglang" in note


def test_each_engines_settings_are_its_section_of_rollout():
    from megatron_rl_fp8.rollout.config import RolloutConfig

    names = [f.name for f in dataclasses.fields(RolloutConfig)]
    assert names[:2] == ["engine", "sglang"]  # each section right after the engine's name
    sglang = ENGINES["sglang"]
    assert isinstance(RolloutConfig().sglang, sglang.settings)
    assert not any(s.settings for s in (LOCAL, RECORDING))
    cfg = load_config(None, ["rollout.sglang.tp_size=2"])
    assert cfg.rollout.sglang.tp_size == 2
    with pytest.raises(ValueError, match="must be an identifier"):
        _spec("my-engine", settings=sglang.settings)


# -- the launcher reaches an engine's servers through its spec alone -------------------------------
class _ToyLauncher:
    def check(self, cfg, *, nodes, gpus_per_node):
        if nodes < 2:
            raise ConfigError("toy needs two nodes")

    def nodes_needed(self, cfg, *, gpus_per_node, most_per_node):
        return 1

    def place(self, cfg, *, nodes, gpus_per_node, colocated, most_per_node):
        return Placement(gpus=((0, 1), (2, 3), (4, 5)), tp=2, notes=("toy: three engines",))

    def trainer_overrides(self, engines, router_url, derived_count):
        return [f"toy.urls={[e.url for e in engines]}", f"toy.router={router_url}"]


def test_the_launcher_places_an_engines_servers_by_its_spec(monkeypatch):
    from megatron_rl_fp8.launch.layout import node_role, plan_layout
    from megatron_rl_fp8.launch.render import RenderOptions, render, trainer_overrides
    from megatron_rl_fp8.launch.slurm import SlurmEnv

    toy = dataclasses.replace(TOY, launcher=_ToyLauncher)
    monkeypatch.setitem(ENGINES, "toy", toy)
    cfg = _toy_config(monkeypatch, "rollout.placement=dedicated")
    monkeypatch.setitem(ENGINES, "toy", toy)  # _toy_config registered the plain one
    env = SlurmEnv(nodes=("a", "b", "c"), gpus_per_node=8, job_id=3)
    layout = plan_layout(cfg, env)
    assert layout.train_nodes == ("a", "b") and layout.rollout_nodes == ("c",)
    assert [(e.node, e.gpus, e.port) for e in layout.engines] == [
        ("c", (0, 1), 10610),
        ("c", (2, 3), 10620),
        ("c", (4, 5), 10630),
    ]
    assert trainer_overrides(layout) == [
        "toy.urls=['http://c:10610', 'http://c:10620', 'http://c:10630']",
        "toy.router=http://c:10601",
    ]
    assert node_role(layout, 2).engines == layout.engines and node_role(layout, 2).router_port
    opts = RenderOptions(config="x.yaml", python="python", torchrun="torchrun")
    assert [c.name for c in render(layout, opts)] == ["trainer", "rollout-2"]
    with pytest.raises(ConfigError, match="toy needs two nodes"):
        plan_layout(cfg, SlurmEnv(nodes=("a",), gpus_per_node=8, job_id=3))
    monkeypatch.setitem(ENGINES, "toy", TOY)  # no launcher
    with pytest.raises(ConfigError, match="rollout.engine=toy has no launcher"):
        plan_layout(cfg, env)
