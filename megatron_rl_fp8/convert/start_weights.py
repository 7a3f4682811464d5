"""A fresh run's start weights, filled on every rank at its own layout: from a Hugging Face
folder (``model.hf_checkpoint``: one Megatron tensor at a time, assembled from memory-mapped
safetensors by the converter's plan, ``plan.py``, padded for the run's TP and cut to this rank's
shard, so no rank holds more than one full tensor in host memory) or from an ``hf-to-mcore`` /
trainer checkpoint (``model.load``, read with ``dist_checkpointing`` at any layout). What the
model section must say about such a start is ``models/pretrained.py``'s (config time)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl_fp8 import checkpoint
from megatron_rl_fp8.convert.assembly import assemble_pieces, hf_to_mcore_plan
from megatron_rl_fp8.convert.hf_io import HFCheckpoint
from megatron_rl_fp8.convert.hf_to_mcore import check_hf_tensors
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.pretrained import converted_dir, expand_path
from megatron_rl_fp8.sync.gather import global_names, split_tp_shard, unwrap

# -- loading weights ----------------------------------------------------------------------------
# Transformer Engine layer specs keep the pre-attention / pre-MLP norms inside the fused linears;
# the conversion plan uses the local-spec names.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _plan_name(name: str, model: ModelConfig) -> str:
    if name == "output_layer.weight" and model.tie_word_embeddings:
        # Tied embeddings under PP > 1: the last stage's output layer is a copy of the embedding.
        return "embedding.word_embeddings.weight"
    for te, local in _TE_NORMS.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


@torch.no_grad()
def load_hf_weights(
    module: torch.nn.Module, hf_dir: str | Path, model: ModelConfig, *, tp_rank: int, tp_size: int
) -> int:
    """Copy an HF checkpoint's weights into this rank's parameters; returns how many it filled.

    Every parameter must be filled (the model is built without random init when it starts from a
    checkpoint), so a tensor the plan does not cover is an error, as is any missing, extra or
    misshapen tensor in the checkpoint (listed together, before anything is copied).
    """
    module = unwrap(module)
    plan = dict(hf_to_mcore_plan(model))
    names = global_names(module)
    padded = model.padded_vocab_size(tp_size)
    filled = 0
    with HFCheckpoint(expand_path(str(hf_dir))) as ckpt:
        check_hf_tensors(ckpt, model)
        for local, param in module.named_parameters():
            key = _plan_name(names[local], model)
            if key not in plan:
                raise RuntimeError(
                    f"parameter {names[local]} has no source in the HF checkpoint plan; the "
                    "layer spec and convert/assembly.py disagree"
                )
            cache: dict[str, torch.Tensor] = {}  # q/k/v are read once, not once per head

            def get(hf_name: str, _cache=cache) -> torch.Tensor:
                if hf_name not in _cache:
                    _cache[hf_name] = ckpt.get(hf_name)
                return _cache[hf_name]

            full = assemble_pieces(plan[key], get)
            if key in _VOCAB_TENSORS and padded > full.shape[0]:
                # Padding rows are zeros; logprobs mask them out (models/logprobs.py).
                full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
            shard = split_tp_shard(key, full, tp_rank, tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise RuntimeError(
                    f"{names[local]}: checkpoint shard {tuple(shard.shape)} != parameter "
                    f"{tuple(param.shape)} (TP={tp_size})"
                )
            param.copy_(shard)
            filled += 1
    return filled


def load_converted(actor, load: str | Path) -> Path:
    """Weights of a converted (or trainer) checkpoint into ``actor``; optimizer state is not read.
    Collective over all ranks. Returns the directory read."""
    path = converted_dir(load)
    loaded, _state = checkpoint.load(path, actor.sharded_state_dict(with_optimizer=False))
    actor.load_sharded(loaded)
    return path
