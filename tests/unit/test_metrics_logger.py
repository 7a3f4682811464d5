"""metrics.jsonl survives a kill -9 mid-write and keeps non-finite values; TensorBoard and offline
W&B get the same values, continue across a resume, and leave no process behind."""

import json
import math
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.config import LoggingConfig, WandbConfig
from megatron_rl_fp8.metrics.logger import MetricsLogger, read_metrics, require_packages

ROOT = Path(__file__).resolve().parents[2]


def _strict(line: str) -> dict:
    """json.loads that rejects NaN / Infinity tokens, as strict JSON readers do."""

    def bad(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=bad)


def _write_lines(out: Path, text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text(text)


def test_torn_last_and_middle_lines_are_skipped(tmp_path):
    _write_lines(
        tmp_path,
        '{"step": 0, "train/loss": 1.0}\n'
        '{"step": 1, "train/lo\n'  # torn, then a newline from a later run
        "[1, 2]\n"  # valid JSON, not a record
        '{"step": 2, "train/loss": 0.5}\n'
        '{"step": 3, "train/loss": 0.2',  # torn last line: no closing brace, no newline
    )
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 2]
    assert read_metrics(tmp_path / "absent") == []


@pytest.mark.parametrize("repair_first", [False, True])
def test_logging_after_a_torn_line_starts_a_new_line(tmp_path, repair_first):
    _write_lines(tmp_path, '{"step": 0, "train/loss": 1.0}\n{"step": 1, "train/lo')
    logger = MetricsLogger(tmp_path)
    if repair_first:  # the trainer's order: truncate_after at start, then log
        logger.truncate_after(0)
    logger.log(1, {"train/loss": 0.5})
    logger.log(2, {"train/loss": 0.25})
    logger.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    # The torn line stays a line of its own (skipped by readers), or is gone after the repair.
    assert lines[1] == (
        '{"step": 1, "train/loss": 0.5}' if repair_first else '{"step": 1, "train/lo'
    )
    assert [_strict(line)["step"] for line in lines if line != '{"step": 1, "train/lo'] == [0, 1, 2]
    assert [(m["step"], m["train/loss"]) for m in read_metrics(tmp_path)] == [
        (0, 1.0),
        (1, 0.5),
        (2, 0.25),
    ]


