"""Verifiers for real math tasks: GSM8K (a final number) and MATH (a ``\\boxed{}`` expression).

Both follow the contract of :mod:`megatron_rl_fp8.reward.verifiers`: ``verifier(response_text,
answer) -> 1.0 or 0.0``, read only the text before the first ``<eos>``/``<pad>``, and never raise
on a bad *response* (garbage scores 0). They are top-level functions, so the reward pool can
pickle them by reference into its worker processes.

How each task reads an answer, and why:

- **gsm8k**: GSM8K solutions end in ``#### 42``, so a response that follows that convention is
  read there; otherwise the *last* number in the response counts (models often end with "so the
  answer is 42 dollars."). Numbers are compared exactly as decimals after dropping thousands
  commas and a ``$`` sign, so ``1,000`` == ``1000`` and ``3.50`` == ``3.5``, while floats never
  enter the comparison (``0.1 + 0.2`` style rounding cannot create or hide a match).
- **math**: MATH answers are LaTeX expressions (``\\frac{3}{4}``, ``2\\sqrt{3}``, ``(1, 2]``), which
  string matching gets wrong in both directions. The answer is the content of the *last*
  ``\\boxed{...}`` (or ``\\fbox{...}``) in the response, read with balanced braces so nested
  ``\\frac{a}{b}`` survives, and compared symbolically with the reference by Math-Verify
  (``math_verify.parse`` / ``math_verify.verify``, the grader used by open-r1 and lighteval). Both
  sides are re-wrapped as ``\\boxed{...}`` before parsing so Math-Verify's LaTeX extraction sees the
  whole expression (units in ``\\text{}``, ``\\dfrac``, ``\\$`` are normalised away by it). A
  response with no closed box scores 0: an answer we had to guess from prose would reward a format
  the task does not ask for.
"""

from __future__ import annotations

import functools
import numbers
import re
import threading
from decimal import Decimal, InvalidOperation

from megatron_rl_fp8.reward.text import answer_region

# ---------------------------------------------------------------------------------------------
# gsm8k
# ---------------------------------------------------------------------------------------------

# A number as GSM8K writes one: optional sign, optional "$", digits with optional thousands
# commas ("12,345" but not "1,2,3", which is read as three numbers), optional decimal part. ASCII
# digits only. A trailing "." (end of sentence) is not a decimal point: it needs a digit after it.
_NUMBER = re.compile(
    r"(?:(?<![0-9A-Za-z])[-+])?\$?\s?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?"
)
_GSM8K_MARK = "####"
# A runaway response ("9999...") must not build a huge Decimal; no GSM8K answer is this long.
_MAX_NUMBER_CHARS = 40


def _to_decimal(number_text: str) -> Decimal | None:
    """``"-$1,000.50"`` -> ``Decimal("-1000.50")``; None if it is not a number we accept."""
    text = number_text.replace(",", "").replace("$", "").replace(" ", "")
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _numbers(text: str) -> list[str]:
    # "−" (U+2212) is how LaTeX-trained models often write a minus sign.
    return _NUMBER.findall(text.replace("\u2212", "-"))


def extract_gsm8k_answer(text: str) -> Decimal | None:
    """The number a GSM8K-style text gives as its answer, or None.

    The first number after the last ``####`` if there is one, else the last number in the text.
    """
    if not isinstance(text, str):
        return None
    head, mark, tail = text.rpartition(_GSM8K_MARK)
    if mark:
        after = _numbers(tail)
        if after:
            return _to_decimal(after[0])
    found = _numbers(text)
    return _to_decimal(found[-1]) if found else None


def _gsm8k_reference(answer: str | int | float) -> Decimal:
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):  # numpy too (Parquet)
        return Decimal(str(answer))
    value = extract_gsm8k_answer(answer) if isinstance(answer, str) else None
    if value is None:
        raise ValueError(
            f"reference answer {answer!r} has no number; GSM8K answers must be a number or a "
            "solution ending in '#### <number>' (fix the dataset's answer field)"
        )
    return value


def gsm8k_exact(response_text: str, answer: str | int | float) -> float:
    """1.0 if the response's final number equals the reference number, else 0.0.

    ``answer`` may be a plain number (``"42"``, ``42``, ``"1,000"``) or a whole GSM8K solution
    ending in ``#### 42``. A malformed *reference* raises (a data bug); any response does not.
    """
    expected = _gsm8k_reference(answer)
    if not isinstance(response_text, str):
        return 0.0
    got = extract_gsm8k_answer(answer_region(response_text))
    return 1.0 if got is not None and got == expected else 0.0


