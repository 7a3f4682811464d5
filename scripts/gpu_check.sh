#!/usr/bin/env bash
# gpu_check.sh: does megatron-rl-fp8 work on this GPU node, and how fast is it?
#
#   scripts/gpu_check.sh [--out DIR]          (or: make gpu-check)
#
# Steps, most important first (each logged to DIR/<step>.log; a failed step does not stop the
# others; the steps past the time budget are reported as not run):
#   1. versions     python, torch, CUDA, GPU, megatron-core, modelopt, Transformer Engine, ...
#                   (no CUDA GPU: says so and exits 2 right here)
#   2. contracts    pytest -m gpu tests/gpu/test_gpu_contracts_gpu.py: the GPU libraries'
#                   preconditions of docs/gpu_contracts.md on this GPU (TE's FP8 GEMM shapes and
#                   the actor's ragged FP8 micro-batches; ATen's block-scaled scaled_mm: where it
#                   runs, e4m3 only, its numbers; NCCL refusing two ranks on one GPU)
#   2b. bench_actor one-GPU actor step at a 2.0B Qwen3 shape: tokens/s, MFU, peak memory, in
#                   BF16 and with tensorwise FP8 on the torch backend, its casts eager and
#                   compiled (fp8.compile_casts), and through torchao compiled where torchao
#                   imports (skipped where it cannot run); one profiled step each
#   3. tiny_fp8     the tiny job, full FP8 with calibrated clipping: examples/tiny_cpu_fp8.yaml,
#                   5 RL steps on the GPU (passes when the job exits 0 and ran 5 steps on CUDA,
#                   token_mult_prob_error is in [1, 1.1) and the step-5 checkpoint exists, as
#                   tests/gpu/test_trainer_gpu.py)
#      tiny_fp8_emulate  the same with fp8.backend=emulate (when tiny_fp8 ran another backend):
#                   the real FP8 GEMMs against their emulation, token_mult_prob_error side by side
#   4. gpu_tests    pytest -m gpu tests/gpu   (FP8 GEMM vs the emulation's Hopper accumulation
#                   model; the torch and torchao backends; TE training steps when TE is installed)
#   5. bench_gemm   GEMM TFLOP/s: BF16 vs FP8 tensorwise / rowwise / blockwise, Qwen3-8B/32B shapes,
#                   at M = 8192 and 1024 tokens
#   6. attention    bench_actor's 2.0B bf16 step with torch's SDPA (model.attention_backend: auto)
#                   and with Megatron's unfused attention: step time and peak memory
#   7. tiny_bf16    the tiny job in full precision (examples/tiny_cpu.yaml), checked as tiny_fp8
#   8. calib_share  benchmarks/bench_calibration.py --no-collective --models tiny: the whole calibration
#                   cost (BF16 shadow forwards included) as a share of the full-FP8 step at
#                   intervals 1 / 5 / 20, and where a plain step's time goes (the trainer's timers)
#   9. rollout_parse benchmarks/bench_rollout_parse.py: a launch-bound update alone and beside a thread
#                   parsing SGLang answers (the pipelined rollout's), the slowdown ratio
#  10. sglang_gpu   tests/gpu/test_sglang_gpu.py: one colocated SGLang engine (memory saver, the
#                   trainer on expandable segments): logprobs after syncs with changed weights and
#                   back, then relaunched while released, resumed only for what it released,
#                   synced again (needs SGLang with CUDA in MRF8_SGLANG_PYTHON; else skipped)
# then a summary table (also DIR/summary.md). Exit status 1 if any step failed.
#
# Interpreter: $PYTHON if set, else .venv/bin/python if it exists, else python3. The repository
# is put on PYTHONPATH, so a plain python with the dependencies importable (e.g.
# PYTHONPATH=/deps:$PWD, no install) works as well as the venv. Designed to finish in under 10
# minutes on one H200 (GPU_CHECK_BUDGET_S, default 540 s, caps the steps together; the steps
# past it are reported as not run).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${GPU_CHECK_OUT:-gpu_check_out}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || { echo "--out needs a directory" >&2; exit 2; }; OUT_DIR=$2; shift 2 ;;
        --out=*) OUT_DIR=${1#--out=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"
    elif command -v python3 >/dev/null 2>&1; then PYTHON=python3
    else PYTHON=python
    fi
fi
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + BUDGET_S))

NAMES=() STATUSES=() TIMES=() DETAILS=()
STEP_RC=0 STEP_SECS=0 STEP_LOG=

