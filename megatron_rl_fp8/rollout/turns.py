"""Multi-turn rollouts over any engine (issue 46): sample a turn, run its tool calls, append the
answer's ids, sample the next turn from the exact ids so far.

Token in, token out: each turn continues from ``prompt_ids + response so far``, ids the engine
sampled and ids of the inserted answers, each answer tokenized once when it is appended; the
trainer gets those same ids as one sequence (never a re-tokenized conversation) with
``Completion.response_mask`` 1 on sampled tokens and 0 on inserted ones. A turn ends where the
policy samples an end-of-sequence id, so any engine's ``generate`` serves (no stop strings).

A trajectory ends, with ``Completion.end`` saying why, when its last turn:
- calls no tool (``answered``), or ran out of tokens mid-turn (``truncated``);
- calls a tool at turn ``env.max_turns`` (``max_turns``), or the answer would leave no room in
  ``rollout.max_new_tokens`` for another turn (``max_tokens``);
- calls a tool that raises or times out (``tool_error``, ``tool_timeout``).
A call the format cannot read is answered with the error, not run.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.rollout.environment import EnvConfig, ToolRunner
from megatron_rl_fp8.rollout.tools import Turn, tool_format

ENDS = ("answered", "truncated", "max_turns", "max_tokens", "tool_error", "tool_timeout")

# Each later turn samples with a seed of its own (the engines seed per call).
_TURN_SEED_STRIDE = 7919


@dataclasses.dataclass
class _Trajectory:
    prompt_ids: list[int]
    record: dict
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finished: bool
    version: int
    last_start: int = 0
    turns: int = 1
    calls: int = 0
    end: str = ""

    def take(self, c: Completion) -> None:
        """Append the policy's next turn ``c`` (sampled within the room this trajectory had: the
        engine takes one limit per prompt)."""
        self.last_start = len(self.ids)
        self.ids += c.response_ids
        self.logprobs += c.response_logprobs
        self.mask += [1] * len(c.response_ids)
        self.finished = c.finished
        self.version = min(self.version, c.version)
        self.turns += 1

    def completion(self) -> Completion:
        return Completion(
            prompt_ids=self.prompt_ids,
            response_ids=self.ids,
            response_logprobs=self.logprobs,
            finished=self.finished and self.end not in ("truncated", "max_tokens"),
            version=self.version,
            response_mask=None if all(self.mask) else self.mask,
            turns=self.turns,
            tool_calls=self.calls,
            end=self.end,
            final_start=self.last_start,
        )


class TurnLoop:
    """The driver's multi-turn sampling: :meth:`generate` is ``RolloutEngine.generate`` with the
    prompts' records (for the tools) and turns. Call :meth:`close` (tool workers)."""

    def __init__(
        self,
        cfg: EnvConfig,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
    ):
        self.cfg = cfg
        self.format = tool_format(cfg.tool_format, "env.tool_format")
        self.encode, self.decode = encode, decode
        self.tools = ToolRunner(cfg)
        self.last_error: str | None = None
        """The first tool failure of the latest :meth:`generate` call, or None."""

    def close(self) -> None:
        self.tools.close()

    def generate(
        self,
        engine,
        prompts: list[list[int]],
        records: list[dict],
        *,
        n: int,
        max_new_tokens: int,
        seed: int = 0,
        **sampling,
    ) -> list[Completion]:
        self.last_error = None
        first = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens, seed=seed, **sampling)
        trajectories = [
            _Trajectory(
                prompt_ids=list(c.prompt_ids),
                record=records[i // n],
                ids=list(c.response_ids),
                logprobs=list(c.response_logprobs),
                mask=[1] * len(c.response_ids),
                finished=c.finished,
                version=c.version,
            )
            for i, c in enumerate(first)
        ]
        for turn in range(1, self.cfg.max_turns + 1):
            going = self._answer_calls(trajectories, max_new_tokens)
            if not going:
                break
            rooms = [max_new_tokens - len(t.ids) for t in going]
            nexts = engine.generate(
                [t.prompt_ids + t.ids for t in going],
                n=1,
                max_new_tokens=rooms,
                seed=seed + turn * _TURN_SEED_STRIDE,
                **sampling,
            )
            for t, c in zip(going, nexts):
                t.take(c)
        for t in trajectories:
            if not t.end:  # unreachable: the last round ends every trajectory
                t.end = "max_turns"
        return [t.completion() for t in trajectories]

    def _answer_calls(self, trajectories: list[_Trajectory], budget: int) -> list[_Trajectory]:
        """End the trajectories whose last turn called nothing; run the others' calls and append
        the answers; returns those that go on to another turn."""
        asking: list[tuple[_Trajectory, Turn]] = []
        for t in trajectories:
            if t.end:
                continue
            if not t.finished:
                t.end = "truncated"
                continue
            turn = self.format.parse(self.decode(t.ids[t.last_start :]))
            if not turn.calls and not turn.error:
                t.end = "answered"
            elif t.turns >= self.cfg.max_turns:
                t.end = "max_turns"
            else:
                asking.append((t, turn))
        outcomes = iter(self.tools.run([(c, t.record) for t, turn in asking for c in turn.calls]))
        going = []
        for t, turn in asking:
            results = [next(outcomes) for _ in turn.calls]
            t.calls += len(turn.calls)
            failed = next((r for r in results if r[0] != "ok"), None)
            if failed is not None:
                t.end = "tool_timeout" if failed[0] == "timeout" else "tool_error"
                why = (
                    f"timed out after {self.cfg.timeout_s:g} s"
                    if failed[0] == "timeout"
                    else failed[1]
                )
                self.last_error = self.last_error or why
                continue
            texts = [r[1] for r in results] if turn.calls else [f"error: {turn.error}"]
            answer = self.encode(self.format.answer(texts))
            if len(t.ids) + len(answer) >= budget:
                t.end = "max_tokens"
                continue
            t.ids += answer
            t.logprobs += [0.0] * len(answer)
            t.mask += [0] * len(answer)
            going.append(t)
        return going


def turn_stats(completions: Sequence[Completion]) -> dict[str, float]:
    """``rollout/...`` numbers of multi-turn completions: turns and calls per trajectory, the
    share that called a tool, of inserted tokens among response tokens, and of each way a
    trajectory ended."""
    n = max(len(completions), 1)
    tokens = sum(len(c.response_ids) for c in completions)
    inserted = sum(len(c.response_ids) - sum(c.sampled()) for c in completions)
    ends = collections.Counter(c.end for c in completions)
    return {
        "rollout/turns_mean": sum(c.turns for c in completions) / n,
        "rollout/tool_calls_mean": sum(c.tool_calls for c in completions) / n,
        "rollout/tool_used_frac": sum(c.tool_calls > 0 for c in completions) / n,
        "rollout/inserted_token_frac": inserted / max(tokens, 1),
        **{f"rollout/end_{e}_frac": ends[e] / n for e in ENDS},
    }
