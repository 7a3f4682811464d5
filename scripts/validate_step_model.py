"""The step-time model per phase against runs measured on this CPU: fit on one run, predict another.

The model (``megatron_rl_fp8.plan.time.predict``) was fitted to an H200; on a CPU its efficiencies
mean nothing. So this tool:

1. **measures this machine** in the same process that starts the runs: dense matmul FLOP/s at the
   runs' dtype (float32: "bf16" on a CPU is unquantized float32 GEMMs) and memory bandwidth from a
   large copy. They become a ``GPU`` parameter set named ``CPU`` (``plan/hardware.py``), with the
   GEMM and Adam efficiencies set to 1 (the peaks *are* the measured rates).
2. **fits the model's free constants on one measured run** (``--fit``, default the tiny model of
   ``examples/tiny_cpu.yaml``), medians over steps 2.. (step 1 warms up): the trainer's non-GEMM
   seconds per FLOP (least squares over old logprobs and update), one rollout efficiency (SGLang's
   prefill / decode efficiencies, all set equal), the reward's seconds per row and the sync's
   engine-load seconds. Each phase is linear in its constant (``a + b * c``), so the fit is
   closed-form (:func:`fit_constant`).
3. **predicts a different run without refitting** (``--predict``, default a ~21M-parameter model
   on half the prompts) and prints measured vs predicted per phase with the error.

The rollout formula assumes SGLang: prefill once per prompt group (prefix cache), then
``max_new_tokens`` decode steps each reading the weights (bf16 bytes) and the KV cache at the
memory bandwidth, or the GEMMs at the compute rate, whichever is slower. The CPU engine
(``rollout/local.py``) is HF ``generate``: every row prefilled (no prefix sharing), float32
weights, and per decode step a fixed Python and kernel-launch cost per layer that no roofline
term has. At these sizes that fixed cost dominates, so the fitted "efficiency" is tiny and the
predicted rollout scales with weight bytes and FLOPs while the measured one scales with steps and
layers: the error says how far the CPU rollout is from the SGLang model, not how good the model
is on a GPU.

    python scripts/validate_step_model.py                       # both runs, ~1 min on 2 idle cores
    python scripts/validate_step_model.py --steps 4 --json
    python scripts/validate_step_model.py --reuse --write-doc   # re-read the runs, update the doc
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_rl_fp8.plan.measure import TIMING_20M as MODEL_20M
from megatron_rl_fp8.plan.measure import TIMING_RUN as COMMON

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
DOC = ROOT / "docs" / "scaling.md"
BEGIN, END = "<!-- validate_step_model.py: begin -->", "<!-- validate_step_model.py: end -->"

# (label, measured perf/ key, the model's phase): the phases compared. The model's reward is its
# own phase; the trainer times it inside the rollout, so generation is compared separately.
ROWS = (
    ("rollout generation", "perf/rollout_generate_time_s", "rollout"),
    ("reward", "perf/reward_time_s", "reward"),
    ("old logprobs", "perf/logprob_time_s", "old_logprobs"),
    ("BF16 shadow", "perf/shadow_time_s", "shadow"),
    ("update", "perf/update_time_s", "update"),
    ("weight sync", "perf/sync_time_s", "sync"),
)
NOT_COMPARED = ("perf/eval_time_s", "perf/checkpoint_time_s")  # not every step


# -- pure parts (tests/unit/test_validate_step_model.py) ------------------------------------------
def step_medians(lines: Iterable[dict], *, skip: int = 1) -> dict[str, float]:
    """Median over the RL steps after the first ``skip`` of every ``perf/`` key, 0 where a step
    lacks it, plus ``other`` (everything in the step that no compared phase holds: the rollout's
    decoding and statistics, advantages, logging) and ``step`` (the step less evaluation and
    checkpoint), and ``fill`` from ``rollout/response_len_mean``."""
    steps = [m for m in lines if "perf/step_time_s" in m]
    steps = steps[skip:]
    if not steps:
        raise ValueError(f"no RL step after the first {skip} in the metrics")
    keys = {k for m in steps for k in m if k.startswith("perf/") and "/amortised/" not in k}
    out = {k: statistics.median(m.get(k, 0.0) for m in steps) for k in sorted(keys)}

    def step(m):
        return m["perf/step_time_s"] - sum(m.get(k, 0.0) for k in NOT_COMPARED)

    def other(m):
        return step(m) - sum(m.get(key, 0.0) for _, key, _ in ROWS)

    out["step"] = statistics.median(step(m) for m in steps)
    out["other"] = statistics.median(other(m) for m in steps)
    if all("rollout/response_len_mean" in m for m in steps):
        out["response_len"] = statistics.median(m["rollout/response_len_mean"] for m in steps)
    out["steps"] = len(steps)
    return out


def fit_constant(a: Sequence[float], b: Sequence[float], measured: Sequence[float]) -> float:
    """The ``c`` that makes ``a_i + b_i * c`` closest to ``measured_i`` (least squares), never
    below 0: a phase's time as a linear function of one model constant."""
    den = sum(x * x for x in b)
    if den <= 0:
        raise ValueError("the constant does not enter these phases (all b = 0)")
    c = sum(x * (m - y) for x, y, m in zip(b, a, measured, strict=True)) / den
    return max(0.0, c)