# step NAME CAP_SECONDS COMMAND... : run COMMAND with its output in $OUT_DIR/NAME.log, under
# min(CAP, time left in the budget). Sets STEP_RC (125 = not started, budget spent), STEP_SECS.
step() {
    local name=$1 cap=$2 left start
    shift 2
    STEP_LOG="$OUT_DIR/$name.log"
    left=$((DEADLINE - SECONDS))
    [ "$cap" -lt "$left" ] || cap=$left
    if [ "$cap" -lt 20 ]; then
        STEP_RC=125 STEP_SECS=0
        echo "== $name: skipped, the time budget is spent" | tee "$STEP_LOG"
        return
    fi
    echo "== $name (limit ${cap}s; log $STEP_LOG)"
    start=$SECONDS
    timeout --kill-after=10 "$cap" "$@" >"$STEP_LOG" 2>&1
    STEP_RC=$?
    STEP_SECS=$((SECONDS - start))
}

# record NAME DETAIL: add the step's row to the summary, its status from STEP_RC.
record() {
    local status
    case $STEP_RC in
        0) status=ok ;;
        124|137) status=FAIL; set -- "$1" "timed out after ${STEP_SECS}s; $2" ;;
        125) status=FAIL; set -- "$1" "not run: the ${BUDGET_S}s budget was spent" ;;
        *) status=FAIL ;;
    esac
    NAMES+=("$1") STATUSES+=("$status") TIMES+=("$STEP_SECS") DETAILS+=("$2")
    echo "   $status (${STEP_SECS}s): $2"
}

last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-160; }

# -- 1. versions -----------------------------------------------------------------------------
step versions 60 "$PYTHON" - <<'PY'
import importlib.metadata as md
import importlib.util
import platform
import shutil
import subprocess
import sys

def version(dist, module=None):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    if module and importlib.util.find_spec(module) is not None:
        mod = __import__(module)
        return getattr(mod, "__version__", "installed (version unknown)")
    return "not installed"

import torch

rows = [
    ("python", f"{platform.python_version()} ({sys.executable})"),
    ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU-only build'})"),
    ("megatron-core", version("megatron-core", "megatron.core")),
    ("nvidia-modelopt", version("nvidia-modelopt", "modelopt")),
    ("transformer-engine", version("transformer-engine", "transformer_engine")),
    ("transformers", version("transformers")),
    ("pytest", version("pytest")),
]
cuda = torch.cuda.is_available()
if cuda:
    p = torch.cuda.get_device_properties(0)
    rows.append(("gpu", f"{torch.cuda.device_count()} x {p.name}, sm_{p.major}{p.minor}, "
                        f"{p.total_memory / 2**30:.0f} GiB"))
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    rows.append(("driver", q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip()
                 else "nvidia-smi failed"))
for k, v in rows:
    print(f"{k:20s} {v}")
sys.exit(0 if cuda else 3)
PY
cp "$STEP_LOG" "$OUT_DIR/versions.txt" 2>/dev/null
sed 's/^/   /' "$STEP_LOG"
if [ "$STEP_RC" -eq 3 ]; then
    echo
    echo "no CUDA GPU: torch.cuda.is_available() is False for $PYTHON."
    echo "This check needs a GPU node (a CUDA build of torch and a visible device);"
    echo "on a CPU box run 'make test' instead. Stopped after the versions step."
    exit 2
fi
GPU=$(grep '^gpu ' "$STEP_LOG" | sed 's/^gpu *//')
TORCH=$(grep '^torch ' "$STEP_LOG" | sed 's/^torch *//')
record versions "${GPU:-no GPU}; torch ${TORCH:-?}"

