"""scripts/validate_step_model.py's pure parts: step medians, the closed-form fit (it recovers
known constants from the model's own predictions), the error rows and the doc block."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.plan.hardware import GPU

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "validate_step_model.py"
_spec = importlib.util.spec_from_file_location("validate_step_model", _PATH)
vsm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vsm)

CPU = GPU(
    name="CPU",
    bf16_flops=40e9,
    fp8_flops=40e9,
    hbm_bytes_s=10e9,
    memory_gb=8.0,
    nvlink_bytes_s=10e9,
    ib_bytes_s=10e9,
)


def _line(n, /, **perf):
    return {"step": n, **{f"perf/{k}_time_s": v for k, v in perf.items()}}


def test_step_medians_skip_the_first_step_and_leave_eval_out():
    lines = [
        {"step": 0, "eval/reward_mean": 0.0},  # the evaluation before the first step: no step
        _line(1, step=30.0, rollout_generate=9.0, update=20.0),  # warm-up, skipped
        _line(2, step=10.0, rollout_generate=2.0, update=7.0, reward=0.5),
        _line(3, step=12.0, rollout_generate=3.0, update=8.0, reward=0.5),
        _line(4, step=15.0, rollout_generate=4.0, update=6.0, reward=0.5, eval=4.0),
    ]
    lines[4]["rollout/response_len_mean"] = 7.0
    for m in lines[2:4]:
        m["rollout/response_len_mean"] = 5.0
    med = vsm.step_medians(lines)
    assert med["steps"] == 3
    assert med["perf/rollout_generate_time_s"] == 3.0
    assert med["perf/update_time_s"] == 7.0
    assert med["perf/eval_time_s"] == 0.0  # absent on two of three steps
    assert med["step"] == 11.0  # 10, 12, 15 - 4
    assert med["other"] == 0.5  # 10-9.5, 12-11.5, 11-10.5
    assert med["response_len"] == 5.0
    with pytest.raises(ValueError, match="no RL step"):
        vsm.step_medians(lines[:2])


def test_fit_constant_is_least_squares_and_never_negative():
    assert vsm.fit_constant([1.0], [2.0], [5.0]) == pytest.approx(2.0)
    # two phases: b = (1, 3), measured - a = (2, 4): c = (2 + 12) / 10
    assert vsm.fit_constant([0.0, 1.0], [1.0, 3.0], [2.0, 5.0]) == pytest.approx(1.4)
    assert vsm.fit_constant([5.0], [1.0], [1.0]) == 0.0
    with pytest.raises(ValueError):
        vsm.fit_constant([1.0], [0.0], [1.0])


def test_fit_recovers_the_constants_of_a_run_the_model_itself_predicted():
    cfg = load_config(vsm.TINY, ["sft.steps=0"])
    truth = dict(rest_s_per_flop=3e-10, rollout_eff=0.02, reward_s_per_row=1e-3, engine_load_s=0.03)
    phases = vsm.predict_phases(cfg, CPU, vsm.cpu_efficiency(**truth), fill=0.5)
    measured = {key: phases[phase] for _, key, phase in vsm.ROWS}
    fitted = vsm.fit(cfg, CPU, measured, fill=0.5)
    assert fitted == pytest.approx(truth, rel=1e-6)
    # and a bigger model predicts more of every compute phase with the same constants
    big = load_config(vsm.TINY, ["sft.steps=0", *vsm.MODEL_20M])
    more = vsm.predict_phases(big, CPU, vsm.cpu_efficiency(**truth), fill=0.5)
    for phase in ("rollout", "old_logprobs", "update"):
        assert more[phase] > phases[phase]


def test_error_rows_and_table():
    measured = {
        "perf/rollout_generate_time_s": 2.0,
        "perf/update_time_s": 4.0,
        "perf/sync_time_s": 0.0,
        "other": 0.5,
        "step": 6.5,
    }
    predicted = {"rollout": 3.0, "update": 3.0, "sync": 0.1, "shadow": 0.0}
    rows = vsm.error_rows(measured, predicted)
    by = {r["phase"]: r for r in rows}
    assert "BF16 shadow" not in by  # 0 on both sides
    assert by["rollout generation"]["error_pct"] == pytest.approx(50.0)
    assert by["update"]["error_pct"] == pytest.approx(-25.0)
    assert by["weight sync"]["error_pct"] is None  # nothing measured
    assert by["other (not modelled)"]["predicted_s"] == 0.0
    assert by["step (less eval, ckpt)"]["predicted_s"] == pytest.approx(6.1)
    table = vsm.markdown_table({"fit": rows, "predict": rows})
    assert "| rollout generation | 2.000 | 3.000 | +50% | 2.000 | 3.000 | +50% |" in table
    assert "n/a" in table


def test_replace_block():
    text = f"a\n{vsm.BEGIN}\nold\n{vsm.END}\nb\n"
    assert vsm.replace_block(text, "new") == f"a\n{vsm.BEGIN}\nnew\n{vsm.END}\nb\n"
    with pytest.raises(ValueError):
        vsm.replace_block("no markers", "new")
