"""What each piece of the actor's model holds, per GPU: parameters of a layer and of a pipeline
stage, the FP8 linears' weight elements and their FP8 copies, and the bytes per token a layer keeps
for its backward (:func:`layer_activation_bytes`) or holds inside a no-grad forward
(:func:`forward_working_bytes`); and what the log-prob path keeps of the logits
(:class:`LogitsCost`, :func:`logits_bytes`).

Pure functions of the model's and FP8's configs and the layout's sizes (no torch, no Megatron);
``plan/memory.py`` adds them up into the per-GPU estimate.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig

Spec = Literal["te", "local"]
Device = Literal["gpu", "cpu"]


# -- layers and stages --------------------------------------------------------------------------
# A mixture-of-experts layer (``model.num_experts``, Qwen3-MoE) has a router (hidden x experts,
# BF16, replicated) and ``num_experts`` SwiGLU experts of width ``moe_ffn_hidden_size``, split over
# EP (whole experts) and TP (each expert, Megatron's expert tensor parallelism = TP); a token passes
# through ``moe_topk`` of them, so its FLOPs and activations see an FFN ``topk x width`` wide.
def _widths(m: ModelConfig) -> tuple[int, int, int, int, int]:
    """(h, q, g, f, n): hidden, query width, key/value width, the FFN width a token passes through
    (MoE: top-k x the expert width), query heads."""
    n, d = m.num_attention_heads, m.kv_channels
    f = m.ffn_hidden_size if m.num_experts is None else m.moe_topk * m.expert_ffn_hidden_size
    return m.hidden_size, n * d, m.num_query_groups * d, f, n


def _router_weights(m: ModelConfig) -> int:
    return 0 if m.num_experts is None else m.hidden_size * m.num_experts


def _split_by_tp_weights(m: ModelConfig) -> int:
    """One layer's linear weights TP splits and EP does not: attention, and a dense model's MLP."""
    h, q, g, f, _ = _widths(m)
    return h * (q + 2 * g) + q * h + (3 * f * h if m.num_experts is None else 0)


def layer_expert_weights(m: ModelConfig) -> int:
    """Weights of one layer's experts, all of them (0 for a dense model)."""
    if m.num_experts is None:
        return 0
    return m.num_experts * 3 * m.expert_ffn_hidden_size * m.hidden_size


def layer_linear_weights(m: ModelConfig) -> int:
    """Weights of one transformer layer's linears (QKV, output projection, gate + up, down; MoE:
    the router and every expert's), whole (not split by TP or EP), without biases."""
    return _split_by_tp_weights(m) + _router_weights(m) + layer_expert_weights(m)


def layer_active_weights(m: ModelConfig) -> int:
    """Weights one token multiplies in one layer (MoE: the router and its top-k experts): what
    its FLOPs count."""
    if m.num_experts is None:
        return layer_linear_weights(m)
    top_k = m.moe_topk * 3 * m.expert_ffn_hidden_size * m.hidden_size
    return _split_by_tp_weights(m) + _router_weights(m) + top_k


def layer_params(m: ModelConfig, tp: int, ep: int = 1) -> float:
    """Parameters of one transformer layer on one GPU: the attention and dense MLP linears split
    by TP, the experts by EP x TP, the router, the norms (and Qwen3's QK-norms) replicated."""
    h, q, g, _, _ = _widths(m)
    bias = (q + 2 * g) if m.qkv_bias else 0
    norms = 2 * h + (2 * m.kv_channels if m.qk_layernorm else 0)
    split = (_split_by_tp_weights(m) + bias) / tp + layer_expert_weights(m) / (tp * ep)
    return split + _router_weights(m) + norms


