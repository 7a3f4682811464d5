"""The step-time breakdown: step windows, other, running means (metrics/step_time.py), the
weight sync's parts (sync/timing.py), the fleet's wait on its slowest engines, and the report's
table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_rl_fp8.metrics import step_time
from megatron_rl_fp8.metrics.report import step_time_breakdown, write_report
from megatron_rl_fp8.metrics.runs import load_runs
from megatron_rl_fp8.metrics.step_time import OTHER, PHASES, STEP, StepClock, other_time
from megatron_rl_fp8.rollout.sglang.fleet import short_of_engines
from megatron_rl_fp8.sync.timing import SyncTimes, timed


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(step_time.time, "perf_counter", fake)
    return fake


def test_other_is_the_rest_of_the_step_and_never_negative():
    m = {STEP: 10.0, "perf/rollout_time_s": 4.0, "perf/update_time_s": 3.5}
    # Parts nested in a phase (generation, the sync's gather) are not added again.
    m |= {"perf/rollout_generate_time_s": 3.0, "perf/reward_time_s": 1.0}
    assert other_time(m) == pytest.approx(2.5)
    assert other_time({STEP: 1.0, "perf/update_time_s": 1.0 + 1e-15}) == 0.0


def test_step_windows_add_up_and_checkpoints_go_to_the_next_line(clock):
    c = StepClock()
    clock.now += 5.0
    first = {"perf/rollout_time_s": 2.0, "perf/update_time_s": 1.0}
    c.finish(first)
    assert first[STEP] == 5.0 and first[OTHER] == pytest.approx(2.0)
    assert "perf/checkpoint_time_s" not in first
    assert "perf/amortised/checkpoint_time_s" not in first  # no phase seen yet: no mean
    clock.now += 0.5
    c.add("perf/checkpoint_time_s", 0.5)  # the save after the first line
    clock.now += 2.5
    second = {"perf/rollout_time_s": 1.5, "perf/eval_time_s": 0.5}
    c.finish(second)
    assert second[STEP] == 3.0
    assert second["perf/checkpoint_time_s"] == 0.5
    assert second[OTHER] == pytest.approx(0.5)
    assert sum(second.get(k, 0.0) for _, k in PHASES) + second[OTHER] == pytest.approx(3.0)
    # Running means over the steps so far; a step without a phase counts 0 for it.
    assert second["perf/amortised/step_time_s"] == 4.0
    assert second["perf/amortised/rollout_time_s"] == 1.75
    assert second["perf/amortised/update_time_s"] == 0.5
    assert second["perf/amortised/checkpoint_time_s"] == 0.25
    assert second["perf/amortised/other_time_s"] == pytest.approx(1.25)
    third = {}
    clock.now += 1.0
    c.finish(third)
    assert "perf/checkpoint_time_s" not in third  # pending times go to one line only
    assert third["perf/amortised/checkpoint_time_s"] == pytest.approx(0.5 / 3)


def test_fleet_wait_is_the_time_short_of_engines_in_flight():
    # Two engines; requests (sent, answered): both busy until 2, then one request left until 5.
    spans = [(0.0, 2.0), (0.0, 5.0), (0.0, 1.0), (1.0, 2.0)]
    assert short_of_engines(spans, 2) == pytest.approx(3.0)
    # One engine never waits; a gap with no request in flight is the driver's, not an engine's.
    assert short_of_engines(spans, 1) == 0.0
    assert short_of_engines([(0.0, 1.0), (2.0, 3.0)], 1) == 0.0
    assert short_of_engines([(0.0, 1.0), (2.0, 4.0), (2.0, 3.0)], 2) == pytest.approx(2.0)
    # Fewer requests than engines: some engine idles the whole time.
    assert short_of_engines([(0.0, 4.0)], 3) == pytest.approx(4.0)
    assert short_of_engines([], 2) == 0.0


def test_sync_parts_come_from_the_stages_they_time(monkeypatch):
    from megatron_rl_fp8.sync import timing

    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)

    def gather():
        for i in range(3):
            fake.now += 1.0  # a gather of 1 s per tensor
            yield f"w{i}", torch.zeros(2)

    def export(stream):
        for name, t in stream:
            fake.now += 0.25  # quantizing it
            yield name, t

    times = SyncTimes()
    out = list(timed(export(timed(gather(), times, "gather")), times, "export"))
    assert [n for n, _ in out] == ["w0", "w1", "w2"]
    assert times.gather == pytest.approx(3.0)
    assert times.quantize == pytest.approx(0.75)  # export includes the gather it pulls
    times.add(SyncTimes(transfer=2.0, load=1.0))
    assert times.metrics() == pytest.approx(
        {
            "perf/sync_gather_time_s": 3.0,
            "perf/sync_quantize_time_s": 0.75,
            "perf/sync_transfer_time_s": 2.0,
            "perf/sync_load_time_s": 1.0,
        }
    )


def _run(root, name, records):
    d = root / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_report_breakdown_means_shares_and_other(tmp_path):
    records = [{"step": 0, "eval/reward_mean": 0.1}]
    for s in (1, 2, 3, 4):
        rec = {
            "step": s,
            STEP: 10.0,
            "perf/rollout_time_s": 6.0,
            "perf/rollout_generate_time_s": 5.0,
            "perf/update_time_s": 2.0,
        }
        if s == 3:
            rec["perf/checkpoint_time_s"] = 1.0  # one save in four steps
        records.append(rec)
    records.append({"step": 5, "rollout/reward_mean": 0.0})  # no step time: not counted
    new = _run(tmp_path, "new", records)
    # A run from before the breakdown: step times only.
    old = _run(tmp_path, "old", [{"step": s, STEP: 4.0} for s in (1, 2)])
    table = step_time_breakdown(load_runs([new])[0])
    assert table[STEP] == (10.0, 1.0)
    assert table["perf/rollout_time_s"] == pytest.approx((6.0, 0.6))
    assert table["perf/rollout_generate_time_s"] == pytest.approx((5.0, 0.5))
    assert table["perf/checkpoint_time_s"] == pytest.approx((0.25, 0.025))
    assert table[OTHER] == pytest.approx((1.75, 0.175))  # parts are not subtracted twice
    assert "perf/eval_time_s" not in table  # never logged: shown as "–"
    shares = sum(table[k][1] for _, k in PHASES if k in table) + table[OTHER][1]
    assert math.isclose(shares, 1.0)

    report = write_report([new, old], tmp_path / "out").read_text()
    section = report.split("## Step-time breakdown")[1].split("##")[0]
    assert "| phase | key | new | old |" in section
    assert "| rollout | `perf/rollout_time_s` | 6 s (60.0%) | – |" in section
    assert "| rollout: generation | `perf/rollout_generate_time_s` | 5 s (50.0%) | – |" in section
    assert "| checkpoint | `perf/checkpoint_time_s` | 0.25 s (2.5%) | – |" in section
    assert "| other | `perf/other_time_s` | 1.75 s (17.5%) | 4 s (100.0%) |" in section
    assert "| step | `perf/step_time_s` | 10 s (100.0%) | 4 s (100.0%) |" in section
    assert "evaluation" not in section  # no run has it
    # Without any step time there is no table.
    bare = _run(tmp_path, "bare", [{"step": 1, "rollout/reward_mean": 0.5}])
    assert "Step-time breakdown" not in write_report([bare], tmp_path / "out2").read_text()


def test_a_pipelined_run_shows_the_rollout_beside_the_trainer(tmp_path):
    # Under one_step_off the rollout phase is the trainer's wait; the rollout itself ran beside.
    records = [
        {
            "step": s,
            STEP: 10.0,
            "perf/rollout_time_s": 1.0,
            "perf/update_time_s": 8.0,
            "perf/pipeline/rollout_time_s": 9.0,
            "perf/pipeline/overlap_time_s": 8.0,
            "perf/pipeline/engine_idle_time_s": 0.0,
        }
        for s in (1, 2)
    ]
    run = _run(tmp_path, "piped", records)
    table = step_time_breakdown(load_runs([run])[0])
    assert table[OTHER] == pytest.approx((1.0, 0.1))  # the rollout beside is not a phase
    report = write_report([run], tmp_path / "out").read_text()
    section = report.split("## Step-time breakdown")[1].split("##")[0]
    beside = (
        "| rollout beside the trainer (pipelined) | `perf/pipeline/rollout_time_s` | 9 s (90.0%) |"
    )
    assert beside in section
    assert (
        "| of it, overlapping the trainer's work | `perf/pipeline/overlap_time_s` | 8 s" in section
    )
