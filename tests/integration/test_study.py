"""``megatron-rl-fp8 study`` end to end on the tiny job: a 2-arm x 2-seed x 2-step study runs,
writes its report, and a study killed after its first finished run and started again ends with
exactly the runs of an uninterrupted one (each run resumes from its checkpoints or is skipped).
The report's per-arm numbers are recomputed here from the runs' metrics.jsonl.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_rl_fp8.metrics.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]
T_975_DF1 = 12.706204736  # Student t, 97.5% quantile, 1 degree of freedom (two seeds)


def _study_file(tmp_path: Path, cache: Path, **changes) -> Path:
    study = {
        "name": "smoke",
        "base": str(ROOT / "examples" / "tiny_cpu.yaml"),
        "overrides": {
            "sft.steps": 8,
            "train.steps": 2,
            "train.prompts_per_step": 8,
            "rollout.n_samples_per_prompt": 4,
            "train.micro_batch_size": 16,
            "train.eval_prompts": 8,
            "train.eval_interval": 2,
            "train.save_interval": 1,
            "train.cache_dir": str(cache),
        },
        "seeds": [1, 2],
        "arms": {"bf16": {}, "fp8_rollout": {"rollout.fp8.weight_quant": "blockwise"}},
        **changes,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _cmd(study: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl_fp8", "study", str(study), "--out", str(out), *extra]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}


def _study(study: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(study, out, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )


def _records(run_dir: Path) -> list[dict]:
    """The run's metrics without its timings (which differ between any two runs)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run_dir)
    ]


