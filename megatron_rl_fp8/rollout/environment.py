"""The environment of a multi-turn rollout (issue 46): the ``env.*`` settings, the tools a
policy's calls run, and the worker processes they run in.

A tool is a function ``fn(name, arguments, record) -> str``: the call's tool name and its
arguments (a dict, as the format read them) and the dataset record of the trajectory's prompt
(every field of the file, as ``reward.function`` gets them); it returns the text the policy reads
back. ``env.tools`` names it as ``package.module:function``, or ``calculator`` for the shipped
one. A tool that raises, or runs past ``env.timeout_s``, ends that trajectory (its reason is
counted in ``rollout/end_tool_error_frac`` / ``rollout/end_tool_timeout_frac`` and the first
message printed), never the run: tools run in spawned worker processes the driver kills at the
deadline, as rewards do (``reward/pool.py``). ``env.num_workers: 0`` runs them in the driver
with no timeout (tests, the tiny CPU job). The reward is scored at the end, by the task's
verifier or ``reward.function``, on the text of the policy's last turn.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl_fp8.config_utils import ConfigError, field
from megatron_rl_fp8.reward.pool import PoolRole, WorkerPool, run_in_process
from megatron_rl_fp8.rollout.tools import FORMATS, ToolCall, tool_format
from megatron_rl_fp8.utils.imports import import_object

BUILTIN_TOOLS = ("calculator",)

ToolFn = Callable[[str, dict, dict], str]


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn rollouts: the tools the policy may call between turns, and the limits."""

    tools: str | None = field(
        default=None,
        help="The tools the policy's calls run: 'calculator' (the shipped one) or "
        "'package.module:function', a function fn(name, arguments, record) -> str. None = "
        "one turn per completion (no environment).",
    )
    tool_format: str = field(
        default="calc",
        help=f"How calls are written and answered: one of {sorted(FORMATS)} (hermes: the "
        "Hermes / Qwen3 chat templates' <tool_call> JSON; calc: calc(expression), answered "
        "=value).",
    )
    max_turns: int = field(
        default=4,
        help="Most policy turns per trajectory (a turn ends at an end-of-sequence id); a "
        "trajectory still calling tools at the last one ends there. The whole response, "
        "sampled and inserted tokens, stays within rollout.max_new_tokens.",
    )
    timeout_s: float = field(
        default=10.0,
        help="Seconds one tool call may take; past it the call's worker is killed and its "
        "trajectory ends (rollout/end_tool_timeout_frac).",
    )
    tool_schemas: str | None = field(
        default=None,
        help="A JSON file: the list of tool schemas in the Hugging Face / OpenAI `tools` "
        'layout ({"type": "function", "function": {"name", "description", "parameters"}}), '
        "which the chat template lists in the prompt (Qwen3 / Hermes: a <tools> block in the "
        "system turn). None: env.tools=calculator lists its own schema; a plugin's prompts "
        "must describe its tools themselves.",
    )
    num_workers: int = field(
        default=2,
        help="Tool worker processes (spawned on the driver); 0 = run tools in the driver "
        "process, with no timeout.",
    )

    def __post_init__(self) -> None:
        tool_format(self.tool_format, "env.tool_format")
        if self.tool_schemas is not None and self.tools is None:
            raise ConfigError(
                f"env.tool_schemas={self.tool_schemas!r} lists tools but env.tools is not set: "
                "name the tools' function too (env.tools)"
            )
        if self.tools is not None and self.tools not in BUILTIN_TOOLS:
            if ":" not in str(self.tools):
                raise ConfigError(
                    f"env.tools={self.tools!r} is neither a shipped tool ({', '.join(BUILTIN_TOOLS)}) "
                    "nor 'package.module:function'"
                )
            load_tool_function(self.tools)
        for name in ("max_turns", "num_workers"):
            value, low = getattr(self, name), 1 if name == "max_turns" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"env.{name}={value!r} must be an integer >= {low}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"env.timeout_s={t!r} must be a positive number of seconds")


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % and "
        "parentheses. Returns the value, or an error.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. 12*(3+4)"},
            },
            "required": ["expression"],
        },
    },
}


