"""Step-time model: what one RL step costs, phase by phase, from the config alone.

A pure function of the resolved ``RunConfig``, the world and a GPU parameter set
(``plan/hardware.py``): no torch, no torch.distributed, no GPU. It shares the memory planner's
layout (``plan/memory.py:Layout``) and reports the planner's memory next to the times.

Each phase is a roofline with *measured* efficiencies (:class:`Efficiency`, ``plan/efficiency.py``: every constant names
the measurement it comes from, or says ``ASSUMPTION`` where there is none yet):

=============  ===============================================================================
rollout        per engine (all engines in parallel, rows split evenly). Prefill: compute
               bound, each prompt once per group (SGLang's prefix cache). Decode:
               as many steps as the engine's tokens need at the KV pool's concurrency
               (continuous batching), at least ``max_new_tokens`` (the longest response), each
               reading the engine's weights once plus the KV cache of the live sequences: HBM
               bound (or compute bound at large batches). FP8 rollout
               halves the linear weights' bytes and runs the GEMMs at the FP8 GEMM ratio.
               Multi-turn (``env.tools``): a trajectory's response is sampled turns and
               the environment's inserted answers (a share ``inserted`` of its tokens, all
               within ``max_new_tokens``); the answers are prefilled, not decoded, and each
               later turn is a new request to the engine (``Efficiency.turn_request_s``).
tools          multi-turn only: every later turn's tool calls, ``tool_s`` each, over
               ``env.num_workers`` (one at a time in the driver when 0); a turn's calls start
               together, so never less than ``(turns - 1) x tool_s``.
reward         rows x a per-row CPU cost / ``reward.num_workers``.
old_logprobs   one forward of the batch (the KL reference's too when ``loss.kl_coef > 0``).
shadow         full FP8 with ``loss.calib.enabled``: a BF16 forward of the batch (pi_old), per
               later mini-batch a BF16 + an FP8 forward of pi_theta, divided by the interval
               (``loss.calib.mode=oracle``: BF16 only, every step).
update         forward + backward = 3 forwards (+1 forward under full recompute), the optimizer
               step per mini-batch, the TP collectives and the DP gradient reduction.
sync           TP gather on NVLink, FP8 quantization (FP8 rollout), the broadcast to the
               engines (NVLink when they share the first node, else InfiniBand or the
               ``engine_link`` given), engine load; ``rollout.delta_sync``: off the node, the
               encode, the changed bytes on the link and the apply (:func:`delta_transfer`).
checkpoint     weights + optimizer state at the file system's rate / ``train.save_interval``.
=============  ===============================================================================

Trainer compute: the FLOP convention of ``benchmarks/bench_actor.py`` (PaLM's: 6 x linear weights per
token + 12 x layers x seq x heads x head_dim for attention, a forward is a third) split in two:
the linear GEMMs at the measured GEMM efficiency, and the rest (attention, norms, the loss,
launches; everything not a linear GEMM) at a per-FLOP cost fitted to the measured 2.03B actor
step, so that the model reproduces that step. FP8 training divides only the GEMM part, by the
measured fwd + bwd ratio of FP8 linear blocks. Pipeline bubbles multiply the compute by
``1 + (PP - 1) / micro-batches``.

The step: ``train.pipeline=sync``, the sum of the phases; ``one_step_off`` (dedicated engines),
max(rollout + reward, old_logprobs + shadow + update) + sync + checkpoint, the shorter side
waiting (:class:`Prediction`; steady state; docs/scaling.md, "Pipelined" steps).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Literal

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.recipes import planned_recipe
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.plan.efficiency import EFFICIENCY, REFERENCE_GPU, Efficiency
from megatron_rl_fp8.plan.hardware import GPU
from megatron_rl_fp8.plan.memory import Estimate, Layout, World, estimate
from megatron_rl_fp8.plan.model_bytes import (
    Spec,
    layer_active_weights,
    layer_linear_weights,
    stage_params,
)
from megatron_rl_fp8.plan.presets import BENCH_ACTOR_2B
from megatron_rl_fp8.rollout import registry
from megatron_rl_fp8.rollout.registry import Fleet

if TYPE_CHECKING:
    from megatron_rl_fp8.config import RunConfig

Precision = Literal["bf16", "fp8-rollout", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp8-rollout", "fp8")
Pipeline = Literal["sync", "one_step_off"]  # train.pipeline
PHASES = ("rollout", "tools", "reward", "old_logprobs", "shadow", "update", "sync", "checkpoint")
# The engines' phases, which under one_step_off overlap the trainer's; then those in turn.
ROLLOUT_SIDE, TRAINER_SIDE = ("rollout", "tools", "reward"), ("old_logprobs", "shadow", "update")
IN_TURN = ("sync", "checkpoint")


# -- FLOPs: benchmarks/bench_actor.py's convention ------------------------------------------------------
def linear_weights(m: ModelConfig) -> float:
    """Weights of every linear GEMM, the output layer included (not the embedding, a lookup);
    MoE: every expert's (what is stored, read and sent)."""
    return m.num_layers * layer_linear_weights(m) + m.hidden_size * m.padded_vocab_size()


