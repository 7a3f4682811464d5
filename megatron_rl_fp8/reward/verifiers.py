"""Rule-based verifiers: score a decoded response against a reference answer.

The registry is a plain typed dict from task name to function (no dotted-path strings), so a
config naming a task can be checked against ``VERIFIERS`` before any server or weight is touched,
and a new task is one :func:`register_verifier` call. Shipped tasks: ``arithmetic`` and ``chain``
(here), ``gsm8k`` and ``math`` (:mod:`megatron_rl_fp8.reward.math_tasks`).

Responses reach a verifier as decoded text; verifiers read it only up to the first ``<eos>`` or
``<pad>`` (:func:`megatron_rl_fp8.reward.text.answer_region`). Whether generation stopped on
``<eos>`` or ran out of budget is the rollout's finish reason, not something text can show.

The one escape hatch from the registry is ``reward.function: "package.module:function"``, a
user's *batch* reward function ``fn(completions, answers, records) -> list[float]`` that gets the
whole dataset record of each prompt (for rewards a reference string cannot express). It is
checked when the config is built: the module must import and the attribute must be a function
taking three arguments.

What one sample's reward is (:class:`ScoreJob`) is defined here; *where* it is computed (a pool of
worker processes with per-sample timeouts) is :mod:`megatron_rl_fp8.reward.pool`. This module
does not import torch at module level, because every pool worker imports it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl_fp8.config_utils import field
from megatron_rl_fp8.reward.math_tasks import gsm8k_exact, gsm8k_format, math_boxed, math_format
from megatron_rl_fp8.reward.text import answer_region
from megatron_rl_fp8.utils.imports import import_object

if TYPE_CHECKING:
    import torch

Verifier = Callable[[str, str], float]
"""``verifier(response_text, answer) -> reward`` (0.0 or 1.0 for exact-match tasks)."""
FormatCheck = Callable[[str], float]
"""``format_check(response_text) -> 1.0 if well formed else 0.0``."""
BatchRewardFn = Callable[[list, list, list], list]
"""``fn(completions: list[str], answers: list[str], records: list[dict]) -> list[float]``."""

# ASCII digits only: `\d` would accept e.g. Arabic-Indic digits, which int() then parses.
_INT = re.compile(r"[+-]?[0-9]+")
_DECIMAL_TAIL = re.compile(r"\.[0-9]")
# No shipped answer is longer than 4 characters; a cap keeps int() away from its 4300-digit limit
# (ValueError) on a runaway response.
_MAX_DIGITS = 32


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
    region = answer_region(response_text)
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
    return 1.0 if _INT.fullmatch(answer_region(response_text)) else 0.0


_CHAIN_STEP = r"[+-]?[0-9]{1,32}[+-][0-9]{1,32}=[+-]?[0-9]{1,32}"
_CHAIN = re.compile(rf"{_CHAIN_STEP}(,{_CHAIN_STEP})*")


def _chain_total(text: str) -> int | None:
    """The integer after the last ``=`` of a worked chain, if that is all that follows it."""
    _, mark, tail = text.rpartition("=")
    tail = tail.strip()
    if not mark or not _INT.fullmatch(tail) or len(tail.lstrip("+-")) > _MAX_DIGITS:
        return None
    return int(tail)


def chain_exact(response_text: str, answer: str | int) -> float:
    """1.0 if the response's final total (the integer after its last ``=``) equals the answer's.

    ``answer`` is the worked solution (``"12+35=47,47-7=40"``, :mod:`megatron_rl_fp8.data.chain`)
    or the bare final integer. A response cut off mid-step (``"...=40,40+"``) has no final total
    and scores 0, as does any response without ``=``. A malformed reference raises (a data bug).
    """
    if isinstance(answer, int) and not isinstance(answer, bool):
        expected = answer
    elif isinstance(answer, str) and _INT.fullmatch(answer.strip()):
        expected = int(answer.strip())
    elif isinstance(answer, str) and _CHAIN.fullmatch(answer.strip()):
        expected = _chain_total(answer)
    else:
        raise ValueError(
            f"reference answer {answer!r} is neither an integer nor a worked chain such as "
            "'12+35=47,47-7=40' (fix the prompt file)"
        )
    if not isinstance(response_text, str):
        return 0.0
    got = _chain_total(answer_region(response_text))
    return 1.0 if got is not None and got == expected else 0.0


def chain_format(response_text: str) -> float:
    """1.0 if the response is a worked chain: ``total op operand = total`` steps joined by ``,``."""
    if not isinstance(response_text, str):
        return 0.0
    return 1.0 if _CHAIN.fullmatch(answer_region(response_text)) else 0.0


VERIFIERS: dict[str, Verifier] = {
    "arithmetic": arithmetic_exact,
    "chain": chain_exact,
    # The tool-use task scores the policy's last turn: a bare product (data/calculator.py).
    "calculator": arithmetic_exact,
    "gsm8k": gsm8k_exact,
    "math": math_boxed,
}
"""Task name -> correctness verifier. Keys match ``TaskConfig.name``."""
FORMAT_CHECKS: dict[str, FormatCheck] = {
    "arithmetic": arithmetic_format,
    "chain": chain_format,
    "calculator": arithmetic_format,
    "gsm8k": gsm8k_format,
    "math": math_format,
}
"""Task name -> format check, used only when a format reward weight is configured."""
WORKER_PRELOADS: dict[str, tuple[str, ...]] = {"math": ("math_verify",)}
"""Task name -> modules its verifier imports lazily. Reward workers import them before taking
work, so a sample's timeout is not spent importing sympy (about a second)."""


