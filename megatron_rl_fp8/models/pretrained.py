"""Starting from trained weights: a Hugging Face folder (``model.hf_checkpoint``) or an
``hf-to-mcore`` output (``model.load``).

Two moments, two functions:

* **Config time** (:func:`fill_model_section`, called by ``load_config`` on the raw YAML mapping):
  the model section is read from the checkpoint (``config.json``, or the conversion record that
  ``hf-to-mcore`` writes), so a user types only the path. A field the user *did* type must agree
  with the checkpoint; if not, the error names both values. ``RunConfig.validate`` repeats the
  comparison on the built config (:func:`check_model_matches`), which also covers configs made in
  Python, and checks that a converted checkpoint's vocab padding fits the run's TP.
* **Build time** (``convert/start_weights.py``: ``load_hf_weights``, ``load_converted``): each
  rank fills *its own* parameters, one Megatron tensor at a time from an HF folder, or with
  ``dist_checkpointing`` (any layout) from a converted checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import MappingError, model_config_from_hf

# ModelConfig fields a checkpoint determines, with the config.json key a user would look up.
ARCH_FIELDS: dict[str, str] = {
    "arch": "architectures",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rope_scaling_factor": "rope_scaling.factor",
    "norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "num_experts": "num_experts",
    "moe_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
}
# Filled from the checkpoint but free to lower: the longest sequence this run serves.
_MAX_POSITIONS = "max_position_embeddings"
# Filled from the checkpoint but free to change: a training setting it was released with.
_TRAINING_DEFAULTS = ("moe_aux_loss_coeff",)
CONVERSION_RECORD = "trainer_state.json"  # what hf-to-mcore writes next to the shards


def expand_path(path: str) -> Path:
    return Path(path).expanduser()


def converted_dir(load: str | Path) -> Path:
    """The checkpoint directory ``model.load`` names: itself, or what its ``latest`` names."""
    path = expand_path(str(load))
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    return path


def _read_json(path: Path, field: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{field}: cannot read {path} ({e}); is the checkpoint complete?") from e


def source_model(*, hf_checkpoint: str | None, load: str | None) -> tuple[ModelConfig, str] | None:
    """The architecture the start checkpoint has, and a name for it in messages.

    ``model.load`` wins when both are set (its weights are the ones loaded); a plain trainer
    checkpoint (no conversion record) has no architecture to read, and gives None.
    """
    if load is not None:
        ckpt = converted_dir(load)
        record = ckpt / CONVERSION_RECORD
        if not ckpt.is_dir() or not record.is_file():
            raise ConfigError(
                f"model.load={load!r}: no checkpoint there ({record} is missing); pass the output "
                "folder of `megatron-rl-fp8 convert hf-to-mcore` or a run's checkpoints folder"
            )
        state = _read_json(record, "model.load")
        if "model" not in state:
            return None  # a trainer checkpoint: the model section must be given
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in state["model"].items() if k in fields}), str(record)
    if hf_checkpoint is None:
        return None
    folder = expand_path(hf_checkpoint)
    if not folder.is_dir():
        raise ConfigError(
            f"model.hf_checkpoint={hf_checkpoint!r} is not a folder; give the local directory of "
            "a Hugging Face model (config.json, *.safetensors, tokenizer files)"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"model.hf_checkpoint={hf_checkpoint!r} has no config.json; give the directory of a "
            "Hugging Face model (the one save_pretrained writes)"
        )
    try:
        model, _notes = model_config_from_hf(_read_json(config_path, "model.hf_checkpoint"))
    except MappingError as e:
        raise ConfigError(f"model.hf_checkpoint: {config_path}: {e}") from None
    return model, str(config_path)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _disagreement(field: str, mine: Any, model: ModelConfig, where: str) -> str | None:
    theirs = getattr(model, field)
    if field == "head_dim":  # None means hidden/heads on either side: compare what is used
        theirs = model.kv_channels
        if mine is None:
            return None
    if _same(mine, theirs):
        return None
    return (
        f"model.{field}={mine!r} disagrees with {where} ({ARCH_FIELDS[field]} -> {theirs!r}); "
        f"remove model.{field} from the config (it is read from the checkpoint) or point the "
        "checkpoint path at the model you mean"
    )


def fill_model_section(section: dict) -> dict:
    """The raw ``model:`` mapping with the start checkpoint's architecture filled in.

    Fields the user typed are kept and checked against the checkpoint (a disagreement raises
    ConfigError naming both values); ``max_position_embeddings`` may be lowered, not raised.
    ``params_dtype`` is the run's choice (``auto``), not the checkpoint's storage dtype.
    """
    source = source_model(hf_checkpoint=section.get("hf_checkpoint"), load=section.get("load"))
    if source is None:
        return section
    model, where = source
    for field in ARCH_FIELDS:
        if field in section:
            problem = _disagreement(field, section[field], model, where)
            if problem:
                raise ConfigError(problem)
    filled = {field: getattr(model, field) for field in ARCH_FIELDS}
    limit = model.max_position_embeddings
    mine = section.get(_MAX_POSITIONS, limit)
    if isinstance(mine, int) and mine > limit:
        raise ConfigError(
            f"model.{_MAX_POSITIONS}={mine} exceeds the checkpoint's {limit} ({where}); the model "
            "was not trained on longer sequences: lower it or remove it"
        )
    filled[_MAX_POSITIONS] = limit
    filled.update({field: getattr(model, field) for field in _TRAINING_DEFAULTS})
    return {**filled, **section}


def check_model_matches(model: ModelConfig, tensor_model_parallel_size: int) -> None:
    """The built model section agrees with its start checkpoint, and (``model.load``) the
    converted vocab padding is the one this TP needs."""
    source = source_model(hf_checkpoint=model.hf_checkpoint, load=model.load)
    if source is None:
        return
    ckpt_model, where = source
    for field in ARCH_FIELDS:
        problem = _disagreement(field, getattr(model, field), ckpt_model, where)
        if problem:
            raise ConfigError(problem)
    if model.load is not None:
        state = _read_json(converted_dir(model.load) / CONVERSION_RECORD, "model.load")
        padded = state.get("padded_vocab_size")
        want = model.padded_vocab_size(tensor_model_parallel_size)
        if padded is not None and padded != want:
            raise ConfigError(
                f"model.load={model.load!r} was converted with its vocab padded to {padded} rows "
                f"(--tp {state.get('tensor_model_parallel_size')}), this run needs {want} "
                f"(TP={tensor_model_parallel_size}, model.make_vocab_size_divisible_by="
                f"{model.make_vocab_size_divisible_by}); convert again with "
                f"--tp {tensor_model_parallel_size}, or start from model.hf_checkpoint"
            )


def is_hf_folder(path: str | Path) -> bool:
    """An HF model folder has a config.json; a converted or trainer checkpoint does not."""
    return (Path(path).expanduser() / "config.json").is_file()


def check_ref_checkpoint(model: ModelConfig) -> None:
    """``model.ref_checkpoint``, when set, is a checkpoint of the actor's architecture (where
    it records one: a trainer checkpoint does not, and its loader checks the shapes). Raises
    ConfigError naming the field; reads only small metadata files."""
    path = model.ref_checkpoint
    if path is None:
        return
    hf = is_hf_folder(path)
    if not hf and not (converted_dir(path) / "trainer_state.json").is_file():
        raise ConfigError(
            f"model.ref_checkpoint={path!r} is neither a Hugging Face model folder (config.json, "
            "*.safetensors) nor a converted checkpoint (an hf-to-mcore output, a run's "
            "checkpoints folder or one iter_* in it); point it at one, or null for the run's "
            "starting weights"
        )
    try:
        source = source_model(hf_checkpoint=path if hf else None, load=None if hf else path)
    except ConfigError as e:
        raise ConfigError(f"model.ref_checkpoint: {e}") from None
    if source is None:
        return
    theirs, where = source
    for name in ARCH_FIELDS:
        mine, other = getattr(model, name), getattr(theirs, name)
        if name == "head_dim":  # None means hidden / heads on either side
            mine, other = model.kv_channels, theirs.kv_channels
        if mine != other:
            raise ConfigError(
                f"model.ref_checkpoint={path!r} has {name}={other!r} ({where}) but the actor has "
                f"model.{name}={mine!r}: the reference must have the actor's architecture"
            )
