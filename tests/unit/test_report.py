"""``megatron-rl-fp8 report`` on tiny synthetic run directories: figures, summary, errors."""

from __future__ import annotations

import json

import pytest

from megatron_rl_fp8.cli import main
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(recipe: str, calib: bool) -> str:
    weight_quant = "bf16" if recipe == "bf16" else "blockwise"
    return (
        f"fp8:\n  recipe: {recipe}\n"
        f"rollout:\n  fp8:\n    weight_quant: {weight_quant}\n"
        f"loss:\n  eps_low: 0.2\n  eps_high: 0.28\n  calib:\n    enabled: {str(calib).lower()}\n"
    )


def _records(steps: int, fp8: bool, offset: float) -> list[dict]:
    """Step 0 (warm start: eval/ and sft/ keys only), then RL steps with eval every 4 steps."""
    records = [{"step": 0, "eval/reward_mean": 0.2, "sft/final_loss": 1.0}]
    for s in range(1, steps + 1):
        rec = {
            "step": s,
            "rollout/reward_mean": offset + 0.01 * s,
            "train/entropy": 2.0 - 0.05 * s,
            "train/pg_clipfrac_pos_upper": 0.01,
            "train/pg_clipfrac_neg_lower": 0.02,
            "train/response_tokens": 400.0,
            "perf/step_time_s": 2.0,
        }
        if fp8:
            rec |= {"calib/lower": 0.75, "calib/upper": 1.3, "fp8/token_mult_prob_error": 1.01}
        if s % 4 == 0:
            rec["eval/reward_mean"] = offset + 0.02 * s
        records.append(rec)
    return records


def _run_dir(root, name, records, config=None, guard_events=None, garbage=False):
    d = root / name
    d.mkdir()
    lines = [json.dumps(r) for r in records]
    if garbage:  # non-finite values as strings; the report must treat them as missing
        lines.insert(
            2, json.dumps({"step": 2, "rollout/reward_mean": "nan", "train/entropy": "inf"})
        )
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config is not None:
        (d / "config.yaml").write_text(config)
    if guard_events is not None:
        (d / "guard_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in guard_events))
    return d


@pytest.fixture
def runs(tmp_path):
    bf16 = _run_dir(tmp_path, "bf16", _records(10, False, 0.3), _config("bf16", False))
    fp8 = _run_dir(tmp_path, "fp8", _records(8, True, 0.1), _config("blockwise", False))
    calib = _run_dir(
        tmp_path,
        "fp8_calib",
        _records(10, True, 0.2),
        _config("blockwise", True),
        guard_events=[
            {"step": 3, "rule": "entropy_drop", "action": "warn", "evidence": "entropy 0.4 < 0.5"},
            {"step": 7, "rule": "ratio_outliers", "action": "skip", "evidence": "p99 3.1"},
        ],
    )
    return [bf16, fp8, calib]


def _table_rows(md: str) -> list[list[str]]:
    section = md.split("## ")[0]  # the summary table comes before the first section
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]