def error_rows(measured: dict[str, float], predicted: dict[str, float]) -> list[dict]:
    """One row per compared phase (skipping those 0 in both), ``other`` (not in the model,
    predicted 0) and ``step``: label, measured s, predicted s, error % (predicted / measured - 1;
    None when nothing was measured)."""
    rows = []
    for label, key, phase in ROWS:
        m, p = measured.get(key, 0.0), predicted.get(phase, 0.0)
        if m == 0 and p == 0:
            continue
        rows.append({"phase": label, "measured_s": m, "predicted_s": p})
    rows.append(
        {"phase": "other (not modelled)", "measured_s": measured["other"], "predicted_s": 0.0}
    )
    total = sum(r["predicted_s"] for r in rows)
    rows.append(
        {"phase": "step (less eval, ckpt)", "measured_s": measured["step"], "predicted_s": total}
    )
    for r in rows:
        m = r["measured_s"]
        r["error_pct"] = 100 * (r["predicted_s"] / m - 1) if m > 0 else None
    return rows


def markdown_table(runs: dict[str, list[dict]]) -> str:
    """``runs``: {run title: error rows}. One table, the runs side by side."""
    titles = list(runs)
    head = (
        "| phase | " + " | ".join(f"{t}: measured s | predicted s | error" for t in titles) + " |"
    )
    lines = [head, "|---|" + "---:|---:|---:|" * len(titles)]
    labels = [r["phase"] for r in runs[titles[0]]]
    for t in titles[1:]:
        labels += [r["phase"] for r in runs[t] if r["phase"] not in labels]
    for label in labels:
        cells = []
        for t in titles:
            r = next((r for r in runs[t] if r["phase"] == label), None)
            if r is None:
                cells.append("| | ")
                continue
            err = "n/a" if r["error_pct"] is None else f"{r['error_pct']:+.0f}%"
            cells.append(f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | {err}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the BEGIN and END markers replaced by ``block``."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{DOC} has no {BEGIN} ... {END} block")
    return text[: i + len(BEGIN)] + "\n" + block.strip() + "\n" + text[j:]


# -- the machine -----------------------------------------------------------------------------------
def measure_machine(*, n: int = 1024, copy_mb: int = 256, repeats: int = 5) -> dict:
    """Median matmul FLOP/s (float32 ``n`` x ``n``) and copy bandwidth (read + write bytes of a
    ``copy_mb`` MB tensor) on this process's torch threads."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    flops = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        flops.append(4 * 2 * n**3 / (time.perf_counter() - t))
    src = torch.empty(copy_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bw = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        bw.append(2 * src.numel() * 4 / (time.perf_counter() - t))
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {
        "matmul_flops": statistics.median(flops),
        "copy_bytes_s": statistics.median(bw),
        "memory_gb": memory_gb,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "load_avg_1m": os.getloadavg()[0],
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_gpu(machine: dict):
    """This CPU as the model's ``GPU``: every peak is a measured rate, links are memory copies."""
    from megatron_rl_fp8.plan.hardware import GPU

    return GPU(
        name="CPU",
        bf16_flops=machine["matmul_flops"],
        fp8_flops=machine["matmul_flops"],  # FP8 is emulated on a CPU: no faster
        hbm_bytes_s=machine["copy_bytes_s"],
        memory_gb=machine["memory_gb"],
        nvlink_bytes_s=machine["copy_bytes_s"],
        ib_bytes_s=machine["copy_bytes_s"],
    )


