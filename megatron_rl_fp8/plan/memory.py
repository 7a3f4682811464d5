"""Per-GPU memory of the actor's training run, estimated from the config alone.

A pure function of the resolved ``RunConfig`` and the world layout: no torch.distributed, no
Megatron, no model. It counts, for one GPU of the pipeline stage that holds the most, in bytes
(the pieces' counts are the functions of ``plan/model_bytes.py``):

=============  ===============================================================================
weights        this stage's parameters / TP, in the parameter dtype (``model.params_dtype``;
               ``auto`` = bf16 on GPUs, fp32 on the CPU). The first stage holds the input
               embedding, the last the output layer (a second copy when tied and PP > 1).
gradients      Megatron DDP's gradient buffer, fp32 (the actor sets ``grad_reduce_in_fp32``):
               4 bytes per parameter, whole on every rank (the distributed optimizer
               reduce-scatters inside it, it does not shrink it).
optimizer      fp32 main weights (bf16 models only) + Adam ``exp_avg`` and ``exp_avg_sq``:
               12 bytes per parameter (8 for an fp32 model); / (DP x CP) with
               ``parallel.use_distributed_optimizer`` (MoE experts: / (DP x CP / EP)); minus the host share with
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
engines        what the rollout engines' processes hold on a trainer's GPU, as their registered
               spec says (``EngineSpec.trainer_gpu_share``): SGLang's ``mem_fraction_static``
               share of a GPU a colocated engine shares with a trainer rank, and the CUDA
               contexts its TP processes open there (``rollout/sglang/sizing.py``).
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
from megatron_rl_fp8.plan.model_bytes import (
    DEFAULT_LOGPROBS,
    Device,
    LogitsCost,
    Spec,
    forward_working_bytes,
    fp8_linear_params,
    fp8_weight_copy_bytes,
    layer_activation_bytes,
    logits_bytes,
    param_bytes,
    saves_fp8_inputs,
    stage_expert_params,
    stage_fp8_layers,
    stage_params,
)
from megatron_rl_fp8.rollout.registry import GpuShare, Hosts, engine_spec
from megatron_rl_fp8.utils.cluster import MAX_GPUS_PER_NODE, MAX_NODES

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig
    from megatron_rl_fp8.models.config import ModelConfig

GB = 1e9  # GB here are 10^9 bytes, as benchmarks/bench_actor.py reports torch.cuda.max_memory_allocated

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
class World:
    """The GPUs a run gets."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_gb: float = 80.0
    # cpu: fp32 for params_dtype=auto, no fused kernels, the local spec, no allowance (the CPU
    # validation of scripts/validate_plan.py).
    device: Device = "gpu"

    def __post_init__(self):
        for name, most in (("gpus_per_node", MAX_GPUS_PER_NODE), ("nodes", MAX_NODES)):
            value = getattr(self, name)
            if not 1 <= value <= most:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {value}: give a count from 1 to {most}"
                )
        if not (self.gpu_memory_gb > 0 and math.isfinite(self.gpu_memory_gb)):
            raise ConfigError(
                f"--gpu-memory-gb {self.gpu_memory_gb}: give a GPU's memory in GB, a finite "
                "number > 0 (80 for H100)"
            )

    @property
    def size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def hosts(self) -> Hosts:
        """These GPUs as an engine's planning hooks take them (``rollout/registry.py``)."""
        return Hosts(
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            gpu_memory_gb=self.gpu_memory_gb,
            on_gpu=self.device != "cpu",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the actor is laid out over the world: the config's, or an alternative the search
    tries. Recompute ``full`` is Megatron's ``uniform`` (chunks of ``recompute_num_layers``) or
    ``block`` method; ``selective`` recomputes ``recompute_modules``."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism (MoE): a split of the DP x CP ranks, not a multiple
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
            ep=p.expert_model_parallel_size,
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

    def optimizer_params(self, m: ModelConfig, stage: int) -> float:
        """Parameters whose optimizer state one GPU of pipeline ``stage`` holds: its own, or with
        the distributed optimizer its share over the DP x CP ranks (MoE: the experts' over
        DP x CP / EP, each expert's replicas)."""
        params = stage_params(m, self.tp, self.pp, stage, ep=self.ep)
        if not self.distributed_optimizer:
            return params
        experts = stage_expert_params(m, self.tp, self.pp, self.ep)
        return (params + experts * (self.ep - 1)) / (self.dp * self.cp)

    def describe(self) -> str:
        recompute = {
            "none": "off",
            "selective": "selective (" + ", ".join(self.recompute_modules) + ")",
            "full": f"full ({self.recompute_method}, {self.recompute_num_layers} layer(s))",
        }[self.recompute]
        offload = (
            f", optimizer offload {self.offload_fraction:.0%}" if self.offload_fraction else ""
        )
        ep = f" (EP {self.ep})" if self.ep > 1 else ""
        return (
            f"TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp}{ep}; "
            f"SP {'on' if self.sequence_parallel else 'off'}; distributed optimizer "
            f"{'on' if self.distributed_optimizer else 'off'}; recompute {recompute}{offload}"
        )


@dataclasses.dataclass(frozen=True)
class Component:
    """One row of the table: bytes per GPU in each phase; ``outside``: held outside the trainer's
    tensors (the runtime allowance, other processes), unseen by its ``max_memory_allocated``."""

    name: str
    update: float
    logprobs: float
    outside: bool = False

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
        allowance and what other processes hold (the rollout engines, their CUDA contexts)."""
        return sum(c[phase] for c in self.components if not c.outside)

    @property
    def peak(self) -> float:
        return max(self.total(p) for p in PHASES)

    @property
    def margin_gb(self) -> float:
        return self.world.gpu_memory_gb - self.peak / GB

    @property
    def fits(self) -> bool:
        return self.margin_gb >= 0


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


def _engine_shares(cfg: RunConfig, world: World) -> tuple[GpuShare, ...]:
    """What the rollout engines' processes hold on a trainer's GPU, by their registered spec."""
    return engine_spec(cfg.rollout.engine).trainer_gpu_share(cfg.rollout, world.hosts)


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
    lg = {ph: logits_bytes(logits, ph, tokens=rank_tokens, vocab=vocab, a=a) for ph in PHASES}
    # Bytes per parameter: fp32 main weights (a bf16 model only) and Adam's two moments, less the
    # share offloaded to the host; over the parameters whose state this GPU holds
    # (Layout.optimizer_params: the distributed optimizer shards them).
    optimizer = ((4 if a == 2 else 0) + 8) * (1 - lay.offload_fraction)
    n_micro = _micro_batches(cfg, lay.dp)
    engines = _engine_shares(cfg, world)
    allowance = 0.0 if cpu else RUNTIME_ALLOWANCE_GB * GB
    fp8_copies = fp8_weight_copy_bytes(cfg.fp8, spec=spec, device=world.device)
    fp8_codes = saves_fp8_inputs(cfg.fp8, spec=spec, device=world.device)

    best = None
    for stage in range(lay.pp):
        params = stage_params(m, lay.tp, lay.pp, stage, ep=lay.ep)
        optimizer_params = lay.optimizer_params(m, stage)
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
        fp8_params = fp8_linear_params(m, cfg.fp8, lay.tp, lay.pp, stage, ep=lay.ep)
        fp8_update, fp8_logprobs = (fp8_params * b for b in fp8_copies)
        rows = (
            Component("weights", params * a, params * a),
            Component("gradients", params * 4, params * 4),
            Component("optimizer", optimizer * optimizer_params, optimizer * optimizer_params),
            Component("activations", update[0], logprobs[0]),
            Component("logits", update[1], logprobs[1]),
            Component("KL reference", ref, ref),
            Component("FP8 weight copies", fp8_update, fp8_logprobs),
            *(Component(e.name, e.bytes, e.bytes, outside=True) for e in engines),
            Component("allowance", allowance, allowance, outside=True),
        )
        est = Estimate(lay, world, stage, rows, tokens, in_flight)
        if best is None or est.peak > best.peak:
            best = est
    notes = tuple(e.note for e in engines if e.note)
    return dataclasses.replace(best, notes=notes)
