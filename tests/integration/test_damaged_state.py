"""Nothing a user shares, damages or fills up wedges a run (docs/stability.md, "Damaged files"):
the tiny job through the CLI, with real concurrent processes, a real full file system (a 16 MiB
tmpfs in a private mount namespace, where the machine allows one) and files damaged by hand.

Each case asserts what holds on any machine: exit codes, the one line that names the damage,
which checkpoint a run resumes from, what is left on disk. The SFT is short (20 steps, cached).
"""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl_fp8.metrics.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "sft.steps=20",
    "train.prompts_per_step=8",
    "train.eval_prompts=8",
    "train.eval_interval=0",
]


def _cmd(out: Path, cache: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_rl_fp8", "train", "examples/tiny_cpu.yaml", *TINY]
    return cmd + [f"train.output_dir={out}", f"train.cache_dir={cache}", *overrides]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


def _train(out: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return _run(_cmd(out, cache, *overrides))


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr lines that are the CLI's own (not library warnings)."""
    kinds = ("config error:", "data error:", "storage error:", "error:", "guard:", "Traceback")
    return [x for x in proc.stderr.splitlines() if x.startswith(kinds)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sft_cache")


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, cache):
    """Three steps with a checkpoint after each: copied by the tests that damage a file."""
    out = tmp_path_factory.mktemp("healthy") / "run"
    proc = _train(out, cache, "train.steps=3", "train.save_interval=1", "train.keep_checkpoints=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# -- 1, 2: the shared warm-start cache ------------------------------------------------------------
# The damaged entry's rebuild is make test's by test_a_damaged_cache_entry_is_rebuilt; the two
# runs racing to rebuild it are the slow tier's (like every variant below marked slow, ~20 s each).
@pytest.mark.parametrize(
    "start", ["fresh cache", pytest.param("damaged entry", marks=pytest.mark.slow)]
)
def test_concurrent_warm_starts_build_the_cache_entry_once(tmp_path, cache, healthy_run, start):
    """Two runs want the same entry at once, and neither finds a usable one: one builds it (or
    rebuilds the damaged one), the other waits and loads it."""
    if start == "fresh cache":
        cache = tmp_path / "cache"
    else:
        cache = shutil.copytree(cache, tmp_path / "cache")
        (entry,) = [p for p in cache.iterdir() if p.is_dir()]
        shard = sorted(entry.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:1000])
    procs = [
        subprocess.Popen(
            _cmd(tmp_path / name, cache, "train.steps=1"),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
    logs = [stdout for stdout, _ in outs]
    # One run built it; the other waited and loaded it (whichever came second).
    assert sum("warm start: SFT step 20/20" in log for log in logs) == 1, logs
    assert sum("warm start: loaded cached SFT policy" in log for log in logs) == 1, logs
    assert sum("is damaged" in log for log in logs) == (start == "damaged entry"), logs
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not list(cache.glob("*.tmp")) and (entry / "manifest.json").is_file()
    # Both started RL from the same policy.
    first = [
        {k: v for k, v in read_metrics(tmp_path / n)[0].items() if k.startswith("eval/")}
        for n in ("a", "b")
    ]
    assert first[0] == first[1]


@pytest.mark.parametrize(
    "damage",
    [
        "truncated shard",
        pytest.param("empty trainer state", marks=pytest.mark.slow),
        pytest.param("same-size shard", marks=pytest.mark.slow),
    ],
)
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, cache, healthy_run, damage):
    own = tmp_path / "cache"
    shutil.copytree(cache, own)
    (entry,) = [p for p in own.iterdir() if p.is_dir()]
    shard = sorted(entry.glob("*.distcp"))[0]
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "empty trainer state":
        (entry / "trainer_state.json").write_text("")
    else:  # bytes changed in place: only the checksums can tell
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    proc = _train(tmp_path / "run", own, "train.steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if "is damaged" in x]
    assert (
        line.startswith(f"warm start: cached entry {entry} is damaged (") and "rebuilding" in line
    )
    assert "warm start: SFT step 20/20" in proc.stdout
    # Rebuilt whole: the next run loads it.
    again = _train(tmp_path / "run2", own, "train.steps=1")
    assert again.returncode == 0 and "loaded cached SFT policy" in again.stdout, again.stderr[
        -2000:
    ]


# -- 3: a full disk during a checkpoint save ---------------------------------------------------
def _private_tmpfs_prefix() -> list[str] | None:
    """``unshare`` arguments that give a command a private mount namespace in which it may mount
    a tmpfs (root, or an unprivileged user namespace), or None where this machine allows neither."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-m"], ["unshare", "-Urm"]):
        probe = subprocess.run(
            [
                *prefix,
                "sh",
                "-c",
                "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                "mount -t tmpfs -o size=1m tmpfs /tmp",
            ],
            capture_output=True,
        )
        if probe.returncode == 0:
            return prefix
    return None


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_write(tmp_path, cache):
    prefix = _private_tmpfs_prefix()
    if prefix is None:
        pytest.skip("this machine allows no private tmpfs mount (unshare -m / -Urm)")
    small = tmp_path / "small"
    small.mkdir()
    out = small / "run"
    listing = tmp_path / "listing.txt"
    # The tmpfs exists only inside the namespace: the listing of what the failed save left is
    # taken there. 16 MiB holds two of the tiny job's checkpoints, not three.
    cmd = " ".join(
        _cmd(out, cache, "train.steps=6", "train.save_interval=1", "train.keep_checkpoints=5")
    )
    script = (
        f"mount -t tmpfs -o size=16m tmpfs {small} && {{ {cmd}; rc=$?; "
        f"ls -a {out}/checkpoints > {listing}; cat {out}/checkpoints/latest >> {listing}; "
        "exit $rc; }"
    )
    proc = _run([*prefix, "sh", "-c", script])
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith(f"storage error: cannot write checkpoint {out}/checkpoints/iter_"), line
    assert "no space left on the device" in line and "is still the latest checkpoint" in line
    left = listing.read_text().split()
    assert not [n for n in left if n.endswith(".tmp")], left  # the partial write was removed
    saved = sorted(n for n in left if n.startswith("iter_") and not n.endswith(".tmp"))
    assert saved and left[-1] == saved[-1]  # latest names the newest complete checkpoint
    assert not (out / "crash-rank0.log").exists()


# -- 5, 7: damaged run files, a refused resume --------------------------------------------------
@pytest.mark.parametrize(
    "damage",
    [
        "config.yaml a list",
        pytest.param("config.yaml binary", marks=pytest.mark.slow),
        pytest.param(".lock binary", marks=pytest.mark.slow),
        ".lock a directory",
    ],
)
def test_a_damaged_run_file_does_not_block_the_resume(tmp_path, cache, healthy_run, damage):
    out = _copy(healthy_run, tmp_path)
    junk = bytes(random.Random(0).randrange(256) for _ in range(512))
    if damage == "config.yaml a list":
        (out / "config.yaml").write_text("- 1\n- 2\n")
    elif damage == "config.yaml binary":
        (out / "config.yaml").write_bytes(junk)
    elif damage == ".lock binary":
        (out / ".lock").write_bytes(junk)
    else:
        (out / ".lock").unlink(missing_ok=True)
        (out / ".lock").mkdir()
    proc = _train(out, cache, "train.steps=4", "train.save_interval=1")
    if damage == ".lock a directory":  # not ours to delete: one line saying what to remove
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = _error_lines(proc)
        assert line.startswith("config error: train.output_dir: ") and "is a directory" in line
        assert "remove it" in line
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    if damage.startswith("config.yaml"):
        assert "the saved config.yaml is" in proc.stdout
        assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 4


def test_a_trainer_state_without_its_step_falls_back_to_the_checkpoint_before(
    tmp_path, cache, healthy_run
):
    out = _copy(healthy_run, tmp_path)
    state = out / "checkpoints" / "iter_0000003" / "trainer_state.json"
    state.write_text('{"train_data": {}}')
    proc = _train(out, cache, "train.steps=4", "train.save_interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if "iter_0000003 is damaged" in x]
    assert "'step' is missing" in line and "trying iter_0000002" in line
    assert "iter_0000002 at step 2" in proc.stdout


def test_a_refused_resume_keeps_the_config_of_the_checkpoints(tmp_path, cache, healthy_run):
    out = _copy(healthy_run, tmp_path)
    before = (out / "config.yaml").read_bytes()
    # Another model than the checkpoints hold: every checkpoint fails to load.
    proc = _train(out, cache, "train.steps=4", "model.hidden_size=96")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _error_lines(proc)
    assert line.startswith("config error: checkpoint: ") and "none is usable" in line
    assert (out / "config.yaml").read_bytes() == before


# -- 6: the guard and a checkpoint damaged in place ---------------------------------------------
def test_a_checkpoint_damaged_in_place_is_not_resumed_or_rolled_back_into(
    tmp_path, cache, healthy_run
):
    out = _copy(healthy_run, tmp_path)
    # Same size, so train.checkpoint_verify=sizes passes it: NaN bit patterns in the middle of a
    # shard, where the tensors' bytes are.
    shard = out / "checkpoints" / "iter_0000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = b"\xff" * 4096
    shard.write_bytes(bytes(data))
    proc = _train(out, cache, "train.steps=5", "train.save_interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if "iter_0000003 failed to load" in x]
    assert "trying an older one" in line
    assert "resumed from" in proc.stdout and "iter_0000002 at step 2" in proc.stdout
    assert "guard:" not in proc.stdout  # no rollback loop through the damaged checkpoint
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000005"


def test_a_garbled_latest_is_repointed_at_the_checkpoint_resumed_from(tmp_path, cache, healthy_run):
    # Issue 44 #6: a finished run whose `latest` is garbled resumed from its newest intact
    # checkpoint and left `latest` garbled, so whatever reads it (a study) saw an unfinished run.
    out = _copy(healthy_run, tmp_path)
    (out / "checkpoints" / "latest").write_bytes(b"\xff\xfe not a name")
    proc = _train(out, cache, "train.steps=3", "train.save_interval=1", "train.keep_checkpoints=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: latest now names iter_0000003" in proc.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
