"""One rollout round of ``/generate`` requests, and the process that runs it off the trainer's.

A round sends every request at once (up to :data:`MAX_IN_FLIGHT` threads), decodes each JSON
answer and checks it (``http.parse_completion``). Decoding holds the GIL for the whole of an
answer (6 ms for 8192 tokens of logprobs), and under ``train.pipeline=one_step_off`` the round
runs while the driver launches the update's kernels, which need the GIL for every small op: a
thread decoding answers slowed a launch-bound update 377x (``benchmarks/bench_rollout_parse.py``,
docs/benchmarks.md). With ``rollout.sglang.parse_answers: process`` (the default) the round runs
in :class:`AnswerProcess`, a spawned helper that imports no torch, and each completion comes back
as two packed arrays: the trainer's process unpickles bytes and makes two lists per answer.
"""

from __future__ import annotations

import array
import concurrent.futures
import multiprocessing
import time
from concurrent.futures.process import BrokenProcessPool

from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone, first_line
from megatron_rl_fp8.rollout.sglang.http import Http, parse_completion

MAX_IN_FLIGHT = 64
"""Requests of one round in flight at once (one thread each)."""

Spans = list[tuple[float, float]]
"""(sent, answered) per request, ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every
process of the machine on Linux)."""


def answer_round(
    url: str,
    requests: dict[int, dict],
    rows: dict[int, list[int]],
    *,
    timeout: float,
    eos_token_id: int | list[int],
    expected_version: str,
    in_flight=None,
    route_shape: tuple[int, int] | None = None,
) -> tuple[dict[int, Completion], dict[int, str], Spans]:
    """Send ``requests`` (``/generate`` bodies by row) to ``url`` all at once and parse the
    answers; returns the completions that came back right and a one-line message per row that
    did not, by row, and the requests' spans. ``in_flight()`` is called once every request is
    submitted (the fault hook: the requests are in flight). Errors other than the engines' ones
    (a bug) propagate. ``route_shape``: the answers carry routes of (layers, top-k) experts."""
    http = Http(url)
    spans: Spans = []

    def call(i: int, body: dict) -> Completion:
        t0 = time.perf_counter()
        try:
            answer = http.call("/generate", body, timeout=timeout)
        finally:
            spans.append((t0, time.perf_counter()))  # list.append is atomic
        if not isinstance(answer, dict):
            raise ServerGone(f"/generate returned {type(answer).__name__}")
        return parse_completion(
            rows[i],
            answer,
            eos_token_id=eos_token_id,
            expected_version=expected_version,
            route_shape=route_shape,
        )

    out: dict[int, Completion] = {}
    failures: dict[int, str] = {}
    with concurrent.futures.ThreadPoolExecutor(min(len(requests), MAX_IN_FLIGHT)) as pool:
        futures = {i: pool.submit(call, i, body) for i, body in requests.items()}
        if in_flight is not None:
            in_flight()
        for i, fut in futures.items():
            try:
                out[i] = fut.result()
            except RolloutEngineError as e:
                failures[i] = first_line(e)
    return out, failures, spans


Packed = tuple[array.array, array.array, bool, object]
"""A completion's response ids ('q'), their logprobs ('d'), whether it finished and its routes
(a MoE's [positions, layers, top-k] tensor, or None): what crosses from the answer process
(arrays pickle as their bytes)."""


def pack(c: Completion) -> Packed:
    """``c`` without its prompt, as it crosses from the answer process."""
    ids, logprobs = array.array("q", c.response_ids), array.array("d", c.response_logprobs)
    return ids, logprobs, c.finished, c.routed_experts


def unpack(prompt: list[int], packed: Packed) -> Completion:
    """The completion of ``prompt`` that :func:`pack` sent: two lists made from bytes."""
    ids, logprobs, finished, routes = packed
    return Completion(
        prompt_ids=list(prompt),
        response_ids=ids.tolist(),
        response_logprobs=logprobs.tolist(),
        finished=finished,
        routed_experts=routes,
    )


def _packed_round(
    url: str, requests: dict[int, dict], **kwargs
) -> tuple[dict[int, Packed], dict[int, str], Spans]:
    """:func:`answer_round` in the answer process, its completions packed (their prompts stay
    with the caller)."""
    out, failures, spans = answer_round(url, requests, {i: [] for i in requests}, **kwargs)
    return {i: pack(c) for i, c in out.items()}, failures, spans


class AnswerProcess:
    """The helper process that runs rounds (:func:`answer_round`) for one fleet: spawned at the
    first round, kept until :meth:`close`, and spawned again after it dies (that round's
    requests fail and are retried like any failed request)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def submit(
        self,
        url: str,
        requests: dict[int, dict],
        *,
        timeout: float,
        eos_token_id: int | list[int],
        expected_version: str,
        route_shape: tuple[int, int] | None = None,
    ) -> concurrent.futures.Future:
        """Start a round in the helper; :meth:`result` collects it."""
        if self._pool is None:
            spawn = multiprocessing.get_context("spawn")  # no fork of a trainer's threads
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn)
        return self._pool.submit(
            _packed_round,
            url,
            requests,
            timeout=timeout,
            eos_token_id=eos_token_id,
            expected_version=expected_version,
            route_shape=route_shape,
        )

    def result(
        self, future: concurrent.futures.Future, requests: dict[int, dict], rows: list[list[int]]
    ) -> tuple[dict[int, Completion], dict[int, str], Spans]:
        """The round's completions (with their prompts from ``rows``), failures and spans."""
        try:
            packed, failures, spans = future.result()
        except BrokenProcessPool as e:
            self.close()
            lost = f"the rollout's answer process died ({e or 'no message'})"
            return {}, {i: lost for i in requests}, []
        return {i: unpack(rows[i], p) for i, p in packed.items()}, failures, spans

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
