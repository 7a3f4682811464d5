"""Rule-based verifiers (arithmetic, gsm8k, math) and in-process batch reward computation.

The ``math`` verifier's cases are checked twice: against a hand-stated expectation, and against
Math-Verify called directly on the same gold and boxed content, so a disagreement shows whether
our extraction or our expectation is wrong.
"""

import pytest
import torch
from math_verify import parse, verify

from megatron_rl_fp8.data import TaskConfig
from megatron_rl_fp8.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from megatron_rl_fp8.reward import (
    VERIFIERS,
    RewardConfig,
    arithmetic_exact,
    arithmetic_format,
    compute_rewards,
    extract_gsm8k_answer,
    get_verifier,
    gsm8k_exact,
    gsm8k_format,
    last_boxed_content,
    math_boxed,
    math_format,
    register_verifier,
)
from megatron_rl_fp8.reward.text import END_MARKERS, answer_region


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
    with pytest.raises(ValueError, match=r"no verifier for task 'nope'; known tasks: \["):
        compute_rewards("nope", ["1"], ["1"])


def test_registry_covers_the_shipped_tasks():
    for name in ("arithmetic", "gsm8k", "math"):
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


def test_end_markers_are_the_tokenizers():
    # reward/text.py spells them out to keep torch out of reward workers; they must not drift.
    assert END_MARKERS == (EOS_TOKEN, PAD_TOKEN)


def test_registry_has_the_math_tasks():
    assert get_verifier("gsm8k") is gsm8k_exact
    assert get_verifier("math") is math_boxed


# ---------------------------------------------------------------------------------------------
# gsm8k
# ---------------------------------------------------------------------------------------------

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("The answer is 72.", "72", 1.0),  # last number; the trailing "." is not a decimal
        ("She sold 24 in May, so 48 + 24 = 72 in total.", "72", 1.0),
        ("48 + 24 = 72\n#### 72", "72", 1.0),  # the GSM8K convention
        ("#### 72\nI think it could also be 73", "72", 1.0),  # after "####" wins over the last
        ("72", GSM8K_SOLUTION, 1.0),  # the reference may be a whole GSM8K solution
        ("#### 72", GSM8K_SOLUTION, 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("It costs $1,000 in total.", "1000", 1.0),  # thousands commas and "$"
        ("#### 1000", "1,000", 1.0),
        ("1,234,567", "1234567", 1.0),
        ("She pays $3.50.", "3.5", 1.0),  # 3.50 == 3.5 (exact decimals)
        ("42.0", "42", 1.0),
        ("42.5", "42", 0.0),
        ("5 dollars", "5", 1.0),  # units after the number
        ("It is 5 dollars, not 6", "5", 0.0),  # the last number counts
        ("-3", "-3", 1.0),  # negative numbers
        ("The temperature fell to -3 degrees.", "-3", 1.0),
        ("#### -$5.50", "-5.5", 1.0),
        ("3", "-3", 0.0),
        ("pages 3-5", "5", 1.0),  # a hyphen between numbers is not a minus sign
        ("The answer is 12 ####", "12", 1.0),  # nothing after "####": fall back to the last number
        ("42<eos>43", "42", 1.0),  # text after <eos> is ignored
        ("41", "42", 0.0),
        ("", "42", 0.0),
        ("no numbers here", "42", 0.0),
        ("9" * 5000, "42", 0.0),  # runaway digits
        (None, "42", 0.0),
        ("42", 42, 1.0),  # numeric references
        ("3.5", 3.5, 1.0),
    ],
)
def test_gsm8k_exact(response, answer, expected):
    assert gsm8k_exact(response, answer) == expected


@pytest.mark.parametrize("answer", ["", "no number", "####", None, True])
def test_gsm8k_bad_reference_raises(answer):
    with pytest.raises(ValueError, match="reference answer"):
        gsm8k_exact("4", answer)


def test_extract_gsm8k_answer():
    assert str(extract_gsm8k_answer("so #### 1,000.50 total")) == "1000.50"
    assert extract_gsm8k_answer("1,2,3") == 3  # not a thousands group: three numbers
    assert extract_gsm8k_answer("\u22127") == -7  # U+2212 minus sign
    assert extract_gsm8k_answer("none") is None


def test_gsm8k_format():
    assert gsm8k_format("work...\n#### 72<eos>") == 1.0
    assert gsm8k_format("the answer is 72") == 0.0
    assert gsm8k_format("#### none") == 0.0
    assert gsm8k_format(None) == 0.0


# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------