def test_truncate_after_drops_later_steps_and_torn_lines(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step in range(4):
        logger.log(step, {"train/loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "tr')
    logger.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 0, "train/loss": 0.0}\n{"step": 1, "train/loss": 1.0}\n'
    )
    logger.truncate_after(-1)  # a fresh start
    assert read_metrics(tmp_path) == []
    MetricsLogger(tmp_path / "absent").truncate_after(3)  # nothing to truncate
    assert not (tmp_path / "absent").exists()


def test_non_finite_values_round_trip_as_strict_json(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(0, {"train/loss": math.nan, "train/grad_norm": math.inf, "calib/x": -math.inf})
    logger.log(1, {"train/loss": 2, "train/grad_norm": 0.5, "calib/x": float("-0.0")})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert _strict(lines[0]) == {
        "step": 0,
        "calib/x": "-inf",
        "train/grad_norm": "inf",
        "train/loss": "nan",
    }
    first, second = read_metrics(tmp_path)
    assert math.isnan(first["train/loss"]) and isinstance(first["train/loss"], float)
    assert first["train/grad_norm"] == math.inf and first["calib/x"] == -math.inf
    assert second == {"step": 1, "calib/x": -0.0, "train/grad_norm": 0.5, "train/loss": 2.0}
    # Two reads of one file compare equal even with NaN in it (what a resume test compares).
    assert read_metrics(tmp_path) == read_metrics(tmp_path)


def test_disabled_logger_writes_and_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = LoggingConfig(tensorboard=True, wandb=WandbConfig(enabled=True, mode="offline"))
    logger = MetricsLogger(tmp_path / "run", cfg, enabled=False)
    logger.truncate_after(-1)
    logger.log(0, {"train/loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "module, cfg, setting, extra",
    [
        ("wandb", LoggingConfig(wandb=WandbConfig(enabled=True)), "logging.wandb.enabled", "wandb"),
        (
            "torch.utils.tensorboard",
            LoggingConfig(tensorboard=True),
            "logging.tensorboard",
            "tensorboard",
        ),
    ],
)
def test_a_missing_package_is_one_clear_config_error(
    tmp_path, monkeypatch, module, cfg, setting, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ConfigError) as err:
        MetricsLogger(tmp_path, cfg)
    msg = str(err.value)
    assert setting in msg and f"pip install 'megatron-rl-fp8[{extra}]'" in msg, msg
    assert "\n" not in msg
    assert list(tmp_path.iterdir()) == []  # failed before writing anything
    with pytest.raises(ConfigError, match=setting):
        require_packages(cfg)
    setup_py = (ROOT / "setup.py").read_text()
    assert f'"{extra}": ["{extra}"]' in setup_py  # the extra the message names exists


def test_tensorboard_events_match_and_a_resume_replaces_replayed_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(tensorboard=True)
    first = MetricsLogger(tmp_path, cfg)
    first.truncate_after(-1)
    for step in range(4):
        first.log(step, {"train/loss": float(step), "train/grad_norm": math.nan})
    first.close()
    resumed = MetricsLogger(tmp_path, cfg)
    resumed.truncate_after(1)  # restored step 1: steps 2 and 3 are replayed
    for step in (2, 3):
        resumed.log(step, {"train/loss": 10.0 + step, "train/grad_norm": math.inf})
    resumed.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    norms = [e.value for e in acc.Scalars("train/grad_norm")]
    assert len(norms) == 4 and all(math.isnan(v) for v in norms[:2]) and norms[2:] == [math.inf] * 2
    assert [m["train/loss"] for m in read_metrics(tmp_path)] == [0.0, 1.0, 12.0, 13.0]


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline W&B run file (``run-<id>.wandb``): a LevelDB-style log
    (7-byte file header, 32 KiB blocks, 7-byte chunk headers) of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    # Nothing outside tmp_path, no console capture under pytest, no network.
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return LoggingConfig(
        wandb=WandbConfig(enabled=True, mode="offline", project="unit", tags=["cpu", "test"])
    )


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_wandb_offline_run_resumes_the_same_run_and_leaves_no_process(tmp_path, offline_wandb):
    out = tmp_path / "my-run"
    before = _children()
    first = MetricsLogger(out, offline_wandb, run_config={"train": {"steps": 4}})
    first.truncate_after(-1)
    for step in range(3):
        first.log(step, {"train/loss": float(step), "train/grad_norm": math.nan})
    first.close()
    run_id = (out / "wandb_run_id").read_text().strip()
    assert len(run_id) == 8

    resumed = MetricsLogger(out, offline_wandb)
    resumed.truncate_after(1)  # step 2 is replayed: W&B gets a new row at trainer/step 2
    for step in (2, 3):
        resumed.log(step, {"train/loss": 10.0 + step, "train/grad_norm": math.inf})
    resumed.close()

    deadline = time.time() + 10
    while _children() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not _children() - before, "a W&B process outlived close()"

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    first_rows, resumed_rows = (_wandb_history(r / f"run-{run_id}.wandb") for r in runs)
    assert [(h["trainer/step"], h["train/loss"]) for h in first_rows] == [(0, 0), (1, 1), (2, 2)]
    assert all(math.isnan(h["train/grad_norm"]) for h in first_rows)
    assert [(h["trainer/step"], h["train/loss"], h["train/grad_norm"]) for h in resumed_rows] == [
        (2, 12, math.inf),
        (3, 13, math.inf),
    ]
    # The name defaults to the output directory's; the run config and tags are recorded.
    raw = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert b"my-run" in raw and b"steps" in raw and b"cpu" in raw


def test_a_process_killed_mid_write_leaves_a_readable_file(tmp_path):
    """A real SIGKILL after a partial line (no newline) was written and flushed; the next run
    truncates, logs and reads every whole record."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from megatron_rl_fp8.metrics.logger import MetricsLogger
        logger = MetricsLogger({str(tmp_path)!r})
        for step in range(3):
            logger.log(step, {{"train/loss": step / 2, "guard/nan": float("nan")}})
        with open(logger.path, "a") as f:
            f.write('{{"step": 3, "guard/nan": "na')
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert [m["train/loss"] for m in read_metrics(tmp_path)] == [0.0, 0.5, 1.0]

    logger = MetricsLogger(tmp_path)
    logger.truncate_after(2)
    logger.log(3, {"train/loss": 1.5})
    records = read_metrics(tmp_path)
    assert [m["step"] for m in records] == [0, 1, 2, 3]
    assert all(math.isnan(m["guard/nan"]) for m in records[:3])
    assert all(_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_lines_that_cannot_be_read_are_set_aside_never_deleted(tmp_path, capsys):
    """Issue 31.10: a garbled middle line and bytes that are not UTF-8 survive a start, moved to
    metrics.unreadable.jsonl, with one line saying so; the whole records stay in order."""
    from megatron_rl_fp8.metrics.logger import UNREADABLE_FILE

    good = [b'{"step": 1, "a": 1.0}', b'{"step": 2, "a": 2.0}', b'{"step": 3, "a": 3.0}']
    garbled = [b'{"step": 2.5, "a"', b"\xff\xfe\x00binary\x80", b"[1, 2]"]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join([good[0], garbled[0], good[1], garbled[1], garbled[2], good[2]]))
    MetricsLogger(tmp_path).truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # step 3 is replayed
    assert (tmp_path / UNREADABLE_FILE).read_bytes() == b"".join(g + b"\n" for g in garbled)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("metrics:")]
    assert "3 line(s)" in line and UNREADABLE_FILE in line
    # A second start finds nothing more to set aside and appends nothing.
    MetricsLogger(tmp_path).truncate_after(2)
    assert (tmp_path / UNREADABLE_FILE).read_bytes().count(b"\n") == 3