def tool_schemas(env: EnvConfig) -> list[dict] | None:
    """The tool schemas the prompts list (``env.tool_schemas``, or the calculator's own under
    ``env.tool_format: hermes``), None when there are none; a one-line error naming the file for one that cannot be read."""
    if env.tool_schemas is None:
        # The calculator's JSON schema describes JSON calls; calc(...) is taught by its traces.
        shipped = env.tools == "calculator" and env.tool_format == "hermes"
        return [CALCULATOR_SCHEMA] if shipped else None
    path = Path(env.tool_schemas).expanduser()
    where = f"env.tool_schemas={env.tool_schemas!r}"
    try:
        schemas = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror or e}; give a JSON file of tool schemas") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is not JSON ({e}); give a list of tool schemas") from None
    if not isinstance(schemas, list) or not schemas:
        raise ConfigError(f"{where} must hold a non-empty JSON list of tool schemas")
    for i, s in enumerate(schemas):
        fn = s.get("function") if isinstance(s, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(
                f'{where}: entry {i} needs {{"type": "function", "function": {{"name": ..., '
                '"description": ..., "parameters": {...}}}'
            )
    return schemas


def load_tool_function(spec: str) -> ToolFn:
    """The function ``spec`` names, or a one-line error naming ``env.tools``."""
    obj = import_object(spec, "env.tools", what="function")
    if not callable(obj):
        raise ConfigError(
            f"env.tools={spec!r} is a {type(obj).__name__}, not a function; point it at "
            "fn(name, arguments, record) -> str"
        )
    return obj


_cached_tool_function = functools.lru_cache(maxsize=None)(load_tool_function)

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_DIGITS = 30


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if abs(value) >= 10**_MAX_DIGITS:
            raise ValueError("the result is too large")
        return value
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


def calculator(name: str, arguments: dict, record: dict) -> str:
    """The shipped tool: ``calc`` (or ``calculator``) with ``{"expression": "12*(3+4)"}``, the
    four operations, ``//``, ``%`` and parentheses on numbers. A call it cannot evaluate gets
    ``error: ...`` back (the policy's mistake, answered so it can learn from it); a tool name it
    does not know raises (a wrongly configured task: the trajectory ends with tool_error)."""
    if name not in ("calc", "calculator"):
        raise ValueError(f"the calculator has no tool {name!r} (it offers 'calc')")
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        return 'error: give the expression as {"expression": "..."}'
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


@dataclass(frozen=True)
class ToolJob:
    """One tool call, picklable for the workers: the tools by name, imported where it runs."""

    tools: str

    def prepare(self) -> None:
        if self.tools not in BUILTIN_TOOLS:
            load_tool_function(self.tools)

    def __call__(self, name: str, arguments: dict, record: dict) -> str:
        fn = calculator if self.tools == "calculator" else _cached_tool_function(self.tools)
        out = fn(name, arguments, record)
        if not isinstance(out, str):
            raise TypeError(f"tool {name!r} returned a {type(out).__name__}, not a str")
        return out


class ToolRunner:
    """Runs a batch of calls, each under ``env.timeout_s`` in the worker pool (or in-process);
    call :meth:`close` (the sampler does)."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.job = ToolJob(cfg.tools)
        self._pool = (
            WorkerPool(
                self.job,
                cfg.num_workers,
                role=PoolRole("tool", "env.tools", "env.num_workers=0 to run tools in-process"),
            )
            if cfg.num_workers > 0
            else None
        )

    def run(self, calls: Sequence[tuple[ToolCall, dict]]) -> list[tuple]:
        """Per call, in order: ``("ok", text)``, ``("error", message)`` or ``("timeout",)``."""
        tasks = [(1, (call.name, call.arguments, record)) for call, record in calls]
        if not tasks:
            return []
        if self._pool is None:
            outcomes = run_in_process(self.job, tasks)
        else:
            outcomes = self._pool.run(tasks, self.cfg.timeout_s)
        return [outcomes[i] for i in range(len(tasks))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