MATH_SOLUTION = r"So the probability is $\boxed{\dfrac{3}{4}}$."


@pytest.mark.parametrize(
    "text, content",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"so $\boxed{12}$. Done", "12"),
        (r"\boxed{1} or \fbox{2}", "2"),  # the last box, either command
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
        (r"$\boxed 5$", "5"),  # MATH's brace-less form
        (r"\boxed {7} z", "7"),
        (r"\boxed{3} and \boxed{4", None),  # the last box is unclosed (truncated): no answer
        (r"\boxedx{3}", None),  # another command
        ("no box", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content


MATH_CASES = [
    # (response, reference, expected)
    (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),  # \dfrac and brace-less \frac
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),  # equivalent forms
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{0.333}", r"\frac13", 0.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),  # units
    (r"\boxed{5 \text{ cm}}", r"5\text{ cm}", 1.0),
    (r"\boxed{\$5}", "5", 1.0),
    (r"so \boxed{12} is it. Let me double-check: 3 * 4 = 12, yes.", "12", 1.0),  # trailing text
    ("The answer is 12.", "12", 0.0),  # no box: no answer
    ("", "12", 0.0),
    (r"\boxed{}", "12", 0.0),
    (r"\boxed{3} no wait, \boxed{4}", "4", 1.0),  # two boxes: the last counts
    (r"\boxed{4} no wait, \boxed{3}", "4", 0.0),
    (r"\boxed{-7}", "-7", 1.0),  # negative numbers
    (r"\boxed{7}", "-7", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),  # symbolic equivalence
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{2,1\}", 1.0),  # sets
    (r"\boxed{[1,2)}", "[1,2)", 1.0),  # intervals
    (r"\boxed{(1,2)}", "[1,2)", 0.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\fbox{10}", "10", 1.0),
    (r"$\boxed 5$", "5", 1.0),
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # unclosed box (truncated response)
    (r"\boxed{12}<eos>\boxed{13}", "12", 1.0),  # text after <eos> is ignored
    (r"\boxed{\frac34}", MATH_SOLUTION, 1.0),  # the reference may be a whole solution
    (r"\boxed{}{}\frac{", "1", 0.0),  # garbage
    (r"\boxed{\frac{1}{0}}", "1", 0.0),
    (r"\boxed{42}", 42, 1.0),  # numeric reference
]


def _boxed(expression) -> str:
    return "\\boxed{" + str(expression) + "}"


@pytest.mark.parametrize("response, answer, expected", MATH_CASES)
def test_math_boxed(response, answer, expected):
    assert math_boxed(response, answer) == expected
    # The same decision as Math-Verify called directly on the gold and on what we extracted.
    gold = last_boxed_content(str(answer)) or str(answer)
    extracted = last_boxed_content(answer_region(response))
    direct = bool(extracted) and verify(parse(_boxed(gold)), parse(_boxed(extracted)))
    assert math_boxed(response, answer) == float(direct)
    # With exactly one closed \boxed and nothing after <eos>, Math-Verify's own extraction from
    # the whole response agrees too. It differs by design elsewhere: it joins several boxes into
    # a set, closes an unclosed box, ignores \fbox, and without a box takes any number in the text.
    one_box = response.count("\\boxed") == 1 and "fbox" not in response
    if one_box and extracted is not None and response == answer_region(response):
        assert float(verify(parse(_boxed(gold)), parse(response))) == expected


def test_math_boxed_never_raises_on_responses():
    for response in [None, 7, r"\boxed{" * 50, r"\boxed{\frac{\frac{}{}}{" + "}" * 20, "}{" * 100]:
        assert math_boxed(response, "1") == 0.0


@pytest.mark.parametrize("answer", ["", "}{", None, ["1"]])
def test_math_bad_reference_raises(answer):
    with pytest.raises(ValueError, match="reference answer"):
        math_boxed(r"\boxed{1}", answer)


def test_math_format():
    assert math_format(r"so \boxed{3}<eos>") == 1.0
    assert math_format(r"\boxed{}") == 0.0
    assert math_format("3") == 0.0
    assert math_format(None) == 0.0


def test_compute_rewards_math_tasks():
    rewards = compute_rewards("gsm8k", ["#### 72", "72.0", "71"], [GSM8K_SOLUTION] * 3)
    assert rewards.tolist() == [1.0, 1.0, 0.0]
    rewards = compute_rewards(
        "math", [r"\boxed{\dfrac34}", "3/4", r"\boxed{1}"], ["0.75"] * 3, format_weight=0.5
    )
    assert rewards.tolist() == [1.5, 0.0, 0.5]