def active_linear_weights(m: ModelConfig) -> float:
    """:func:`linear_weights` that one token multiplies (MoE: its top-k experts): its FLOPs / 2."""
    return m.num_layers * layer_active_weights(m) + m.hidden_size * m.padded_vocab_size()


def train_flops_per_token(m: ModelConfig, seq: float) -> tuple[float, float]:
    """(linear, attention) training FLOPs per token, forward + backward, at sequence length
    ``seq``: ``benchmarks/bench_actor.py:flops_per_token`` split in its two terms (a unit test
    holds them equal); MoE: the active weights only."""
    q = m.num_attention_heads * m.kv_channels
    return 6.0 * active_linear_weights(m), 12.0 * m.num_layers * seq * q


def optimizer_seconds(params: float, gpu: GPU, eff: Efficiency) -> float:
    """Seconds of one Adam step over ``params`` parameters on one GPU: memory-bound."""
    # Adam, fp32 main weights: read grad, main, m, v (16 B); write main, m, v, bf16 weight (14 B).
    return params * 30 / (gpu.hbm_bytes_s * eff.optimizer_hbm)


@functools.lru_cache(maxsize=8)
def _rest_seconds_per_flop(eff: Efficiency) -> float:
    """The non-GEMM cost per model FLOP, fitted so that the reference step (bench_actor's 2.03B
    shape, 16384 tokens of 2048) takes ``eff.actor_step_s`` on the reference GPU."""
    m = ModelConfig(**BENCH_ACTOR_2B)
    tokens = 8 * 2048
    lin, attn = train_flops_per_token(m, 2048)
    gemm = tokens * lin / (REFERENCE_GPU.bf16_flops * eff.gemm_bf16)
    opt = optimizer_seconds(stage_params(m, tp=1, pp=1, stage=0), REFERENCE_GPU, eff)
    rest = eff.actor_step_s - gemm - opt
    return rest / (tokens * (lin + attn))


def delta_transfer(sent: float, link: float, eff: Efficiency) -> float:
    """Seconds of a delta sync of ``sent`` bytes over ``link`` bytes/s: the senders' encode, the
    changed bytes (``eff.delta_fraction``) on the link, the receivers' apply (docs/delta_sync.md:
    it pays where ``1 / link`` exceeds ``2 / encode rate`` by ``1 - fraction``)."""
    rate = eff.delta_encode_bytes_s
    return sent / rate + eff.delta_fraction * sent / link + sent / rate