def test_report_writes_valid_pngs_and_one_row_per_run(runs, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "report" / "nested"  # --out is created
    report = write_report(runs, out)
    assert report == out / "report.md"
    for name in ("overview", "clipping", "mismatch", "throughput"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        h, w, channels = imread(png).shape
        assert h > 200 and w > 300 and channels in (3, 4)
    assert not list(out.glob("*.tmp"))

    md = report.read_text()
    rows = _table_rows(md)
    assert [r[0] for r in rows] == ["bf16", "fp8", "fp8_calib"]
    header = [c.strip() for c in md.splitlines()[2].strip("|").split(" | ")]
    col = {name: i for i, name in enumerate(header)}
    bf16, fp8, calib = rows
    assert bf16[col["precision"]] == "train bf16, rollout bf16"
    assert fp8[col["precision"]] == "train blockwise, rollout blockwise"
    assert calib[col["precision"]] == "train blockwise, rollout blockwise, calibrated clip"
    assert [r[col["steps"]] for r in rows] == ["10", "8", "10"]
    # eval at 0 (0.2), 4, 8 (bf16: 0.3 + 0.02 * step); best is the first maximum
    assert bf16[col["final eval"]] == "0.460 (step 8)" == bf16[col["best eval"]]
    assert fp8[col["final eval"]] == "0.260 (step 8)"
    assert fp8[col["best eval"]] == "0.260 (step 8)"
    # reward: mean of steps 6..10 = 0.3 + 0.01 * 8
    assert bf16[col["reward (last 5)"]] == f"{0.3 + 0.08:.3f}"
    assert fp8[col["reward (last 5)"]] == f"{0.1 + 0.06:.3f}"
    assert bf16[col["entropy first→last"]] == "1.950 → 1.500"
    assert bf16[col["mean step time"]] == "2.00 s"
    assert [r[col["guard events"]] for r in rows] == ["0", "0", "2"]
    assert "| fp8_calib | 7 | ratio_outliers | skip | p99 3.1 |" in md
    for name in ("overview", "clipping", "mismatch", "throughput"):
        assert f"![{name}]({name}.png)" in md
    # Absent everywhere: listed as skipped; present in some runs only: drawn, not listed.
    skipped = md.split("## Skipped panels")[1]
    assert "`train/ratio_above_2`" in skipped and "`rollout/garbled_frac`" in skipped
    assert "`fp8/rollout_train_kl`" in skipped
    assert "calib/lower" not in skipped and "eval/reward_mean" not in skipped


def test_labels_garbled_values_and_guard_metrics(tmp_path):
    records = _records(6, False, 0.5)
    # No guard_events.jsonl: the guard's metric keys name the event (guard/lr_scale is none).
    records[3] |= {"guard/events": 1.0, "guard/rule/entropy": 1.0, "guard/action/rollback": 1.0}
    records[4]["guard/lr_scale"] = 0.5
    a = _run_dir(tmp_path, "a", records, garbage=True)  # no config.yaml either
    b = _run_dir(tmp_path, "b", _records(6, False, 0.5))
    out = tmp_path / "out"
    assert main(["report", str(a), str(b), "--out", str(out), "--label", "A", "--label", "B"]) == 0
    md = (out / "report.md").read_text()
    rows = _table_rows(md)
    assert [r[0] for r in rows] == ["A", "B"]
    assert rows[0][2] == "?"  # no config: precision unknown
    assert rows[0][3:-1] == rows[1][3:-1]  # the line of "nan"/"inf" strings changed no number
    assert rows[0][-1] == "1" and rows[1][-1] == "0"  # guard events
    assert "| A | 3 | entropy | rollback |" in md
    # Only BF16-style runs: no calibrated bounds, so that panel is skipped and said so.
    assert "`calib/lower`, `calib/upper`" in md.split("## Skipped panels")[1]
    assert not (out / "mismatch.png").exists()  # none of its metrics in any run


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("no_metrics", "has no metrics.jsonl"),
        ("labels", "--label given 1 times for 2 runs"),
        ("unwritable", "is not a writable directory"),
    ],
)
def test_bad_inputs_are_one_line_config_errors(tmp_path, capsys, case, message):
    good = _run_dir(tmp_path, "good", _records(2, False, 0.0))
    other = tmp_path / "other"
    other.mkdir()
    out = tmp_path / "out"
    extra = []
    if case == "missing":
        other = tmp_path / "nope"
    elif case == "no_metrics":
        (other / "config.yaml").write_text("fp8:\n  recipe: bf16\n")
    elif case == "labels":
        other = _run_dir(tmp_path, "good2", _records(2, False, 0.0))
        extra = ["--label", "only-one"]
    elif case == "unwritable":
        other = _run_dir(tmp_path, "good2", _records(2, False, 0.0))
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        out = blocker / "out"  # no directory under a file, even for root
    code = main(["report", str(good), str(other), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("config error: ") and message in err[0], err
    assert not (out / "report.md").exists()
    with pytest.raises(ConfigError):
        write_report([good, other], out, extra[1:] or None)


def test_missing_values_never_reach_the_numbers(tmp_path):
    from megatron_rl_fp8.metrics.report import summary_row
    from megatron_rl_fp8.metrics.runs import load_runs

    records = [{"step": 0}, {"step": 1, "rollout/reward_mean": None, "train/entropy": "nan"}]
    (run,) = load_runs([_run_dir(tmp_path, "r", records)])
    row = summary_row(run)
    assert row["steps"] == "1" and row["reward (last 5)"] == "–"
    assert row["entropy first→last"] == "–" and run.series("train/entropy") == ([], [])


def test_throughput_panel_never_mixes_two_token_counts(tmp_path):
    from megatron_rl_fp8.metrics.figures import RESPONSE_THROUGHPUT, THROUGHPUT, resolve_panel
    from megatron_rl_fp8.metrics.runs import RESPONSE_TOKENS_PER_S, load_runs

    new = _records(3, True, 0.0)
    for rec in new[1:]:
        rec["perf/useful_tokens_per_s"] = 150.0
    a, b = load_runs([_run_dir(tmp_path, "a", new), _run_dir(tmp_path, "b", _records(3, True, 0))])
    assert resolve_panel(THROUGHPUT, [a]) is THROUGHPUT
    assert resolve_panel(THROUGHPUT, [a, b]) is RESPONSE_THROUGHPUT  # b predates the key
    assert b.series(RESPONSE_TOKENS_PER_S) == ([1, 2, 3], [200.0, 200.0, 200.0])
