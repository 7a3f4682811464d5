"""How the train command ends: user errors in one line (exit 2), guard stops (exit 3), bugs with
their traceback, also kept in the run directory (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl_fp8 import cli
from megatron_rl_fp8.trainer import loop

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")


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


def _one_line(argv, capsys, kind="config error"):
    """Run the CLI; it must exit 2 with one stderr line ``<kind>: ...`` and no traceback."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"{kind}: "), line
    return line


# Bytes that are not UTF-8 anywhere (0xff never occurs in it), nor Parquet.
_JUNK = bytes(range(128, 256)) * 4


@pytest.mark.parametrize("field", ["train_path", "val_path"])
def test_prompt_file_that_is_not_utf8_names_file_and_line(field, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "1+2=", "answer": "3"}\n' + _JUNK + b"\n")
    line = _one_line(
        ["train", "examples/tiny_cpu.yaml", f"task.{field}={path}", f"train.output_dir={tmp_path}"],
        capsys,
        "data error",
    )
    assert f"{path}:2: not UTF-8 text" in line


@pytest.mark.parametrize("content", [b"", _JUNK], ids=["empty", "garbage"])
def test_parquet_file_that_is_not_parquet_is_a_data_error(content, tmp_path, capsys):
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    path.write_bytes(content)
    line = _one_line(
        [
            "train",
            "examples/tiny_cpu.yaml",
            f"task.train_path={path}",
            f"train.output_dir={tmp_path}",
        ],
        capsys,
        "data error",
    )
    assert f"prompt file {str(path)!r} is not a readable Parquet file (" in line


@pytest.mark.parametrize(
    "content, message",
    [
        (_JUNK, "is not UTF-8 text (byte 0x80 on line 1)"),
        (b"train: [1,\n", "is not valid YAML: line 2, column 1: "),
        (b"- train\n- model\n", "must hold a mapping of sections (model:, train:, ...), got list"),
        (b"42\n", "must hold a mapping of sections (model:, train:, ...), got int"),
        (b"", "is empty (or only comments); give at least one section, or write {}"),
        (b"# train:\n#   steps: 3\n", "is empty (or only comments)"),
        (
            b"train:\n  steps: 3\nmodel: {}\ntrain:\n  steps: 5\n",
            "is not valid YAML: line 4, column 1: while constructing a mapping; found duplicate "
            "key 'train' (first on line 1)",
        ),
    ],
    ids=["binary", "bad-yaml", "list", "scalar", "empty", "comments", "duplicate-key"],
)
def test_unusable_config_file_is_one_line_naming_it(content, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    # A run directory of its own, should a broken check let the run start.
    for argv in (["train", str(path), f"train.output_dir={tmp_path}"], ["config", str(path)]):
        line = _one_line(argv, capsys)
        assert line.startswith(f"config error: config file {str(path)!r} {message}"), line


def test_config_path_that_is_a_directory_says_so(tmp_path, capsys):
    said = "is a directory; give the path of a YAML file"
    line = _one_line(["train", str(tmp_path)], capsys)
    assert line == f"config error: config file {str(tmp_path)!r} {said}"
    (tmp_path / "child.yaml").write_text(f"base: {tmp_path}\n")
    line = _one_line(["train", str(tmp_path / "child.yaml")], capsys)
    assert line == (
        f"config error: config file {str(tmp_path)!r} (the base of "
        f"{str(tmp_path / 'child.yaml')!r}) {said}"
    )


@pytest.mark.parametrize(
    "override, field, shown",
    [
        ("sft.lr=.nan", "sft.lr", "nan"),
        ("loss.eps_high=.nan", "loss.eps_high", "nan"),
        ("rollout.temperature=.nan", "rollout.temperature", "nan"),
        ("rollout.temperature=nan", "rollout.temperature", "nan"),
        ("loss.eps_high=inf", "loss.eps_high", "inf"),
        ("optim.adam_eps=-.inf", "optim.adam_eps", "-inf"),
    ],
)
def test_non_finite_overrides_name_the_field(override, field, shown, tmp_path, capsys):
    argv = ["train", "examples/tiny_cpu.yaml", override, f"train.output_dir={tmp_path}"]
    line = _one_line(argv, capsys)
    assert line == f"config error: {field}: expected a finite number, got {shown}"


def test_non_finite_yaml_values_name_the_field(tmp_path, capsys):
    for value, shown in ((".nan", "nan"), (".inf", "inf"), (".NaN", "nan")):
        path = tmp_path / "run.yaml"
        path.write_text(
            f"base: {Path('examples/tiny_cpu.yaml').resolve()}\n"
            f"train:\n  output_dir: {tmp_path}\nsft:\n  lr: {value}\n"
        )
        line = _one_line(["train", str(path)], capsys)
        assert line == f"config error: sft.lr: expected a finite number, got {shown}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=100000000000000000000000", "train.seed: 100000000000000000000000 is past a 64-bit"),
        ("train.seed=-1", "train.seed: -1 is not a seed; give an integer from 0 to 4294967295"),
        ("rollout.seed=4294967296", "rollout.seed: 4294967296 is not a seed"),
        ("train.micro_batch_size=10000000000000000000000", "train.micro_batch_size: 10000000000000000000000 is past"),
    ],
)  # fmt: skip
def test_integers_are_bounded_by_what_takes_them(override, message, tmp_path, capsys):
    # Issue 44 #3: a seed past int64 passed every check and crashed mid-run in torch.
    for argv in (
        ["config", TINY, override],
        ["train", TINY, override, f"train.output_dir={tmp_path}"],
    ):
        assert message in _one_line(argv, capsys)


def test_config_refuses_what_train_refuses(capsys):
    # Issue 44 #10: the rules that span several settings ran in train and plan, not in config.
    line = _one_line(
        ["config", TINY, "train.pipeline=one_step_off", "rollout.engine=sglang",
         "rollout.placement=colocated"],
        capsys,
    )  # fmt: skip
    assert "colocated engines cannot" in line


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    # Issue 44 #7: a KeyboardInterrupt traceback; now one line naming the command, exit 130.
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(["train", TINY]) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("interrupted: megatron-rl-fp8 train stopped by Ctrl-C")
