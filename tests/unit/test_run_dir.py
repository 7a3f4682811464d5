"""The run directory before any compute: one writer, writable paths, degenerate settings."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.trainer.run_dir import RunLock, changed_settings

_HOLD = """
import sys, time
from megatron_rl_fp8.trainer.run_dir import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(out_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_is_refused_and_a_killed_owner_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {proc.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the kernel dropped the dead process's lock
    assert lock.previous["pid"] == proc.pid  # ... and the takeover is known
    lock.release()
    again = RunLock(tmp_path)
    again.acquire()
    assert again.previous == {}  # a clean release leaves no owner behind
    again.release()


def test_cli_refuses_a_busy_directory_before_writing_anything(tmp_path, capsys):
    from megatron_rl_fp8.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the other run's config\n")
    proc = _holder(out)
    try:
        code = main(["train", "examples/tiny_cpu.yaml", f"train.output_dir={out}",
                     f"train.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is in use by another run" in err[0], err
    assert (out / "config.yaml").read_text() == "the other run's config\n"


def test_unwritable_cache_fails_before_the_warm_start(tmp_path, capsys):
    from megatron_rl_fp8.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    t0 = time.perf_counter()
    code = main(["train", "examples/tiny_cpu.yaml", f"train.output_dir={tmp_path / 'run'}",
                 f"train.cache_dir={blocker / 'cache'}"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("config error: train.cache_dir=") and "not a writable" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert time.perf_counter() - t0 < 30  # no SFT ran (600 steps take minutes)
    # The refused run released the directory.
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    lock.release()


def test_one_sample_per_prompt_is_refused():
    with pytest.raises(ConfigError, match="n_samples_per_prompt=1: GRPO"):
        load_config(None, ["rollout.n_samples_per_prompt=1"]).validate(1)


def test_changed_settings_on_resume(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text("optim:\n  lr: 0.0001\ntrain:\n  steps: 10\n")
    new = {"optim": {"lr": 0.0003}, "train": {"steps": 10, "seed": 1}}
    assert changed_settings(old, new) == [
        "optim.lr: 0.0001 -> 0.0003",
        "train.seed: '(unset)' -> 1",
    ]
    assert changed_settings(old, {"optim": {"lr": 0.0001}, "train": {"steps": 10}}) == []
    # A field the saved run's code did not have yet: at the value that code ran with it is not a
    # change, set to anything else it is; a field the saved file has is compared as ever.
    absent = {"train.seed": 1, "optim.lr": 0.0003, "train.tags": ("a", "b")}
    assert changed_settings(old, new, absent=absent) == ["optim.lr: 0.0001 -> 0.0003"]
    newer = {**new, "train": {**new["train"], "tags": ["a", "b"], "seed": 2}}
    assert changed_settings(old, newer, absent=absent) == [
        "optim.lr: 0.0001 -> 0.0003",
        "train.seed: '(unset)' -> 2",
    ]


def test_crash_logs_of_an_earlier_run_are_set_aside_at_the_start(tmp_path):
    """Issue 31.11: a crash log in the run directory belongs to its latest run."""
    from megatron_rl_fp8.trainer import run_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "crash-rank0.log").write_text("an old traceback\n")
    cfg = load_config(None, [f"train.output_dir={out}", f"train.cache_dir={tmp_path / 'c'}"])
    lock, problem = run_dir.prepare(cfg, is_driver=True, rank=0)
    lock.release()
    assert problem is None and not (out / "crash-rank0.log").exists()
    assert (out / "crash-rank0.previous.log").read_text() == "an old traceback\n"


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x81garbage", b"[1, 2]", b""])
def test_a_garbled_lock_file_is_taken_over(tmp_path, content):
    (tmp_path / ".lock").write_bytes(content)
    lock = RunLock(tmp_path)
    lock.acquire()  # no holder: the kernel holds no flock on it
    assert lock.previous == {}
    lock.release()


def test_a_lock_path_that_is_a_directory_is_one_line_naming_it(tmp_path):
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"train.output_dir: .*\.lock is a directory.*remove it"):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("saved", [b"- 1\n- 2\n", b"\xff\xfe\x00garbage", b"a: [unclosed\n"])
def test_a_damaged_saved_config_is_said_not_fatal(tmp_path, saved):
    (tmp_path / "config.yaml").write_bytes(saved)
    (item,) = changed_settings(tmp_path / "config.yaml", {"train": {"steps": 1}})
    assert item.startswith("(the saved config.yaml is ") and "replaced" in item
