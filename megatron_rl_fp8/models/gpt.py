"""Megatron-Core GPTModel providers for Llama / Qwen2 / Qwen3 shapes.

``layer_spec(...)`` is the one place that chooses kernels: the Transformer Engine spec on GPU
clusters (where TE provides FP8 GEMMs), Megatron's local spec elsewhere. Model structure (this file)
does not branch on the device; the CPU FP8 path swaps the local spec's linear classes for emulated
FP8 linears (``megatron_rl_fp8.fp8``) without touching the structure.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_rl_fp8.fp8.te import have_te
from megatron_rl_fp8.models.attention import SDPAttention
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.utils.imports import module_exists


class SequenceParallelRMSNorm:
    """The local spec's RMSNorm (``torch.nn.RMSNorm``, as Megatron's ``WrappedTorchNorm`` builds
    it) for sequence parallelism, which ``WrappedTorchNorm`` refuses. Under SP each TP rank
    normalises its own slice of the sequence, so the norm weight's gradient is partial per rank;
    marking it ``sequence_parallel`` makes Megatron's ``finalize_model_grads`` sum it over TP, as
    Transformer Engine's and apex's norms do."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


class HeadRMSNorm:
    """The query / key RMSNorm (Qwen3) of the local spec under sequence parallelism. It works on
    the full sequence of this rank's heads, so it is not sequence-parallel; Megatron sums its
    gradient over TP by name (``q_layernorm`` / ``k_layernorm``) in every layout."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)


def _moe_without_te() -> None:
    """Megatron-Core 0.16.1's router GEMM (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name ``moe_utils`` binds only when Transformer Engine
    imports: without TE every router forward raised NameError (CPU, or a GPU without TE).
    Bound to None there, the router takes its own ``torch.mm`` path, as the check intends."""
    from megatron.core.transformer.moe import moe_utils  # lazy: only MoE models need it

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def layer_spec(
    model: ModelConfig,
    *,
    use_te: bool | None = None,
    sequence_parallel: bool = False,
    on_cpu: bool | None = None,
):
    """The transformer-layer ModuleSpec: TE spec when TE + CUDA exist, local spec otherwise (with
    the sequence-parallel norms above when ``sequence_parallel``, and :class:`SDPAttention` as
    its core attention where ``model.uses_sdpa``)."""
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if use_te is None:
        use_te = have_te() and not on_cpu
    # Dense models call the spec functions as before; MoE adds its experts (TE: one grouped GEMM
    # per layer; the local spec: a SequentialMLP of ordinary linears, one pair per expert).
    moe = {}
    if model.num_experts is not None:
        _moe_without_te()
        moe = {"num_experts": model.num_experts, "moe_grouped_gemm": use_te}
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=model.qk_layernorm, **moe
        )
    spec = specs.get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm, normalization="RMSNorm", **moe
    )
    if model.uses_sdpa(on_cpu=on_cpu):
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if sequence_parallel:
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
        attention = layer.self_attention.submodules
        if attention.q_layernorm is not None:
            attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return spec


def params_dtype(model: ModelConfig, *, on_cpu: bool) -> torch.dtype:
    """The actor's parameter dtype: ``model.params_dtype``, where ``auto`` is bfloat16 on GPUs
    (with fp32 main parameters and gradients in the optimizer, as Megatron trains) and float32 on
    the CPU (where bf16 GEMMs are slow and the layout-parity tests compare fp32 results)."""
    if model.params_dtype == "auto":
        return torch.float32 if on_cpu else torch.bfloat16
    return torch.bfloat16 if model.params_dtype == "bfloat16" else torch.float32


def megatron_fusions(*, on_cpu: bool, use_te: bool) -> dict[str, bool]:
    """Megatron's fused kernels, each turned on where this install has its kernel.

    * ``bias_activation_fusion`` (SwiGLU) and ``bias_dropout_fusion``: torch.jit-scripted code in
      ``megatron.core.fusions``, nothing to install: on for every CUDA run;
    * ``apply_rope_fusion``: Transformer Engine's fused RoPE (Megatron refuses it without TE);
    * ``gradient_accumulation_fusion`` (wgrad GEMMs accumulate straight into the fp32
      ``main_grad``): only where apex's ``fused_weight_gradient_mlp_cuda`` imports, with TE too.
      TE's linears would fuse it themselves, but ``GPTModel.output_layer`` is Megatron's own
      ``tensor_parallel.ColumnParallelLinear`` in every spec, and its constructor raises when the
      flag is set without that apex kernel (Megatron-Core 0.16.1 ``tensor_parallel/layers.py``);
      the ``[gpu]`` extra installs TE, not apex;
    * ``masked_softmax_fusion``: Megatron's fused softmax extension (apex), used by the local
      spec's attention only (TE brings its own attention);
    * ``persist_layer_norm``: apex's persistent LayerNorm; these models use RMSNorm: off.

    On the CPU every fusion is off: they are CUDA kernels.
    """
    if on_cpu:
        return dict(
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
    return dict(
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        apply_rope_fusion=use_te,
        gradient_accumulation_fusion=module_exists("fused_weight_gradient_mlp_cuda"),
        masked_softmax_fusion=not use_te
        and module_exists("scaled_upper_triang_masked_softmax_cuda"),
        persist_layer_norm=False,
    )


def moe_config(model: ModelConfig, *, use_te: bool) -> dict:
    """TransformerConfig's MoE fields for ``model``. Routing as Qwen3-MoE's: softmax over the
    top-k logits (Megatron's default order, equal to HF's softmax, top-k, renormalise with
    ``norm_topk_prob``), in fp32; the all-to-all token dispatcher; TE's grouped expert GEMM
    where TE builds the layer."""
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_topk,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_te,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff or None,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
    )


def transformer_config(
    model: ModelConfig,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    on_cpu: bool | None = None,
    use_te: bool | None = None,
    **overrides,
):
    """Megatron TransformerConfig for ``model``: dtype and fusions chosen for the device (see
    :func:`params_dtype`, :func:`megatron_fusions`); ``overrides`` win."""
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if use_te is None:
        use_te = not on_cpu and have_te()
    dtype = params_dtype(model, on_cpu=on_cpu)
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        # Deterministic TP-invariant init: the full master weight is built on CPU then split, so
        # TP=1 and TP=2 start from identical weights for the same seed.
        use_cpu_initialization=True,
        init_method_std=0.02,
        # Megatron's default ("full") is deprecated for [], which means the same (the whole layer,
        # where CUDA graphs are on at all); passing it spares every run the deprecation warning.
        cuda_graph_scope=[],
    )
    kwargs.update(megatron_fusions(on_cpu=on_cpu, use_te=use_te))
    if model.num_experts is not None:
        kwargs.update(moe_config(model, use_te=use_te))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    model: ModelConfig,
    config,
    *,
    use_te: bool | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
):
    """Instantiate this rank's pipeline stage of the GPTModel (parallel_state must be set up)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    spec = layer_spec(model, use_te=use_te, sequence_parallel=config.sequence_parallel)
    if config.sequence_parallel and spec.submodules.input_layernorm is SequenceParallelRMSNorm:
        # The block's final norm too (Megatron would pick WrappedTorchNorm for it).
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config),
            layer_norm=SequenceParallelRMSNorm,
        )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay vocab-sharded; logprobs use vocab-parallel CE
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rope_scaling=model.rope_scaling_factor is not None,
        rope_scaling_factor=model.rope_scaling_factor or 8.0,
    )
    # The local spec's norms (torch.nn.RMSNorm, here and in Megatron's WrappedTorchNorm) are built
    # in float32 whatever params_dtype says; Megatron's scripts cast them with Float16Module. They
    # take the model's dtype here, as TE's norms do: Megatron's mixed-precision optimizer cannot
    # checkpoint a float32 parameter of a bf16 model ("Param id .. does not match any model
    # sharded param", seen on the H200).
    for p in gpt.parameters():
        if p.dtype != config.params_dtype:
            p.data = p.data.to(config.params_dtype)
    return gpt
