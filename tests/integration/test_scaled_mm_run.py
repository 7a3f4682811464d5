"""The tiny full-FP8 job with the trainer's linears on real FP8 GEMMs (``torch._scaled_mm``, the
``torch`` and ``torchao`` backends; CPU torch runs the kernel, tests/scaled_mm_stand_in.py)
against the same job on the emulation, and a resume of the torch backend under delayed scaling.
Each job is the trainer of ``megatron-rl-fp8 train`` on one rank (tests/dist_utils).

What must hold on any machine:

* Step 1 starts from the same SFT weights and the same rollout (the rollout engine does not depend
  on the training backend), so the first update differs only by the GEMMs' output rounding: the
  emulation rounds each product once to the layer's dtype (float32 here), ``_scaled_mm`` to
  bfloat16 (relative 2^-8 = 0.4%, once per GEMM). Entropy, a mean over tokens of those outputs,
  then agrees to 1%; the gradient norm, through three GEMMs per linear and two layers, to 5%.
* Over the run the rollout/trainer mismatch (``fp8/token_mult_prob_error``, the Must-show's
  measure) is of the same order as the emulation's: every step in (1, 1.05), and the mean excess
  over 1 within 2x of the emulation's either way (0.9-1.1x seen).
* Calibrated clipping runs through them as through the emulation: bounds inside the limits.
* Delayed scaling keeps amax histories across steps; a run resumed from a checkpoint equals the
  uninterrupted one bit for bit (same machine, same kernels), so the histories travel with the
  checkpoint.
"""

import math
import shutil
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_utils import trainer_body

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu_fp8.yaml"
STEPS = 4
OVERRIDES = [
    "sft.steps=100",
    "sft.batch_size=32",
    f"train.steps={STEPS}",
    "train.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "train.save_interval=2",
    "train.eval_interval=0",
    "optim.lr=3e-4",
    "loss.calib.interval=2",
    # The training GEMMs are this test's subject. The rollout's weights are quantized by the
    # project's own quantizer, bit-identical to modelopt's (tests/unit/test_rollout_quantizer.py),
    # which spares importing modelopt (test_tiny_run runs modelopt).
    "rollout.fp8.quantizer=builtin",
]


def _job(rank, world_size, overrides):
    """The trainer's whole run with the FP8 GEMM backends allowed on this CPU."""
    from tests.scaled_mm_stand_in import allow_fp8_backends

    allow_fp8_backends()
    return trainer_body(rank, world_size, overrides, CONFIG)


def _run(out: Path, cache: Path, backend: str, recipe: str) -> dict[int, dict]:
    """The job on one rank forked from tests/dist_utils' preloaded server: the CLI's code path
    without a fresh interpreter's ~15 s of imports per run (the CLI itself: test_tiny_run)."""
    overrides = [*OVERRIDES, f"fp8.backend={backend}", f"fp8.recipe={recipe}"]
    overrides += [f"train.output_dir={out}", f"train.cache_dir={cache}"]
    (metrics,) = run_distributed(_job, world_size=1, args=(overrides,), timeout=600)
    return {m["step"]: m for m in metrics}


@pytest.fixture(scope="module")
def cache(tiny_sft_cache):
    return tiny_sft_cache  # the SFT settings of tests/integration/test_tiny_run.py: one warm start


@pytest.fixture(scope="module")
def run_of(tmp_path_factory, cache):
    """backend -> metrics by step of the tensorwise_current job, each run once when first asked
    for; the SFT warm start is shared."""
    done = {}

    def get(backend: str) -> dict[int, dict]:
        if backend not in done:
            out = tmp_path_factory.mktemp(backend)
            done[backend] = _run(out, cache, backend, "tensorwise_current")
        return done[backend]

    return get


@pytest.mark.parametrize("backend", ["torch", "torchao"])
def test_real_fp8_gemms_train_like_the_emulation(run_of, backend):
    from megatron_rl_fp8.loss.calibration import CalibConfig

    if backend == "torchao":
        pytest.importorskip("torchao.float8", reason="torchao does not import here (make install)")
    emu, got = run_of("emulate"), run_of(backend)
    assert sorted(got) == sorted(emu) == list(range(STEPS + 1))
    first_e, first_g = emu[1], got[1]
    assert math.isclose(first_g["train/entropy"], first_e["train/entropy"], rel_tol=1e-2)
    assert math.isclose(first_g["train/grad_norm"], first_e["train/grad_norm"], rel_tol=5e-2)
    excess = {}
    for name, run in (("emulate", emu), (backend, got)):
        errors = [run[s]["fp8/token_mult_prob_error"] for s in range(1, STEPS + 1)]
        assert all(1.0 < e < 1.05 for e in errors), (name, errors)
        excess[name] = sum(e - 1 for e in errors) / len(errors)
    assert 0.5 <= excess[backend] / excess["emulate"] <= 2.0, excess
    limits = CalibConfig()
    for step in range(1, STEPS + 1):
        m = got[step]
        assert all(math.isfinite(v) or k.startswith("calib/") for k, v in m.items()), step
        lo, hi = m["calib/lower"], m["calib/upper"]
        assert limits.lower_limits[0] <= lo <= 1.0 <= hi <= limits.upper_limits[1], (step, lo, hi)


def _computed(m: dict) -> dict:
    """The step's computed metrics, NaN (an empty calibration share) equal to NaN."""
    return {
        k: "nan" if isinstance(v, float) and math.isnan(v) else v
        for k, v in m.items()
        if not k.startswith("perf/")
    }


def test_delayed_scaling_resume_equals_uninterrupted(tmp_path, cache):
    full = _run(tmp_path / "full", cache, "torch", "tensorwise_delayed")
    # The same run stopped after its step-2 checkpoint: its directory as it was then.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed_dir)
    ckpts = resumed_dir / "checkpoints"
    shutil.rmtree(ckpts / f"iter_{STEPS:07d}")
    (ckpts / "latest").write_text("iter_0000002\n")
    resumed = _run(resumed_dir, cache, "torch", "tensorwise_delayed")
    for step in range(3, STEPS + 1):
        assert _computed(resumed[step]) == _computed(full[step]), step