def register_verifier(
    task_name: str,
    verifier: Verifier,
    format_check: FormatCheck | None = None,
    *,
    overwrite: bool = False,
    preload: Sequence[str] = (),
) -> None:
    """Add a task's verifier (and optional format check) to the registries.

    To run in the reward pool (``reward.num_workers > 0``) the functions must be picklable, i.e.
    defined at the top level of an importable module (no lambdas or nested functions).
    ``preload`` names slow-to-import modules the verifier needs (see ``WORKER_PRELOADS``).
    """
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
    if preload:
        WORKER_PRELOADS[task_name] = tuple(preload)


def get_verifier(task_name: str) -> Verifier:
    """The verifier registered for ``task_name``; the error lists the known tasks."""
    try:
        return VERIFIERS[task_name]
    except KeyError:
        raise ValueError(
            f"no verifier for task {task_name!r}; known tasks: {sorted(VERIFIERS)} "
            "(add one with megatron_rl_fp8.reward.register_verifier)"
        ) from None


def load_reward_function(spec: str) -> BatchRewardFn:
    """Import ``"package.module:function"`` and return the function.

    Every way this can fail raises one one-line ``ValueError`` that names ``reward.function``, the
    value and the fix, so a bad config stops before any rank starts.
    """
    obj = import_object(spec, "reward.function", what="function")

    def fail(problem: str, fix: str) -> ValueError:
        return ValueError(f"reward.function={spec!r} {problem}; {fix}".replace("\n", " "))

    if not callable(obj):
        raise fail(
            f"is a {type(obj).__name__}, not a function",
            "point it at a function fn(completions, answers, records) -> list[float]",
        )
    try:
        inspect.signature(obj).bind(None, None, None)
    except TypeError:
        raise fail(
            f"has signature {inspect.signature(obj)} and cannot be called with 3 arguments",
            "reward functions are called as fn(completions, answers, records) -> list[float]",
        ) from None
    except ValueError:  # some builtins have no inspectable signature; let the call decide
        pass
    return obj


