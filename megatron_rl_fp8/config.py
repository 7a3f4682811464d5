"""RunConfig: one run = per-concern dataclasses, loaded from YAML, validated before anything starts.

Each section's dataclass lives next to the code that uses it; this module composes them and checks
the rules that span sections (parallel layout vs model shape vs batch sizes) once, before any
process group, server or weight exists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import yaml

from megatron_rl_fp8.config_utils import ConfigError, field, from_dict, set_dotted, to_dict
from megatron_rl_fp8.data.prompts import TokenizerConfig
from megatron_rl_fp8.data.task import TaskConfig
from megatron_rl_fp8.fp8.backend import resolve_backend
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.te import fp8_weight_shapes, have_te, te_fp8_dims_problem
from megatron_rl_fp8.loss.config import PolicyLossConfig
from megatron_rl_fp8.metrics.config import LoggingConfig
from megatron_rl_fp8.metrics.logger import require_packages
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.memory import MemoryConfig
from megatron_rl_fp8.models.pretrained import (
    check_model_matches,
    check_ref_checkpoint,
    fill_model_section,
)
from megatron_rl_fp8.parallel import ParallelConfig, check_context_parallel
from megatron_rl_fp8.reward.verifiers import VERIFIERS, RewardConfig
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.environment import EnvConfig
from megatron_rl_fp8.rollout.registry import engine_spec
from megatron_rl_fp8.trainer.config import GuardConfig, OptimConfig, SFTConfig, TrainConfig
from megatron_rl_fp8.utils.yaml_unique import safe_load as safe_load_unique
from megatron_rl_fp8.utils.yaml_unique import yaml_problem

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
SFT_STEPS_FROM_SCRATCH = 300
DEFAULT_CONFIG = EXAMPLES_DIR / "tiny_cpu.yaml"


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig, help="Architecture and shapes.")
    parallel: ParallelConfig = field(default_factory=ParallelConfig, help="TP / PP layout.")
    tokenizer: TokenizerConfig = field(
        default_factory=TokenizerConfig, help="Tokenizer and prompt layout (chat template)."
    )
    task: TaskConfig = field(default_factory=TaskConfig, help="Prompts and length limits.")
    reward: RewardConfig = field(default_factory=RewardConfig, help="Reward shaping.")
    rollout: RolloutConfig = field(default_factory=RolloutConfig, help="Sampling.")
    env: EnvConfig = field(
        default_factory=EnvConfig,
        help="Multi-turn rollouts: the tools the policy calls between turns (none = one turn).",
    )
    fp8: FP8Config = field(
        default_factory=FP8Config,
        help="FP8 training: recipe of the actor's linear layers (bf16 = off).",
    )
    memory: MemoryConfig = field(
        default_factory=MemoryConfig,
        help="Activation memory of the actor: Megatron's activation recomputation.",
    )
    optim: OptimConfig = field(default_factory=OptimConfig, help="Optimizer.")
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig, help="Policy loss.")
    sft: SFTConfig = field(default_factory=SFTConfig, help="Supervised warm start.")
    train: TrainConfig = field(default_factory=TrainConfig, help="Loop shape and outputs.")
    guard: GuardConfig = field(
        default_factory=GuardConfig,
        help="Stability guard: rules on each step's metrics (non-finite loss, entropy rise, "
        "mismatch, reward collapse, garbled outputs) and the action each takes.",
    )
    logging: LoggingConfig = field(
        default_factory=LoggingConfig,
        help="Metric loggers: metrics.jsonl always; TensorBoard and W&B when switched on.",
    )

    def __post_init__(self):
        if self.sft.steps is None:
            # A random tiny model needs a supervised start to ever be rewarded; a pretrained one
            # does not, and SFT on bare answers would only teach it a format.
            self.sft.steps = 0 if self.model.pretrained else SFT_STEPS_FROM_SCRATCH
        # The seeds left null follow train.seed: one number varies a run (config.yaml records
        # what each resolved to).
        for section in (self.sft, self.task, self.rollout):
            if section.seed is None:
                section.seed = self.train.seed

    def _check_experts(self, dp: int) -> None:
        """Mixture-of-experts rules (issue 47): the expert-parallel layout, routing replay."""
        m, ep = self.model, self.parallel.expert_model_parallel_size
        replay = self.rollout.routing_replay
        if replay != "none" and m.num_experts is None:
            raise ConfigError(
                f"rollout.routing_replay={replay} needs a mixture-of-experts model "
                "(model.num_experts); set it to none for a dense one"
            )
        if replay != "none" and self.env.tools is not None:
            raise ConfigError(
                f"rollout.routing_replay={replay} with env.tools: multi-turn rollouts do not "
                "carry their turns' routes yet; set rollout.routing_replay=none"
            )
        if m.num_experts is None:
            if ep > 1:
                raise ConfigError(
                    f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model "
                    "(model.num_experts); set it to 1 for a dense one"
                )
            return
        if m.num_experts % ep:
            raise ConfigError(
                f"model.num_experts={m.num_experts} must be divisible by "
                f"parallel.expert_model_parallel_size={ep}"
            )
        problem = self.parallel.expert_layout_problem(dp)
        if problem:
            raise ConfigError(problem)
        if self.parallel.tensor_model_parallel_size > 1 and not self.parallel.sequence_parallel:
            raise ConfigError(
                "parallel.tensor_model_parallel_size > 1 with model.num_experts needs "
                "parallel.sequence_parallel: true (Megatron's MoE layer refuses to train "
                "without it)"
            )

    def validate(self, world_size: int = 1, *, this_machine: bool = True) -> RunConfig:
        """Cross-section rules; raises ConfigError naming the fields involved. ``this_machine``:
        also what this machine must have to run it (logger packages, Transformer Engine where a
        setting needs it); off when planning a run for another machine."""
        p, m, t = self.parallel, self.model, self.train
        check_model_matches(m, p.tensor_model_parallel_size)
        if self.loss.kl_coef > 0:
            check_ref_checkpoint(m)
        self._check_reward()
        # On every rank: only the driver logs, but a missing package must stop all of them.
        if this_machine:
            require_packages(self.logging)
        try:
            self.optim.resolved_lr_decay_steps(t.steps * t.updates_per_step)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if world_size % p.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size "
                f"({tp}) * parallel.pipeline_model_parallel_size ({pp}) * "
                f"parallel.context_parallel_size ({p.context_parallel_size}); change the layout "
                "or the number of processes"
            )
        dp = world_size // p.model_parallel_size
        self._check_experts(dp)
        if m.num_layers % pp:
            raise ConfigError(
                f"model.num_layers={m.num_layers} is not divisible by "
                f"parallel.pipeline_model_parallel_size={pp}"
            )
        self._check_scale_features(this_machine)
        spec = engine_spec(self.rollout.engine)
        if spec.check_run is not None:
            spec.check_run(self, this_machine)
        problem = self.memory.check_layers(m.num_layers // pp)
        if problem:
            raise ConfigError(problem)
        if m.num_attention_heads % tp or m.num_query_groups % tp:
            raise ConfigError(
                f"model.num_attention_heads={m.num_attention_heads} and model.num_query_groups="
                f"{m.num_query_groups} must both be divisible by "
                f"parallel.tensor_model_parallel_size={tp}"
            )
        if m.ffn_hidden_size % tp:
            raise ConfigError(
                f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp}"
            )
        if self.rollout.n_samples_per_prompt < 2:
            raise ConfigError(
                f"rollout.n_samples_per_prompt={self.rollout.n_samples_per_prompt}: GRPO's "
                "advantage is each reward minus its group's mean, so a group of one has advantage "
                "0 and the run would train on nothing; use >= 2 (8 or 16 is usual)"
            )
        rows = t.prompts_per_step * self.rollout.n_samples_per_prompt
        per_update = rows // t.updates_per_step
        # Under a token budget micro-batches have any row count: rows need only split evenly
        # over the updates and the data-parallel ranks.
        budget = t.max_tokens_per_gpu is not None
        row_unit = dp if budget else dp * t.micro_batch_size
        unit = (
            f"data-parallel size ({dp}) (train.max_tokens_per_gpu is set)"
            if budget
            else f"data-parallel size ({dp}) * train.micro_batch_size ({t.micro_batch_size})"
        )
        if rows % t.updates_per_step or per_update % row_unit:
            raise ConfigError(
                f"train.prompts_per_step * rollout.n_samples_per_prompt = {rows} rows must split "
                f"into train.updates_per_step={t.updates_per_step} mini-batches, each a multiple "
                f"of {unit}"
            )
        if self.sft.steps and self.sft.batch_size % row_unit:
            raise ConfigError(f"sft.batch_size={self.sft.batch_size} must be a multiple of {unit}")
        if self.fp8.enabled and self.loss.calib.enabled and t.updates_per_step < 2:
            raise ConfigError(
                "loss.calib.enabled with fp8 training needs train.updates_per_step >= 2: with one "
                "update per step pi_theta == pi_old, every ratio is 1 and there is nothing to "
                "calibrate; raise train.updates_per_step or set loss.calib.enabled=false"
            )
        if t.pipeline == "one_step_off" and self.rollout.placement == "colocated":
            raise ConfigError(
                "train.pipeline=one_step_off overlaps generation with training, which colocated "
                "engines cannot (they share the trainer's GPUs and take turns with it); set "
                "rollout.placement=dedicated or train.pipeline=sync"
            )
        if self.loss.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(
                f"loss.overlong_buffer={self.loss.overlong_buffer} exceeds "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        actions = self.guard.actions_in_use()
        if "bf16" in actions and not self.fp8.enabled:
            raise ConfigError(
                "a guard rule's action is bf16 (train without FP8 for guard.bf16_steps) but "
                "fp8.recipe is bf16 already: choose another action (guard.on_*)"
            )
        if "recalibrate" in actions and not (self.fp8.enabled and self.loss.calib.enabled):
            raise ConfigError(
                "guard.on_mismatch=recalibrate needs FP8 training with loss.calib.enabled=true; "
                "choose bf16, rollback or stop, or set guard.max_mismatch=null"
            )
        longest = self.task.max_prompt_len + self.rollout.max_new_tokens
        if longest > m.max_position_embeddings:
            raise ConfigError(
                f"task.max_prompt_len + rollout.max_new_tokens = {longest} exceeds "
                f"model.max_position_embeddings={m.max_position_embeddings}"
            )
        return self

    def _check_scale_features(self, this_machine: bool) -> None:
        p, cp = self.parallel, self.parallel.context_parallel_size
        # Under CP each rank holds part of every sequence (trainer/context_parallel.py): what
        # needs a whole row inside the loss cannot be computed there.
        if cp > 1 and self.loss.agg == "seq-mean-token-mean":
            raise ConfigError(
                f"loss.agg=seq-mean-token-mean divides by each sequence's token count, which "
                f"parallel.context_parallel_size={cp} splits over ranks; use token-mean or "
                "seq-mean-token-sum, or context_parallel_size=1"
            )
        level = self.loss.is_correction.level if self.loss.is_correction else "token"
        if cp > 1 and level != "token":
            raise ConfigError(
                f"loss.is_correction.level={level} weighs whole sequences, which "
                f"parallel.context_parallel_size={cp} splits over ranks; use level=token, or "
                "context_parallel_size=1"
            )
        if self.memory.optimizer_cpu_offload and not p.use_distributed_optimizer:
            raise ConfigError(
                "memory.optimizer_cpu_offload needs parallel.use_distributed_optimizer=true "
                "(Megatron offloads the distributed optimizer's shards)"
            )
        if self.fp8.enabled and self.fp8.backend == "torchao":
            self._check_fp8_weight_shapes("torchao")
        if not this_machine:
            if self.fp8.enabled and self.fp8.backend == "te":
                self._check_fp8_weight_shapes("te")
            return
        # What the actor will build on this machine (as Actor.__init__ decides it).
        try:
            backend = resolve_backend(self.fp8)
        except ValueError as e:
            raise ConfigError(f"fp8.{str(e).removeprefix('FP8Config.')}") from None
        use_te = torch.cuda.is_available() and backend in (None, "te") and have_te()
        try:
            self.memory.check_backend(use_te=use_te)
            check_context_parallel(cp, use_te=use_te)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if use_te and backend == "te":
            self._check_fp8_weight_shapes("te")

    def _check_fp8_weight_shapes(self, backend: str) -> None:
        """FP8 GEMMs that refuse weights whose per-TP-rank shape breaks their alignment rule: TE's
        (``fp8/te.py: te_fp8_dims_problem``; the sequence side is padded by the actor), and
        torchao's, which pads only the contraction dim while ATen's ``_scaled_mm`` wants both dims
        of its second operand (the weight, in fprop and dgrad) multiples of 16. The model's
        widths cannot be padded."""
        tp = self.parallel.tensor_model_parallel_size
        for name, shape in fp8_weight_shapes(self.model, tp).items():
            if backend == "te":
                problem = te_fp8_dims_problem(shape, self.fp8.recipe)
            elif shape[0] % 16 or shape[1] % 16:
                problem = (
                    f"shape {list(shape)}: ATen's _scaled_mm needs both dims of the weight "
                    "multiples of 16 (torchao pads only the contraction dim)"
                )
            else:
                problem = None
            if problem:
                raise ConfigError(
                    f"fp8.backend={backend}: the {name} weight of one of {tp} tensor-parallel "
                    f"rank(s) has {problem}; change model.hidden_size / ffn_hidden_size / "
                    "head_dim or parallel.tensor_model_parallel_size, or use fp8.backend=torch "
                    "(which pads)"
                )

    def _check_reward(self) -> None:
        if getattr(self.reward, "function", None) is None and self.task.name not in VERIFIERS:
            raise ConfigError(
                f"task.name={self.task.name!r} has no verifier; known: {sorted(VERIFIERS)}. "
                "Pick one, register yours (megatron_rl_fp8.reward.register_verifier) or set "
                "reward.function: package.module:function"
            )

    def idle_settings(self) -> tuple[str, ...]:
        """Dotted prefixes of settings that change nothing in this run: the clip calibration's
        knobs where training is not FP8 or calibration is off, ``fp8.scales_per_step`` where the
        recipe keeps no scale history. The settings that decide it (``fp8.recipe``,
        ``loss.calib.enabled``) are never idle, so a change to them is still a change. A study
        ignores these when it checks an existing run against its file, so a default that moved
        under a BF16 or nominal arm does not refuse runs that it never acted on."""
        idle = []
        if not self.fp8.enabled:
            idle.append("loss.calib.")
        elif not self.loss.calib.enabled:
            idle += [
                f"loss.calib.{f.name}"
                for f in dataclasses.fields(self.loss.calib)
                if f.name != "enabled"
            ]
        if not (self.fp8.enabled and self.fp8.spec.delayed):
            idle.append("fp8.scales_per_step")
        return tuple(idle)

    def to_yaml(self) -> str:
        return yaml.safe_dump(to_dict(self), sort_keys=False)


def _json_or_yaml(raw: str) -> object:
    """An override's value. JSON is YAML, and a list the launcher writes (every engine's URL of
    a large job) parses in a fraction of PyYAML's time as JSON."""
    if raw.startswith(("[", "{")):
        try:
            return json.loads(raw)
        except ValueError:
            pass  # not JSON (e.g. [a, b] unquoted): YAML reads it below
    return yaml.safe_load(raw)


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} must look like section.key=value (e.g. train.steps=5)"
        )
    key, raw = text.split("=", 1)
    value = _json_or_yaml(raw)
    if isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string; users mean the number.
        try:
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict; ``base: other.yaml`` (relative to the file) is read first and this
    file's sections are merged over it, so variants state only what they change."""
    name = f"config file {str(path)!r}" + (f" (the base of {str(chain[-1])!r})" if chain else "")
    if path.is_dir():
        raise ConfigError(f"{name} is a directory; give the path of a YAML file")
    if not path.is_file():
        raise ConfigError(f"{name} does not exist")
    if path.resolve() in chain:
        raise ConfigError(f"config file {str(path)!r} includes itself through 'base'")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{name} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{name} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); a config is a "
            "YAML file"
        ) from None
    try:
        data = safe_load_unique(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{name} is not valid YAML: {yaml_problem(e, text)}") from None
    if data is None:
        # An empty file (or one of comments) would silently run on the built-in defaults: most
        # likely a wrong or truncated file. `{}` says "all defaults" on purpose.
        raise ConfigError(
            f"{name} is empty (or only comments); give at least one section, or write {{}} to "
            "run on the built-in defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name} must hold a mapping of sections (model:, train:, ...), got "
            f"{type(data).__name__} {data!r:.40}"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{str(path)!r}: 'base' must be a file name, got {base!r}")
    return _deep_merge(_read_yaml(path.parent / base, chain + (path.resolve(),)), data)


def read_config_dict(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """The run's settings as one mapping: the YAML file (its ``base`` chain merged) with the
    ``a.b=value`` overrides applied; nothing filled from a checkpoint, nothing validated."""
    data = _read_yaml(Path(path) if path is not None else DEFAULT_CONFIG)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (default: examples/tiny_cpu.yaml) + ``a.b=value`` overrides -> RunConfig."""
    data = read_config_dict(path, overrides)
    if isinstance(data.get("model"), dict):
        # A start checkpoint supplies the architecture; fields typed as well must agree with it.
        data["model"] = fill_model_section(data["model"])
    return from_dict(RunConfig, data)
