"""How each full Megatron tensor is assembled from HF tensors, for ``hf-to-mcore`` conversion.

A plan lists, per Megatron tensor, the row ranges of HF tensors that stacked in order give it, so
the converter writes fused tensors (QKV, SwiGLU fc1) as row blocks straight from memory-mapped
safetensors without materialising them. Derived from the layout facts of
:mod:`megatron_rl_fp8.models.hf_mapping`; tests check the plan builds what ``hf_state_to_mcore``
builds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import DIRECT


class Piece(NamedTuple):
    """Rows ``[start, stop)`` of one HF tensor (``rows=None``: all of it)."""

    hf_name: str
    rows: tuple[int, int] | None = None


def hf_to_mcore_plan(model: ModelConfig) -> list[tuple[str, list[Piece]]]:
    """How each full Megatron tensor is made of HF tensors, without touching any data.

    Returns ``[(megatron name, pieces)]`` (local-spec names, global layer numbers, unpadded vocab).
    Stacking the pieces' rows in order gives exactly what :func:`hf_state_to_mcore` builds, so a
    converter can write the pieces as row blocks of the fused tensor straight from memory-mapped
    HF files, never materialising a fused tensor. All pieces of one tensor have the same number
    of rows: the fused QKV is cut per head (head_dim rows: q heads of group g, then k_g, then v_g),
    the SwiGLU fc1 into its gate and up halves.
    """
    d = model.kv_channels
    groups = model.num_query_groups
    q_per_group = model.num_attention_heads // groups
    plan: list[tuple[str, list[Piece]]] = [
        ("embedding.word_embeddings.weight", [Piece("model.embed_tokens.weight")])
    ]
    inverse = {v: k for k, v in DIRECT.items() if "layer_norm_weight" not in k}
    for i in range(model.num_layers):
        p, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        kinds = ("weight", "bias") if model.qkv_bias else ("weight",)
        for kind in kinds:
            pieces = []
            for g in range(groups):
                for j in range(q_per_group):
                    head = g * q_per_group + j
                    pieces.append(Piece(f"{p}self_attn.q_proj.{kind}", (head * d, (head + 1) * d)))
                pieces.append(Piece(f"{p}self_attn.k_proj.{kind}", (g * d, (g + 1) * d)))
                pieces.append(Piece(f"{p}self_attn.v_proj.{kind}", (g * d, (g + 1) * d)))
            plan.append((f"{mp}self_attention.linear_qkv.{kind}", pieces))
        if model.num_experts is None:
            mlp = [("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"])]
        else:  # Qwen3-MoE: the router, then each expert's [gate; up] and down
            mlp = [("mlp.router.weight", ["mlp.gate.weight"])]
            for e in range(model.num_experts):
                mx, hx = f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}."
                mlp.append(
                    (mx + "linear_fc1.weight", [hx + "gate_proj.weight", hx + "up_proj.weight"])
                )
                mlp.append((mx + "linear_fc2.weight", [hx + "down_proj.weight"]))
        plan += [(mp + mc, [Piece(p + h) for h in hf_names]) for mc, hf_names in mlp]
        for hf_suffix, mc_suffix in inverse.items():
            if (
                hf_suffix.startswith(("self_attn.q_norm", "self_attn.k_norm"))
                and not model.qk_layernorm
            ) or (hf_suffix == "mlp.down_proj.weight" and model.num_experts is not None):
                continue
            plan.append((mp + mc_suffix, [Piece(p + hf_suffix)]))
    plan.append(("decoder.final_layernorm.weight", [Piece("model.norm.weight")]))
    if not model.tie_word_embeddings:
        plan.append(("output_layer.weight", [Piece("lm_head.weight")]))
    return plan


def assemble_pieces(pieces: list[Piece], get) -> torch.Tensor:
    """The full Megatron tensor from its pieces; ``get(hf_name)`` returns an HF tensor."""
    parts = []
    for piece in pieces:
        t = get(piece.hf_name)
        parts.append(t if piece.rows is None else t[piece.rows[0] : piece.rows[1]])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
