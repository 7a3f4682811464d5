"""Verifiers and reward functions for the reward-pool tests.

They live in an importable module (not in a test file's body) because the pool's workers are
spawned processes: they receive a verifier by reference (module + name) and import it afresh.
"""

import os
import time

from megatron_rl_fp8.reward import arithmetic_exact


def misbehaving_verifier(response: str, answer: str) -> float:
    """``arithmetic_exact``, except: "hang" never returns, "boom" raises, "die" kills the worker,
    "slow 4" takes a second to score as "4"."""
    if response.startswith("slow "):
        time.sleep(1.0)
        response = response[len("slow ") :]
    if response == "hang":
        while True:
            time.sleep(60)
    if response == "boom":
        raise RuntimeError("boom: verifier failed on purpose")
    if response == "die":
        os._exit(3)
    return arithmetic_exact(response, answer)


def len_reward(completions: list, answers: list, records: list) -> list:
    """A batch reward function: the completion's length, plus the record's ``bonus`` if any."""
    return [float(len(c)) + r.get("bonus", 0.0) for c, r in zip(completions, records)]


def hanging_batch_reward(completions: list, answers: list, records: list) -> list:
    """``len_reward``, but hangs on any chunk that contains "hang"."""
    if "hang" in completions:
        while True:
            time.sleep(60)
    return len_reward(completions, answers, records)


def wrong_length_reward(completions: list, answers: list, records: list) -> list:
    return [1.0]


def two_argument_reward(completions: list, answers: list) -> list:
    return [0.0] * len(completions)


NOT_A_FUNCTION = 42
