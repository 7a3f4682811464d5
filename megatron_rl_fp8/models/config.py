"""What the model *is*: architecture family and shapes. No kernels, no sharding here."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl_fp8.config_utils import field

Arch = Literal["llama", "qwen2", "qwen3"]


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """A dense decoder-only LLM in one of the supported families (RMSNorm, SwiGLU, RoPE, GQA).

    With ``hf_checkpoint`` or ``load`` the shape fields are read from that checkpoint
    (``models/pretrained.py``); fields given as well must agree with it.
    """

    hf_checkpoint: str | None = field(
        None,
        help="Start from this Hugging Face model folder (config.json, *.safetensors, tokenizer): "
        "the shape fields below are read from its config.json and its weights are loaded at the "
        "run's TP/PP. Ignored when the run resumes from its own checkpoint.",
    )
    load: str | None = field(
        None,
        help="Start from the weights of an `hf-to-mcore` output (or another run's checkpoints "
        "folder) instead: weights only, no optimizer state, step 0. Ignored on resume.",
    )
    ref_checkpoint: str | None = field(
        None,
        help="The reference policy's weights for the KL penalty (loss.kl_coef > 0): an HF folder "
        "or an hf-to-mcore output / checkpoints folder, of this architecture. null = the run's "
        "starting weights (the policy at RL step 0, after any SFT warm start).",
    )
    arch: Arch = field(
        "qwen3", help="Family: llama (no biases), qwen2 (QKV bias), qwen3 (QK-norm)."
    )
    num_layers: int = field(2, help="Transformer layers.")
    hidden_size: int = field(64, help="Model width.")
    ffn_hidden_size: int = field(128, help="SwiGLU inner width (per gate/up projection).")
    num_attention_heads: int = field(4, help="Query heads.")
    num_query_groups: int = field(2, help="Key/value heads (GQA groups); = heads for MHA.")
    head_dim: int | None = field(None, help="Per-head width; default hidden_size / heads.")
    vocab_size: int = field(64, help="Tokenizer vocabulary size (before padding for TP).")
    max_position_embeddings: int = field(128, help="Longest sequence the model serves.")
    rope_theta: float = field(10000.0, help="RoPE base frequency.")
    rope_scaling_factor: float | None = field(
        None,
        help="Llama 3.1 RoPE scaling (HF rope_type 'llama3': low/high frequency factors 1 "
        "and 4, original context 8192, as Megatron-Core implements it); null = off.",
    )
    norm_eps: float = field(1e-6, help="RMSNorm epsilon.")
    tie_word_embeddings: bool = field(False, help="Share input embedding and output layer weights.")
    params_dtype: Literal["auto", "float32", "bfloat16"] = field(
        "auto",
        help="Parameter dtype. auto = bfloat16 on GPUs (the optimizer keeps fp32 main parameters "
        "and gradients, as Megatron trains) and float32 on the CPU.",
    )
    make_vocab_size_divisible_by: int = field(
        128, help="Pad the vocab to a multiple of this times tensor_model_parallel_size."
    )
    attention_backend: Literal["auto", "sdpa", "unfused"] = field(
        "auto",
        help="Core attention without Transformer Engine (the local spec): sdpa = torch's "
        "scaled_dot_product_attention (flash / memory-efficient kernels, no s^2 scores kept), "
        "unfused = Megatron's DotProductAttention. auto = sdpa on GPUs, unfused on the CPU. "
        "TE's spec brings its own attention.",
    )

    def uses_sdpa(self, *, on_cpu: bool) -> bool:
        """Whether the local spec's core attention is torch's SDPA (``attention_backend``;
        ``auto``: on GPUs)."""
        if self.attention_backend == "auto":
            return not on_cpu
        return self.attention_backend == "sdpa"

    num_experts: int | None = field(
        None,
        help="Mixture of experts: routed experts per layer (Qwen3-MoE's num_experts); null = a "
        "dense SwiGLU MLP.",
    )
    moe_topk: int = field(2, help="MoE: experts each token is routed to (num_experts_per_tok).")
    moe_ffn_hidden_size: int | None = field(
        None,
        help="MoE: each expert's SwiGLU width (moe_intermediate_size); null = ffn_hidden_size.",
    )
    moe_aux_loss_coeff: float = field(
        0.0,
        help="MoE: weight of the load-balancing loss (Switch-style, per layer; Qwen3-MoE "
        "pretrained with 0.001); 0 = none.",
    )
    moe_z_loss_coeff: float = field(
        0.0,
        help="MoE: weight of the router z-loss (the squared log-sum-exp of the router logits, "
        "which keeps them small; ST-MoE); 0 = none.",
    )

    def __post_init__(self):
        for name in ("hf_checkpoint", "load", "ref_checkpoint"):
            if getattr(self, name) == "":
                raise ValueError(f"model.{name} is empty; give a folder or leave it out (null)")
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.rope_scaling_factor is not None and self.rope_scaling_factor <= 1:
            raise ValueError(
                f"model.rope_scaling_factor must be > 1 (Llama 3.1 uses 8) or null, "
                f"got {self.rope_scaling_factor}"
            )
        if self.num_experts is not None:
            if self.num_experts < 2:
                raise ValueError(f"model.num_experts={self.num_experts} must be >= 2 (or null)")
            if not 1 <= self.moe_topk <= self.num_experts:
                raise ValueError(
                    f"model.moe_topk={self.moe_topk} must be in [1, model.num_experts="
                    f"{self.num_experts}]"
                )
            if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size <= 0:
                raise ValueError(
                    f"model.moe_ffn_hidden_size must be > 0, got {self.moe_ffn_hidden_size}"
                )
            for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                if not getattr(self, name) >= 0:
                    raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set model.head_dim explicitly"
            )

    @property
    def pretrained(self) -> bool:
        """True when the run starts from checkpoint weights rather than a random init."""
        return self.hf_checkpoint is not None or self.load is not None

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """MoE: each expert's SwiGLU width (``moe_ffn_hidden_size``, default ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_layernorm(self) -> bool:
        return self.arch == "qwen3"

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple
