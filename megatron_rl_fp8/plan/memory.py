"""Per-GPU memory of the actor's training run, estimated from the config alone.

A pure function of the resolved ``RunConfig`` and the world layout: no torch.distributed, no
Megatron, no model. It counts, for one GPU of the pipeline stage that holds the most, in bytes:

=============  ===============================================================================
weights        this stage's parameters / TP, in the parameter dtype (``model.params_dtype``;
               ``auto`` = bf16 on GPUs, fp32 on the CPU). The first stage holds the input
               embedding, the last the output layer (a second copy when tied and PP > 1).
gradients      Megatron DDP's gradient buffer, fp32 (the actor sets ``grad_reduce_in_fp32``):
               4 bytes per parameter, whole on every rank (the distributed optimizer
               reduce-scatters inside it, it does not shrink it).
optimizer      fp32 main weights (bf16 models only) + Adam ``exp_avg`` and ``exp_avg_sq``:
               12 bytes per parameter (8 for an fp32 model); / (DP x CP) with
               ``parallel.use_distributed_optimizer``; minus the host share with
               ``memory.optimizer_cpu_offload``.
activations    what the backward needs of each micro-batch (:func:`layer_activation_bytes`)
               times the micro-batches a stage holds under 1F1B (PP - stage), and the local
               spec's score buffer; in the backward of full recomputation, also the recomputed
               chunk's activations; in the no-grad logprob pass, one layer's working set
               (:func:`forward_working_bytes`).
logits         the log-prob path's copies of the [tokens, V/TP] logits (:class:`LogitsCost`).
KL reference   the frozen reference's weights (``loss.kl_coef > 0``), sharded like the actor's.
FP8 weight     the FP8 copies of the FP8 linears' weights (:func:`fp8_weight_copy_bytes`): the
               forward's and the transposed one for the backward, 1 byte per element each.
SGLang         ``rollout.sglang.mem_fraction_static`` x GPU memory, on a GPU a colocated
               engine shares with a trainer rank (``rollout.placement=colocated``).
allowance      ``RUNTIME_ALLOWANCE_GB`` (CUDA context, libraries, allocator fragmentation).
=============  ===============================================================================

in two phases: ``update`` (forward and backward of the policy loss, activations kept) and
``logprobs`` (the no-grad old-logprob pass: nothing kept between layers, but the entropy's copies
of the logits). Each phase's column lists what is alive at its peak moment, so the rows add up:
the update peaks at the loss (kept activations + the logits' copies) or, with full recomputation,
possibly in the backward (kept activations + a recomputed chunk; the logits' copies are gone by
then); the logprob pass peaks inside a layer or at the loss. A micro-batch is
``train.micro_batch_size`` rows of the longest sequence, ``task.max_prompt_len +
rollout.max_new_tokens`` tokens (or ``train.max_tokens_per_gpu`` tokens under a token budget).

Not counted: communication buffers (NCCL, pipeline p2p, the distributed optimizer's all-gather
buckets), Transformer Engine's FP8 copies of saved linear inputs (counted as bf16: an
overestimate; the torch backend's tensorwise recipes, whose layout is known, are counted at 1
byte per element), Adam's temporaries where it is torch's foreach Adam rather
than TE's / apex's fused one (one fp32 copy of the parameters, at the step, when activations are
freed), the rollout batch itself (a few [rows, S] tensors).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

from megatron_rl_fp8.config_utils import ConfigError

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig

GB = 1e9  # GB here are 10^9 bytes, as tools/bench_actor.py reports torch.cuda.max_memory_allocated

Spec = Literal["te", "local"]
Device = Literal["gpu", "cpu"]
Recompute = Literal["none", "selective", "full"]
PHASES = ("update", "logprobs")

RUNTIME_ALLOWANCE_GB = 4.0
"""Per-GPU memory outside the tensors the planner counts, on a GPU run: the CUDA context (~0.5 GB
with lazy module loading), cuBLAS / cuDNN / Transformer Engine workspaces and NCCL's buffers for
the TP, PP, DP and embedding groups (~1.5 GB together at 8 GPUs per node), and what PyTorch's
caching allocator reserves but cannot hand out, its fragmentation (~2 GB: a few percent of a
peak of 60-130 GB; variable micro-batch shapes make it worse). ``torch.cuda.max_memory_allocated``
sees none of this; ``nvidia-smi`` sees all of it. Zero on the CPU."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    """The GPUs a run gets."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_gb: float = 80.0
    # cpu: fp32 for params_dtype=auto, no fused kernels, the local spec, no allowance (the CPU
    # validation of tools/validate_plan.py).
    device: Device = "gpu"

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.gpu_memory_gb > 0:
            raise ConfigError(f"--gpu-memory-gb must be > 0, got {self.gpu_memory_gb}")

    @property
    def size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the actor is laid out over the world: the config's, or an alternative the search
    tries. Recompute ``full`` is Megatron's ``uniform`` (chunks of ``recompute_num_layers``) or
    ``block`` method; ``selective`` recomputes ``recompute_modules``."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: Recompute = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    offload_fraction: float = 0.0

    @classmethod
    def from_config(cls, cfg: RunConfig, world_size: int) -> Layout:
        p, mem = cfg.parallel, cfg.memory
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        cp = p.context_parallel_size
        if world_size % (tp * pp * cp):
            raise ConfigError(
                f"{world_size} GPUs are not divisible by parallel.tensor_model_parallel_size "
                f"({tp}) * parallel.pipeline_model_parallel_size ({pp}) * "
                f"parallel.context_parallel_size ({cp}); change the layout or --nodes / "
                "--gpus-per-node"
            )
        return cls(
            tp=tp,
            pp=pp,
            cp=cp,
            dp=world_size // (tp * pp * cp),
            sequence_parallel=p.sequence_parallel,
            distributed_optimizer=p.use_distributed_optimizer,
            recompute=mem.recompute_granularity or "none",
            recompute_method=mem.recompute_method or "uniform",
            recompute_num_layers=mem.recompute_num_layers or 1,
            recompute_modules=tuple(mem.recompute_modules),
            offload_fraction=mem.optimizer_offload_fraction if mem.optimizer_cpu_offload else 0.0,
        )

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        recompute = {
            "none": "off",
            "selective": "selective (" + ", ".join(self.recompute_modules) + ")",
            "full": f"full ({self.recompute_method}, {self.recompute_num_layers} layer(s))",
        }[self.recompute]
        offload = (
            f", optimizer offload {self.offload_fraction:.0%}" if self.offload_fraction else ""
        )
        return (
            f"TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp}; "
            f"SP {'on' if self.sequence_parallel else 'off'}; distributed optimizer "
            f"{'on' if self.distributed_optimizer else 'off'}; recompute {recompute}{offload}"
        )


@dataclasses.dataclass(frozen=True)
class Component:
    """One row of the table: bytes per GPU in each phase."""

    name: str
    update: float
    logprobs: float

    def __getitem__(self, phase: str) -> float:
        return getattr(self, phase)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The planner's answer for one layout: the components of the worst GPU (its pipeline
    ``stage``) and whether they fit."""

    layout: Layout
    world: World
    stage: int
    components: tuple[Component, ...]
    micro_batch_tokens: int
    micro_batches_in_flight: int
    notes: tuple[str, ...] = ()

    def total(self, phase: str) -> float:
        return sum(c[phase] for c in self.components)

    def allocated(self, phase: str) -> float:
        """What ``torch.cuda.max_memory_allocated`` would see: the total less the runtime
        allowance and the SGLang server (another process)."""
        return sum(c[phase] for c in self.components if c.name not in ("allowance", "SGLang"))

    @property
    def peak(self) -> float:
        return max(self.total(p) for p in PHASES)

    @property
    def margin_gb(self) -> float:
        return self.world.gpu_memory_gb - self.peak / GB

    @property
    def fits(self) -> bool:
        return self.margin_gb >= 0


# -- the model's pieces -------------------------------------------------------------------------
def _widths(m: ModelConfig) -> tuple[int, int, int, int, int]:
    """(h, q, g, f, n): hidden, query width, key/value width, FFN width, query heads."""
    n, d = m.num_attention_heads, m.kv_channels
    return m.hidden_size, n * d, m.num_query_groups * d, m.ffn_hidden_size, n


def layer_linear_weights(m: ModelConfig) -> int:
    """Weights of one transformer layer's four linears (QKV, output projection, gate + up, down),
    whole (not split by TP), without biases."""
    h, q, g, f, _ = _widths(m)
    return h * (q + 2 * g) + q * h + 2 * f * h + f * h


def layer_params(m: ModelConfig, tp: int) -> float:
    """Parameters of one transformer layer on one TP rank: the four linears split by TP, the
    norms (and Qwen3's QK-norms) replicated."""
    h, q, g, _, _ = _widths(m)
    linear = layer_linear_weights(m)
    bias = (q + 2 * g) if m.qkv_bias else 0
    norms = 2 * h + (2 * m.kv_channels if m.qk_layernorm else 0)
    return (linear + bias) / tp + norms


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int) -> float:
    """Parameters on one GPU of pipeline ``stage``: its layers, the embedding on the first stage,
    the output layer and the final norm on the last (a tied output layer is the embedding itself
    at PP = 1, a synchronised copy of it at PP > 1)."""
    vocab = m.padded_vocab_size(tp) * m.hidden_size / tp
    n = m.num_layers // pp * layer_params(m, tp)
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


def fp8_linear_params(m: ModelConfig, fp8: FP8Config, tp: int, pp: int, stage: int) -> float:
    """Weight elements of the FP8 linears on one GPU of pipeline ``stage``: the four linears of
    each of its layers that runs FP8 (BF16 first / last layers are global positions), and the
    output layer on the last stage when it runs FP8 (``keep_lm_head_bf16: false``)."""
    if not fp8.enabled:
        return 0.0
    n = layer_linear_weights(m) / tp * sum(stage_fp8_layers(m, fp8, pp, stage))
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
        return (1.0, 1.0) if fp8.recipe == "tensorwise_current" else (0.0, 0.0)
    return (0.0, 0.0) if fp8.recipe == "tensorwise_delayed" else (2.0, 1.0)


def gpu_fp8_backend(fp8: FP8Config, *, spec: Spec, device: Device) -> str | None:
    """The backend running FP8 GEMMs on the GPU ('te', 'torch' or 'torchao'), as ``fp8.backend: auto``
    picks it for ``spec``; None without FP8, on the CPU or under the emulation."""
    if not fp8.enabled or device == "cpu" or fp8.backend == "emulate":
        return None
    if fp8.backend != "auto":
        return fp8.backend
    from megatron_rl_fp8.fp8.config import BACKEND_RECIPES  # the fp8 package imports torch

    return "te" if spec == "te" and fp8.recipe in BACKEND_RECIPES["te"] else "torch"


def saves_fp8_inputs(fp8: FP8Config, *, spec: Spec, device: Device) -> bool:
    """Whether the FP8 linears keep their inputs for the backward as 1-byte FP8 codes: the torch
    backend's tensorwise recipes (one scale per tensor serves the transposed wgrad GEMM too).
    Transformer Engine keeps FP8 inputs as well, in layouts not read here: counted as bf16."""
    tensorwise = fp8.recipe in ("tensorwise_delayed", "tensorwise_current")
    return tensorwise and gpu_fp8_backend(fp8, spec=spec, device=device) == "torch"


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
    business: this is per token). Checked against the tensors autograd saves on the CPU
    (tools/validate_plan.py); the GPU-only kernels (fused SwiGLU, TE) are read from their code.
    """
    h, q, g, f, n = _widths(m)
    gqa = m.num_attention_heads > m.num_query_groups
    local = spec == "local"
    norms = 2 * (8 * h if local else a * h)
    c = 1 if fp8_inputs else a  # bytes per element of a linear's saved input
    linear_inputs = 0 if "layernorm" in selective else 2 * c * h
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
    mlp = 0 if "mlp" in selective else (2 if fused_swiglu else 4) * a * f + c * f
    outside = norms + linear_inputs
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
    mlp = a * h + (3 if fused_swiglu else 5) * a * f / tp
    if spec == "local" and sdpa:
        attn = 4 * a * q / tp
    elif spec == "local":
        attn = (3 * a * q + (12 if a == 2 else 8) * n * seq) / tp
    else:
        attn = a * (2 * q + 2 * g) / tp
    return residual + max(mlp, attn)


# -- the estimate -------------------------------------------------------------------------------
def micro_batch_tokens(cfg: RunConfig) -> tuple[int, int]:
    """(tokens of the largest micro-batch, its longest sequence)."""
    seq = cfg.task.max_prompt_len + cfg.rollout.max_new_tokens
    budget = getattr(cfg.train, "max_tokens_per_gpu", None)
    if budget:
        return max(budget, seq), seq  # a row longer than the budget runs alone
    return cfg.train.micro_batch_size * seq, seq


def _micro_batches(cfg: RunConfig, dp: int) -> int | None:
    """Micro-batches per optimizer step on one DP rank (None under a token budget: it depends on
    the lengths)."""
    if getattr(cfg.train, "max_tokens_per_gpu", None):
        return None
    rows = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt
    per_rank = rows // cfg.train.updates_per_step // dp
    return max(1, math.ceil(per_rank / cfg.train.micro_batch_size))


def _logits_bytes(cost: LogitsCost, phase: str, *, tokens: float, vocab: float, a: int) -> float:
    model = getattr(cost, f"{phase}_model_copies")
    fp32 = getattr(cost, f"{phase}_fp32_copies")
    if cost.upcast_copy and a == 4 and fp32:
        fp32 -= 1
    chunks = getattr(cost, f"{phase}_chunks") * min(cost.chunk_tokens, tokens) * vocab * 4
    return tokens * vocab * (model * a + fp32 * 4) + chunks


def _sglang_share(cfg: RunConfig, world: World) -> tuple[float, str | None]:
    """(bytes of a colocated SGLang server on the GPU it shares, a note for the table)."""
    r = cfg.rollout
    if r.engine != "sglang" or world.device == "cpu" or r.sglang.device == "cpu":
        return 0.0, None
    if r.placement == "dedicated":
        return 0.0, None  # the engines' GPUs are not the trainer's
    gpus = f"{r.sglang.num_engines * r.sglang.tp_size} of the {world.size} GPUs"
    if r.sglang.mem_fraction_static is None:
        return 0.0, (
            f"SGLang runs on {gpus} but rollout.sglang.mem_fraction_static is unset (SGLang sizes "
            "itself, most of a GPU): its share is not counted; set it to plan a colocated run"
        )
    share = r.sglang.mem_fraction_static * world.gpu_memory_gb * GB
    return share, (
        f"rollout.placement=colocated: the engines use {gpus} (num_engines x tp_size) next to a "
        "trainer rank; the table is for one of those, counting the engine's share although it "
        "is released while the trainer trains"
    )


@dataclasses.dataclass(frozen=True)
class _Activations:
    """A stage's activation terms, in bytes on one GPU."""

    kept: float  # what one micro-batch in flight keeps for the backward, this stage's layers
    working: float  # full recompute: a recomputed chunk's activations, during the backward
    forward: float  # a no-grad forward: one layer's working set
    buffer: float  # the local spec's score buffer (Megatron's global memory buffer), persistent
    head: float  # last stage: the final norm's and the output layer's inputs


def _activations(
    m: ModelConfig,
    lay: Layout,
    *,
    a: int,
    spec: Spec,
    cpu: bool,
    tokens: float,
    seq: int,
    fp8_inputs: list[bool],
    sdpa: bool,
) -> _Activations:
    """``fp8_inputs``: per layer of the stage, in order, whether its linears keep FP8 inputs.
    ``sdpa``: the local spec's attention is torch's fused one (no s^2 scores, no score buffer)."""
    kwargs = dict(
        a=a,
        tp=lay.tp,
        sequence_parallel=lay.sequence_parallel,
        seq=seq,
        spec=spec,
        fused_swiglu=not cpu,
        sdpa=sdpa,
    )

    def per_layer(**extra) -> list[float]:  # kept bytes of each of the stage's layers
        full, fp8 = (
            tokens * layer_activation_bytes(m, **kwargs, **extra, fp8_inputs=f)
            for f in (False, True)
        )
        return [fp8 if f else full for f in fp8_inputs]

    full = per_layer()
    layer_input = tokens * a * m.hidden_size / (lay.tp if lay.sequence_parallel else 1)
    layers = len(full)
    n = min(lay.recompute_num_layers, layers)
    if lay.recompute == "full" and lay.recompute_method == "uniform":  # chunks of n layers
        chunks = range(0, layers, n)
        kept, working = len(chunks) * layer_input, max(sum(full[i : i + n]) for i in chunks)
    elif lay.recompute == "full":  # block: the first n layers of the stage, one at a time
        kept, working = n * layer_input + sum(full[n:]), max(full[:n])
    elif lay.recompute == "selective":
        kept, working = sum(per_layer(selective=lay.recompute_modules)), 0.0
    else:
        kept, working = sum(full), 0.0
    heads = m.num_attention_heads / lay.tp
    return _Activations(
        kept=kept,
        working=working,
        forward=tokens * forward_working_bytes(m, **kwargs),
        buffer=tokens * a * heads * seq if spec == "local" and not sdpa else 0.0,
        head=2 * layer_input,
    )


def estimate(
    cfg: RunConfig,
    world: World,
    *,
    layout: Layout | None = None,
    spec: Spec = "te",
    logits: LogitsCost = DEFAULT_LOGPROBS,
) -> Estimate:
    """Per-GPU memory of the actor's run ``cfg`` on ``world`` (its own layout unless ``layout``
    is given), for the pipeline stage that needs the most. ``spec``: Megatron's layer spec,
    ``te`` (Transformer Engine: fused attention and norms; GPU clusters) or ``local`` (no TE:
    the [b, heads, s, s] attention scores are stored; forced on the CPU). ``logits``: what the
    log-prob path keeps. Raises ConfigError for a layout this cannot run."""
    lay = layout or Layout.from_config(cfg, world.size)
    m = cfg.model
    cpu = world.device == "cpu"
    if cpu:
        spec = "local"
    if lay.cp > 1 and spec == "local":
        raise ConfigError(
            f"parallel.context_parallel_size={lay.cp} needs Transformer Engine's attention; the "
            "local spec has no context parallelism (plan with --spec te, or CP 1)"
        )
    a = param_bytes(m, world.device)
    tokens, seq = micro_batch_tokens(cfg)
    rank_tokens = tokens / lay.cp
    vocab = m.padded_vocab_size(lay.tp) / lay.tp
    lg = {ph: _logits_bytes(logits, ph, tokens=rank_tokens, vocab=vocab, a=a) for ph in PHASES}
    # Bytes per parameter: fp32 main weights (a bf16 model only) and Adam's two moments, sharded
    # over DP x CP by the distributed optimizer, less the share offloaded to the host.
    optimizer = ((4 if a == 2 else 0) + 8) * (1 - lay.offload_fraction)
    if lay.distributed_optimizer:
        optimizer /= lay.dp * lay.cp
    n_micro = _micro_batches(cfg, lay.dp)
    sglang, sglang_note = _sglang_share(cfg, world)
    allowance = 0.0 if cpu else RUNTIME_ALLOWANCE_GB * GB
    fp8_copies = fp8_weight_copy_bytes(cfg.fp8, spec=spec, device=world.device)
    fp8_codes = saves_fp8_inputs(cfg.fp8, spec=spec, device=world.device)

    best = None
    for stage in range(lay.pp):
        params = stage_params(m, lay.tp, lay.pp, stage)
        fp8_layers = stage_fp8_layers(m, cfg.fp8, lay.pp, stage)
        acts = _activations(
            m,
            lay,
            a=a,
            spec=spec,
            cpu=cpu,
            tokens=rank_tokens,
            seq=seq,
            fp8_inputs=[fp8_codes and f for f in fp8_layers],
            sdpa=spec == "local" and m.uses_sdpa(on_cpu=cpu),
        )
        last = stage == lay.pp - 1
        in_flight = lay.pp - stage if n_micro is None else min(lay.pp - stage, n_micro)
        stored = in_flight * acts.kept + (acts.head if last else 0.0) + acts.buffer
        update_lg, logprobs_lg = (lg["update"], lg["logprobs"]) if last else (0.0, 0.0)
        # Each phase peaks at one of two moments, and a column lists what is alive then. Update:
        # at the loss (every kept activation and the logits' copies) or, recomputing, in the
        # backward (the kept ones and a recomputed chunk's; the logits' are freed by then).
        # Logprobs: inside a layer (its working set) or at the loss (the logits' copies).
        if update_lg >= acts.working:
            update = (stored, update_lg)
        else:
            update = (stored + acts.working, 0.0)
        if logprobs_lg >= acts.forward:
            logprobs = (acts.buffer, logprobs_lg)
        else:
            logprobs = (acts.buffer + acts.forward, 0.0)
        ref = params * a if cfg.loss.kl_coef > 0 else 0.0
        fp8_params = fp8_linear_params(m, cfg.fp8, lay.tp, lay.pp, stage)
        fp8_update, fp8_logprobs = (fp8_params * b for b in fp8_copies)
        rows = (
            Component("weights", params * a, params * a),
            Component("gradients", params * 4, params * 4),
            Component("optimizer", optimizer * params, optimizer * params),
            Component("activations", update[0], logprobs[0]),
            Component("logits", update[1], logprobs[1]),
            Component("KL reference", ref, ref),
            Component("FP8 weight copies", fp8_update, fp8_logprobs),
            Component("SGLang", sglang, sglang),
            Component("allowance", allowance, allowance),
        )
        est = Estimate(lay, world, stage, rows, tokens, in_flight)
        if best is None or est.peak > best.peak:
            best = est
    return dataclasses.replace(best, notes=(sglang_note,) if sglang_note else ())
