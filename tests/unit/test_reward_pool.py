"""The reward pool: same rewards as in-process, hangs and errors scored 0 and counted, no leaks.

Workers are spawned processes, so the verifiers and functions they run come from an importable
module (``tests/reward_plugins.py``). Timeouts here are ~1 s; each test starts at most a few
workers (a start costs about a second: the package's reward code, no torch).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from megatron_rl_fp8.reward import (
    VERIFIERS,
    RewardConfig,
    Rewarder,
    compute_rewards,
    load_reward_function,
    register_verifier,
)
from tests.reward_plugins import misbehaving_verifier

GSM8K_BATCH = (
    ["#### 72", "The answer is 72.", "71", "", "It costs $1,000.", "#### -3"],
    ["72", "72", "72", "72", "1000", "-3"],
)


def _worker_children() -> list:
    """Live spawned multiprocessing workers of this process (not its resource tracker)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != "zombie":
                out.append(child)
        except psutil.NoSuchProcess:
            pass  # exited between listing and inspection: not a leak
    return out


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def misbehaving_task(monkeypatch):
    monkeypatch.setattr("megatron_rl_fp8.reward.verifiers.VERIFIERS", dict(VERIFIERS))
    register_verifier("misbehaving", misbehaving_verifier)
    return "misbehaving"


def test_pool_scores_equal_in_process_scores():
    cfg = RewardConfig(num_workers=2, format_weight=0.5)
    with Rewarder("gsm8k", cfg) as rewarder:
        rewards, stats = rewarder.score(*GSM8K_BATCH)
        assert len(rewarder.worker_pids()) == 2
    expected = compute_rewards("gsm8k", *GSM8K_BATCH, format_weight=0.5)
    assert rewards.dtype == torch.float32 and torch.equal(rewards, expected)
    assert rewards.tolist() == [1.5, 1.0, 0.0, 0.0, 1.0, 1.5]
    assert stats["reward/timeouts"] == 0 and stats["reward/errors"] == 0
    assert stats["perf/reward_time_s"] >= 0
    in_process, _ = Rewarder("gsm8k", RewardConfig(num_workers=0, format_weight=0.5)).score(
        *GSM8K_BATCH
    )
    assert torch.equal(in_process, expected)
    assert set(stats) == {"reward/timeouts", "reward/errors", "perf/reward_time_s"}
    assert _worker_children() == []


def test_pool_runs_the_math_verifier():
    responses = [r"so \boxed{\dfrac{3}{4}}", r"\boxed{0.75} cm", "3/4", r"\boxed{1}"]
    with Rewarder("math", RewardConfig(num_workers=2)) as rewarder:
        rewards, stats = rewarder.score(responses, [r"\frac34"] * 4)
    assert (
        rewards.tolist()
        == [1.0, 1.0, 0.0, 0.0]
        == compute_rewards("math", responses, [r"\frac34"] * 4).tolist()
    )
    assert stats["reward/timeouts"] == 0 and stats["reward/errors"] == 0


def test_hang_and_error_score_zero_are_counted_and_the_pool_recovers(misbehaving_task):
    rewarder = Rewarder(misbehaving_task, RewardConfig(num_workers=2, timeout_s=1.0))
    try:
        first_pids = set(rewarder.worker_pids())
        batch = ["4", "hang", "boom", "4", "5", "die"]
        t0 = time.monotonic()
        rewards, stats = rewarder.score(batch, ["4"] * 6)
        assert time.monotonic() - t0 < 30  # the hang cost about timeout_s, not forever
        assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
        assert stats["reward/timeouts"] == 1.0
        assert stats["reward/errors"] == 2.0  # "boom" raised, "die" killed its worker
        assert rewarder.last_error.startswith("RuntimeError: boom")
        # The hung and the dead workers were replaced; the next batch runs normally.
        assert set(rewarder.worker_pids()) != first_pids
        for pid in first_pids - set(rewarder.worker_pids()):
            assert _gone(pid)
        rewards, stats = rewarder.score(["4", "3"], ["4", "4"])
        assert rewards.tolist() == [1.0, 0.0]
        assert stats["reward/timeouts"] == 0 and stats["reward/errors"] == 0
        assert rewarder.last_error is None
        pids = rewarder.worker_pids()
    finally:
        rewarder.close()
    assert all(_gone(pid) for pid in pids)
    assert _worker_children() == []
    with pytest.raises(RuntimeError, match="after close"):
        rewarder.score(["4"], ["4"])


def test_signals_meant_for_the_trainer_do_not_kill_its_workers(misbehaving_task):
    """torchrun forwards SIGUSR1 (preemption) to the rank's process group and slurmstepd to every
    process of the step, so the workers get it too, idle or mid-sample; so does Ctrl-C's SIGINT.
    They ignore both: the step being finished before the checkpoint still gets its rewards."""
    with Rewarder(misbehaving_task, RewardConfig(num_workers=2, timeout_s=30)) as rewarder:
        pids = rewarder.worker_pids()
        for pid in pids:  # idle
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGINT)
        timer = threading.Timer(
            0.3,
            lambda: [os.kill(pid, signal.SIGUSR1) for pid in pids],  # busy
        )
        timer.start()
        rewards, stats = rewarder.score(["slow 4", "slow 5"], ["4", "4"])
        timer.join()
        assert rewards.tolist() == [1.0, 0.0]
        assert stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0
        assert rewarder.worker_pids() == pids  # none died, none replaced
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the parent's mask restored