# Workers call the user function once per chunk; import and check it once per process.
_cached_reward_function = functools.lru_cache(maxsize=None)(load_reward_function)


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are scored: the task's verifier or a user function, shaping, and the pool."""

    format_weight: float = field(
        default=0.0,
        help="Weight of the format bonus added to correctness (0 = off, the default). "
        "Reward = correct + format_weight * well_formed.",
    )
    function: str | None = field(
        default=None,
        help="'package.module:function', a batch reward function fn(completions, answers, "
        "records) -> list[float] used instead of the task's verifier (None = the verifier).",
    )
    num_workers: int = field(
        default=4,
        help="Reward worker processes; each sample is scored under reward.timeout_s there. "
        "0 = score in the driver process, with no timeout (tests, tiny CPU runs).",
    )
    timeout_s: float = field(
        default=10.0,
        help="Seconds one sample may take to score; past it the sample scores 0, is counted in "
        "reward/timeouts, and its worker is replaced. A user function gets this per sample.",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(
                f"RewardConfig.format_weight={self.format_weight!r} must be in [0, 1]; a larger "
                "bonus outweighs being correct. Use 0 to turn it off."
            )
        if self.function is not None:
            load_reward_function(self.function)
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            raise ValueError(f"reward.num_workers={self.num_workers!r} must be an integer >= 0")
        if self.num_workers < 0:
            raise ValueError(
                f"reward.num_workers={self.num_workers} must be >= 0; use 0 to score in-process"
            )
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            raise ValueError(
                f"reward.timeout_s={self.timeout_s!r} must be a positive number of seconds per "
                "sample (e.g. 10)"
            )


@dataclass(frozen=True)
class ScoreJob:
    """What a reward is, for one task: correctness plus an optional format bonus.

    ``reward_i = correct_i + format_weight * format_check(response_i)``, where ``correct_i`` is
    ``verifier(response_i, answer_i)`` or, with a user function, its i-th output. The job is
    picklable (functions by reference, the user function by its ``"module:function"`` string,
    imported where the job runs), so the reward pool ships it to its workers once.
    """

    verifier: Verifier | None = None
    function: str | None = None
    format_check: FormatCheck | None = None
    format_weight: float = 0.0
    preload: tuple[str, ...] = ()

    def prepare(self) -> None:
        """Do the slow imports now (a worker calls this before it reports ready)."""
        for name in self.preload:
            importlib.import_module(name)
        if self.function is not None:
            load_reward_function(self.function)

    def __call__(
        self, responses: Sequence[str], answers: Sequence, records: Sequence[dict]
    ) -> list[float]:
        """Rewards of one chunk; raises if the verifier/function does (the caller decides)."""
        if self.function is not None:
            fn = _cached_reward_function(self.function)
            out = fn(list(responses), list(answers), list(records))
            if out is None or len(out) != len(responses):
                got = "None" if out is None else f"{len(out)} values"
                raise ValueError(
                    f"reward.function={self.function!r} returned {got} for {len(responses)} "
                    "completions; return one float per completion"
                )
            scores = [float(s) for s in out]
        else:
            scores = [float(self.verifier(r, a)) for r, a in zip(responses, answers)]
        bad = [s for s in scores if not math.isfinite(s)]
        if bad:
            raise ValueError(f"reward is {bad[0]} (not finite); rewards must be finite floats")
        if self.format_weight:
            scores = [
                s + self.format_weight * self.format_check(r) for s, r in zip(scores, responses)
            ]
        return scores


def make_score_job(
    task_name: str, *, format_weight: float = 0.0, function: str | None = None
) -> ScoreJob:
    """The :class:`ScoreJob` of a task; unknown tasks and a missing format check raise here."""
    if format_weight and task_name not in FORMAT_CHECKS:
        raise ValueError(
            f"format_weight={format_weight} but task {task_name!r} has no format check; "
            "set format_weight=0 or register one"
        )
    return ScoreJob(
        verifier=None if function is not None else get_verifier(task_name),
        function=function,
        format_check=FORMAT_CHECKS.get(task_name) if format_weight else None,
        format_weight=format_weight,
        preload=WORKER_PRELOADS.get(task_name, ()) if function is None else (),
    )


def compute_rewards(
    task_name: str,
    responses: Sequence[str],
    answers: Sequence[str | int],
    *,
    format_weight: float = 0.0,
) -> torch.Tensor:
    """Score each response against its answer, in this process: float32 ``[len(responses)]``.

    ``reward_i = verifier(response_i, answer_i) + format_weight * format_check(response_i)``; the
    format term is skipped entirely when ``format_weight == 0``. Unlike
    :class:`~megatron_rl_fp8.reward.pool.Rewarder` there is no timeout, and an exception in a
    verifier propagates (a quick check or eval on trusted data wants to see it).
    """
    # lazy: the spawned scoring workers import this module and must start without torch
    import torch

    if len(responses) != len(answers):
        raise ValueError(
            f"compute_rewards got {len(responses)} responses but {len(answers)} answers; pass "
            "one answer per response (repeat each prompt's answer for its group)"
        )
    job = make_score_job(task_name, format_weight=format_weight)
    return torch.tensor(job(responses, answers, [{}] * len(responses)), dtype=torch.float32)
