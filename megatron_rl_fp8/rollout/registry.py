"""Rollout engines by name: everything the config, the trainer and the commands know of an engine.

An engine is its ``RolloutEngine`` class (``rollout/base.py``) plus one :class:`EngineSpec`: how to
build it, the placements it supports, how often the trainer retries a sync or a rollout it lost,
the word its errors are reported under, and the settings it cannot run with. ``rollout.engine``
names a registered spec; nothing outside an engine's own folder branches on its name.

Where specs come from:
* the in-process engine, ``local``, is registered here;
* every subpackage of ``rollout/`` with a ``spec`` module registers its own when this module is
  imported (``rollout/sglang/spec.py``), so a new built-in engine is a new folder;
* a user's or a test's engine: ``rollout.engine: package.module:SPEC``, an :class:`EngineSpec` that
  loading the config imports and registers under its ``name`` (the trainer's ranks and the
  launcher import it the same way), as ``reward.function`` takes a user's reward.

Importing this module imports no torch: a spec's ``build`` imports its engine's code when called.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl_fp8.utils.imports import OBJECT_PATH, import_object

if TYPE_CHECKING:
    from megatron_rl_fp8.rollout.base import RolloutEngine
    from megatron_rl_fp8.rollout.launching import Launcher

# ``RolloutConfig`` (rollout/config.py, which reads this registry) in the signatures below.
RolloutConfig = Any

PLACEMENTS = ("dedicated", "colocated")
"""``rollout.placement``'s values: GPUs of the engines' own, or the trainer's GPUs shared."""


def _no_restarts(cfg: RolloutConfig) -> int:
    return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hosts:
    """The machines a run is planned or launched on, as an engine's planning hooks see them."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    on_gpu: bool = True
    """False: a CPU run (no GPU memory to share)."""

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fleet:
    """The rollout engines a run starts, as the planner's step-time model sees them: ``engines``
    servers of ``tp`` GPUs each, sharing the trainer's GPUs (colocated) or on GPUs of their own
    (dedicated), with ``mem_fraction`` of each GPU for weights + KV cache. The ``*_setting``
    fields name the settings behind the numbers, for the planner's errors and notes."""

    engines: int
    tp: int
    placement: str
    mem_fraction: float
    count_setting: str = "the engine count"
    tp_setting: str = "the engines' TP size"
    memory_setting: str = "the engines' memory fraction"
    count_note: str = ""
    """Where the count comes from, when the engine derived it (``""``: it is the setting's)."""


@dataclasses.dataclass(frozen=True)
class GpuShare:
    """Memory the engines' processes hold on a trainer's GPU: one row of the planner's table
    (``plan/memory.py``), which ``torch.cuda.max_memory_allocated`` in the trainer never sees."""

    name: str
    bytes: float
    note: str | None = None


def _no_share(cfg: RolloutConfig, hosts: Hosts) -> tuple[GpuShare, ...]:
    return ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One rollout engine, as the rest of the package sees it."""

    name: str
    """What ``rollout.engine`` says to pick it."""
    help: str
    """One line for ``rollout.engine``'s help: what it is and what it needs."""
    build: Callable[..., RolloutEngine]
    """``build(cfg, hf_cfg, *, pad_token_id, eos_token_id, output_dir, device, dtype,
    pipeline_model_parallel_size)``: the engine, ready for its first ``update_weights``
    (``rollout.build_engine`` documents the arguments)."""
    placements: tuple[str, ...] = ("dedicated",)
    """The ``rollout.placement`` values it runs with (``colocated``: it releases and resumes its
    GPU memory around each training phase)."""
    max_restarts: Callable[[RolloutConfig], int] = _no_restarts
    """How many more times the trainer runs a sync that did not reach every engine, or a rollout
    whose engines lost the synced weights, before it gives up (0: once only)."""
    in_process: bool = False
    """It runs inside the trainer's driver process: the launcher places no server for it and
    every node trains."""
    error_label: str = "rollout error"
    """The word the CLI prints its ``RolloutEngineError`` under (``<label>: <one line>``)."""
    settings: type | None = None
    """The dataclass of its own section, ``rollout.<name>`` (the config machinery's ``field``s,
    each with its help). Built-in engines only: the section is part of ``RolloutConfig``, which
    is made when the registry first loads, before a plugin engine is imported."""
    settings_help: str = ""
    """One line for the section's help."""
    check: Callable[[RolloutConfig], None] | None = None
    """Rollout settings it cannot run with: raises ``ValueError`` naming the setting and the fix
    (run while ``rollout.*`` is checked, before anything starts)."""
    check_run: Callable[[Any, bool], None] | None = None
    """Settings of other sections it cannot run with: ``check_run(run_config, this_machine)``
    raises ``ConfigError`` (run by ``RunConfig.validate``; ``this_machine``: the run starts
    here, so this machine's GPUs count)."""
    fleet: Callable[[RolloutConfig, Hosts], Fleet] | None = None
    """The servers it starts on ``hosts`` (the planner's step-time model; ConfigError where the
    settings cannot be placed there). None: it runs in the trainer, and the planner models the
    first registered engine that has a fleet instead, saying so."""
    trainer_gpu_share: Callable[[RolloutConfig, Hosts], tuple[GpuShare, ...]] = _no_share
    """What its processes hold on a trainer's GPU (colocated engines' memory, their CUDA
    contexts), each with a note for the planner's table; empty where they hold nothing there."""
    launcher: Callable[[], Launcher] | None = None
    """Its :class:`~.launching.Launcher`: how ``megatron-rl-fp8 launch`` places, checks and
    starts its servers on a Slurm job (called when needed, so its code may import torch). None:
    it runs in the trainer, or the launcher cannot start it (the driver starts its servers
    itself on its own node)."""
    launched_beside_trainer: Callable[[RolloutConfig, Hosts], bool] = lambda cfg, hosts: False
    """The launcher starts its servers on the trainer's GPUs for this config (the planner then
    asks the launcher's layout whether it would refuse them)."""

    def __post_init__(self):
        if self.settings is not None and not re.fullmatch(r"[A-Za-z_]\w*", self.name):
            raise ValueError(
                f"EngineSpec.name={self.name!r}: an engine with settings names its section "
                "rollout.<name>, so its name must be an identifier"
            )
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.name):
            raise ValueError(f"EngineSpec.name={self.name!r}: a word (letters, digits, _ or -)")
        for p in self.placements:
            if p not in PLACEMENTS:
                raise ValueError(
                    f"EngineSpec {self.name!r}: placement {p!r} is not one of {PLACEMENTS}"
                )