def _finished(out: Path) -> list[Path]:
    done = []
    for status in out.glob("*/seed*/study_status.json"):
        try:
            if json.loads(status.read_text()).get("state") == "done":
                done.append(status.parent)
        except ValueError:  # being replaced right now
            pass
    return done


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    cache = tmp / "cache"
    study = _study_file(tmp, cache)
    proc = _study(study, tmp / "out", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, study, proc


def test_a_study_runs_every_arm_and_seed_and_reports_them(finished):
    tmp, _, proc = finished
    out = tmp / "out"
    assert "2 arms x 2 seeds = 4 runs" in proc.stdout and "study: 4 done" in proc.stdout
    for arm in ("bf16", "fp8_rollout"):
        for seed in (1, 2):
            run = out / arm / f"seed{seed}"
            assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
            assert yaml.safe_load((run / "study_config.yaml").read_text())["train"]["seed"] == seed
    assert (out / "report" / "report.md").is_file() and (out / "report" / "curves.png").is_file()
    # Same seed, same SFT start: the cached warm start was built once per seed, used by both arms.
    step0 = {(a, s): read_metrics(out / a / f"seed{s}")[0] for a in ("bf16", "fp8_rollout")
             for s in (1, 2)}  # fmt: skip
    for s in (1, 2):
        assert step0[("bf16", s)]["sft/final_loss"] == step0[("fp8_rollout", s)]["sft/final_loss"]


def test_the_reports_numbers_are_the_runs_metrics(finished):
    tmp, _, _ = finished
    out = tmp / "out"
    numbers = json.loads((out / "report" / "study.json").read_text())
    for arm in ("bf16", "fp8_rollout"):
        finals = []
        for seed in (1, 2):
            evals = [r["eval/reward_mean"] for r in read_metrics(out / arm / f"seed{seed}")
                     if "eval/reward_mean" in r]  # fmt: skip
            finals.append(evals[-1])
        mean = sum(finals) / 2
        half = T_975_DF1 * abs(finals[0] - finals[1]) / math.sqrt(2) / math.sqrt(2)
        got = numbers["arms"][arm]["stats"]["final_accuracy"]
        assert got["n"] == 2 and got["mean"] == pytest.approx(mean, abs=1e-12)
        if half > 0:
            assert got["lo"] == pytest.approx(mean - half, rel=1e-6)
            assert got["hi"] == pytest.approx(mean + half, rel=1e-6)
    diff = numbers["arms"]["fp8_rollout"]["diff"]["final_accuracy"]
    assert diff["test"] == "paired"


def test_a_moved_study_directory_is_the_same_study(finished, tmp_path, capsys):
    """Copied off the cluster (or reached through a link), a study's runs are still its runs:
    the report reads them, nothing reruns; a changed setting that acts on the run is still
    refused."""
    import shutil

    from megatron_rl_fp8.cli import main

    tmp, study, _ = finished
    moved = tmp_path / "copied"
    shutil.copytree(tmp / "out", moved, symlinks=True)
    # One run as an older version of the package wrote it, without a setting added since (at
    # its default now): still the study's run.
    frozen = moved / "bf16" / "seed1" / "config.yaml"
    older = yaml.safe_load(frozen.read_text())
    del older["rollout"]["sglang"]["parse_answers"]
    # and with defaults since moved under settings that never act on a BF16 run (12-07's
    # calibration default): not a change either.
    older["loss"]["calib"] |= {"mode": "calibrate", "interval": 20, "ema_decay": 0.5}
    older["fp8"]["scales_per_step"] = False
    frozen.write_text(yaml.safe_dump(older))
    assert main(["study", str(study), "--out", str(moved), "--report-only"]) == 0
    assert (moved / "report" / "report.md").is_file()
    link = tmp_path / "link"
    link.symlink_to(moved)
    assert main(["study", str(study), "--out", str(link), "--report-only"]) == 0
    changed = yaml.safe_load(study.read_text())
    changed["arms"]["bf16"] = {"optim.lr": 1.0e-3}
    other = tmp_path / "study.yaml"
    other.write_text(yaml.safe_dump(changed))
    capsys.readouterr()
    assert main(["study", str(other), "--out", str(moved), "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "was started with other settings (optim.lr:" in err and "output_dir" not in err, err


@pytest.mark.slow  # kill -9 + resume of one run is make test's: tests/integration/test_tiny_run.py
def test_a_killed_study_resumes_to_the_uninterrupted_result(finished, tmp_path):
    """The fixture's study less one arm (its bf16 runs are the same runs: same settings, same
    threads per run), killed in its second run and started again."""
    tmp, _, _ = finished
    study = _study_file(tmp_path, tmp / "cache", arms={"bf16": {}})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _cmd(study, out, "--jobs", "2"),  # the fixture's: the same threads per run
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while not _finished(out) and time.time() < deadline:
            time.sleep(0.2)
        assert _finished(out), "no run finished in 300 s"
        # The next run has started; kill the study in the middle of it (its runs die with it).
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    again = _study(study, out, "--jobs", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs already finished; skipping them" in again.stdout
    for seed in (1, 2):
        run = f"bf16/seed{seed}"
        assert _records(out / run) == _records(tmp / "out" / run), run


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arm": {}}, "unknown key(s) 'arm'; valid keys: name, description, base"),
        ({"seeds": []}, "'seeds' must be a non-empty list of integers"),
        ({"arms": {"bf16": {"optim.lr": -1.0}}}, "arm 'bf16': optim"),
        ({"arms": {"bf16": {"train.nope": 1}}}, "arm 'bf16': unknown key(s) 'nope' in train"),
        ({"reference": "fp8"}, "reference 'fp8' is not an arm"),
        ({"reference": ["bf16"]}, "reference ['bf16'] is not an arm"),
        ({"arms": {"bf16": {}, "report": {}}}, "arm name 'report' is the study's report folder"),
        ({"name": "../escape"}, "name '../escape' must be letters, digits"),
        # The study sets these per run; set in a study file they were silently replaced.
        ({"arms": {"bf16": {"train.seed": 7}}}, "arm 'bf16' sets train.seed, which the study"),
        ({"overrides": {"train.output_dir": "x"}}, "'overrides' sets train.output_dir, which"),
    ],
)
def test_bad_study_files_are_one_line_before_any_run(tmp_path, capsys, changes, message):
    from megatron_rl_fp8.cli import main

    study = _study_file(tmp_path, tmp_path / "cache", **changes)
    assert main(["study", str(study), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_duplicate_arm_or_an_unusable_out_is_one_line(tmp_path, capsys):
    """Issue 44 #12, #1: YAML keeps the last of two equal keys, so a second arm of one name
    silently replaced the first; ``--out`` naming a file, or a folder that cannot be made, was a
    traceback from the first mkdir."""
    from megatron_rl_fp8.cli import main

    study = _study_file(tmp_path, tmp_path / "cache")
    text = study.read_text()
    doubled = tmp_path / "doubled.yaml"
    doubled.write_text(text.replace("arms:\n", "arms:\n  bf16: {optim.lr: 0.1}\n", 1))
    assert main(["study", str(doubled), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "found duplicate key 'bf16' (first on line" in err[0], err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in (a_file, a_file / "below"):
        assert main(["study", str(study), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not a writable directory" in err[0] and "--out=" in err[0]
    assert a_file.read_text() == "x"


def test_a_second_study_process_on_one_directory_is_refused(tmp_path, capsys):
    """Issue 44 #4: two study processes on one --out started runs the run locks refused and
    overwrote the live runs' statuses; now the second is refused in one line, before any run."""
    from megatron_rl_fp8.cli import main
    from megatron_rl_fp8.study.runner import STUDY_LOCK
    from megatron_rl_fp8.utils.fs import FileLock

    study = _study_file(tmp_path, tmp_path / "cache")
    out = tmp_path / "out"
    first = FileLock(out / STUDY_LOCK, "--out")  # the running study's hold (another fd)
    assert first.try_acquire()
    assert main(["study", str(study), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use by another study process (pid" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == [STUDY_LOCK]  # no run was started


def test_ctrl_c_is_one_line_and_leaves_true_statuses(tmp_path):
    """Issue 44 #7: Ctrl-C in a study printed a KeyboardInterrupt traceback and left its runs
    marked running. Now: one line, exit 130, the interrupted runs say so (and resume)."""
    study = _study_file(tmp_path, tmp_path / "cache")
    out = tmp_path / "out"
    # As from a terminal: a test suite started in the background (`make test &`) has SIGINT
    # ignored, which its children would inherit, and the study would never see the Ctrl-C.
    proc = subprocess.Popen(
        _cmd(study, out, "--jobs", "1"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(out.glob("*/seed*/study_status.json")):
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted: megatron-rl-fp8 study stopped")
    states = [json.loads(p.read_text())["state"] for p in out.glob("*/seed*/study_status.json")]
    assert states and "running" not in states, states


def test_damaged_runs_are_said_not_relaunched(finished, tmp_path, capsys):
    """Issue 44 #6: a garbled ``checkpoints/latest`` in a finished run relaunched it on every
    invocation; a ``study_config.yaml`` that is a directory was a traceback (and a ``.tmp``)."""
    import shutil

    from megatron_rl_fp8.cli import main

    tmp, study, _ = finished
    copy = tmp_path / "copy"
    shutil.copytree(tmp / "out", copy, symlinks=True)
    (copy / "bf16" / "seed1" / "checkpoints" / "latest").write_bytes(b"\xff\x00garbled")
    capsys.readouterr()
    assert main(["study", str(study), "--out", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "study: 4 of 4 runs already finished; skipping them" in out, out
    frozen = copy / "fp8_rollout" / "seed2" / "study_config.yaml"
    frozen.unlink()
    frozen.mkdir()
    assert main(["study", str(study), "--out", str(copy)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "fp8_rollout seed 2:" in line and "study_config.yaml is not a file; remove it" in line
    assert not list(copy.rglob("*.tmp"))
