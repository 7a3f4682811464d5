"""benchmarks/bench_calibration.py: the share arithmetic on hand-made metric lines, and the merge
comparison on two real gloo ranks (the histogram path agrees with the exact all-gather)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

bench = load_script("benchmarks/bench_calibration.py")


def _line(step, *, shadow=None, eval_s=0.0):
    m = {
        "step": step,
        "perf/step_time_s": 2.0 + eval_s + (shadow or 0.0),
        "perf/rollout_time_s": 1.0,
        "perf/logprob_time_s": 0.25,
        "perf/update_time_s": 0.5,
        "perf/sync_time_s": 0.1,
        "perf/other_time_s": 0.15,
    }
    if eval_s:
        m["perf/eval_time_s"] = eval_s
    if shadow is not None:
        m["perf/shadow_time_s"] = shadow
    return m


def test_share_row_splits_calibrating_from_plain_steps():
    # Step 1 (warm-up, skipped) and the last step carry an evaluation that is left out.
    lines = [_line(1, shadow=9.0, eval_s=5.0), _line(2), _line(3, shadow=0.5)]
    lines += [_line(4), _line(5, shadow=0.5, eval_s=3.0), {"eval/reward_mean": 0.1}]
    row = bench.share_row(lines)
    assert (row["plain_steps"], row["calib_steps"]) == (2, 2)
    assert row["plain_s"] == pytest.approx(2.0)
    assert row["calib_s"] == pytest.approx(2.5)
    assert row["shadow_s"] == pytest.approx(0.5)
    assert row["train_s"] == pytest.approx(0.75)
    # One calibration in 20 steps: 0.5 s of 20 x 2 s + 0.5 s.
    assert row["share_20"] == pytest.approx(0.5 / 40.5)
    assert row["share_1"] == pytest.approx(0.5 / 2.5)
    table = bench.share_table({"m": row})
    assert "| m | 2.000 | 2.500 | 0.500 | 0.500 | 0.67 | 20.0% | 4.8% | 1.2% |" in table


def test_share_row_without_plain_steps_says_how_to_run():
    with pytest.raises(ValueError, match="loss.calib.interval=2"):
        bench.share_row([_line(1, shadow=1.0), _line(2, shadow=1.0)])


def test_amortised_share_falls_with_the_interval():
    shares = [bench.amortised_share(1.0, 4.0, k) for k in (1, 2, 5, 20, 100)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] == pytest.approx(0.2)


def test_histogram_merge_matches_exact_all_gather_on_two_ranks():
    rows = bench.collective_rows(2, [8192], repeats=1, bins=4096)
    (row,) = rows
    assert row["ranks"] == 2 and row["tokens_per_rank"] == 8192
    assert row["hist_bytes"] == 8 * (4 * 4096 + 7)
    # fp8 + bf16 log ratios (float32) and the mask (bool) per token, advantages per row.
    assert row["exact_bytes"] == 8192 * (4 + 4 + 1) + 8 * 4
    assert row["hist_s"] > 0 and row["exact_s"] > 0
    # Bounds agree to a few bins of 4 / 4096 in log ratio (ratio ~1, so the same in ratio).
    assert row["bound_diff"] < 5 * 4 / 4096


def test_bad_arguments_are_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--ranks", "1"])
    assert "--ranks [1]" in capsys.readouterr().err
