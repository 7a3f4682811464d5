"""How the train command ends: user errors in one line (exit 2), guard stops (exit 3), bugs with
their traceback, also kept in the run directory (exit 1)."""

from __future__ import annotations

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.trainer import loop


class _Broken:
    def __init__(self, cfg):
        raise RuntimeError("boom: a bug")


def test_a_bug_prints_its_traceback_and_keeps_it_in_the_run_directory(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(loop, "Trainer", _Broken)  # fault injection: the trainer's build fails
    rc = cli.main(["train", "examples/tiny_cpu.yaml", f"train.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    log = tmp_path / "crash-rank0.log"
    assert rc == 1
    assert "Traceback" in err and "RuntimeError: boom: a bug" in err
    assert err.strip().splitlines()[-1] == (
        f"error: the run failed unexpectedly; the traceback is also in {log}"
    )
    assert "RuntimeError: boom: a bug" in log.read_text()


@pytest.mark.parametrize("override", ["optim.lr=.nan", "guard.window=0"])
def test_user_errors_stay_one_line(override, capsys):
    assert cli.main(["train", "examples/tiny_cpu.yaml", override]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("config error: ")