def stage_expert_params(m: ModelConfig, tp: int, pp: int, ep: int = 1) -> float:
    """The experts' parameters on one GPU of any pipeline stage (0 for a dense model): the
    distributed optimizer shards them over the expert-data-parallel ranks, DP x CP / EP."""
    return m.num_layers // pp * layer_expert_weights(m) / (tp * ep)


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> float:
    """Parameters on one GPU of pipeline ``stage``: its layers, the embedding on the first stage,
    the output layer and the final norm on the last (a tied output layer is the embedding itself
    at PP = 1, a synchronised copy of it at PP > 1)."""
    vocab = m.padded_vocab_size(tp) * m.hidden_size / tp
    n = m.num_layers // pp * layer_params(m, tp, ep)
    if stage == 0:
        n += vocab
    if stage == pp - 1:
        n += m.hidden_size + (vocab if not m.tie_word_embeddings or pp > 1 else 0)
    return n


def stage_fp8_layers(m: ModelConfig, fp8: FP8Config, pp: int, stage: int) -> list[bool]:
    """Whether each of pipeline ``stage``'s transformer layers, in order, runs FP8 (the BF16
    first / last layers are global positions)."""
    per_stage = m.num_layers // pp
    first = stage * per_stage + 1
    return [fp8.layer_uses_fp8(i, m.num_layers) for i in range(first, first + per_stage)]


def fp8_linear_params(
    m: ModelConfig, fp8: FP8Config, tp: int, pp: int, stage: int, ep: int = 1
) -> float:
    """Weight elements of the FP8 linears on one GPU of pipeline ``stage``: the linears of each
    of its layers that runs FP8 (BF16 first / last layers are global positions; MoE: the experts
    on this GPU, the router stays BF16), and the output layer on the last stage when it runs FP8
    (``keep_lm_head_bf16: false``)."""
    if not fp8.enabled:
        return 0.0
    per_layer = _split_by_tp_weights(m) / tp + layer_expert_weights(m) / (tp * ep)
    n = per_layer * sum(stage_fp8_layers(m, fp8, pp, stage))
    if stage == pp - 1 and not fp8.keep_lm_head_bf16:
        n += m.padded_vocab_size(tp) * m.hidden_size / tp
    return n


def fp8_weight_copy_bytes(fp8: FP8Config, *, spec: Spec, device: Device) -> tuple[float, float]:
    """Bytes per FP8-linear weight element held as FP8 copies, (update, logprobs).

    Both FP8 backends of a GPU run quantize each weight once per forward / backward schedule
    and keep it: the forward's [N, K] codes and the backward's transposed [K, N] codes, 1 byte
    each. Transformer Engine (the ``te`` spec under ``fp8.backend: auto``) keeps both in its
    weight workspaces across steps (read from its code, not measured here): 2 and 2. The torch
    backend (``fp8/torch_backend.py``) keeps them inside one schedule: 2 in the update, 1 in the
    no-grad logprob pass (no transposed copy), none under ``tensorwise_delayed`` (its weight
    scale moves with every call, so nothing is cached; one linear's copy at a time). The
    torchao backend keeps one copy under ``tensorwise_current`` (its fprop and dgrad read the
    same codes): 1 and 1; rowwise casts per call (none kept). The emulation and every CPU run
    keep none (their copies live for one GEMM)."""
    backend = gpu_fp8_backend(fp8, spec=spec, device=device)
    if backend is None:
        return 0.0, 0.0
    if backend == "te":
        return 2.0, 2.0
    if backend == "torchao":  # one tensorwise copy serves both GEMMs; rowwise casts per call
        return (1.0, 1.0) if fp8.spec.torchao_keeps_weight else (0.0, 0.0)
    return (2.0, 1.0) if fp8.spec.torch_keeps_weight else (0.0, 0.0)


def gpu_fp8_backend(fp8: FP8Config, *, spec: Spec, device: Device) -> str | None:
    """The backend running FP8 GEMMs on the GPU ('te', 'torch' or 'torchao'), as ``fp8.backend: auto``
    picks it for ``spec``; None without FP8, on the CPU or under the emulation."""
    if not fp8.enabled or device == "cpu" or fp8.backend == "emulate":
        return None
    if fp8.backend != "auto":
        return fp8.backend
    return "te" if spec == "te" and "te" in fp8.spec.backends else "torch"


def saves_fp8_inputs(fp8: FP8Config, *, spec: Spec, device: Device) -> bool:
    """Whether the FP8 linears keep their inputs for the backward as 1-byte FP8 codes: the torch
    backend's tensorwise recipes (one scale per tensor serves the transposed wgrad GEMM too).
    Transformer Engine keeps FP8 inputs as well, in layouts not read here: counted as bf16."""
    return fp8.spec.per_tensor and gpu_fp8_backend(fp8, spec=spec, device=device) == "torch"


def param_bytes(m: ModelConfig, device: Device) -> int:
    if m.params_dtype == "auto":
        return 4 if device == "cpu" else 2
    return 2 if m.params_dtype == "bfloat16" else 4


def layer_activation_bytes(
    m: ModelConfig,
    *,
    a: int,
    tp: int,
    sequence_parallel: bool,
    seq: int,
    spec: Spec,
    fused_swiglu: bool,
    selective: tuple[str, ...] = (),
    fp8_inputs: bool = False,
    sdpa: bool = False,
) -> float:
    """Bytes one transformer layer keeps for its backward, per token of the micro-batch.

    The accounting of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models" (2022, sec. 4): list the tensors each operation saves for its backward. Redone for
    these layers: RMSNorm instead of LayerNorm, SwiGLU instead of GeLU, grouped-query attention,
    Qwen3's QK-norm, RoPE, and no dropout (the actor's dropout is 0: no masks). With a bytes per
    activation (2 in bf16, 4 in fp32), h the hidden size, q = heads x head_dim, g = query groups
    x head_dim, f the FFN size, n the heads and s the sequence length::

        outside the TP-split linears (/ TP with sequence parallelism, else on every TP rank):
            norms           local spec: 8 h per norm, x 2 (torch's composite RMSNorm keeps an
                            fp32 copy of its input and the fp32 normalized values; the layer's
                            norm weights are fp32, so a bf16 input never reaches the fused
                            kernel); TE spec: a h per norm, x 2 (its input)
          + 2 a h           the inputs of the QKV and FC1 linears
        inside (/ TP):
            QK-norm         local spec: 8 (q + g) in bf16; in fp32 the QKV output a (q + 2g) (K's
                            input is a view of it), Q's input, a copy under GQA, a q, and the
                            normalized a (q + g); TE spec: a (q + 2g) + a q. Without QK-norm:
                            the QKV output a (q + 2g) for MHA only (V is a view of it)
          + attention       local spec: Q after RoPE and, under GQA, K and V repeated to every
                            query head, a (q + 2q) (MHA: Q and K after RoPE, a (q + g), V being a
                            view of the QKV output); plus the s^2 scores, kept as the fp32
                            softmax output and the bf16 probabilities: 6 n s (4 n s in fp32).
                            TE (flash / cuDNN): Q, K, V, a (q + 2g), and the fp32 softmax
                            statistics, 4 n
          + a q             the output projection's input (the fused kernel's saved output)
          + 2 a f           SwiGLU's input (Megatron's fused kernel, on GPUs; 4 a f unfused on the
                            CPU: also SiLU's output and the up projection's copy)
          + a f             the FC2 input

    ``sdpa`` (the local spec with ``model.attention_backend`` sdpa, ``models/attention.py``):
    torch's fused attention keeps the fp32 log-sum-exp per query and head, 4 n, instead of the
    s^2 scores; its output is the projection's input (one storage: the kernels write it
    [b, s, heads, d]); measured on the CPU's flash kernel at the test shape, 2048 + 64 bytes per
    token fewer than unfused in fp32 (the scores and the causal mask) and 32 more (the
    statistics). ``fp8_inputs``: the four linears keep their inputs as 1-byte FP8 codes (the torch backend's
    tensorwise recipes, :func:`saves_fp8_inputs`) and no other operation keeps them: 1 instead of
    a for the QKV, FC1, projection and FC2 inputs. (The paper's own count for GPT-3's layer, with
    dropout masks and GeLU, is 34 s b h + 5 a s^2 b in bf16.) Selective recomputation of ``core_attn`` keeps only its inputs
    (local spec: Q and K after RoPE, a (q + g), and V, a view that keeps the QKV output alive; no
    s^2 term); of ``mlp``, drops SwiGLU's and FC2's terms; of ``layernorm``, the two linear
    inputs (norm outputs, recomputed). Context parallelism divides the tokens (the caller's
    business: this is per token). A MoE layer (``model.num_experts``, E experts, top-k) counts f
    as k x the expert width, FC1's input as the token's k permuted copies, k c h, the fp32
    router's input, 4 h, and its routing (indices, probabilities, map, permutation), 24 k + 5 E
    + 4; unfused, each expert also keeps SwiGLU's output before the routing probability scales
    it, a f more. Checked on the CPU (fp32, local spec, hidden 256, expert width 192, 64
    tokens): 4 experts top-2 saved 27796 bytes per token against 27464 counted, 8 experts top-4
    39128 against 38796, the same 332-336 of small tensors the dense layer leaves out
    (``test_moe_layer_activations_match_the_tensors_autograd_saves``). Expert parallelism moves
    tokens between GPUs but, with the load balanced, leaves each GPU as many as it started with. Checked against the tensors autograd saves on the CPU
    (scripts/validate_plan.py); the GPU-only kernels (fused SwiGLU, TE) are read from their code.
    """
    h, q, g, f, n = _widths(m)
    gqa = m.num_attention_heads > m.num_query_groups
    local = spec == "local"
    norms = 2 * (8 * h if local else a * h)
    c = 1 if fp8_inputs else a  # bytes per element of a linear's saved input
    # MoE: FC1's input is the token's k copies permuted to its experts; the fp32 router keeps its
    # input (4 h) and the routing (top-k indices, probabilities, map, permutation: ~24 k + 5 E).
    k = 1 if m.num_experts is None else m.moe_topk
    router = 0 if m.num_experts is None else 4 * h + 24 * k + 5 * m.num_experts + 4
    linear_inputs = 0 if "layernorm" in selective else (1 + k) * c * h
    # The QKV output stays alive while a view of it is saved: K as the K-norm's input (unless the
    # local spec's norm saves an fp32 copy of a bf16 K instead), or V (MHA, and the checkpoint of
    # a selectively recomputed core attention).
    if not m.qk_layernorm:
        qk, qkv_kept = 0, not gqa
    elif local and a == 2:  # fp32 copies of Q and K, and their normalized values; MHA's V
        qk, qkv_kept = 8 * (q + g), not gqa
    else:
        qk, qkv_kept = a * q * gqa + (a * (q + g) if local else 0), True
    if local and "core_attn" not in selective:
        scores = 4 * n if sdpa else (6 if a == 2 else 4) * n * seq
        attn = a * q + (2 * a * q if gqa else a * g) + scores
    elif local:
        attn, qkv_kept = a * (q + g), True  # the checkpoint's inputs: Q, K after RoPE, and V
    else:
        attn = a * (q + 2 * g) + 4 * n
    qk += a * (q + 2 * g) if qkv_kept else 0
    proj = c * q
    # Unfused, an expert also keeps SwiGLU's output before the routing probability scales it.
    unfused = 4 if m.num_experts is None else 5
    mlp = 0 if "mlp" in selective else (2 if fused_swiglu else unfused) * a * f + c * f
    outside = norms + linear_inputs + router
    return outside / (tp if sequence_parallel else 1) + (qk + attn + proj + mlp) / tp