def test_in_process_errors_are_counted_not_raised(misbehaving_task):
    rewarder = Rewarder(misbehaving_task, RewardConfig(num_workers=0))
    rewards, stats = rewarder.score(["4", "boom"], ["4", "4"])
    assert rewards.tolist() == [1.0, 0.0]
    assert stats["reward/errors"] == 1.0 and stats["reward/timeouts"] == 0.0
    assert "boom" in rewarder.last_error
    assert rewarder.score([], [])[0].shape == (0,)


def test_user_batch_function_in_chunks_with_records():
    cfg = RewardConfig(function="tests.reward_plugins:len_reward", num_workers=2)
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    records = [{"bonus": 0.5 * i} for i in range(5)]
    with Rewarder("any-task-name", cfg) as rewarder:
        rewards, stats = rewarder.score(completions, ["x"] * 5, records)
        assert rewards.tolist() == [1.0, 2.5, 4.0, 5.5, 7.0]
        assert stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0
        rewards, _ = rewarder.score(["abc"], ["x"])  # fewer samples than workers; no records
        assert rewards.tolist() == [3.0]
    in_process = Rewarder("any-task-name", RewardConfig(function=cfg.function, num_workers=0))
    assert in_process.score(completions, ["x"] * 5, records)[0].tolist() == [
        1.0,
        2.5,
        4.0,
        5.5,
        7.0,
    ]


def test_user_function_chunk_timeout_and_bad_output():
    cfg = RewardConfig(
        function="tests.reward_plugins:hanging_batch_reward", num_workers=2, timeout_s=0.5
    )
    with Rewarder("t", cfg) as rewarder:
        # Two chunks of two: the chunk holding "hang" times out after 0.5 s * 2 samples.
        rewards, stats = rewarder.score(["a", "hang", "ccc", "dd"], ["x"] * 4)
        assert rewards.tolist() == [0.0, 0.0, 3.0, 2.0]
        assert stats["reward/timeouts"] == 2.0 and stats["reward/errors"] == 0.0
        assert rewarder.score(["ab"], ["x"])[0].tolist() == [2.0]
    wrong = Rewarder(
        "t", RewardConfig(function="tests.reward_plugins:wrong_length_reward", num_workers=0)
    )
    rewards, stats = wrong.score(["a", "b"], ["x", "x"])
    assert rewards.tolist() == [0.0, 0.0] and stats["reward/errors"] == 2.0
    assert "returned 1 values for 2 completions" in wrong.last_error


@pytest.mark.parametrize(
    "value, message",
    [
        ("tests.reward_plugins.len_reward", "is not of the form 'package.module:function'"),
        ("tests.reward_plugins:", "is not of the form"),
        ("no_such_pkg_xyz.mod:fn", "cannot be loaded: importing 'no_such_pkg_xyz.mod' failed"),
        ("tests.reward_plugins:nope", "has no attribute 'nope'"),
        ("tests.reward_plugins:NOT_A_FUNCTION", "is a int, not a function"),
        ("tests.reward_plugins:two_argument_reward", "cannot be called with 3 arguments"),
    ],
)
def test_bad_reward_function_is_a_one_line_config_error(value, message):
    with pytest.raises(ValueError) as info:
        RewardConfig(function=value)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"reward.function={value!r} ")
    assert message in text


def test_reward_config_pool_fields():
    cfg = RewardConfig()
    assert (cfg.function, cfg.num_workers, cfg.timeout_s) == (None, 4, 10.0)
    assert load_reward_function("tests.reward_plugins:len_reward")(["ab"], ["x"], [{}]) == [2.0]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="reward.num_workers"):
            RewardConfig(num_workers=bad)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="reward.timeout_s"):
            RewardConfig(timeout_s=bad)


def test_a_verifier_workers_cannot_import_is_refused_early(monkeypatch):
    monkeypatch.setattr("megatron_rl_fp8.reward.verifiers.VERIFIERS", dict(VERIFIERS))
    register_verifier("lambda-task", lambda response, answer: 1.0)
    with pytest.raises(ValueError, match="top level of an importable module"):
        Rewarder("lambda-task", RewardConfig(num_workers=1))
    assert Rewarder("lambda-task", RewardConfig(num_workers=0)).score(["a"], ["b"])[0].tolist() == [
        1.0
    ]


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    """kill -9 of the driver while a worker is stuck in a verifier: the worker exits by itself."""
    script = textwrap.dedent(
        """
        import sys
        from megatron_rl_fp8.reward import RewardConfig, Rewarder, register_verifier
        from tests.reward_plugins import misbehaving_verifier

        register_verifier("misbehaving", misbehaving_verifier)
        rewarder = Rewarder("misbehaving", RewardConfig(num_workers=1, timeout_s=600))
        print(*rewarder.worker_pids(), flush=True)
        rewarder.score(["hang"], ["4"])
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        worker_pid = int(proc.stdout.readline())
        time.sleep(0.5)  # let the parent hand the hanging sample to the worker
        assert not _gone(worker_pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker_pid)