# -- 2. the GPU contracts (docs/gpu_contracts.md): the first cluster step's preconditions -------
# pytest_step NAME CAP ECHO_PATTERN PYTEST_ARGS...: a pytest run as a step, its summary line as the
# detail, the log lines matching ECHO_PATTERN shown.
pytest_step() {
    local name=$1 cap=$2 pattern=$3 detail
    shift 3
    if ! "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
        STEP_RC=1 STEP_SECS=0
        record "$name" "pytest is not importable by $PYTHON (pip install pytest)"
        return
    fi
    step "$name" "$cap" "$PYTHON" -m pytest -q -s -rs -m gpu "$@"
    detail=$(grep -E '^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|skipped|error)' \
        "$STEP_LOG" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    record "$name" "${detail:-$(last_line "$STEP_LOG")}"
    grep -h "$pattern" "$STEP_LOG" | sed 's/^/   /'
}
pytest_step contracts 150 '^block-scaled scaled_mm on' tests/gpu/test_gpu_contracts_gpu.py

# -- 2b. the actor step at 2.0B: BF16 vs real FP8 GEMMs (issue 17's 1.3x target) ----------
FP8_ENTRIES=bf16,torch:tensorwise_current,torch:tensorwise_current+compile
if "$PYTHON" -c "import torchao" >/dev/null 2>&1; then  # torchao's own float8 path beside ours
    FP8_ENTRIES=$FP8_ENTRIES,torchao:tensorwise_current+compile
fi
step bench_actor 330 "$PYTHON" benchmarks/bench_actor.py --profile 12 --fp8 "$FP8_ENTRIES" \
    --json "$OUT_DIR/bench_actor.json"
detail=$("$PYTHON" - "$OUT_DIR/bench_actor.json" <<'PY' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))
r = rows[0]
mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU ? (no --peak-tflops for this GPU)"
fp8 = "".join(f"; {o['fp8']} x{o['tokens_per_s'] / r['tokens_per_s']:.2f}" for o in rows[1:])
print(f"{r['params_b']:.2f}B, {r['rows']}x{r['seq']} tokens: {r['step_s']:.2f} s/step, "
      f"{r['tokens_per_s']:.0f} tokens/s, {mfu}, peak {r['peak_mem_gb']:.1f} GB{fp8}")
PY
)
record bench_actor "${detail:-$(last_line "$STEP_LOG")}"
main_table() { awk '/^\| config /{t=1} t&&/^\|/{print} t&&!/^\|/{exit}' "$1"; }
main_table "$STEP_LOG" >"$OUT_DIR/bench_actor.md" 2>/dev/null
sed -n "/: one step's .* time: /,\$p" "$STEP_LOG" >"$OUT_DIR/bench_actor_profile.md" 2>/dev/null

# -- 3. the tiny job in full FP8: real FP8 GEMMs and their emulation ----------------------
# A fresh output dir each time: the trainer resumes from an existing one.
rm -rf "$OUT_DIR/runs"
summarize_run() {  # summarize_run RUN_DIR LOG STEPS: one line; exit 1 if the run looks wrong
    "$PYTHON" - "$@" <<'PY'
import json, math, sys
from pathlib import Path
run, log, want = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
lines = []
if (run / "metrics.jsonl").exists():
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
steps = [r["step"] for r in lines if any(k.startswith("train/") for k in r)]
mult = [r["fp8/token_mult_prob_error"] for r in lines
        if r["step"] >= 1 and isinstance(r.get("fp8/token_mult_prob_error"), float)]
reward = [r["eval/reward_mean"] for r in lines if "eval/reward_mean" in r]
actor = [l for l in log.read_text(errors="replace").splitlines() if l.startswith("actor: ")]
latest = run / "checkpoints" / "latest"
parts = [f"{len(steps)} steps"]
if mult:
    parts.append(f"fp8/token_mult_prob_error last {mult[-1]:.5f} max {max(mult):.5f}")
if reward:
    parts.append(f"eval/reward_mean {reward[-1]:.3f}")
if actor:  # "actor: 2.1M parameters on this rank, bfloat16 on cuda:0 (TP=1 ...), FP8 off"
    where = actor[-1].split(" on this rank, ")[-1]
    parts.append(where.split(" (")[0] + ", FP8 " + where.split(", FP8 ")[-1])
problems = []
if len(steps) != want:
    problems.append(f"expected {want} steps")
if not actor or " on cuda" not in actor[-1]:
    problems.append("the actor did not run on the GPU")
if not mult or not all(math.isfinite(m) and 1.0 <= m < 1.1 for m in mult):
    problems.append("token_mult_prob_error missing or outside [1, 1.1)")
if not latest.exists() or latest.read_text().strip() != f"iter_{want:07d}":
    problems.append(f"no checkpoint at step {want}")
print("; ".join(parts + [f"PROBLEM: {p}" for p in problems]))
sys.exit(1 if problems else 0)
PY
}
TINY_ARGS=(train.steps=5 sft.steps=50 train.eval_interval=5 train.save_interval=5
           "train.cache_dir=$OUT_DIR/cache")
