"""The scaling tables and plots of docs/scaling.md, from the step-time model (plan/time.py) and the
memory planner (plan/memory.py). Pure arithmetic: seconds on a CPU, no GPU.

For each preset (plan/presets.py) on 1/2/4/8 nodes of 8 H100 and H200, one GRPO workload (the
FP8 example's settings, ``WORKLOAD``): the planner's best layout that fits (``plan.alternatives``,
its first), colocated SGLang engines of the smallest TP whose BF16 weights take at most half of
their memory share, one on every TP group of every node (:func:`engine_overrides`); then BF16, FP8
rollout and full FP8 (blockwise, shadow every 20 steps) per phase. Also the batch sweep (where
FP8 stops paying), the training-phase speed-up per recipe (the paper's "up to 1.5x" against end
to end), the one-step-off pipelined step on dedicated engine nodes against the synchronous one
(:func:`dedicated_config`), and the validation against the measured H200 actor steps of
docs/gpu.md.

    python scripts/scaling_model.py                    # rewrites the tables in docs/scaling.md
    python scripts/scaling_model.py --print            # prints them instead
    python scripts/scaling_model.py --no-plots
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.recipes import RECIPES
from megatron_rl_fp8.plan.hardware import GPUS
from megatron_rl_fp8.plan.layouts import alternatives
from megatron_rl_fp8.plan.measure import preset_model
from megatron_rl_fp8.plan.memory import GB, Layout, World
from megatron_rl_fp8.plan.model_bytes import CHUNKED_LOGPROBS, stage_params
from megatron_rl_fp8.plan.presets import PRESETS, preset_overrides
from megatron_rl_fp8.plan.time import (
    EFFICIENCY,
    PHASES,
    PRECISIONS,
    REFERENCE_GPU,
    Fleet,
    optimizer_seconds,
    planned_fleet,
    predict,
    train_flops_per_token,
    trainer_pass_seconds,
)
from megatron_rl_fp8.rollout.sglang.placement import colocated_engines

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = EXAMPLES_DIR / "qwen3_8b_grpo_math_fp8.yaml"
WORKLOAD = [
    "model.hf_checkpoint=null",
    "train.prompts_per_step=128",
    "rollout.n_samples_per_prompt=8",
    "task.max_prompt_len=1024",
    "rollout.max_new_tokens=4096",
    "train.updates_per_step=4",
    "train.micro_batch_size=1",
    "train.save_interval=20",
    "fp8.recipe=blockwise",
    "loss.calib.interval=20",
]
FILL = 0.5  # mean response = half of max_new_tokens (ASSUMPTION; docs/scaling.md)
MEM_FRACTION = 0.35  # the engines' share of each GPU (the 32B example's)
DEDICATED_MEM_FRACTION = (
    0.85  # a dedicated engine's share: SGLang's default in the planner (sizing.py)
)
TRAINER_START = [  # the planner picks the layout (plan.alternatives); these start its search
    "parallel.tensor_model_parallel_size=1",
    "parallel.sequence_parallel=false",
    "parallel.use_distributed_optimizer=true",
]
PIPELINE_GPU = "H200"
PIPELINE_NODES = ((1, 1), (2, 1), (4, 1), (8, 2))  # (trainer nodes, dedicated engine nodes)
NODES = (1, 2, 4, 8)
GPUS_PER_NODE = World.gpus_per_node  # the planner's node (8 GPUs), the tables' and the launcher's
TABLE_GPUS = ("H100", "H200")
FIGURES = ROOT / "docs" / "figures"
DOC = ROOT / "docs" / "scaling.md"
BEGIN, END = "<!-- scaling_model.py: begin -->", "<!-- scaling_model.py: end -->"


@dataclasses.dataclass
class Case:
    preset: str
    gpu: str
    nodes: int
    layout: Layout | None
    fleet: Fleet | None
    preds: dict  # precision -> Prediction
    why: str = ""


def engine_tp(cfg, gpu, share: float = MEM_FRACTION) -> int:
    """Smallest power of two whose BF16 weights per GPU take at most half the engine's share."""
    weights = 2 * stage_params(cfg.model, 1, 1, 0)
    k = 1
    while weights / k > 0.5 * share * gpu.memory_gb * GB and k < 8:
        k *= 2
    return k


