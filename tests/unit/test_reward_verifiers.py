"""Rule-based verifiers and batch reward computation."""

import pytest
import torch

from megatron_rl_fp8.data import TaskConfig
from megatron_rl_fp8.reward import (
    VERIFIERS,
    RewardConfig,
    arithmetic_exact,
    arithmetic_format,
    compute_rewards,
    get_verifier,
    register_verifier,
)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("47", "47", 1.0),
        ("47<eos>", "47", 1.0),
        ("47<eos><pad><pad>", "47", 1.0),
        ("  47 \n", "47", 1.0),  # leading/trailing whitespace
        ("47 is the answer", "47", 1.0),  # stops at the first non-integer character
        ("47=47", "47", 1.0),
        ("+47", "47", 1.0),
        ("047", "47", 1.0),
        ("-8", "-8", 1.0),  # negative answers
        (" -542<eos>", "-542", 1.0),
        ("8", "-8", 0.0),
        ("-8", "8", 0.0),
        ("48", "47", 0.0),  # wrong
        ("4", "47", 0.0),
        ("471", "47", 0.0),  # a longer number is a different number
        ("47.5", "47", 0.0),  # a decimal is a different number
        ("47.", "47", 1.0),  # trailing punctuation is not a decimal
        ("", "47", 0.0),  # empty
        ("<eos>47", "47", 0.0),  # nothing before eos
        ("   ", "47", 0.0),
        ("abc", "47", 0.0),  # garbage
        ("x47", "47", 0.0),
        ("- 47", "-47", 0.0),
        ("--47", "-47", 0.0),
        ("٤٧", "47", 0.0),  # non-ASCII digits are not accepted
        ("9" * 5000, "47", 0.0),  # runaway digits do not hit int()'s limit
        ("<unk><bos>+*", "0", 0.0),
        (None, "47", 0.0),
        ("47", 47, 1.0),  # integer reference answers are fine too
    ],
)
def test_arithmetic_exact(response, answer, expected):
    assert arithmetic_exact(response, answer) == expected


@pytest.mark.parametrize("answer", ["", "abc", "4.5", None, True])
def test_bad_reference_answer_raises(answer):
    with pytest.raises(ValueError, match="reference answer"):
        arithmetic_exact("4", answer)


def test_arithmetic_format():
    assert arithmetic_format("47<eos>") == 1.0
    assert arithmetic_format(" -3 ") == 1.0
    assert arithmetic_format("47 is it") == 0.0
    assert arithmetic_format("") == 0.0
    assert arithmetic_format(None) == 0.0


def test_compute_rewards():
    responses = ["47<eos>", "46", "", "47 ok"]
    rewards = compute_rewards("arithmetic", responses, ["47"] * 4)
    assert rewards.dtype == torch.float32 and rewards.shape == (4,)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    shaped = compute_rewards("arithmetic", responses, ["47"] * 4, format_weight=0.25)
    assert shaped.tolist() == [1.25, 0.25, 0.0, 1.0]
    assert compute_rewards("arithmetic", [], []).shape == (0,)


def test_compute_rewards_errors():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        compute_rewards("arithmetic", ["1", "2"], ["1"])
    with pytest.raises(ValueError, match=r"no verifier for task 'gsm8k'; known tasks: \["):
        compute_rewards("gsm8k", ["1"], ["1"])


def test_registry_is_typed_and_covers_every_task_name():
    from typing import get_args

    from megatron_rl_fp8.data.task import TaskName

    for name in get_args(TaskName):
        assert callable(get_verifier(name))
    assert get_verifier(TaskConfig().name) is arithmetic_exact


def test_register_verifier(monkeypatch):
    monkeypatch.setattr("megatron_rl_fp8.reward.verifiers.VERIFIERS", dict(VERIFIERS))
    register_verifier("echo", lambda resp, ans: float(resp == ans))
    assert compute_rewards("echo", ["a", "b"], ["a", "a"]).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("echo", lambda resp, ans: 0.0)
    with pytest.raises(ValueError, match="has no format check"):
        compute_rewards("echo", ["a"], ["a"], format_weight=0.1)
    with pytest.raises(TypeError, match="must be callable"):
        register_verifier("bad", "pkg.module.fn")


def test_reward_config_validation():
    assert RewardConfig().format_weight == 0.0
    with pytest.raises(ValueError, match="RewardConfig.format_weight=2.0"):
        RewardConfig(format_weight=2.0)