def gsm8k_format(response_text: str) -> float:
    """1.0 if the response ends its reasoning with ``#### <number>``, the GSM8K convention."""
    if not isinstance(response_text, str):
        return 0.0
    region = answer_region(response_text)
    _, mark, tail = region.rpartition(_GSM8K_MARK)
    return 1.0 if mark and _numbers(tail) else 0.0


# ---------------------------------------------------------------------------------------------
# math (MATH / competition math with boxed answers)
# ---------------------------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# Math-Verify bounds its own parse/compare steps with signal.alarm, which Python allows only on
# the main thread. Pool workers and a trainer's main thread get that inner bound; a verifier run
# from another thread runs without it and relies on the pool's per-sample timeout instead.
_MATH_VERIFY_TIMEOUT_S = 5


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, or None.

    Braces are matched with a depth counter (escaped ``\\{`` ``\\}`` do not count), so
    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The MATH dataset's brace-less form
    ``\\boxed 5`` gives ``5``. A last box that is never closed (a truncated response) gives None:
    only the last box counts, so an earlier, closed one is not used instead.
    """
    if not isinstance(text, str):
        return None
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start == -1:
        return None
    after = start + len(command)
    i = after
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # "\boxed 5" (the MATH dataset's brace-less form): up to the next whitespace or "$".
        # "\boxedfoo" is another command, not a box.
        match = re.match(r"[^\s${}]+", text[i:]) if i > after else None
        return match.group(0) if match else None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def _math_verify_timeout() -> int | None:
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_boxed(expression: str) -> list:
    """``math_verify.parse`` of ``\\boxed{expression}``: the parsed forms Math-Verify compares."""
    from math_verify import parse  # lazy: it pulls in sympy (~1 s); config loading reaches here

    return parse("\\boxed{" + expression + "}", parsing_timeout=_math_verify_timeout())


@functools.lru_cache(maxsize=4096)
def _parsed_reference(answer: str) -> tuple:
    # Each prompt's reference is scored once per sample of its group: parse it once per worker.
    text = answer.strip()
    boxed = last_boxed_content(text)
    if boxed is not None:
        text = boxed  # a whole MATH solution was given as the reference: use its boxed answer
    elif len(text) >= 2 and text[0] == text[-1] == "$":
        text = text[1:-1]
    parsed = parse_boxed(text)
    if not parsed:
        raise ValueError(
            f"reference answer {answer!r} could not be parsed by math_verify; MATH answers must "
            "be a LaTeX expression such as '\\frac{3}{4}' (fix the dataset's answer field)"
        )
    return tuple(parsed)


def math_boxed(response_text: str, answer: str | int | float) -> float:
    """1.0 if the last ``\\boxed{}`` in the response is equivalent to ``answer``, else 0.0.

    Equivalence is Math-Verify's: ``\\frac{1}{2}``, ``\\dfrac12``, ``0.5`` and ``1/2`` all match
    ``\\frac{1}{2}``; ``5\\text{ cm}`` matches ``5``. ``answer`` is the bare expression or a whole
    solution containing a box. A response without a closed box scores 0. A reference Math-Verify
    cannot parse raises (a data bug); any response does not.
    """
    from math_verify import verify  # lazy: sympy (~1 s), as parse above

    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):  # numpy too (Parquet)
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(f"reference answer {answer!r} must be a string (a LaTeX expression)")
    gold = _parsed_reference(answer)
    if not isinstance(response_text, str):
        return 0.0
    boxed = last_boxed_content(answer_region(response_text))
    if boxed is None or not boxed.strip():
        return 0.0
    try:
        predicted = parse_boxed(boxed)
        ok = verify(list(gold), predicted, timeout_seconds=_math_verify_timeout())
    except Exception:  # a response that breaks the parser is a wrong answer, not a crash
        return 0.0
    return 1.0 if ok else 0.0


def math_format(response_text: str) -> float:
    """1.0 if the response (before ``<eos>``) contains a closed, non-empty ``\\boxed{}``."""
    boxed = (
        last_boxed_content(answer_region(response_text)) if isinstance(response_text, str) else None
    )
    return 1.0 if boxed is not None and boxed.strip() else 0.0