def forward_working_bytes(
    m: ModelConfig,
    *,
    a: int,
    tp: int,
    sequence_parallel: bool,
    seq: int,
    spec: Spec,
    fused_swiglu: bool,
    sdpa: bool = False,
) -> float:
    """Bytes per token alive at once inside one layer of a no-grad forward (the old-logprob
    pass), where nothing is kept for a backward: the residual stream (the layer's input and the
    block output added to it, 2 a h) plus the larger of the two blocks' transients. MLP: its
    input a h, FC1's output 2 a f, SwiGLU's output a f (unfused on the CPU: also SiLU's output
    and the up projection's copy, 2 a f more). Attention, local spec: Q and the repeated K, V,
    3 a q, and the scores in the model dtype, their fp32 copy, the fp32 softmax and the bf16
    probabilities, 12 n s (8 n s in fp32, where the copy is the scores themselves); TE: Q, K,
    V and the output, a (2q + 2g); local spec with SDPA: Q, the repeated K, V and the output,
    4 a q."""
    h, q, g, f, n = _widths(m)
    residual = 2 * a * h / (tp if sequence_parallel else 1)
    k = 1 if m.num_experts is None else m.moe_topk  # MoE: the token's permuted copies
    mlp = (1 + (k if k > 1 else 0)) * a * h + (3 if fused_swiglu else 5) * a * f / tp
    if spec == "local" and sdpa:
        attn = 4 * a * q / tp
    elif spec == "local":
        attn = (3 * a * q + (12 if a == 2 else 8) * n * seq) / tp
    else:
        attn = a * (2 * q + 2 * g) / tp
    return residual + max(mlp, attn)