# -- inputs -------------------------------------------------------------------------------------
def planned_fleet(cfg: RunConfig, world: World) -> tuple[Fleet, str | None]:
    """The rollout engines the model plans on ``world``, as their registered spec places them
    (SGLang's ``num_engines=0``: one per TP group of every node, ``rollout/sglang/placement.py``),
    and a note where the configured engine runs in the trainer and another engine's stand in."""
    return registry.planned_fleet(cfg.rollout, world.hosts)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds per phase (amortised where a phase is not every step) and what they came from.
    ``phases`` is each phase's work; ``step_s`` is the step under ``pipeline`` (``train.pipeline``;
    the module docstring has both formulas)."""

    precision: Precision
    phases: dict[str, float]
    detail: dict[str, float]
    memory: Estimate
    tokens: float  # prompt + response tokens per step
    gpus: int  # trainer GPUs + dedicated engine GPUs
    pipeline: Pipeline = "sync"

    @property
    def rollout_side_s(self) -> float:  # the engines' work: generation and reward scoring
        return sum(self.phases[p] for p in ROLLOUT_SIDE)

    @property
    def trainer_side_s(self) -> float:  # the trainer's: old logprobs, BF16 shadow, update
        return sum(self.phases[p] for p in TRAINER_SIDE)

    @property
    def sync_step_s(self) -> float:
        """The synchronous step: every phase in turn, whatever ``pipeline`` is."""
        return sum(self.phases.values())

    @property
    def step_s(self) -> float:
        if self.pipeline == "sync":
            return self.sync_step_s
        overlapped = max(self.rollout_side_s, self.trainer_side_s)
        return overlapped + sum(self.phases[p] for p in IN_TURN)

    @property
    def bottleneck(self) -> Literal["rollout", "trainer"] | None:
        """The longer side of a ``one_step_off`` step (the trainer on a tie); None in sync."""
        if self.pipeline != "sync":
            return "rollout" if self.rollout_side_s > self.trainer_side_s else "trainer"

    @property
    def trainer_wait_s(self) -> float:
        """``one_step_off``: the trainer's wait, its update done, for the next rollout (0 in
        sync, where the rollout is a phase of the step)."""
        gap = self.rollout_side_s - self.trainer_side_s
        return 0.0 if self.pipeline == "sync" else max(0.0, gap)

    @property
    def engine_wait_s(self) -> float:
        """``one_step_off``: the engines' idle time, their rollout done, until the trainer syncs."""
        gap = self.trainer_side_s - self.rollout_side_s
        return 0.0 if self.pipeline == "sync" else max(0.0, gap)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def check_turns(
    cfg: RunConfig, turns: float | None, inserted: float, tool_s: float
) -> tuple[float, float]:
    """(turns, inserted) for the step-time model: the defaults a single-turn run and a
    multi-turn one plan with (1 and 0; ``env.max_turns`` and 0), one-line errors otherwise."""
    most = cfg.env.max_turns if cfg.env.tools else 1
    turns = float(most) if turns is None else turns
    if not 1 <= turns <= most:  # nan fails it too
        if not cfg.env.tools:
            raise ConfigError(f"--turns {turns:g}: a run without env.tools takes one turn")
        raise ConfigError(
            f"--turns {turns:g}: give the mean turns per trajectory, 1 to env.max_turns={most}"
        )
    if not 0 <= inserted < 1 or (inserted > 0 and turns == 1):
        raise ConfigError(
            f"--inserted {inserted:g}: give the share of response tokens the environment "
            "inserted (rollout/inserted_token_frac), in [0, 1), and 0 for one turn"
        )
    if not 0 <= tool_s < math.inf:
        raise ConfigError(f"--tool-s {tool_s:g}: give the seconds of one tool call, 0 or more")
    return turns, inserted


