"""Multi-turn rollouts (``rollout/turns.py``, ``rollout/environment.py``): each turn continues from
the exact ids so far, inserted answers are masked out, every way a trajectory ends, tools that
raise or hang end their trajectory and never the run, and the shipped calculator."""

import dataclasses

import pytest

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.rollout.base import Completion, prompt_limits
from megatron_rl_fp8.rollout.environment import EnvConfig, calculator
from megatron_rl_fp8.rollout.turns import ENDS, TurnLoop, turn_stats

EOS = 0


def encode(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


class ScriptedEngine:
    """The engine contract's ``generate``, answering from a script: the text so far (prompt and
    response, decoded) -> the next turn's text. Every call's prompts are kept."""

    def __init__(self, script, *, logprob=-0.5, version=3, encode=encode, decode=decode, eos=EOS):
        self.script, self.logprob, self.version = script, logprob, version
        self.encode, self.decode, self.eos = encode, decode, eos
        self.calls = []

    def generate(self, prompts, *, n, max_new_tokens, temperature=1.0, seed=0, **kw):
        limits = prompt_limits(max_new_tokens, len(prompts))
        self.calls.append(
            {"prompts": [list(p) for p in prompts], "n": n, "seed": seed, "limits": limits}
        )
        out = []
        for p, max_new_tokens in zip(prompts, limits):
            for _ in range(n):
                ids = self.encode(self.script(self.decode(p)))
                end = [self.eos]
                ids, finished = (ids + end, True) if len(ids) < max_new_tokens else (ids, False)
                ids = ids[:max_new_tokens]
                out.append(
                    Completion(
                        prompt_ids=list(p),
                        response_ids=ids,
                        response_logprobs=[self.logprob] * len(ids),
                        finished=finished,
                        version=self.version,
                    )
                )
        return out


def calc_then_answer(text: str) -> str:
    """Asks the calculator once, then answers with what it read back."""
    if "=" not in text:
        return "calc(2+3)"
    return "is " + text.rsplit("=", 1)[1].split("\n")[0]


def loop(**env) -> TurnLoop:
    cfg = EnvConfig(**{"tools": "calculator", "num_workers": 0, **env})
    return TurnLoop(cfg, encode=encode, decode=decode)


def test_each_turn_continues_from_the_exact_ids_and_inserted_ids_are_masked():
    engine = ScriptedEngine(calc_then_answer)
    [c] = loop().generate(engine, [encode("Q:")], [{}], n=1, max_new_tokens=64, temperature=1.0)
    turn1, answer, turn2 = encode("calc(2+3)") + [EOS], encode("=5\n"), None
    turn2 = encode("is 5") + [EOS]
    assert c.response_ids == turn1 + answer + turn2
    assert c.response_mask == [1] * len(turn1) + [0] * len(answer) + [1] * len(turn2)
    assert c.response_logprobs == [-0.5] * len(turn1) + [0.0] * len(answer) + [-0.5] * len(turn2)
    # The second turn was sampled from the prompt and the ids so far, not a re-encoded text.
    assert engine.calls[1]["prompts"] == [encode("Q:") + turn1 + answer]
    assert engine.calls[1]["n"] == 1 and engine.calls[1]["seed"] != engine.calls[0]["seed"]
    # Each later turn asks for what its trajectory has left of the budget, no more.
    assert engine.calls[1]["limits"] == [64 - len(turn1 + answer)]
    assert (c.turns, c.tool_calls, c.end, c.finished, c.version) == (2, 1, "answered", True, 3)
    assert decode(c.response_ids[c.final_start :]) == "is 5"


def test_a_group_of_samples_ends_each_trajectory_on_its_own():
    def script(text):
        # Even prompts call a tool; odd ones answer at once.
        return calc_then_answer(text) if text.startswith("A") else "7"

    cs = loop().generate(
        ScriptedEngine(script), [encode("A"), encode("B")], [{}, {}], n=2, max_new_tokens=64
    )
    assert [c.turns for c in cs] == [2, 2, 1, 1]
    assert [c.response_mask is None for c in cs] == [False, False, True, True]
    assert all(c.end == "answered" for c in cs)
    stats = turn_stats(cs)
    assert stats["rollout/turns_mean"] == 1.5 and stats["rollout/tool_used_frac"] == 0.5
    inserted = 2 * len("=5\n")
    assert stats["rollout/inserted_token_frac"] == inserted / sum(len(c.response_ids) for c in cs)
    assert sum(stats[f"rollout/end_{e}_frac"] for e in ENDS) == 1.0


def test_a_policy_that_keeps_calling_stops_at_max_turns():
    engine = ScriptedEngine(lambda text: "calc(1+1)")
    [c] = loop(max_turns=3).generate(engine, [encode("Q")], [{}], n=1, max_new_tokens=200)
    assert (c.turns, c.tool_calls, c.end, c.finished) == (3, 2, "max_turns", True)
    assert len(engine.calls) == 3


def test_the_token_budget_covers_the_whole_response():
    # Room for the first turn but not for its answer plus another turn.
    engine = ScriptedEngine(calc_then_answer)
    [c] = loop().generate(engine, [encode("Q")], [{}], n=1, max_new_tokens=12)
    assert c.end == "max_tokens" and not c.finished and c.turns == 1
    # Room for the answer, and a second turn cut where the budget ends.
    engine = ScriptedEngine(lambda t: calc_then_answer(t) if "=" not in t else "x" * 50)
    [c] = loop().generate(engine, [encode("Q")], [{}], n=1, max_new_tokens=40)
    assert len(c.response_ids) == 40 and c.end == "truncated" and not c.finished


def test_a_call_the_format_cannot_read_is_answered_with_the_error():
    engine = ScriptedEngine(lambda t: "calc(2+(3)" if "=" not in t else "ok")
    [c] = loop().generate(engine, [encode("Q")], [{}], n=1, max_new_tokens=200)
    assert "=error: calc( without its closing )\n" in decode(c.response_ids)
    assert c.end == "answered" and c.tool_calls == 0


def test_the_tools_get_the_call_and_the_prompts_record():
    engine = ScriptedEngine(calc_then_answer)
    [c] = loop(tools="tests.tools_for_tests:echo").generate(
        engine, [encode("Q")], [{"id": "r7"}], n=1, max_new_tokens=200
    )
    assert "=calc:2+3:r7\n" in decode(c.response_ids)


@pytest.mark.parametrize(
    "tool, end, why",
    [
        ("broken", "tool_error", "RuntimeError: the service is down"),
        ("not_text", "tool_error", "returned a int, not a str"),
        ("hangs", "tool_timeout", "timed out after 1 s"),
    ],
)
def test_a_tool_that_raises_or_hangs_ends_its_trajectory_not_the_run(tool, end, why):
    turns = loop(tools=f"tests.tools_for_tests:{tool}", num_workers=1, timeout_s=1.0)
    try:
        engine = ScriptedEngine(lambda t: calc_then_answer(t) if t.startswith("A") else "9")
        cs = turns.generate(engine, [encode("A"), encode("B")], [{}, {}], n=1, max_new_tokens=99)
        assert [c.end for c in cs] == [end, "answered"]
        assert why in turns.last_error
        # The pool goes on: the next call is answered by a fresh worker.
        again = turns.generate(engine, [encode("A")], [{}], n=1, max_new_tokens=99)
        assert again[0].end == end
    finally:
        turns.close()


def test_a_tool_that_answers_a_megabyte_ends_its_trajectory_out_of_tokens():
    turns = loop(tools="tests.tools_for_tests:huge", num_workers=1)
    try:
        engine = ScriptedEngine(lambda t: calc_then_answer(t) if t.startswith("A") else "9")
        cs = turns.generate(engine, [encode("A"), encode("B")], [{}, {}], n=1, max_new_tokens=99)
        assert [c.end for c in cs] == ["max_tokens", "answered"]
        assert len(cs[0].response_ids) < 99 and len(engine.calls) == 1
    finally:
        turns.close()


@pytest.mark.parametrize(
    "expression, answer",
    [
        ("12*(3+4)", "84"),
        ("7/2", "3.5"),
        ("8/4", "2"),
        ("-5 // 2", "-3"),
        ("17 % 5", "2"),
        ("1/0", "error: division by zero"),
        ("2**100", "error: only numbers, + - * / // % and parentheses are allowed"),
        ("__import__('os')", "error: only numbers, + - * / // % and parentheses are allowed"),
        ("3+", "error: invalid syntax"),
        ("9" * 20 + "*" + "9" * 20, "error: the result is too large"),
    ],
)
def test_the_calculator(expression, answer):
    assert calculator("calc", {"expression": expression}, {}) == answer


def test_the_calculator_refuses_a_tool_it_does_not_have():
    with pytest.raises(ValueError, match="no tool 'search'"):
        calculator("search", {"expression": "1"}, {})
    assert calculator("calc", {}, {}).startswith("error: give the expression")


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"tool_format": "xml"}, r"env.tool_format='xml' is not a tool-call format"),
        ({"tools": "nowhere.module:fn"}, r"env.tools='nowhere.module:fn' cannot be loaded"),
        ({"tools": "calc"}, r"env.tools='calc' is neither a shipped tool \(calculator\)"),
        ({"max_turns": 0}, r"env.max_turns=0 must be an integer >= 1"),
        ({"timeout_s": -1}, r"env.timeout_s=-1 must be a positive number"),
    ],
)
def test_bad_env_settings_are_one_line_errors(setting, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        EnvConfig(**setting)


def test_one_turn_completions_keep_their_defaults():
    c = Completion([1], [2, 3], [-0.1, -0.2], True)
    assert (c.turns, c.tool_calls, c.end, c.final_start, c.sampled()) == (1, 0, "", 0, [1, 1])
    assert dataclasses.replace(c, response_mask=[1, 0]).sampled() == [1, 0]
