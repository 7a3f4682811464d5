"""Tool calls in the policy's text, and the text that answers them, per named format (issue 46).

A turn of the policy ends where it samples an end-of-sequence id, as a one-turn completion does;
the format then reads the calls in that turn's text, and after the environment has run them,
words the text inserted before the policy's next turn (tokenized once and appended to the ids so
far: the trainer sees the same ids, never a re-tokenized conversation).

``hermes``: the Hermes / Qwen2.5 / Qwen3 chat templates' calls, one JSON object ``{"name": ...,
"arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` per call. The answers go back
as the templates render ``tool`` messages: one user turn holding a ``<tool_response>`` block per
call, then the header of the next assistant turn. ``calc``: the shipped calculator task's
``calc(expression)``, answered ``=value`` and a newline (characters the tiny model's tokenizer
has).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from megatron_rl_fp8.config_utils import ConfigError


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one turn of the policy asked for: its calls in order, or ``error`` when a call could
    not be read (the environment answers with the error instead of running anything)."""

    calls: tuple[ToolCall, ...] = ()
    error: str = ""


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Callable[[str], Turn]
    """A turn's text -> its calls (none: the policy answered, the trajectory ends)."""
    answer: Callable[[list[str]], str]
    """The environment's results, one per call in order -> the text inserted after the turn."""


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _parse_hermes(text: str) -> Turn:
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return Turn(error=f"tool call is not JSON ({e.msg} at character {e.pos})")
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return Turn(error='tool call needs {"name": "...", "arguments": {...}}')
        if not isinstance(args, dict):
            return Turn(error=f"tool call {obj['name']!r}: arguments must be a JSON object")
        calls.append(ToolCall(obj["name"], args))
    if text.count("<tool_call>") > len(calls):
        return Turn(error="<tool_call> without its </tool_call>")
    return Turn(tuple(calls))


def _answer_hermes(results: list[str]) -> str:
    blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n"


def _parse_calc(text: str) -> Turn:
    calls, at = [], 0
    while (start := text.find("calc(", at)) >= 0:
        depth, i = 1, start + len("calc(")
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if depth:
            return Turn(error="calc( without its closing )")
        calls.append(ToolCall("calc", {"expression": text[start + len("calc(") : i - 1].strip()}))
        at = i
    return Turn(tuple(calls))


def _answer_calc(results: list[str]) -> str:
    return "".join(f"={r}\n" for r in results)


FORMATS = {
    f.name: f
    for f in (
        ToolFormat("hermes", _parse_hermes, _answer_hermes),
        ToolFormat("calc", _parse_calc, _answer_calc),
    )
}


def tool_format(name: str, setting: str = "env.tool_format") -> ToolFormat:
    """The format called ``name``, or a one-line error naming ``setting`` and the choices."""
    if name not in FORMATS:
        raise ConfigError(
            f"{setting}={name!r} is not a tool-call format; choose one of {sorted(FORMATS)}"
        )
    return FORMATS[name]
