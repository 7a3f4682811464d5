"""``megatron-rl-fp8 plan CONFIG [--gpus-per-node 8] [--nodes N] [section.key=value ...]``: the
per-GPU memory of a run, whether its layout fits, and the layouts of the same GPUs that would
(docs/plan.md explains the table). ``--time`` adds the predicted seconds per phase of one step
for BF16, FP8 rollout and full FP8 (``plan/time.py``; docs/scaling.md), the pipelined step of
``train.pipeline=one_step_off`` included (compare with the override ``train.pipeline=sync``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megatron_rl_fp8.config import load_config, read_config_dict
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.recipes import planned_recipe
from megatron_rl_fp8.launch.layout import plan_layout
from megatron_rl_fp8.launch.slurm import SlurmEnv
from megatron_rl_fp8.plan.efficiency import EFFICIENCY
from megatron_rl_fp8.plan.hardware import get_gpu
from megatron_rl_fp8.plan.layouts import alternatives
from megatron_rl_fp8.plan.memory import GB, PHASES, RUNTIME_ALLOWANCE_GB, Estimate, World, estimate
from megatron_rl_fp8.plan.model_bytes import DEFAULT_LOGPROBS, param_bytes, stage_params
from megatron_rl_fp8.plan.presets import preset_overrides
from megatron_rl_fp8.plan.time import (
    IN_TURN,
    PRECISIONS,
    ROLLOUT_SIDE,
    TRAINER_SIDE,
    active_linear_weights,
    check_turns,
    planned_fleet,
    predict,
)
from megatron_rl_fp8.plan.time import PHASES as TIME_PHASES
from megatron_rl_fp8.rollout.registry import engine_spec

# The model fields the planner needs when the start checkpoint, which would supply them, is not
# on this machine (a plan is often made before the download).
SHAPE_FIELDS = (
    "arch",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False)
    p.add_argument("config", help="YAML config of the run.")
    p.add_argument(
        "overrides",
        nargs="*",
        help="section.key=value overrides, e.g. train.pipeline=one_step_off or "
        "train.pipeline=sync to compare the pipelined and the synchronous step under --time.",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8).")
    p.add_argument("--nodes", type=int, default=1, help="Nodes (default 1).")
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="Memory of one GPU, GB of 10^9 bytes (default: --gpu's, else 80: H100; 141 for H200).",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU parameter set for --time: H100, H200 or B200 (default H100); also sets "
        "--gpu-memory-gb unless given.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Plan a preset shape instead of the config's model: qwen3-8b, qwen3-14b, "
        "qwen2.5-32b, qwen3-32b (public config.json values; plan/presets.py).",
    )
    p.add_argument(
        "--time",
        action="store_true",
        help="Also print the step-time model: seconds per phase for bf16, fp8-rollout and fp8; "
        "with train.pipeline=one_step_off the overlapped step, its bottleneck and both sides' "
        "waits.",
    )
    p.add_argument(
        "--fill",
        type=float,
        default=1.0,
        help="--time: mean response length / rollout.max_new_tokens (default 1: every "
        "response at the limit).",
    )
    p.add_argument(
        "--turns",
        type=float,
        default=None,
        help="--time, multi-turn runs (env.tools): mean turns per trajectory, a run's "
        "rollout/turns_mean (default env.max_turns, the most).",
    )
    p.add_argument(
        "--inserted",
        type=float,
        default=0.0,
        help="--time, multi-turn runs: share of the response tokens the environment inserted "
        "(tool answers, prefilled rather than decoded), a run's rollout/inserted_token_frac "
        "(default 0).",
    )
    p.add_argument(
        "--tool-s",
        type=float,
        default=0.0,
        help="--time, multi-turn runs: seconds of one tool call (default 0).",
    )
    p.add_argument(
        "--engine-link-gbps",
        type=float,
        default=None,
        help="--time: Gb/s from each pipeline stage's sender to engines off its node (default: "
        "the GPU's InfiniBand; e.g. 10 for rollout workers outside the cluster).",
    )
    p.add_argument(
        "--delta-fraction",
        type=float,
        default=None,
        help="--time with rollout.delta_sync: a delta sync's share of a full one's bytes "
        f"(default {EFFICIENCY.delta_fraction:g}, measured at lr 1e-5; a run's "
        "perf/sync_relay_mb / perf/sync_relay_full_mb).",
    )
    p.add_argument(
        "--spec",
        choices=["te", "local"],
        default="te",
        help="Megatron layer spec: te = Transformer Engine, fused attention without the s^2 "
        "scores (GPU clusters, the default); local = no TE, attention per "
        "model.attention_backend (auto: torch's SDPA on GPUs, no s^2 scores; unfused: the "
        "[b, heads, s, s] scores are stored).",
    )
    p.add_argument("--top", type=int, default=5, help="Alternative layouts to print (default 5).")
    return p


def load_for_plan(path: str, overrides: list[str]):
    """(the run's config, notes). A checkpoint path that is not on this machine is dropped when
    the config states the model's shape; without the shape it is an error."""

    model = read_config_dict(path, overrides).get("model") or {}
    absent = [
        k
        for k in ("hf_checkpoint", "load", "ref_checkpoint")
        if isinstance(model.get(k), str) and not Path(model[k]).expanduser().exists()
    ]
    unstated = [f for f in SHAPE_FIELDS if f not in model]
    start = [k for k in absent if k != "ref_checkpoint"]
    if start and unstated:
        raise ConfigError(
            f"model.{start[0]}={model[start[0]]!r} is not on this machine and the config does "
            f"not state the model's shape ({', '.join('model.' + f for f in unstated)}): give "
            "the checkpoint folder, or the shape fields"
        )
    cfg = load_config(path, [*overrides, *(f"model.{k}=null" for k in absent)])
    notes = [
        f"model.{k}={model[k]!r} is not on this machine: planned from the config's model.* fields"
        for k in absent
    ]
    return cfg, notes


def _gb(x: float) -> str:
    return f"{x / GB:9.2f}" if x else "        -"


def format_table(e: Estimate) -> str:
    world = e.world
    lines = [f"{'GB per GPU (10^9 bytes)':<40}{'update':>9}  {'logprobs':>9}"]
    for c in e.components:
        lines.append(f"  {c.name:<38}{_gb(c.update)}  {_gb(c.logprobs)}")
    lines.append(f"  {'total':<38}{_gb(e.total('update'))}  {_gb(e.total('logprobs'))}")
    lines.append(f"  {'GPU memory':<38}{world.gpu_memory_gb:9.2f}")
    phase = max(PHASES, key=e.total)
    if e.fits:
        verdict = f"FITS: {e.margin_gb:.1f} GB to spare at the peak ({phase})"
    else:
        verdict = f"DOES NOT FIT: {-e.margin_gb:.1f} GB over at the peak ({phase})"
    return "\n".join([*lines, "", verdict])


def format_alternatives(fits: list[Estimate], top: int) -> str:
    if not fits:
        return "No layout of these GPUs fits: add GPUs, shorten the micro-batch, or offload."
    moe = any(e.layout.ep > 1 for e in fits)  # the EP column, for a mixture-of-experts model
    order = (
        "least recompute, smallest EP within a node, most margin"
        if moe
        else ("least recompute, most margin")
    )
    lines = [
        f"Layouts of the same {fits[0].world.size} GPUs that fit: {len(fits)}, the best "
        f"{min(top, len(fits))} (fewest model-parallel ranks, {order}):",
        "   TP  PP  CP  DP"
        + ("  EP" if moe else "")
        + "  SP   dist-opt  recompute    peak GB  margin GB",
    ]
    onoff = {True: "on", False: "off"}
    for e in fits[:top]:
        lay = e.layout
        ep = f" {lay.ep:>3}" if moe else ""
        lines.append(
            f"  {lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.dp:>3}{ep}  {onoff[lay.sequence_parallel]:<4}"
            f" {onoff[lay.distributed_optimizer]:<9} {lay.recompute:<10}"
            f"{e.peak / GB:9.1f}  {e.margin_gb:9.1f}"
        )
    return "\n".join(lines)


TIME_LABELS = {
    "rollout": "rollout (generation)",
    "tools": "tool calls",
    "shadow": "BF16 shadow (amortised)",
    "checkpoint": "checkpoint (amortised)",
}


def _row(label: str, values, fmt: str = "13.2f") -> str:
    return f"  {label:<32}" + "".join(f"{v:{fmt}}" for v in values)


def _shown(phases, preds) -> list[str]:
    """The phases of the table: a single-turn run's has no tool calls to show."""
    return [ph for ph in phases if ph != "tools" or any(p.phases[ph] for p in preds)]


def format_time(preds: list, gpu_name: str) -> str:
    """The ``--time`` table: one column per precision, seconds per phase; a ``one_step_off``
    run's phases grouped by the side that does them, which overlap."""
    head = "".join(f"{p.precision:>13}" for p in preds)
    lines = [f"{'seconds per step (' + gpu_name + ')':<34}{head}"]
    if preds[0].pipeline == "sync":
        for phase in _shown(TIME_PHASES, preds):
            lines.append(_row(TIME_LABELS.get(phase, phase), [p.phases[phase] for p in preds]))
        lines.append(_row("step", [p.step_s for p in preds]))
    else:
        groups = (
            ("engines, overlapping the trainer:", ROLLOUT_SIDE, "rollout side", "rollout_side_s"),
            ("trainer, overlapping the engines:", TRAINER_SIDE, "trainer side", "trainer_side_s"),
        )
        for title, phases, total, attr in groups:
            lines.append(f"  {title}")
            for phase in _shown(phases, preds):
                label = "  " + TIME_LABELS.get(phase, phase)
                lines.append(_row(label, [p.phases[phase] for p in preds]))
            lines.append(_row(f"  = {total}", [getattr(p, attr) for p in preds]))
        lines.append("  then in turn (nothing overlaps):")
        for phase in IN_TURN:
            lines.append(
                _row("  " + TIME_LABELS.get(phase, phase), [p.phases[phase] for p in preds])
            )
        lines.append(_row("step: max(sides) + sync + ckpt", [p.step_s for p in preds]))
        lines.append(f"  {'bottleneck':<32}" + "".join(f"{p.bottleneck:>13}" for p in preds))
        lines.append(_row("trainer waits for the rollout", [p.trainer_wait_s for p in preds]))
        lines.append(_row("engines wait for the trainer", [p.engine_wait_s for p in preds]))
        lines.append(_row("sync step (sum of the phases)", [p.sync_step_s for p in preds]))
        lines.append(
            f"  {'speed-up vs sync':<32}"
            + "".join(f"{p.sync_step_s / p.step_s:12.2f}x" for p in preds)
        )
    lines.append(_row("tokens/s", [p.tokens_per_s for p in preds], "13.0f"))
    base = preds[0].step_s
    lines.append(
        f"  {'speed-up vs ' + preds[0].precision:<32}"
        + "".join(f"{base / p.step_s:12.2f}x" for p in preds)
    )
    return "\n".join(lines)


def _shadow_schedule(cfg) -> str:
    calib = cfg.loss.calib
    if not calib.enabled:
        return "off"
    if calib.mode == "oracle":
        return "every step (oracle: a BF16 forward per mini-batch)"
    return f"every {calib.interval} steps"


def _sync_inputs(link_gbps, delta_fraction):
    """(the efficiencies with ``--delta-fraction``, ``--engine-link-gbps`` in bytes/s or None);
    a ConfigError names a bad flag."""
    eff = EFFICIENCY
    if delta_fraction is not None:
        if not 0 <= delta_fraction <= 1:
            raise ConfigError(f"--delta-fraction={delta_fraction} must be in [0, 1]")
        eff = dataclasses.replace(eff, delta_fraction=delta_fraction)
    if link_gbps is not None and not link_gbps > 0:
        raise ConfigError(f"--engine-link-gbps={link_gbps} must be > 0")
    return eff, (link_gbps * 1e9 / 8 if link_gbps else None)


def run_time(cfg, world: World, gpu, fill: float, spec: str, turns=None, inserted=0.0, tool_s=0.0,
             link_gbps=None, delta_fraction=None):  # fmt: skip
    """The ``--time`` table and its notes; ``turns``, ``inserted``, ``tool_s`` as
    :func:`~megatron_rl_fp8.plan.time.predict` takes them; ``link_gbps``: the senders' link to
    engines off their node; ``delta_fraction``: a delta sync's share of the bytes."""
    fleet, stand_in = planned_fleet(cfg, world)
    eff, link = _sync_inputs(link_gbps, delta_fraction)
    multi = dict(turns=turns, inserted=inserted, tool_s=tool_s, eff=eff, engine_link=link)
    preds = [
        predict(cfg, world, gpu, p, fill=fill, spec=spec, fleet=fleet, **multi) for p in PRECISIONS
    ]
    recipe = planned_recipe(cfg.fp8.recipe)
    d = preds[-1].detail
    notes = [
        f"step-time model (plan/time.py, docs/scaling.md): {cfg.train.prompts_per_step} prompts "
        f"x {cfg.rollout.n_samples_per_prompt} samples, {cfg.task.max_prompt_len} + "
        f"{cfg.rollout.max_new_tokens} tokens, fill {fill:g}; fp8 training recipe {recipe}; "
        f"shadow {_shadow_schedule(cfg)}",
        f"rollout: {_engines(fleet)} x TP {fleet.tp}, {fleet.placement}; decode "
        f"{d['rollout/decode_steps']:.0f} steps at {d['rollout/concurrent_per_engine']:.0f} "
        "sequences per engine (fp8)",
    ]
    if cfg.env.tools:
        turns, inserted = check_turns(cfg, turns, inserted, tool_s)
        notes.append(
            f"multi-turn ({cfg.env.tools}): {turns:g} turns per trajectory, "
            f"{d['rollout/sampled_tokens']:.0f} sampled and {d['rollout/inserted_tokens']:.0f} "
            f"inserted response tokens per step (--turns, --inserted: a run's "
            f"rollout/turns_mean, rollout/inserted_token_frac), {tool_s:g} s per tool call "
            "(--tool-s)"
        )
    if "sync/transfer_full" in d:
        notes.append(
            "rollout.delta_sync: the sync's transfer "
            + " / ".join(f"{p.detail['sync/transfer']:.2f}" for p in preds)
            + " s by deltas (encode + "
            f"{eff.delta_fraction:g} of the bytes on the link + apply), "
            + " / ".join(f"{p.detail['sync/transfer_full']:.2f}" for p in preds)
            + f" s in full ({' / '.join(PRECISIONS)}; docs/delta_sync.md)"
        )
    elif link is not None:
        notes.append(f"the senders' link to the engines: {link_gbps:g} Gb/s (--engine-link-gbps)")
    if stand_in:
        notes.append(stand_in)
    if cfg.train.pipeline == "one_step_off":
        notes.append(
            "train.pipeline=one_step_off: the engines generate the next step's rollout while the "
            "trainer updates on this one's (rows one policy version old); steady state, the "
            "first step's rollout not overlapped; the override train.pipeline=sync prints the "
            "synchronous step"
        )
    elif cfg.rollout.placement == "dedicated":
        pipelined = [dataclasses.replace(p, pipeline="one_step_off").step_s for p in preds]
        notes.append(
            "train.pipeline=one_step_off would overlap rollout with training: "
            + " / ".join(f"{s:.2f}" for s in pipelined)
            + f" s per step ({' / '.join(PRECISIONS)})"
        )
    return "\n".join([format_time(preds, gpu.name), *(f"  note: {n}" for n in notes)])


def _engines(fleet) -> str:
    """The engine count, and where it comes from when the engine derived it."""
    return f"{fleet.engines} engine(s)" + (f" ({fleet.count_note})" if fleet.count_note else "")


def launcher_note(cfg, world: World) -> str | None:
    """What ``megatron-rl-fp8 launch`` says of a run's engines on these nodes, when it would
    start them on the trainer's GPUs (the engine's spec says when: ``launched_beside_trainer``)
    and refuse them: the plan counts the engines as the launcher does, and the launcher also
    checks that the weight sync reaches them (``launch/layout.py``), so the two agree or the
    plan says why not. Dedicated engines run on nodes of their own, outside the planned trainer
    GPUs."""
    if not engine_spec(cfg.rollout.engine).launched_beside_trainer(cfg.rollout, world.hosts):
        return None

    nodes = tuple(f"node{i + 1}" for i in range(world.nodes))
    try:
        plan_layout(cfg, SlurmEnv(nodes=nodes, gpus_per_node=world.gpus_per_node, job_id=0))
    except ConfigError as e:
        return f"`megatron-rl-fp8 launch` would refuse this run's engines on these GPUs: {e}"
    return None


def run(args) -> int:

    if not (0 < args.fill <= 1):  # nan fails it too
        raise ConfigError(
            f"--fill {args.fill}: give the mean response length as a fraction of "
            "rollout.max_new_tokens, in (0, 1]"
        )
    if args.turns is not None or args.inserted or args.tool_s:
        if not args.time:
            raise ConfigError(
                "--turns, --inserted and --tool-s are the step-time model's: add --time"
            )
    if args.top < 0:
        raise ConfigError(f"--top {args.top}: give how many layouts to list, 0 or more")
    gpu = get_gpu(args.gpu or "H100")
    memory_gb = args.gpu_memory_gb if args.gpu_memory_gb is not None else gpu.memory_gb
    world = World(gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu_memory_gb=memory_gb)
    overrides = [*(preset_overrides(args.model) if args.model else []), *args.overrides]
    cfg, notes = load_for_plan(args.config, overrides)
    # The rules `train` applies, with the same one-line errors; not what this machine lacks
    # (TE, logger packages): plans are usually made away from the GPUs.
    cfg.validate(world.size, this_machine=False)
    if args.time:  # the step-time model's refusals, before any table is printed
        check_turns(cfg, args.turns, args.inserted, args.tool_s)
        planned_fleet(cfg, world)
        _sync_inputs(args.engine_link_gbps, args.delta_fraction)
    e = estimate(cfg, world, spec=args.spec, logits=DEFAULT_LOGPROBS)
    refused = launcher_note(cfg, world)
    notes = [*notes, refused] if refused else notes
    m = cfg.model
    dtype = "bf16" if param_bytes(m, world.device) == 2 else "fp32"
    print(
        f"{args.config} on {world.size} GPUs ({world.nodes} x {world.gpus_per_node}, "
        f"{world.gpu_memory_gb:g} GB each)"
    )
    moe = ""
    if m.num_experts is not None:
        active = active_linear_weights(m) + m.hidden_size * m.padded_vocab_size()
        moe = f", {m.num_experts} experts, top-{m.moe_topk}, {active / 1e9:.2f}B active"
    print(
        f"  model: {stage_params(m, tp=1, pp=1, stage=0) / 1e9:.2f}B parameters "
        f"({m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}{moe}), {dtype}; "
        f"{args.spec} spec"
    )
    print(f"  layout: {e.layout.describe()}")
    stage = f"pipeline stage {e.stage} of {e.layout.pp}" if e.layout.pp > 1 else "every stage"
    print(
        f"  micro-batch: {e.micro_batch_tokens} tokens; the table: {stage}, "
        f"{e.micro_batches_in_flight} micro-batch(es) in flight (1F1B); log-prob path: "
        f"{DEFAULT_LOGPROBS.name}; allowance {RUNTIME_ALLOWANCE_GB:g} GB"
    )
    for note in [*notes, *e.notes]:
        print(f"  note: {note}")
    print()
    print(format_table(e))
    print()
    print(
        format_alternatives(
            alternatives(cfg, world, spec=args.spec, logits=DEFAULT_LOGPROBS), args.top
        )
    )
    if args.time:
        print()
        print(
            run_time(
                cfg,
                world,
                gpu,
                args.fill,
                args.spec,
                args.turns,
                args.inserted,
                args.tool_s,
                args.engine_link_gbps,
                args.delta_fraction,
            )  # fmt: skip
        )
    return 0


def main(argv: list[str] | None = None, prog: str = "megatron-rl-fp8 plan") -> int:
    # Intermixed: the overrides may come after the flags.
    args = build_parser(prog).parse_intermixed_args(argv)

    try:
        return run(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