# -- the phases ---------------------------------------------------------------------------------
def _rollout(
    m: ModelConfig,
    gpu: GPU,
    fleet: Fleet,
    *,
    prompts: int,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    fill: float,
    fp8: bool,
    eff: Efficiency,
    turns: float = 1.0,
    inserted: float = 0.0,
) -> dict[str, float]:
    k = fleet.tp
    # MoE: the engine holds (and a decode step of a full batch reads) every expert, but a token
    # multiplies only its top-k (ASSUMPTION: the batch touches every expert at each step).
    lin, stored = active_linear_weights(m), linear_weights(m)
    emb = m.hidden_size * m.padded_vocab_size()  # the input embedding, read once per token
    q = m.num_attention_heads * m.kv_channels
    weight_bytes = (stored * (1 if fp8 else 2) + 2 * emb) / k  # per GPU of the engine
    kv_per_token = 2 * m.num_layers * m.num_query_groups * m.kv_channels * 2 / k  # bf16 K and V
    pool = fleet.mem_fraction * gpu.memory_gb * 1e9 - weight_bytes
    seq = prompt_len + new_tokens
    if pool < kv_per_token * seq:
        raise ConfigError(
            f"{fleet.memory_setting}={fleet.mem_fraction} leaves no KV cache for one "
            f"{seq}-token sequence on a TP {k} engine ({weight_bytes / 1e9:.1f} GB of weights per "
            f"GPU): raise it or {fleet.tp_setting}"
        )
    per_engine = math.ceil(rows / fleet.engines)
    concurrent = min(per_engine, int(pool // (kv_per_token * seq)))
    gemm_rate = gpu.bf16_flops * (eff.rollout_fp8_gemm if fp8 else 1.0)
    # Prefill: each prompt once per group (prefix cache), causal attention counted in full.
    groups = math.ceil(prompts / fleet.engines)
    prefill_tokens = groups * prompt_len
    prefill = prefill_tokens * (
        2 * lin / (gemm_rate * eff.prefill_mfu)
        + 4 * m.num_layers * prompt_len * q / (gpu.bf16_flops * eff.prefill_mfu)
    )
    # Multi-turn: the environment's answers, each trajectory's own (no prefix shared), are
    # prefilled against the context so far (on average half the response in).
    mean_new = fill * new_tokens
    answers = per_engine * mean_new * inserted
    context = prompt_len + mean_new / 2
    prefill += answers * (
        2 * lin / (gemm_rate * eff.prefill_mfu)
        + 4 * m.num_layers * context * q / (gpu.bf16_flops * eff.prefill_mfu)
    )
    prefill /= k
    # Decode: the longest response sets the steps; the mean sets the KV bytes and the FLOPs.
    sampled = mean_new * (1 - inserted)
    generated = per_engine * sampled
    # Continuous batching refills finished slots: the tokens at the pool's concurrency, but never
    # fewer steps than the longest response's sampled tokens.
    steps = max(math.ceil(new_tokens * (1 - inserted)), math.ceil(generated / concurrent))
    kv_read = generated * context * kv_per_token
    hbm = gpu.hbm_bytes_s * eff.decode_hbm
    memory_s = (steps * weight_bytes + kv_read) / hbm
    compute_s = generated * 2 * lin / k / (gemm_rate * eff.decode_mfu)
    latency_s = steps * 2 * m.num_layers * eff.tp_collective_latency_s if k > 1 else 0.0
    return {
        "rollout/prefill": prefill,
        "rollout/decode": max(memory_s, compute_s) + latency_s,
        "rollout/turn_requests": (turns - 1) * eff.turn_request_s,
        "rollout/decode_steps": steps,
        "rollout/concurrent_per_engine": concurrent,
        "rollout/sampled_tokens": rows * sampled,
        "rollout/inserted_tokens": rows * mean_new * inserted,
    }


def trainer_pass_seconds(
    m: ModelConfig,
    gpu: GPU,
    lay: Layout,
    *,
    tokens: float,
    seq: float,
    forwards: float,
    fp8_speedup: float,
    bubble: float,
    eff: Efficiency,
    gpus_per_node: int = 8,
) -> float:
    """Seconds on each GPU for ``forwards`` forward-equivalents (a backward is two) of
    ``tokens``, the compute split evenly over the world, plus the TP (and MoE's EP)
    collectives."""
    lin, attn = train_flops_per_token(m, seq)
    world = lay.tp * lay.pp * lay.cp * lay.dp
    per_gpu = tokens * forwards / 3 / world
    gemm = per_gpu * lin / (gpu.bf16_flops * eff.gemm_bf16) / fp8_speedup
    # The non-GEMM part, fitted on the reference GPU, scaled by HBM bandwidth (ASSUMPTION: it is
    # mostly memory-bound elementwise work).
    if eff.rest_s_per_flop is None:
        rest = per_gpu * (lin + attn) * _rest_seconds_per_flop(eff)
        rest *= REFERENCE_GPU.hbm_bytes_s / gpu.hbm_bytes_s
    else:  # fitted on this device: no scaling
        rest = per_gpu * (lin + attn) * eff.rest_s_per_flop
    # TP: 2 all-reduces (or all-gather + reduce-scatter under SP) of [tokens, hidden] bf16 per
    # layer and forward, each moving 2 (TP - 1) / TP of it per GPU, not overlapped.
    tp_s = 0.0
    local = tokens / (lay.dp * lay.cp)
    if lay.tp > 1:
        moved = 2 * local * m.hidden_size * 2 * 2 * (lay.tp - 1) / lay.tp
        tp_s = forwards * (m.num_layers / lay.pp) * moved / (gpu.nvlink_bytes_s * eff.nvlink)
    # EP: per MoE layer and forward, the token dispatcher's two all-to-alls (to the experts and
    # back) of the top-k copies, [tokens x k, hidden] bf16 / TP, of which (EP - 1) / EP leave
    # the GPU; over NVLink within a node, InfiniBand across (not overlapped: an upper bound).
    ep_s = 0.0
    if m.num_experts is not None and lay.ep > 1:
        moved = 2 * local * m.moe_topk * m.hidden_size * 2 / lay.tp * (lay.ep - 1) / lay.ep
        intra = lay.ep * lay.tp <= gpus_per_node
        link = gpu.nvlink_bytes_s * eff.nvlink if intra else gpu.ib_bytes_s * eff.ib
        ep_s = forwards * (m.num_layers / lay.pp) * moved / link
    return (gemm + rest) * bubble + tp_s + ep_s


def predict(
    cfg: RunConfig,
    world: World,
    gpu: GPU,
    precision: Precision,
    *,
    layout: Layout | None = None,
    fleet: Fleet | None = None,
    fill: float = 1.0,
    turns: float | None = None,
    inserted: float = 0.0,
    tool_s: float = 0.0,
    recipe: str | None = None,
    spec: Spec = "te",
    eff: Efficiency = EFFICIENCY,
    engine_link: float | None = None,
) -> Prediction:
    """Predicted seconds per phase of one step of ``cfg`` on ``world`` (trainer GPUs) of
    ``gpu``, for ``precision``: ``bf16``, ``fp8-rollout`` (FP8 engines, BF16 trainer) or ``fp8``
    (both; the trainer's recipe is ``recipe`` or ``fp8.recipe``, blockwise if that is bf16).
    ``fill``: mean response length / ``rollout.max_new_tokens``. A multi-turn run's
    (``env.tools``) ``turns``: mean turns per trajectory (default ``env.max_turns``, the most);
    ``inserted``: the share of its response tokens the environment inserted; ``tool_s``: seconds
    per tool call (the run's ``rollout/turns_mean``, ``rollout/inserted_token_frac``).
    ``engine_link``: bytes per second from a sender to engines off its node (default: the GPU's
    InfiniBand). Memory is
    the planner's
    :func:`~megatron_rl_fp8.plan.memory.estimate` for the same layout and ``spec``, with the
    trainer's FP8 as ``precision`` has it (its FP8 weight copies only under ``fp8``). The step
    is ``train.pipeline``'s (:class:`Prediction`)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    if not 0 < fill <= 1:
        raise ConfigError(f"--fill={fill} must be in (0, 1]")
    turns, inserted = check_turns(cfg, turns, inserted, tool_s)
    m, t, r = cfg.model, cfg.train, cfg.rollout
    lay = layout or Layout.from_config(cfg, world.size)
    fleet = fleet or planned_fleet(cfg, world)[0]
    fp8_rollout = precision != "bf16"
    fp8_train = precision == "fp8"
    recipe = recipe or planned_recipe(cfg.fp8.recipe)
    trainer_fp8 = dataclasses.replace(cfg.fp8, recipe=recipe if fp8_train else "bf16")
    memory = estimate(dataclasses.replace(cfg, fp8=trainer_fp8), world, layout=lay, spec=spec)
    if fleet.placement == "colocated" and fleet.engines * fleet.tp > world.size:
        raise ConfigError(f"{fleet.count_setting} ({fleet.engines}) x {fleet.tp_setting} "
                          f"({fleet.tp}) colocated engines need more than the {world.size} "
                          "trainer GPUs")  # fmt: skip
    if t.pipeline == "one_step_off" and fleet.placement == "colocated":
        # RunConfig.validate refuses the config; this catches a colocated ``fleet`` argument.
        raise ConfigError(
            "train.pipeline=one_step_off overlaps generation with training, which colocated "
            "engines cannot: give dedicated engines or train.pipeline=sync"
        )
    speed = eff.fp8_speedup(recipe) if fp8_train else 1.0

    prompts = t.prompts_per_step
    rows = prompts * r.n_samples_per_prompt
    prompt_len, new = cfg.task.max_prompt_len, r.max_new_tokens
    seq = prompt_len + fill * new
    tokens = rows * seq

    detail = _rollout(
        m,
        gpu,
        fleet,
        prompts=prompts,
        rows=rows,
        prompt_len=prompt_len,
        new_tokens=new,
        fill=fill,
        fp8=fp8_rollout,
        eff=eff,
        turns=turns,
        inserted=inserted,
    )
    phases = {
        "rollout": detail["rollout/prefill"]
        + detail["rollout/decode"]
        + detail["rollout/turn_requests"]
    }
    # A turn's calls start together: each later turn waits for its slowest worker's share.
    workers = max(1, cfg.env.num_workers)
    calls = rows * (turns - 1)
    phases["tools"] = max((turns - 1) * tool_s, calls * tool_s / workers)
    phases["reward"] = rows * eff.reward_s_per_row / max(1, cfg.reward.num_workers)

    # Micro-batches per DP rank and mini-batch: the pipeline bubble.
    per_rank = max(1, rows // t.updates_per_step // lay.dp)
    if t.max_tokens_per_gpu:
        micro = max(1, math.ceil(per_rank * seq / t.max_tokens_per_gpu))
    else:
        micro = max(1, math.ceil(per_rank / t.micro_batch_size))
    bubble = 1 + (lay.pp - 1) / micro
    run = dict(tokens=tokens, seq=seq, bubble=bubble, eff=eff, gpus_per_node=world.gpus_per_node)
    forward_fp8 = trainer_pass_seconds(m, gpu, lay, forwards=1, fp8_speedup=speed, **run)
    forward_bf16 = trainer_pass_seconds(m, gpu, lay, forwards=1, fp8_speedup=1.0, **run)
    reference = forward_fp8 if cfg.loss.kl_coef > 0 else 0.0
    phases["old_logprobs"] = forward_fp8 + reference

    shadow = 0.0
    if fp8_train and cfg.loss.calib.enabled:
        later = (t.updates_per_step - 1) / t.updates_per_step  # the mini-batches after the first
        shadow = forward_bf16 * (1 + later)  # oracle: BF16 pi_old and pi_theta, every step
        if cfg.loss.calib.mode != "oracle":  # and an FP8 pi_theta, every interval steps
            shadow = (shadow + later * forward_fp8) / cfg.loss.calib.interval
    phases["shadow"] = shadow

    forwards = 3 + (1 if lay.recompute == "full" else 0)
    update = trainer_pass_seconds(m, gpu, lay, forwards=forwards, fp8_speedup=speed, **run)
    params = stage_params(m, lay.tp, lay.pp, stage=0, ep=lay.ep)
    update += t.updates_per_step * optimizer_seconds(lay.optimizer_params(m, 0), gpu, eff)
    n = lay.dp * lay.cp
    if n > 1:  # DP gradient reduction, fp32, not overlapped (ASSUMPTION: an upper bound)
        per_gpu = (4 + 2 if lay.distributed_optimizer else 2 * 4) * params * (n - 1) / n
        spans_nodes = world.nodes > 1
        link = gpu.ib_bytes_s * eff.ib if spans_nodes else gpu.nvlink_bytes_s * eff.nvlink
        detail["update/grad_reduce"] = t.updates_per_step * per_gpu / link
        update += detail["update/grad_reduce"]
    phases["update"] = update

    # Weight sync: each PP stage's sender gathers its TP shards, quantizes (FP8 rollout), and
    # broadcasts to every engine; the stages send in turn.
    total = stage_params(m, 1, 1, 0)
    lin = linear_weights(m) - m.hidden_size * m.padded_vocab_size()  # the layers' linears
    nvlink = gpu.nvlink_bytes_s * eff.nvlink
    gather = 2 * total / lay.pp * (lay.tp - 1) / lay.tp / nvlink
    quantize = 0.0
    if fp8_rollout:
        rate = eff.quantize_bytes_s * gpu.hbm_bytes_s / REFERENCE_GPU.hbm_bytes_s
        quantize = 2 * lin / lay.pp / rate
    sent = 2 * total - (lin if fp8_rollout else 0)  # e4m3 linears (scales: ~0.01%), bf16 rest
    same_node = fleet.placement == "colocated" and fleet.engines * fleet.tp <= world.gpus_per_node
    link = nvlink if same_node else engine_link or gpu.ib_bytes_s * eff.ib
    transfer = sent / link
    if r.delta_sync and not same_node:
        detail["sync/transfer_full"] = transfer
        transfer = delta_transfer(sent, link, eff)
    detail.update(
        {
            "sync/gather": gather,
            "sync/quantize": quantize,
            "sync/transfer": transfer,
            "sync/load": eff.engine_load_s,
        }
    )
    phases["sync"] = gather + quantize + transfer + eff.engine_load_s

    ckpt_bytes = total * (2 + 12)  # bf16 weights + fp32 main weights and Adam's moments
    interval = t.save_interval or t.steps
    ckpt = ckpt_bytes / (world.nodes * eff.checkpoint_bytes_s_per_node)
    phases["checkpoint"] = ckpt / max(1, interval)

    dedicated = fleet.engines * fleet.tp if fleet.placement == "dedicated" else 0
    gpus = world.size + dedicated
    return Prediction(precision, phases, detail, memory, tokens, gpus, pipeline=t.pipeline)