# Calibrate every 2 steps so the BF16 shadow pass runs within the 5 steps.
step tiny_fp8 120 "$PYTHON" -m megatron_rl_fp8 train examples/tiny_cpu_fp8.yaml "${TINY_ARGS[@]}" \
    loss.calib.interval=2 "train.output_dir=$OUT_DIR/runs/tiny_fp8"
detail=$(summarize_run "$OUT_DIR/runs/tiny_fp8" "$STEP_LOG" 5) || [ "$STEP_RC" -ne 0 ] || STEP_RC=1
[ "$STEP_RC" -eq 0 ] || detail="$(last_line "$STEP_LOG") | $detail"
record tiny_fp8 "$detail"

# The same FP8 job through the emulation: the torch backend must train like it (issue 17: its
# token_mult_prob_error of the same order). Skipped where tiny_fp8 already ran the emulation.
if grep -q '^actor: .*(emulated)' "$OUT_DIR/tiny_fp8.log" 2>/dev/null; then
    STEP_RC=0 STEP_SECS=0
    record tiny_fp8_emulate "skipped: tiny_fp8 ran on the emulation"
else
    step tiny_fp8_emulate 120 "$PYTHON" -m megatron_rl_fp8 train examples/tiny_cpu_fp8.yaml \
        "${TINY_ARGS[@]}" loss.calib.interval=2 fp8.backend=emulate \
        "train.output_dir=$OUT_DIR/runs/tiny_fp8_emulate"
    detail=$(summarize_run "$OUT_DIR/runs/tiny_fp8_emulate" "$STEP_LOG" 5) ||
        [ "$STEP_RC" -ne 0 ] || STEP_RC=1
    [ "$STEP_RC" -eq 0 ] || detail="$(last_line "$STEP_LOG") | $detail"
    record tiny_fp8_emulate "$detail"
fi

# -- 4. GPU tests ----------------------------------------------------------------------------
# tests/gpu/test_trainer_gpu.py runs the tiny job in bf16 and full FP8 through the CLI: steps 3
# and 7 run the same jobs (checking the same things, outputs kept), so not twice; the contracts
# ran in step 2.
pytest_step gpu_tests 240 '^_scaled_mm(' tests/gpu --ignore=tests/gpu/test_trainer_gpu.py \
    --ignore=tests/gpu/test_gpu_contracts_gpu.py --ignore=tests/gpu/test_sglang_gpu.py

# -- 5. GEMM table --------------------------------------------------------------------------
step bench_gemm 120 "$PYTHON" benchmarks/bench_gemm.py --tokens 1024,8192 \
    --json "$OUT_DIR/bench_gemm.json"
detail=$("$PYTHON" - "$OUT_DIR/bench_gemm.json" <<'PY' 2>/dev/null
import json, sys
all_rows = json.load(open(sys.argv[1]))["rows"]
out = []
for m in sorted({r["M"] for r in all_rows}, reverse=True):
    rows = [r for r in all_rows if r["M"] == m]
    part = []
    for method in dict.fromkeys(r["method"] for r in rows):
        ok = [r for r in rows if r["method"] == method and r["tflops"] is not None]
        if not ok:
            part.append(f"{method} {next(r['status'] for r in rows if r['method'] == method)}")
        elif method == "bf16":
            part.append(f"bf16 {min(r['tflops'] for r in ok):.0f}-{max(r['tflops'] for r in ok):.0f} TFLOP/s")
        else:
            part.append(f"{method.removeprefix('fp8_')} x{min(r['vs_bf16'] for r in ok):.2f}-"
                        f"{max(r['vs_bf16'] for r in ok):.2f}")
    out.append(f"M {m}: " + ", ".join(part))
print("; ".join(out))
PY
)
record bench_gemm "${detail:-$(last_line "$STEP_LOG")}"
grep '^|' "$STEP_LOG" >"$OUT_DIR/bench_gemm.md" 2>/dev/null

# -- 6. attention: torch's SDPA (the local spec's GPU default) against Megatron's unfused ---------
step attention 200 "$PYTHON" benchmarks/bench_actor.py --configs base,unfused --fp8 bf16 \
    --profile 12 --json "$OUT_DIR/bench_attention.json"
