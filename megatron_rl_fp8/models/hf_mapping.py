"""Megatron-Core <-> Hugging Face names and layouts for Llama / Qwen2 / Qwen3 / Qwen3-MoE (the one mapping).

What a model family looks like on each side, next to the model definitions: weight sync into
rollout engines, the checkpoint conversion tools and the trainer all go through this module, so a
layout bug is fixed once (the conversion-only planning is ``convert/assembly.py``). It works on *full* (TP-gathered) tensors; ``sync.gather`` produces
those from the shards. Layout facts:

* ``linear_qkv.weight`` is [groups * (q_per_group + 2) * head_dim, hidden], interleaved per query
  group: for each KV group g the rows are (q heads of g, k of g, v of g). HF keeps q/k/v separate.
* ``linear_fc1.weight`` is [gate; up] stacked along rows (SwiGLU); HF has gate_proj and up_proj.
* The embedding / output layer are padded to a multiple of 128 * TP rows; HF has the true vocab.
* With the Transformer Engine spec the pre-attention / pre-MLP RMSNorm weights live inside the fused
  linears (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); both spellings map.
* Qwen3-MoE (``model.num_experts``): every layer's MLP is a router (``mlp.router.weight``, HF
  ``mlp.gate.weight``, [experts, hidden]) and experts named by their *global* index,
  ``mlp.experts.local_experts.<e>.linear_fc1.weight`` ([gate; up], as the dense fc1) and
  ``linear_fc2`` (HF ``mlp.experts.<e>.{gate,up,down}_proj.weight``, the layout of the HF files and
  of SGLang's loader; transformers 5 fuses the experts in memory, not on disk). Megatron's top-k
  over the router logits with a softmax over the k chosen is Qwen3-MoE's ``norm_topk_prob: true``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from megatron_rl_fp8.models.config import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

# Megatron per-layer suffix -> HF per-layer suffix, for the tensors that map one to one.
DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


class MappingError(ValueError):
    """A tensor that the mapping does not know, or a missing / misshapen one."""


def hf_architecture(model: ModelConfig) -> str:
    if model.num_experts is not None:
        if model.arch != "qwen3":
            raise MappingError(
                f"model.num_experts with arch {model.arch!r} has no HF mapping; mixture-of-experts "
                "models map as Qwen3-MoE (arch qwen3)"
            )
        return "Qwen3MoeForCausalLM"
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
        model.arch
    ]


def hf_config(
    model: ModelConfig,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
):
    """A transformers config object equivalent to ``model``."""
    import transformers  # lazy: ~1.5 s to import; config loading reaches this module

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model.arch]
    if hf_architecture(model) == "Qwen3MoeForCausalLM":
        cls = transformers.Qwen3MoeConfig
    kwargs = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.kv_channels,
        max_position_embeddings=model.max_position_embeddings,
        rope_theta=model.rope_theta,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
        hidden_act="silu",
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=[hf_architecture(model)],
    )
    if model.arch == "llama":
        kwargs.update(attention_bias=False, mlp_bias=False)
    if model.arch == "qwen3":
        kwargs.update(attention_bias=False)
    if model.num_experts is not None:
        kwargs.update(
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_topk,
            moe_intermediate_size=model.expert_ffn_hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
    if model.rope_scaling_factor is not None:
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": model.rope_scaling_factor,
            **_LLAMA3_ROPE,
            "rope_theta": model.rope_theta,
        }
    cfg = cls(**kwargs)
    # transformers 5 moved rope_theta into rope_parameters; make sure the base is what we asked for.
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict):
        rope["rope_theta"] = model.rope_theta
    return cfg


# The Llama 3.1 RoPE scaling constants Megatron-Core hard-codes (rope_utils / _apply_scaling).
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config_with_tokens(model: ModelConfig, tokenizer):
    """:func:`hf_config` with the special-token ids of the run's tokenizer (a ``PromptEncoder``):
    the config the rollout engines are built from."""
    return hf_config(
        model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(tokenizer.eos_token_ids),
        pad_token_id=tokenizer.pad_token_id,
    )


def _split_qkv(qkv: torch.Tensor, model: ModelConfig):
    groups = model.num_query_groups
    q_per_group = model.num_attention_heads // groups
    d = model.kv_channels
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (q_per_group + 2) * d, *rest)
    q = per_group[:, : q_per_group * d].reshape(groups * q_per_group * d, *rest)
    k = per_group[:, q_per_group * d : (q_per_group + 1) * d].reshape(groups * d, *rest)
    v = per_group[:, (q_per_group + 1) * d :].reshape(groups * d, *rest)
    return q, k, v


def _merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig
) -> torch.Tensor:
    groups = model.num_query_groups
    q_per_group = model.num_attention_heads // groups
    d = model.kv_channels
    rest = q.shape[1:]
    parts = [
        q.reshape(groups, q_per_group * d, *rest),
        k.reshape(groups, d, *rest),
        v.reshape(groups, d, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(groups * (q_per_group + 2) * d, *rest)


def mcore_to_hf(
    name: str, tensor: torch.Tensor, model: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor -> its HF tensors (global layer numbering in ``name``)."""
    if name.endswith("._extra_state"):
        return []
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: model.vocab_size])]
    if name == "output_layer.weight":
        if model.tie_word_embeddings:
            return []
        return [("lm_head.weight", tensor[: model.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    m = _LAYER.match(name)
    if m is None:
        raise MappingError(f"no HF mapping for Megatron tensor {name!r} (arch {model.arch})")
    layer, suffix = int(m.group(1)), m.group(2)
    prefix = f"model.layers.{layer}."
    if suffix in DIRECT:
        return [(prefix + DIRECT[suffix], tensor)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = _split_qkv(tensor, model)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if suffix == "mlp.router.weight":
        return [(prefix + "mlp.gate.weight", tensor)]
    e = _EXPERT.match(suffix)
    if e is not None:
        expert = f"{prefix}mlp.experts.{e.group(1)}."
        if e.group(2) == "linear_fc2":
            return [(expert + "down_proj.weight", tensor)]
        gate, up = tensor.chunk(2, dim=0)
        return [(expert + "gate_proj.weight", gate), (expert + "up_proj.weight", up)]
    raise MappingError(f"no HF mapping for Megatron tensor {name!r} (arch {model.arch})")


def mcore_state_to_hf(
    state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], model: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) pairs from a Megatron state dict or a stream of (name, tensor)."""
    pairs = state.items() if isinstance(state, dict) else state
    for name, tensor in pairs:
        yield from mcore_to_hf(name, tensor, model)


def expected_hf_names(model: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not model.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        names += [
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            p + "self_attn.o_proj.weight",
        ]
        if model.num_experts is None:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        else:
            names.append(p + "mlp.gate.weight")
            names += [
                f"{p}mlp.experts.{e}.{x}_proj.weight"
                for e in range(model.num_experts)
                for x in ("gate", "up", "down")
            ]
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        if model.qkv_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        if model.qk_layernorm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def hf_state_to_mcore(
    hf: dict[str, torch.Tensor], model: ModelConfig, *, padded_vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full Megatron (local-spec names) state dict; strict about names."""
    expected = set(expected_hf_names(model))
    present = {k for k in hf if not k.endswith("rotary_emb.inv_freq")}
    if model.tie_word_embeddings:
        present.discard("lm_head.weight")
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        raise MappingError(
            f"HF checkpoint does not match {model.arch}: missing {missing}, unexpected {extra}"
        )

    def pad_vocab(t: torch.Tensor) -> torch.Tensor:
        if padded_vocab_size is None or padded_vocab_size == t.shape[0]:
            return t
        return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])])

    out = {
        "embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not model.tie_word_embeddings:
        out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"])
    inverse = {v: k for k, v in DIRECT.items() if "layer_norm_weight" not in k}
    for i in range(model.num_layers):
        p, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in inverse.items():
            if p + hf_suffix in hf:
                out[mp + mc_suffix] = hf[p + hf_suffix]
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" in hf:
                out[mp + f"self_attention.linear_qkv.{kind}"] = _merge_qkv(
                    *(hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"), model
                )
        if model.num_experts is None:
            out[mp + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
            continue
        out[mp + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
        for e in range(model.num_experts):
            hx, mx = f"{p}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
            out[mx + "linear_fc1.weight"] = torch.cat(
                [hf[hx + "gate_proj.weight"], hf[hx + "up_proj.weight"]], dim=0
            )
            out[mx + "linear_fc2.weight"] = hf[hx + "down_proj.weight"]
    return out


# -- reading HF configs (conversion, and later a pretrained start) -----------------------------
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
}


def model_config_from_hf(
    config: dict, *, params_dtype: str | None = None
) -> tuple[ModelConfig, list[str]]:
    """The project's ModelConfig for an HF ``config.json`` dict (inverse of :func:`hf_config`).

    Returns ``(model, notes)``: ``notes`` lists HF settings that do not change any weight but that
    ModelConfig does not represent (e.g. Llama 3.1 RoPE scaling), so a caller can warn about them.
    Settings that would change the weights or their meaning raise :class:`MappingError`.
    """
    archs = config.get("architectures") or []
    known = [a for a in archs if a in _ARCHITECTURES]
    if not known:
        raise MappingError(
            f"config.json architectures={archs} is not supported; supported: "
            f"{sorted(_ARCHITECTURES)} (dense Llama / Qwen2 / Qwen3, and Qwen3-MoE)"
        )
    arch = _ARCHITECTURES[known[0]]
    notes: list[str] = []

    def need(key):
        if key not in config:
            raise MappingError(f"config.json ({known[0]}) has no {key!r}")
        return config[key]

    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise MappingError(f"config.json hidden_act={act!r}: only SwiGLU ('silu') is supported")
    if arch == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise MappingError("config.json: Llama with attention_bias / mlp_bias is not supported")
    if arch == "qwen3" and config.get("attention_bias"):
        raise MappingError("config.json: Qwen3 with attention_bias=true is not supported")
    if config.get("use_sliding_window"):
        raise MappingError(
            "config.json use_sliding_window=true is not supported (full attention only)"
        )
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = (
        rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    rope_scaling_factor = None
    params = {**scaling, **rope}
    if rope_type == "llama3" and all(float(params.get(k, v)) == v for k, v in _LLAMA3_ROPE.items()):
        rope_scaling_factor = float(params.get("factor", 8.0))
    elif rope_type != "default":
        notes.append(
            f"RoPE scaling {rope_type!r} ({params}) is kept in config.json but not "
            "represented in ModelConfig (weights are unaffected; long-context positions "
            "will differ from the HF model)"
        )
    heads = need("num_attention_heads")
    moe = _moe_from_hf(config, need) if known[0] == "Qwen3MoeForCausalLM" else {}
    if params_dtype is None:
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        params_dtype = "float32" if dtype == "float32" else "bfloat16"
        if dtype not in ("float32", "bfloat16"):
            notes.append(f"checkpoint dtype {dtype!r} -> params_dtype bfloat16")
    model = ModelConfig(
        arch=arch,
        num_layers=need("num_hidden_layers"),
        hidden_size=need("hidden_size"),
        ffn_hidden_size=need("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or None,
        vocab_size=need("vocab_size"),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_theta=float(rope_theta),
        rope_scaling_factor=rope_scaling_factor,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        params_dtype=params_dtype,
        **moe,
    )
    return model, notes


def _moe_from_hf(config: dict, need) -> dict:
    """ModelConfig's expert fields from a Qwen3-MoE config.json; what Megatron's MoE layer does
    not compute the same way is refused."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        raise MappingError("config.json (Qwen3MoeForCausalLM) has no 'num_experts'")
    if config.get("norm_topk_prob", True) is not True:
        raise MappingError(
            "config.json norm_topk_prob=false is not supported: Megatron's router renormalises "
            "the top-k weights (Qwen3-MoE's norm_topk_prob: true)"
        )
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise MappingError(
            "config.json: decoder_sparse_step != 1 or mlp_only_layers (dense layers between the "
            "MoE ones) is not supported; every layer must be a mixture of experts"
        )
    if config.get("shared_expert_intermediate_size"):
        raise MappingError("config.json: shared experts are not supported (Qwen3-MoE has none)")
    return {
        "num_experts": int(experts),
        "moe_topk": int(need("num_experts_per_tok")),
        "moe_ffn_hidden_size": int(need("moe_intermediate_size")),
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0)),
    }


def expected_hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for exactly the names of :func:`expected_hf_names`."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    if model.num_experts is not None:
        fe = model.expert_ffn_hidden_size
        per_layer["mlp.gate.weight"] = (model.num_experts, h)
        expert = {"gate_proj": (fe, h), "up_proj": (fe, h), "down_proj": (h, fe)}
    out = {}
    for name in expected_hf_names(model):
        m = re.match(r"^model\.layers\.\d+\.(.+)$", name)
        e = re.match(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(\w+)\.weight$", name)
        if e:
            out[name] = expert[e.group(1)]
        elif m:
            out[name] = per_layer[m.group(1)]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = (model.vocab_size, h)
        else:  # model.norm.weight
            out[name] = (h,)
    return out