def make_case(preset: str, gpu_name: str, nodes: int, extra: list[str] = ()) -> Case:
    gpu = GPUS[gpu_name]
    w = World(nodes=nodes, gpu_memory_gb=gpu.memory_gb)
    cfg = case_config(preset, gpu_name, nodes, extra)
    fits = alternatives(cfg, w, spec="te", logits=CHUNKED_LOGPROBS)
    if not fits:
        return Case(preset, gpu_name, nodes, None, None, {}, "no layout fits")
    lay = fits[0].layout  # the planner's pick (memory-ranked: fewest model-parallel ranks)
    check_engines(cfg, lay, nodes)
    fleet = planned_fleet(cfg, w)[0]
    preds = {p: predict(cfg, w, gpu, p, layout=lay, fleet=fleet, fill=FILL) for p in PRECISIONS}
    return Case(preset, gpu_name, nodes, lay, fleet, preds)


def short_layout(lay: Layout) -> str:
    s = f"TP{lay.tp} PP{lay.pp} DP{lay.dp}"
    if lay.cp > 1:
        s += f" CP{lay.cp}"
    return s + (" rc" if lay.recompute == "full" else "")


# The presets are single-turn jobs: no tool-call phase in their tables and figures.
ONE_TURN = tuple(ph for ph in PHASES if ph != "tools")


# -- tables -------------------------------------------------------------------------------------
def scaling_tables(cases: list[Case]) -> str:
    out = []
    for preset in PRESETS:
        out += [
            f"### {preset}",
            "",
            "| GPU | nodes | layout (engines) | GB/GPU | precision | rollout | reward | "
            "old logprobs | shadow | update | sync | ckpt | step s | tokens/s | vs BF16 |",
            "|---|---:|---|---:|---|" + "---:|" * 10,
        ]
        for c in (c for c in cases if c.preset == preset):
            if not c.preds:
                out.append(f"| {c.gpu} | {c.nodes} | {c.why} | | | | | | | | | | | | |")
                continue
            base = c.preds["bf16"].step_s
            for p, pred in c.preds.items():
                mem = pred.memory.peak / GB
                where = f"{short_layout(c.layout)} ({c.fleet.engines} x TP{c.fleet.tp})"
                cells = " | ".join(f"{pred.phases[ph]:.2f}" for ph in ONE_TURN)
                out.append(
                    f"| {c.gpu} | {c.nodes} | {where} | {mem:.0f} | {p} | {cells} | "
                    f"{pred.step_s:.1f} | {pred.tokens_per_s:,.0f} | {base / pred.step_s:.2f}x |"
                )
        out.append("")
    return "\n".join(out)


def batch_sweep(preset: str, gpu: str, nodes: int) -> list[tuple[int, float, dict]]:
    rows = []
    for prompts in (4, 8, 16, 32, 64, 128, 256, 512):
        c = make_case(preset, gpu, nodes, [f"train.prompts_per_step={prompts}"])
        if c.preds:
            base = c.preds["bf16"].step_s
            rows.append(
                (prompts, c.preds["bf16"].tokens, {p: base / c.preds[p].step_s for p in PRECISIONS})
            )
    return rows