# -- the logits --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitsCost:
    """What the log-prob path (``models/logprobs.py``) keeps of one micro-batch's logits
    [tokens, V/TP] at its peak: full-size copies in the model's dtype (the output layer's logits,
    their gradient), full-size fp32 copies, and fixed-size fp32 chunks of ``chunk_tokens`` rows.

    Update this when that module changes; it is the number most likely to move."""

    name: str
    update_model_copies: float
    update_fp32_copies: float
    logprobs_model_copies: float
    logprobs_fp32_copies: float
    chunk_tokens: int = 0
    update_chunks: int = 0
    logprobs_chunks: int = 0
    # The first fp32 copy is the upcast ``logits.float()``, which an fp32 model does not make.
    upcast_copy: bool = False


CHUNKED_LOGPROBS = LogitsCost(
    name="chunked",
    # Forward: the logits (saved by reference) + one fp32 chunk. Backward: the logits + their
    # gradient (model dtype) + one chunk; then the gradient and the output layer's contiguous
    # copy of it.
    update_model_copies=2,
    update_fp32_copies=0,
    chunk_tokens=4096,  # models.logprobs.DEFAULT_CHUNK_TOKENS
    update_chunks=1,
    # No grad: the logits + the chunk and its exp (entropy).
    logprobs_model_copies=1,
    logprobs_fp32_copies=0,
    logprobs_chunks=2,
)
"""``models/logprobs.py`` since issue 14: tokens in chunks, the fp32 softmax recomputed per chunk
in the backward (what the trainer runs now)."""

UNCHUNKED_LOGPROBS = LogitsCost(
    name="unchunked",
    # Loss: the bf16 logits + ``.float()`` + the [S, B, V] transpose that Megatron's
    # vocab_parallel_cross_entropy turns into the softmax in place and keeps for the backward.
    update_model_copies=1,
    update_fp32_copies=2,
    # Entropy (no grad): ``.float()``, shifted, exp, exp * shifted.
    logprobs_model_copies=1,
    logprobs_fp32_copies=4,
    upcast_copy=True,
)
"""``models/logprobs.py`` before issue 14 (one more fp32 copy each for a padded vocabulary on the
last TP rank and for a temperature != 1, not counted). The 82.4 GB GPU reference point was
measured with it."""

DEFAULT_LOGPROBS = CHUNKED_LOGPROBS


def logits_bytes(cost: LogitsCost, phase: str, *, tokens: float, vocab: float, a: int) -> float:
    """Bytes of ``cost``'s copies of one micro-batch's logits at ``phase``'s peak ('update' or
    'logprobs'): ``tokens`` rows of ``vocab`` (V / TP) columns, ``a`` bytes per element in the
    model's dtype, 4 in fp32 (an fp32 model makes no upcast copy)."""
    model = getattr(cost, f"{phase}_model_copies")
    fp32 = getattr(cost, f"{phase}_fp32_copies")
    if cost.upcast_copy and a == 4 and fp32:
        fp32 -= 1
    chunks = getattr(cost, f"{phase}_chunks") * min(cost.chunk_tokens, tokens) * vocab * 4
    return tokens * vocab * (model * a + fp32 * 4) + chunks
