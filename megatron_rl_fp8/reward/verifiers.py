"""Rule-based verifiers: score a decoded response against a reference answer.

The registry is a plain typed dict from task name to function (no dotted-path strings), so a
config naming a task can be checked against ``VERIFIERS`` before any server or weight is touched,
and a new task is one :func:`register_verifier` call.

Responses reach a verifier as decoded text. Whether the special tokens were kept in that text
depends on the rollout (``skip_special_tokens``), so verifiers cut the text at the first ``<eos>``
or ``<pad>`` themselves and never rely on either being present. Whether generation stopped on
``<eos>`` or ran out of budget is the rollout's finish reason, not something text can show.

Rewards are computed on the host from Python strings, then put in one float32 tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_rl_fp8.config_utils import field
from megatron_rl_fp8.data.tokenizer import EOS_TOKEN, PAD_TOKEN

Verifier = Callable[[str, str], float]
"""``verifier(response_text, answer) -> reward`` (0.0 or 1.0 for exact-match tasks)."""
FormatCheck = Callable[[str], float]
"""``format_check(response_text) -> 1.0 if well formed else 0.0``."""

_END_MARKERS = (EOS_TOKEN, PAD_TOKEN)
# ASCII digits only: `\d` would accept e.g. Arabic-Indic digits, which int() then parses.
_INT = re.compile(r"[+-]?[0-9]+")
_DECIMAL_TAIL = re.compile(r"\.[0-9]")
# No shipped answer is longer than 4 characters; a cap keeps int() away from its 4300-digit limit
# (ValueError) on a runaway response.
_MAX_DIGITS = 32


def _answer_region(response_text: str) -> str:
    """The response up to its first end marker, with surrounding whitespace removed."""
    end = len(response_text)
    for marker in _END_MARKERS:
        i = response_text.find(marker)
        if i != -1:
            end = min(end, i)
    return response_text[:end].strip()


def _parse_reference(answer: str | int) -> int:
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer
    if isinstance(answer, str) and _INT.fullmatch(answer.strip()):
        return int(answer.strip())
    raise ValueError(
        f"reference answer {answer!r} is not an integer; arithmetic answers must look like "
        "'47' or '-3' (fix the prompt file)"
    )


def arithmetic_exact(response_text: str, answer: str | int) -> float:
    """1.0 if the response's leading integer equals ``answer``, else 0.0.

    The response is read up to ``<eos>``/``<pad>``, stripped of whitespace, and its leading
    integer (optional sign, ASCII digits) is taken; reading stops at the first character that
    cannot continue an integer, so ``"47<eos>"``, ``" 47"`` and ``"47 is it"`` all score for 47.
    A decimal (``"47.5"``) is a different number and scores 0. Empty, garbage or non-string
    responses score 0. A malformed *reference* answer raises, as it is a data bug.
    """
    expected = _parse_reference(answer)
    if not isinstance(response_text, str):
        return 0.0
    region = _answer_region(response_text)
    match = _INT.match(region)
    if match is None:
        return 0.0
    if _DECIMAL_TAIL.match(region, match.end()):
        return 0.0
    digits = match.group(0).lstrip("+-")
    if len(digits) > _MAX_DIGITS:
        return 0.0
    return 1.0 if int(match.group(0)) == expected else 0.0


def arithmetic_format(response_text: str) -> float:
    """1.0 if the response (up to ``<eos>``/``<pad>``, whitespace stripped) is one bare integer."""
    if not isinstance(response_text, str):
        return 0.0
    return 1.0 if _INT.fullmatch(_answer_region(response_text)) else 0.0


VERIFIERS: dict[str, Verifier] = {"arithmetic": arithmetic_exact}
"""Task name -> correctness verifier. Keys match ``TaskConfig.name``."""
FORMAT_CHECKS: dict[str, FormatCheck] = {"arithmetic": arithmetic_format}
"""Task name -> format check, used only when a format reward weight is configured."""


def register_verifier(
    task_name: str,
    verifier: Verifier,
    format_check: FormatCheck | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Add a task's verifier (and optional format check) to the registries."""
    if not callable(verifier) or (format_check is not None and not callable(format_check)):
        raise TypeError(f"register_verifier({task_name!r}): verifier/format_check must be callable")
    if task_name in VERIFIERS and not overwrite:
        raise ValueError(
            f"a verifier for task {task_name!r} is already registered; pass overwrite=True to "
            "replace it"
        )
    VERIFIERS[task_name] = verifier
    if format_check is not None:
        FORMAT_CHECKS[task_name] = format_check


def get_verifier(task_name: str) -> Verifier:
    """The verifier registered for ``task_name``; the error lists the known tasks."""
    try:
        return VERIFIERS[task_name]
    except KeyError:
        raise ValueError(
            f"no verifier for task {task_name!r}; known tasks: {sorted(VERIFIERS)} "
            "(add one with megatron_rl_fp8.reward.register_verifier)"
        ) from None


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are scored beyond the task's correctness verifier."""

    format_weight: float = field(
        default=0.0,
        help="Weight of the format bonus added to correctness (0 = off, the default). "
        "Reward = correct + format_weight * well_formed.",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(
                f"RewardConfig.format_weight={self.format_weight!r} must be in [0, 1]; a larger "
                "bonus outweighs being correct. Use 0 to turn it off."
            )


def compute_rewards(
    task_name: str,
    responses: Sequence[str],
    answers: Sequence[str | int],
    *,
    format_weight: float = 0.0,
) -> torch.Tensor:
    """Score each response against its answer: float32 tensor of shape ``[len(responses)]``.

    ``reward_i = verifier(response_i, answer_i) + format_weight * format_check(response_i)``; the
    format term is skipped entirely when ``format_weight == 0``.
    """
    if len(responses) != len(answers):
        raise ValueError(
            f"compute_rewards got {len(responses)} responses but {len(answers)} answers; pass "
            "one answer per response (repeat each prompt's answer for its group)"
        )
    verifier = get_verifier(task_name)
    rewards = [verifier(r, a) for r, a in zip(responses, answers)]
    if format_weight:
        if task_name not in FORMAT_CHECKS:
            raise ValueError(
                f"format_weight={format_weight} but task {task_name!r} has no format check; "
                "set format_weight=0 or register one"
            )
        check = FORMAT_CHECKS[task_name]
        rewards = [r + format_weight * check(resp) for r, resp in zip(rewards, responses)]
    return torch.tensor(rewards, dtype=torch.float32)