def sweep_table(sweeps: dict) -> str:
    out = [
        "| preset | GPUs | prompts x 8 | tokens / step | FP8 rollout vs BF16 | full FP8 vs BF16 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (preset, gpu, nodes), rows in sweeps.items():
        for prompts, tokens, r in rows:
            out.append(
                f"| {preset} | {nodes} x 8 {gpu} | {prompts} | {tokens:,.0f} | "
                f"{r['fp8-rollout']:.3f}x | {r['fp8']:.3f}x |"
            )
    return "\n".join(out)


def recipe_table(preset: str, gpu: str, nodes: int) -> str:
    """Training phase vs end to end, per recipe, at the measured efficiencies and at a
    hypothetical GEMM-dominated trainer."""
    out = [
        "| trainer efficiency | recipe | FP8 linears fwd+bwd | training phase, no shadow | "
        "training phase + shadow | end to end (FP8 rollout too) | full FP8 vs FP8 rollout | "
        "break-even calib interval |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    c = make_case(preset, gpu, nodes)
    for label, eff in efficiency_variants().items():
        w = World(nodes=nodes, gpu_memory_gb=GPUS[gpu].memory_gb)
        cfg = case_config(preset, gpu, nodes)
        b = predict(cfg, w, GPUS[gpu], "bf16", layout=c.layout, fleet=c.fleet, fill=FILL, eff=eff)
        for recipe, speed in eff.fp8_linear_speedup:
            spec = RECIPES[recipe]
            if spec.delayed or spec.min_capability >= (10, 0):
                continue  # priced as its current-scaling twin; or Blackwell's only
            f = predict(
                cfg,
                w,
                GPUS[gpu],
                "fp8",
                layout=c.layout,
                fleet=c.fleet,
                fill=FILL,
                recipe=recipe,
                eff=eff,
            )
            no_shadow = ("old_logprobs", "update")
            with_shadow = (*no_shadow, "shadow")
            tr = sum(b.phases[p] for p in no_shadow) / sum(f.phases[p] for p in no_shadow)
            ts = sum(b.phases[p] for p in no_shadow) / sum(f.phases[p] for p in with_shadow)
            rollout_only = predict(
                cfg, w, GPUS[gpu], "fp8-rollout", layout=c.layout, fleet=c.fleet, fill=FILL,
                eff=eff,
            )  # fmt: skip
            # The interval at which one calibration's shadow passes cost what FP8 training saves.
            gain = sum(b.phases[p] - f.phases[p] for p in no_shadow)
            per_calibration = f.phases["shadow"] * cfg.loss.calib.interval
            even = f"{per_calibration / gain:.1f}" if gain > 0 else "never"
            out.append(
                f"| {label} | {recipe} | {speed:.2f}x | {tr:.3f}x | {ts:.3f}x | "
                f"{b.step_s / f.step_s:.3f}x | {rollout_only.step_s / f.step_s:.3f}x | {even} |"
            )
    return "\n".join(out)


def dedicated_config(preset: str, gpu: str, nodes: int, engine_nodes: int):
    """The workload with the preset's shape on ``nodes`` trainer nodes, pipelined one step off
    (``train.pipeline=one_step_off``), and ``engine_nodes`` nodes of dedicated engines: every GPU,
    TP the smallest power of two whose BF16 weights take at most half of
    ``DEDICATED_MEM_FRACTION``. Checked by the launcher's placement with TRAIN_NODES=nodes."""
    from megatron_rl_fp8.launch.layout import plan_layout
    from megatron_rl_fp8.launch.slurm import SlurmEnv

    fixed = [*WORKLOAD, *preset_overrides(preset)]
    k = engine_tp(load_config(EXAMPLE, fixed), GPUS[gpu], DEDICATED_MEM_FRACTION)
    cfg = load_config(
        EXAMPLE,
        [
            *fixed,
            "rollout.placement=dedicated",
            f"rollout.sglang.tp_size={k}",
            f"rollout.sglang.num_engines={engine_nodes * GPUS_PER_NODE // k}",
            "rollout.sglang.transport=distributed",
            "rollout.sglang.base_gpu_id=null",
            f"rollout.sglang.mem_fraction_static={DEDICATED_MEM_FRACTION}",
            "train.pipeline=one_step_off",
            *TRAINER_START,
        ],
    )
    names = tuple(f"node{i + 1}" for i in range(nodes + engine_nodes))
    env = SlurmEnv(nodes=names, gpus_per_node=GPUS_PER_NODE, job_id=0)
    plan_layout(cfg, env, train_nodes=nodes)  # ConfigError if refused
    return cfg


def make_pipelined_case(preset: str, gpu_name: str, nodes: int, engine_nodes: int) -> Case:
    """:func:`make_case` for :func:`dedicated_config`: the planner's first layout on the trainer
    nodes, every precision predicted one step off (``Prediction.sync_step_s`` is the same run
    synchronous: the phases do not depend on the pipeline)."""
    gpu = GPUS[gpu_name]
    w = World(nodes=nodes, gpu_memory_gb=gpu.memory_gb)
    cfg = dedicated_config(preset, gpu_name, nodes, engine_nodes)
    fits = alternatives(cfg, w, spec="te", logits=CHUNKED_LOGPROBS)
    if not fits:
        return Case(preset, gpu_name, nodes, None, None, {}, "no layout fits")
    lay = fits[0].layout
    fleet = planned_fleet(cfg, w)[0]
    preds = {p: predict(cfg, w, gpu, p, layout=lay, fleet=fleet, fill=FILL) for p in PRECISIONS}
    return Case(preset, gpu_name, nodes, lay, fleet, preds)


def pipeline_table(cases: list[tuple[int, Case]]) -> str:
    """Per preset and scale: the synchronous and the one-step-off step per precision, and which
    side is longer with the other side's wait (R: the rollout, the trainer waits; T: the
    trainer, the engines wait)."""
    head = " | ".join(f"{p}: sync / pipelined s" for p in PRECISIONS)
    out = [
        f"| preset | nodes: trainer + engines | layout (engines) | {head} | longer side, the "
        "other's wait s |",
        "|---|---|---|" + "---:|" * len(PRECISIONS) + "---|",
    ]
    for engine_nodes, c in cases:
        where = f"{c.nodes} + {engine_nodes} x 8 {c.gpu}"
        if not c.preds:
            out.append(f"| {c.preset} | {where} | {c.why} |" + " |" * (len(PRECISIONS) + 1))
            continue
        cells = " | ".join(
            f"{q.sync_step_s:.1f} / {q.step_s:.1f} ({q.sync_step_s / q.step_s:.2f}x)"
            for q in c.preds.values()
        )
        waits = " / ".join(
            f"{q.bottleneck[0].upper()} {max(q.trainer_wait_s, q.engine_wait_s):.1f}"
            for q in c.preds.values()
        )
        lay = f"{short_layout(c.layout)} ({c.fleet.engines} x TP{c.fleet.tp})"
        out.append(f"| {c.preset} | {where} | {lay} | {cells} | {waits} |")
    return "\n".join(out)


def engine_overrides(cfg, gpu, nodes: int) -> list[str]:
    """Colocated engines on every TP group of GPUs of every node (``rollout/sglang/placement.py``:
    ``colocated_engines``, ``rollout.sglang.num_engines=0`` in a run's config), synced over
    ``transport=tensor``: CUDA IPC from the sending ranks on one node, and on several the
    per-node sync (``trainer/node_sync.py``: each node's trainer ranks hand their own node's
    engines the weights). The count is
    spelled out (``num_engines`` = the placement's) so that a table row names it."""
    k = engine_tp(cfg, gpu)
    placed = colocated_engines(nodes=nodes, gpus_per_node=GPUS_PER_NODE, engine_tp=k)
    return [
        f"rollout.sglang.tp_size={k}",
        f"rollout.sglang.num_engines={len(placed)}",
        "rollout.sglang.transport=tensor",
        "rollout.sglang.base_gpu_id=0",
    ]


def launcher_accepts(cfg, nodes: int) -> None:
    """The launcher's placement of ``cfg``'s engines on ``nodes`` nodes (ConfigError if
    refused)."""
    from megatron_rl_fp8.launch.layout import plan_layout
    from megatron_rl_fp8.launch.slurm import SlurmEnv

    names = tuple(f"node{i + 1}" for i in range(nodes))
    plan_layout(cfg, SlurmEnv(nodes=names, gpus_per_node=GPUS_PER_NODE, job_id=0))


def case_config(preset: str, gpu: str, nodes: int, extra: list[str] = ()):
    """The workload with the preset's shape and its engines (:func:`engine_overrides`), checked
    by the launcher's own placement rules (:func:`launcher_accepts`)."""
    fixed = [*WORKLOAD, *preset_overrides(preset), *extra]
    engines = engine_overrides(load_config(EXAMPLE, fixed), GPUS[gpu], nodes)
    cfg = load_config(
        EXAMPLE,
        [
            *fixed,
            *engines,
            f"rollout.sglang.mem_fraction_static={MEM_FRACTION}",
            *TRAINER_START,
        ],
    )
    launcher_accepts(cfg, nodes)
    return cfg


def check_engines(cfg, lay: Layout, nodes: int) -> None:
    """The launcher's placement of the case's engines once the planner has picked the trainer's
    layout (the weight sync's sending ranks, one per pipeline stage, sit on GPUs that depend on
    PP; the tensor transport may share them). ConfigError if refused."""
    parallel = dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        context_parallel_size=lay.cp,
    )
    launcher_accepts(dataclasses.replace(cfg, parallel=parallel), nodes)


def efficiency_variants() -> dict:
    """Measured (local spec, 19.4% MFU) and a hypothetical trainer at 40% MFU (TE-like;
    ASSUMPTION, for the explanation only)."""
    from megatron_rl_fp8.models.config import ModelConfig

    ref = ModelConfig(
        arch="qwen3", num_layers=28, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=16, num_query_groups=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False,
    )  # fmt: skip
    lin, attn = train_flops_per_token(ref, 2048)
    at40 = 8 * 2048 * (lin + attn) / (REFERENCE_GPU.bf16_flops * 0.40)
    return {
        "measured (19.4% MFU, local spec)": EFFICIENCY,
        "hypothetical 40% MFU (TE-like)": dataclasses.replace(EFFICIENCY, actor_step_s=at40),
    }


def validation_table() -> str:
    """The trainer part of the model against the measured H200 actor steps of docs/gpu.md."""
    m = preset_model("2b", 2048)
    opt = optimizer_seconds(stage_params(m, 1, 1, 0), REFERENCE_GPU, EFFICIENCY)

    def step(tokens, forwards=3):
        return (
            trainer_pass_seconds(
                m, REFERENCE_GPU, Layout(), tokens=tokens, seq=2048, forwards=forwards,
                fp8_speedup=1.0, bubble=1.0, eff=EFFICIENCY,
            )
            + opt
        )  # fmt: skip

    real = sum(round(512 + i * (2048 - 512) / 7) for i in range(8))  # --varlen's lengths
    rows = [
        ("gpu_check `bench_actor`, 8 x 2048 (the fit point)", 1.00, step(16384)),
        ("ad-hoc script, same shape, earlier code", 1.10, step(16384)),
        ("`--configs base --varlen` (rows padded to 2048)", 0.969, step(16384)),
        ("`--configs recompute --varlen` (full, uniform, 1 layer)", 1.262, step(16384, 4)),
        (f"`--configs budget --varlen` ({real} real tokens; lower bound)", 0.869, step(real)),
    ]
    out = ["| measured run (H200, 2.03B, local spec, bf16) | measured s/step | predicted | error |",
           "|---|---:|---:|---:|"]  # fmt: skip
    for name, measured, predicted in rows:
        out.append(
            f"| {name} | {measured:.3f} | {predicted:.3f} | {(predicted - measured) / measured:+.1%} |"
        )
    return "\n".join(out)


# -- plots --------------------------------------------------------------------------------------
def plots(cases: list[Case], sweeps: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    written = []
    styles = {"bf16": "C0", "fp8-rollout": "C1", "fp8": "C2"}

    fig, axes = plt.subplots(1, len(PRESETS), figsize=(11, 3), sharey=False)
    for ax, preset in zip(axes, PRESETS):
        for gpu, ls in (("H200", "-"), ("H100", "--")):
            pts = [c for c in cases if c.preset == preset and c.gpu == gpu and c.preds]
            for p in PRECISIONS:
                ax.plot(
                    [c.nodes * GPUS_PER_NODE for c in pts],
                    [c.preds[p].tokens_per_s / 1e3 for c in pts],
                    ls, color=styles[p], marker=".", label=f"{gpu} {p}",
                )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(preset, fontsize=9)
        ax.set_xlabel("GPUs", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("k tokens / s (predicted)", fontsize=8)
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, "scaling_throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for (preset, gpu, nodes), rows in sweeps.items():
        xs = [t for _, t, _ in rows]
        ax.plot(xs, [r["fp8-rollout"] for *_, r in rows], "--", marker=".",
                label=f"{preset} {nodes}x8 {gpu}: FP8 rollout")  # fmt: skip
        ax.plot(xs, [r["fp8"] for *_, r in rows], "-", marker=".",
                label=f"{preset} {nodes}x8 {gpu}: full FP8")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens per step (prompt + response)", fontsize=8)
    ax.set_ylabel("predicted speed-up vs BF16", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, "scaling_breakeven.png"))

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, preset in zip(axes, ("qwen3-8b", "qwen3-32b")):
        (c,) = [c for c in cases if c.preset == preset and c.gpu == "H200" and c.nodes == 2]
        bottom = [0.0] * 3
        for i, ph in enumerate(ONE_TURN):
            vals = [c.preds[p].phases[ph] for p in PRECISIONS]
            ax.bar(PRECISIONS, vals, bottom=bottom, label=ph, color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{preset}, 2 x 8 H200", fontsize=9)
        ax.set_ylabel("s / step (predicted)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, "scaling_phases.png"))
    return written


def _save(fig, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = FIGURES / name
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print", action="store_true", help="Print the tables; leave the doc.")
    ap.add_argument("--no-plots", action="store_true", help="Skip the PNGs.")
    args = ap.parse_args(argv)
    cases = [make_case(p, g, n) for p in PRESETS for g in TABLE_GPUS for n in NODES]
    sweeps = {k: batch_sweep(*k) for k in (("qwen3-8b", "H200", 1), ("qwen3-32b", "H200", 2))}
    pipelined = [
        (e, make_pipelined_case(p, PIPELINE_GPU, n, e)) for p in PRESETS for n, e in PIPELINE_NODES
    ]
    text = "\n\n".join(
        [
            "## Tables (generated)",
            f"Printed by `python scripts/scaling_model.py` on {datetime.now(timezone.utc):%Y-%m-%d} "
            f"({os.cpu_count()} CPU cores, no GPU, Python {platform.python_version()}; pure "
            "arithmetic, the same on any machine). Seconds per step, amortised phases included; "
            "tokens/s = prompt + response tokens per step / step time; GB/GPU = the planner's "
            "peak per GPU.",
            scaling_tables(cases),
            "### Where FP8 stops paying: the batch sweep",
            sweep_table(sweeps),
            "### Training phase vs end to end, per recipe (qwen3-8b, 1 x 8 H200)",
            recipe_table("qwen3-8b", "H200", 1),
            "### Pipelined (one-step off-policy) steps, dedicated engines",
            "The same workload with `train.pipeline=one_step_off` and engine nodes of their own "
            f"(every GPU, {DEDICATED_MEM_FRACTION:g} of each; `dedicated_config`): sync s = "
            "every phase in turn, pipelined s = max(rollout + reward, old logprobs + shadow + "
            "update) + sync + checkpoint, and their ratio. Longer side: R = rollout + reward (the "
            "trainer waits that many seconds), T = the trainer (the engines wait), per precision "
            "in the columns' order. Predicted, not measured.",
            pipeline_table(pipelined),
            "### Validation: the trainer part against measured H200 steps",
            validation_table(),
        ]
    )
    if args.print:
        print(text)
    else:
        doc = DOC.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*" + re.escape(END), re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
        DOC.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc))
        print(f"wrote the tables into {DOC}")
    if not args.no_plots:
        for path in plots(cases, sweeps):
            print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} KB)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