ENGINES: dict[str, EngineSpec] = {}
"""Registered engines by name, built-in ones first."""


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add ``spec`` under its name (registering the same spec again is a no-op)."""
    if not isinstance(spec, EngineSpec):
        raise TypeError(f"register_engine takes an EngineSpec, got {type(spec).__name__}")
    old = ENGINES.get(spec.name)
    if old is not None and old is not spec:
        raise ValueError(f"a rollout engine named {spec.name!r} is already registered")
    ENGINES[spec.name] = spec
    return spec


def engine_spec(engine: str) -> EngineSpec:
    """The spec ``rollout.engine`` names: a registered name, or ``package.module:SPEC`` (imported
    and registered). Raises ``ValueError`` naming the setting, the value and the choices."""
    if not isinstance(engine, str):
        raise ValueError(f"rollout.engine={engine!r} must be a string: one of {names()}")
    if engine in ENGINES:
        return ENGINES[engine]
    if not OBJECT_PATH.fullmatch(engine):
        raise ValueError(
            f"rollout.engine={engine!r} is not a registered engine ({names()}); name one, or "
            "write package.module:SPEC for an EngineSpec of your own"
        )
    obj = import_object(engine, "rollout.engine", what="EngineSpec")
    if not isinstance(obj, EngineSpec):
        raise ValueError(
            f"rollout.engine={engine!r} is a {type(obj).__name__}, not an EngineSpec "
            "(megatron_rl_fp8.rollout.registry.EngineSpec)"
        )
    register_engine(obj)
    ENGINES[engine] = obj  # the config keeps the dotted value; later lookups find it here
    return obj


def sections() -> list[tuple[str, type, str]]:
    """(name, dataclass, help) of every registered engine's own section, ``rollout.<name>``."""
    return [
        (spec.name, spec.settings, spec.settings_help)
        for name, spec in ENGINES.items()
        if name == spec.name and spec.settings is not None
    ]


def choices() -> str:
    """The registered engines with their help, for ``rollout.engine``'s help."""
    return "; ".join(f"{s.name} = {s.help}" for name, s in ENGINES.items() if name == s.name)


def names() -> str:
    """The registered engines' names, for errors."""
    return ", ".join(name for name, s in ENGINES.items() if name == s.name)


def planned_fleet(cfg: RolloutConfig, hosts: Hosts) -> tuple[Fleet, str | None]:
    """The fleet the planner models for ``cfg``: its engine's, or (an engine that runs in the
    trainer) the first registered engine's that has one, with a note saying which."""
    spec = engine_spec(cfg.engine)
    if spec.fleet is not None:
        return spec.fleet(cfg, hosts), None
    stand_in = next((s for s in ENGINES.values() if s.fleet is not None), None)
    if stand_in is None:
        raise ValueError(f"no registered engine describes a fleet to plan ({names()})")
    return stand_in.fleet(cfg, hosts), (
        f"rollout.engine={cfg.engine} runs inside the trainer; the step-time model plans "
        f"{stand_in.name}'s engines instead (rollout.engine={stand_in.name})"
    )


def error_labels() -> tuple[str, ...]:
    """Every registered engine's error word (the study reads runs' last error lines by them)."""
    return tuple(dict.fromkeys(s.error_label for s in ENGINES.values()))


def _build_local(cfg, hf_cfg, *, pad_token_id, eos_token_id, device=None, dtype=None, **_):
    # lazy: torch and transformers (importing the registry loads no engine code)
    from megatron_rl_fp8.rollout.local import LocalEngine

    kw = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    return LocalEngine(
        hf_cfg,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        fp8=cfg.fp8,
        return_routes=cfg.routing_replay != "none",
        **kw,
    )


LOCAL = register_engine(
    EngineSpec(
        name="local",
        help="the in-process transformers engine on the trainer's driver rank (CPU and small "
        "GPU runs; always dedicated: it runs inside the trainer)",
        build=_build_local,
        in_process=True,
    )
)


def _register_builtin() -> None:
    """Import the ``spec`` module of every engine folder of ``rollout/`` (each registers its own)."""
    package = __name__.rsplit(".", 1)[0]
    for found in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if found.ispkg and (Path(__file__).parent / found.name / "spec.py").exists():
            importlib.import_module(f"{package}.{found.name}.spec")


_register_builtin()
