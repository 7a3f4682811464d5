"""Tool-call formats (``rollout/tools.py``): the calls read from a turn's text, malformed calls
reported instead of run, and the answer text as the chat templates render tool messages."""

import pytest

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.tools import ToolCall, Turn, tool_format

HERMES = tool_format("hermes")
CALC = tool_format("calc")


def test_hermes_reads_every_call_in_order():
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "search", "arguments": {"q": "fp8", "k": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2+3\\"}"}</tool_call>'
    )
    assert HERMES.parse(text) == Turn(
        (ToolCall("search", {"q": "fp8", "k": 2}), ToolCall("calc", {"expression": "2+3"}))
    )
    assert HERMES.parse("The answer is 5.") == Turn()


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', "without its </tool_call>"),
    ],
)
def test_hermes_reports_a_call_it_cannot_read(text, error):
    turn = HERMES.parse(text)
    assert turn.calls == () and error in turn.error


def test_hermes_answer_is_one_user_turn_of_tool_responses_then_the_assistant_header():
    # What the Qwen3 / Hermes templates render for two tool messages after an assistant turn
    # that ended with <|im_end|> (sampled), up to the next assistant turn's generation prompt.
    assert HERMES.answer(["5", '{"hits": []}']) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
        '\n<tool_response>\n{"hits": []}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_calc_reads_calculator_calls_and_answers_them():
    assert CALC.parse("calc( 12*(3+4) )") == Turn((ToolCall("calc", {"expression": "12*(3+4)"}),))
    two = CALC.parse("calc(1+2) and calc(3)")
    assert [c.arguments["expression"] for c in two.calls] == ["1+2", "3"]
    assert CALC.parse("84") == Turn()
    assert "without its closing )" in CALC.parse("calc(12*(7)").error
    assert CALC.answer(["84"]) == "=84\n"
    assert CALC.answer(["1", "2"]) == "=1\n=2\n"


def test_an_unknown_format_names_the_setting_and_the_choices():
    with pytest.raises(ConfigError, match=r"env.tool_format='xml'.*\['calc', 'hermes'\]"):
        tool_format("xml")