detail=$("$PYTHON" - "$OUT_DIR/bench_attention.json" <<'PY' 2>/dev/null
import json, sys
rows = {r["config"]: r for r in json.load(open(sys.argv[1]))}
s, u = rows["base"], rows["unfused"]
share = lambda r: r["profile"]["kinds"].get("attention", 0.0)  # noqa: E731
print(f"2.0B bf16 step: SDPA {s['step_s']:.2f} s, peak {s['peak_mem_gb']:.1f} GB, attention "
      f"{share(s):.0%} of kernel time; unfused {u['step_s']:.2f} s, peak {u['peak_mem_gb']:.1f} "
      f"GB, attention {share(u):.0%} (SDPA x{u['step_s'] / s['step_s']:.2f})")
PY
)
record attention "${detail:-$(last_line "$STEP_LOG")}"
sed -n "/: one step's .* time: /,\$p" "$STEP_LOG" >"$OUT_DIR/attention_profile.md" 2>/dev/null

# -- 7. the tiny job in full precision ------------------------------------------------------
step tiny_bf16 120 "$PYTHON" -m megatron_rl_fp8 train examples/tiny_cpu.yaml "${TINY_ARGS[@]}" \
    "train.output_dir=$OUT_DIR/runs/tiny_bf16"
detail=$(summarize_run "$OUT_DIR/runs/tiny_bf16" "$STEP_LOG" 5) || [ "$STEP_RC" -ne 0 ] || STEP_RC=1
[ "$STEP_RC" -eq 0 ] || detail="$(last_line "$STEP_LOG") | $detail"
record tiny_bf16 "$detail"

# -- 8. calibration's share of the step, per-phase timers -------------------------------------------
step calib_share 150 "$PYTHON" benchmarks/bench_calibration.py --no-collective --models tiny --steps 7 \
    --json "$OUT_DIR/bench_calibration.json"
detail=$("$PYTHON" - "$OUT_DIR/bench_calibration.json" <<'PY' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))["share"]["tiny"]
phases = ", ".join(f"{k.split('/')[1].removesuffix('_time_s')} {r[k]:.2f}"
                   for k in ("perf/rollout_time_s", "perf/logprob_time_s", "perf/update_time_s",
                             "perf/sync_time_s", "perf/other_time_s"))
print(f"tiny full FP8: shadow {1e3 * r['shadow_s']:.0f} ms on a {r['plain_s']:.2f} s plain step "
      f"({phases} s); share at interval 1 / 5 / 20: {r['share_1']:.1%} / {r['share_5']:.1%} / "
      f"{r['share_20']:.1%}")
PY
)
record calib_share "${detail:-$(last_line "$STEP_LOG")}"

# -- 9. the pipelined rollout's answer parsing beside the update (issue 43 #6) -----------------------
# 5 steps, not the default 50: on the 2-core CPU the parse thread slowed each step ~377x (4.6 s),
# docs/benchmarks.md; at that rate 50 steps x 3 reps would not fit the step's 60 s.
step rollout_parse 60 "$PYTHON" benchmarks/bench_rollout_parse.py --device cuda --steps 5 --reps 2
detail=$(grep -F '| with a thread' "$STEP_LOG" | awk -F'|' '{gsub(/ /, "", $4); print "update slowed x" $4 " by a thread parsing 8192-token answers"}')
record rollout_parse "${detail:-$(last_line "$STEP_LOG")}"

# -- 10. a colocated SGLang engine on this GPU (issue 43 #1, #2, #4, #7) -----------------------------
# Needs SGLang's CUDA build: MRF8_SGLANG_PYTHON (or .venv-sglang); skipped in seconds without it.
pytest_step sglang_gpu 240 '^SKIPPED' -m "gpu and sglang" tests/gpu/test_sglang_gpu.py

# -- summary -----------------------------------------------------------------------------------
{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ): ${GPU:-GPU ?}"
    echo
    echo "| step | status | s | detail |"
    echo "|---|---|---:|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUSES[$i]} | ${TIMES[$i]} | ${DETAILS[$i]//|/\\|} |"
    done
    echo
    echo "Total ${SECONDS}s. Logs, run outputs and benchmark JSON: $OUT_DIR"
} | tee "$OUT_DIR/summary.md"
if [ -s "$OUT_DIR/bench_gemm.md" ]; then echo; cat "$OUT_DIR/bench_gemm.md"; fi
if [ -s "$OUT_DIR/bench_actor.md" ]; then echo; cat "$OUT_DIR/bench_actor.md"; fi
if [ -s "$OUT_DIR/bench_actor_profile.md" ]; then echo; cat "$OUT_DIR/bench_actor_profile.md"; fi

for s in "${STATUSES[@]}"; do
    [ "$s" = ok ] || exit 1
done
exit 0
