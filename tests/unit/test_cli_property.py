"""Issue 44's property over the CLI: every integer, float and path-like setting of the tiny job,
set to values generated to be wrong (negative, zero, past int64, non-finite, not a number, a
path under a file), through `config`, `train`, `plan`, `launch --dry-run` and `study`, and every
integer and path flag of `convert`, ends within seconds in exit 0 (the value is legal) or exit 2
with exactly one stderr line naming what to fix (argparse's own refusals: its usage, then one
error line): never a traceback, never a hang. `train` and `study` get the cases `config` refuses
(a value `config` accepts starts a real run) and must refuse every one of them before any run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from megatron_rl_fp8 import cli
from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import describe_fields

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_cpu.yaml")
PLAN = str(ROOT / "examples" / "qwen3_8b_grpo_math_fp8.yaml")
SECONDS = 10.0  # per invocation: checks, not compute
PATHLIKE = ("dir", "path", "file", "checkpoint", "load", "save")


def _cases() -> list[tuple[str, str]]:
    cases = []
    for doc in describe_fields(load_config(TINY, [])):
        value, leaf = doc.value, doc.path.rsplit(".", 1)[-1]
        if isinstance(value, bool):
            bad = ["2", "maybe"]
        elif isinstance(value, int):
            bad = ["-1", "0", str(2**64), "1.5", "x"]
        elif isinstance(value, float):
            bad = ["-1e30", "nan", "inf", "x"]
        elif isinstance(value, str) and any(p in leaf for p in PATHLIKE):
            bad = [f"{TINY}/below", "/proc/no/such/dir"]
        else:
            continue
        cases += [(doc.path, b) for b in bad]
    return cases


CASES = _cases()


def _run(argv: list[str], capsys) -> tuple[int, list[str], float]:
    t0 = time.perf_counter()
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err[-2000:])
    return rc, err.strip().splitlines(), seconds


def _one_line_or_ok(argv, capsys, kinds=("config error: ",)) -> int:
    rc, lines, seconds = _run(argv, capsys)
    assert seconds < SECONDS, (argv, seconds)
    assert rc in (0, 2), (argv, rc, lines)
    if rc == 2:
        if lines and lines[0].startswith("usage: "):  # argparse: its usage, then the one error
            lines = [ln for ln in lines if not ln.startswith(" ")][1:]
            assert len(lines) == 1 and ": error: argument " in lines[0], (argv, lines)
        else:
            assert len(lines) == 1 and lines[0].startswith(kinds), (argv, lines)
    return rc


def test_the_cases_cover_every_kind_of_setting():
    kinds = {b for _, b in CASES}
    assert len(CASES) > 300 and {"nan", str(2**64), "/proc/no/such/dir"} <= kinds


def test_config_and_train_refuse_bad_values_in_one_line(tmp_path, capsys):
    refused = 0
    for path, bad in CASES:
        if _one_line_or_ok(["config", TINY, f"{path}={bad}"], capsys) == 2:
            refused += 1
            out = f"train.output_dir={tmp_path / 'run'}" if path != "train.output_dir" else ""
            argv = ["train", TINY, f"{path}={bad}", *([out] if out else [])]
            rc, lines, seconds = _run(argv, capsys)
            assert rc == 2 and len(lines) == 1, (argv, rc, lines)
            assert seconds < SECONDS, (argv, seconds)
    assert refused > len(CASES) // 2  # most generated values are wrong


def test_plan_and_launch_refuse_bad_values_in_one_line(capsys):
    # The same values through the commands around training (one per setting: the planner's and
    # launcher's own checks come on top of the config's).
    seen = set()
    for path, bad in CASES:
        if path in seen:
            continue
        seen.add(path)
        _one_line_or_ok(["plan", PLAN, f"{path}={bad}"], capsys)
        launch = [
            "launch",
            TINY,
            f"{path}={bad}",
            "--dry-run",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
        ]
        _one_line_or_ok(launch, capsys, kinds=("launch error: ", "config error: "))
    for flag, bad in [("--nodes", "-3"), ("--nodes", str(2**64)), ("--gpus-per-node", "0"),
                      ("--gpu-memory-gb", "nan"), ("--top", "-2"), ("--fill", "inf")]:  # fmt: skip
        rc = _one_line_or_ok(["plan", PLAN, flag, bad, "--time"], capsys)
        assert rc == 2, (flag, bad)


@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node"])
def test_launch_sizes_past_any_cluster_are_refused(flag, capsys):
    argv = ["launch", TINY, "--dry-run", "--nodes", "1", "--gpus-per-node", "1", flag, str(2**64)]
    assert _one_line_or_ok(argv, capsys, kinds=("launch error: ",)) == 2


def test_study_refuses_in_one_line_what_config_refuses_before_any_run(tmp_path, capsys):
    # One refused value per setting, as an arm's override (the same YAML text as on the command
    # line, so the same value): the study checks every arm before it starts a run.
    refused = {}
    for path, bad in CASES:
        if path not in refused and path != "train.output_dir":
            if _one_line_or_ok(["config", TINY, f"{path}={bad}"], capsys) == 2:
                refused[path] = bad
    assert len(refused) > 50
    out = tmp_path / "study"
    for path, bad in refused.items():
        study = tmp_path / "study.yaml"
        study.write_text(
            yaml.safe_dump({"name": "bad", "base": TINY, "seeds": [1], "reference": "ok"})
            + f"arms:\n  ok: {{}}\n  bad:\n    {path}: {bad}\n"
        )
        argv = ["study", str(study), "--out", str(out)]
        rc = _one_line_or_ok(argv, capsys, kinds=("study error: ", "config error: "))
        assert rc == 2, (path, bad)
        assert not (out / "bad").exists() and not (out / "ok").exists(), (path, bad)


CONVERT_INTS = ["-1", "0", str(2**64), "1.5", "x", ""]
CONVERT_PATHS = [f"{TINY}/below", "/proc/no/such/dir", ""]


def test_convert_refuses_bad_flag_values_in_one_line(tiny_hf_model, tmp_path, capsys):
    from megatron_rl_fp8.convert import hf_to_mcore

    hf = str(tiny_hf_model["dir"])
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(hf, ckpt, progress=False)
    commands = {
        "hf-to-mcore": {"--hf": hf, "--tp": "1", "--pp": "1"},
        "mcore-to-hf": {"--ckpt": str(ckpt), "--hf-config": hf, "--max-shard-size": "5GB"},
        "export-fp8": {
            "--hf": hf,
            "--keep-first-layers": "0",
            "--keep-last-layers": "0",
            "--max-shard-size": "5GB",
        },
    }
    n = 0
    for command, flags in commands.items():
        for flag in [*flags, "--out"]:
            paths = flag in ("--hf", "--ckpt", "--hf-config", "--out")
            for bad in CONVERT_PATHS if paths else CONVERT_INTS:
                n += 1
                out = tmp_path / f"out{n}"
                values = {**flags, "--out": str(out), flag: bad}
                argv = ["convert", command, "--no-progress"]
                argv += [f"{k}={v}" for k, v in values.items()]
                kinds = ("convert error: ", "config error: ")
                if _one_line_or_ok(argv, capsys, kinds=kinds) == 2:
                    assert not out.exists() or flag == "--out", argv
    assert n > 40