# -- runs and predictions --------------------------------------------------------------------------
def run_config(overrides: list[str], steps: int, out: Path):
    from megatron_rl_fp8.config import load_config

    full = [*COMMON, f"train.steps={steps}", f"train.output_dir={out}", *overrides]
    return load_config(TINY, full), full


def train(overrides: list[str], out: Path, *, log: Path) -> float:
    """Run the trainer in a subprocess (this process's niceness); its wall seconds."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", TINY, *overrides]
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def predict_phases(cfg, gpu, eff, fill: float) -> dict[str, float]:
    from megatron_rl_fp8.plan.memory import World
    from megatron_rl_fp8.plan.time import Fleet, predict

    world = World(gpus_per_node=1, gpu_memory_gb=gpu.memory_gb, device="cpu")
    # One in-process engine on the trainer's own cores, all memory available to its cache.
    fleet = Fleet(engines=1, tp=1, placement="colocated", mem_fraction=0.5)
    return predict(cfg, world, gpu, "bf16", fleet=fleet, fill=fill, spec="local", eff=eff).phases


def cpu_efficiency(**fitted):
    """The model's constants for this CPU: peaks are measured rates (efficiency 1); ``fitted``
    are the fitted ones."""
    from megatron_rl_fp8.plan.time import Efficiency

    base = dict(
        gemm_bf16=1.0,
        optimizer_hbm=1.0,
        prefill_mfu=1.0,
        decode_hbm=1.0,
        decode_mfu=1.0,
        reward_s_per_row=0.0,
        engine_load_s=0.0,
        rest_s_per_flop=0.0,
    )
    base.update(fitted)
    if "rollout_eff" in base:
        e = base.pop("rollout_eff")
        base.update(prefill_mfu=e, decode_hbm=e, decode_mfu=e)
    return Efficiency(**base)


def fit(cfg, gpu, measured: dict, fill: float) -> dict[str, float]:
    """The free constants from one measured run (see the module docstring)."""
    zero = predict_phases(cfg, gpu, cpu_efficiency(), fill)
    probe = 1e-9  # s per FLOP: any value works, the phases are linear in it
    one = predict_phases(cfg, gpu, cpu_efficiency(rest_s_per_flop=probe), fill)
    trainer = ("old_logprobs", "perf/logprob_time_s"), ("update", "perf/update_time_s")
    rest = probe * fit_constant(
        [zero[p] for p, _ in trainer],
        [(one[p] - zero[p]) for p, _ in trainer],
        [measured[k] for _, k in trainer],
    )
    # Rollout at efficiency 1 is b; the time is b / e, so fit c = 1 / e.
    inv = fit_constant([0.0], [zero["rollout"]], [measured["perf/rollout_generate_time_s"]])
    rows = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt
    workers = max(1, cfg.reward.num_workers)
    reward = fit_constant([0.0], [rows / workers], [measured.get("perf/reward_time_s", 0.0)])
    load = fit_constant([zero["sync"]], [1.0], [measured.get("perf/sync_time_s", 0.0)])
    return {
        "rest_s_per_flop": rest,
        "rollout_eff": 1 / inv if inv > 0 else 1.0,
        "reward_s_per_row": reward,
        "engine_load_s": load,
    }


def params_of(cfg) -> float:
    from megatron_rl_fp8.plan.model_bytes import stage_params

    return stage_params(cfg.model, tp=1, pp=1, stage=0)


# -- the command -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="RL steps per run (step 1 is skipped)")
    p.add_argument(
        "--fit", nargs="*", default=[], help="overrides of the run the model is fitted on"
    )
    p.add_argument(
        "--predict", nargs="*", default=MODEL_20M, help="overrides of the run it predicts"
    )
    p.add_argument("--out", default="/tmp/validate_step_model", help="run directories go here")
    p.add_argument("--reuse", action="store_true", help="read existing runs instead of training")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--write-doc", action="store_true", help=f"replace the marked block in {DOC}")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 is a warm-up and is skipped)")

    command = "python scripts/validate_step_model.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = Path(args.out)
    # The machine as it was when the runs were made: --reuse reads that measurement back.
    saved = out / "machine.json"
    if args.reuse and saved.exists():
        machine = json.loads(saved.read_text())
    else:
        machine = measure_machine()
        if not args.reuse:
            out.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(machine))
    gpu = cpu_gpu(machine)
    runs = {}
    for name, overrides in (("fit", args.fit), ("predict", args.predict)):
        cfg, full = run_config(list(overrides), args.steps, out / name)
        wall = None
        if not args.reuse:
            (out / name).mkdir(parents=True, exist_ok=True)
            print(f"training the {name} run ({out / name}) ...", file=sys.stderr)
            wall = train(full, out / name, log=out / f"{name}.log")
        measured = step_medians(read_metrics(out / name))
        fill = min(
            1.0,
            measured.get("response_len", cfg.rollout.max_new_tokens) / cfg.rollout.max_new_tokens,
        )
        runs[name] = dict(
            cfg=cfg, overrides=list(overrides), measured=measured, fill=fill, wall_s=wall
        )
    machine.setdefault("load_avg_1m_after", os.getloadavg()[0])
    if not args.reuse:
        saved.write_text(json.dumps(machine))

    fitted = fit(runs["fit"]["cfg"], gpu, runs["fit"]["measured"], runs["fit"]["fill"])
    eff = cpu_efficiency(**fitted)
    result = {"command": command, "date": date, "machine": machine, "fitted": fitted, "runs": {}}
    tables = {}
    for name, r in runs.items():
        pred = predict_phases(r["cfg"], gpu, eff, r["fill"])
        rows = error_rows(r["measured"], pred)
        cfg = r["cfg"]
        title = (
            f"{name} ({params_of(cfg) / 1e6:.2f}M, {cfg.train.prompts_per_step}x"
            f"{cfg.rollout.n_samples_per_prompt} rows)"
        )
        tables[title] = rows
        result["runs"][name] = {
            "title": title,
            "overrides": r["overrides"],
            "params": params_of(cfg),
            "fill": r["fill"],
            "steps_in_median": r["measured"]["steps"],
            "measured": r["measured"],
            "wall_s": r["wall_s"],
            "rows": rows,
            # the trainer phases' GEMM + Adam part alone (the fitted non-GEMM term left out)
            "predicted_gemm_only": predict_phases(
                cfg, gpu, cpu_efficiency(**{**fitted, "rest_s_per_flop": 0.0}), r["fill"]
            ),
        }
    table = markdown_table(tables)
    m = machine
    header = (
        f"Command: `{command}` (niceness {os.nice(0)}), {date}, {m['cpu']}, "
        f"{m['threads']} torch threads, "
        f"load average {m['load_avg_1m']:.1f} before / {m['load_avg_1m_after']:.1f} after. "
        f"Measured: float32 matmul {m['matmul_flops'] / 1e9:.1f} GFLOP/s (1024^3), copy "
        f"{m['copy_bytes_s'] / 1e9:.1f} GB/s. Fitted on the first run: trainer non-GEMM "
        f"{fitted['rest_s_per_flop'] * 1e12:.3g} ps/FLOP, rollout efficiency "
        f"{fitted['rollout_eff']:.3g}, reward {fitted['reward_s_per_row'] * 1e3:.3g} ms/row, "
        f"engine load {fitted['engine_load_s'] * 1e3:.3g} ms. Medians over steps 2-{args.steps}; "
        "error = predicted / measured - 1."
    )
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(header + "\n\n" + table)
    if args.write_doc:
        DOC.write_text(replace_block(DOC.read_text(), header + "\n\n" + table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
