"""The HTTP side of the SGLang engines: the JSON client, and the ``/generate`` request and answer
formats (one server's endpoints are ``server.SGLangServer``'s methods)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import urllib3

from megatron_rl_fp8.rollout.base import Completion, eos_ids
from megatron_rl_fp8.rollout.errors import RolloutEngineError, ServerGone


def sampling_params(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    eos_token_id: int | Iterable[int],
    seed: int | None,
) -> dict:
    """One request's ``sampling_params`` (greedy = temperature 0, SGLang's argmax path)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": list(eos_ids(eos_token_id)),
        "temperature": 0.0 if greedy else temperature,
        "top_p": 1.0 if greedy else top_p,
        "top_k": -1,
    }
    if seed is not None and not greedy:
        params["sampling_seed"] = seed
    return params


def generate_request(
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    seed: int,
    eos_token_id: int | Iterable[int],
    first_row: int = 0,
    return_routes: bool = False,
) -> dict:
    """The ``/generate`` body for ``rows`` (token ids), asking for the sampled tokens' logprobs.
    ``first_row``: the batch index of ``rows[0]`` when a batch is sent as several requests (the
    per-row seeds follow the batch index, so the split does not change what is sampled).
    ``return_routes``: a MoE model's experts of every token too (``rollout.routing_replay``)."""
    params = [
        # Distinct, reproducible per-row seeds (honoured by SGLang's deterministic sampling
        # mode; otherwise a hint).
        sampling_params(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            eos_token_id=eos_token_id,
            seed=(seed * 1_000_003 + i) % (2**31),
        )
        for i in range(first_row, first_row + len(rows))
    ]
    body = {
        "input_ids": rows,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routes:
        body["return_routed_experts"] = True  # from position 0: the whole sequence's
    return body


def row_requests(rows: list[list[int]], **kwargs) -> list[dict]:
    """One ``/generate`` body per row, each with that row's own seed (as in the batch body of
    :func:`generate_request`, which takes the same ``kwargs``): what an sglang-router takes (it
    accepts one sampling_params object per request) and spreads over its engines."""
    batch = generate_request(rows, **kwargs)
    return [
        {**batch, "input_ids": ids, "sampling_params": params}
        for ids, params in zip(batch["input_ids"], batch["sampling_params"])
    ]


def parse_completion(
    prompt: list[int],
    answer: dict,
    *,
    eos_token_id: int | Iterable[int],
    expected_version: str,
    route_shape: tuple[int, int] | None = None,
) -> Completion:
    """A ``/generate`` answer -> Completion, after checking it came from ``expected_version``.
    ``route_shape`` (layers, top-k): the answer's routed experts too (requested with
    ``return_routes``)."""
    meta = answer.get("meta_info", {})
    versions = {meta.get("weight_version")} | {
        s.get("version") for s in meta.get("weight_versions") or []
    }
    versions.discard(None)
    if versions != {expected_version}:
        raise ServerGone(
            f"completion produced by weight version(s) {sorted(versions)}, "
            f"expected {expected_version!r}"
        )
    ids = [int(t) for t in answer["output_ids"]]
    lp = meta.get("output_token_logprobs") or []
    if len(lp) != len(ids) or any(int(e[1]) != t for e, t in zip(lp, ids)):
        raise RolloutEngineError(
            "SGLang returned logprobs that do not line up with the output ids "
            f"({len(lp)} logprobs for {len(ids)} tokens)"
        )
    finished = bool(ids) and ids[-1] in eos_ids(eos_token_id)
    return Completion(
        prompt_ids=list(prompt),
        response_ids=ids,
        response_logprobs=[float(e[0]) for e in lp],
        finished=finished,
        routed_experts=parse_routes(meta, route_shape) if route_shape else None,
    )


def parse_routes(meta: dict, route_shape: tuple[int, int]):
    """``meta_info["routed_experts"]``: SGLang 0.5.23's base64 of an int32 array [positions,
    layers, top-k] (``RoutedExpertsCapturer``; ``DetokenizerManager._b64_encode_per_request``),
    every position of prompt + output but the last -> an int16 tensor of that shape."""
    import base64

    import numpy as np
    import torch  # lazy: the answer process imports torch only for a MoE's routes

    encoded = meta.get("routed_experts")
    if not encoded:
        raise RolloutEngineError(
            "SGLang returned no routed_experts: rollout.routing_replay needs servers started "
            "with --enable-return-routed-experts (launched ones are; add it to attached ones)"
        )
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    layers, topk = route_shape
    if flat.size % (layers * topk):
        raise RolloutEngineError(
            f"SGLang's routed_experts hold {flat.size} ids, not a whole number of positions of "
            f"{layers} layers x top-{topk}"
        )
    return torch.from_numpy(flat.reshape(-1, layers, topk).astype(np.int16))


POOL_SIZE = 64
"""Kept-alive connections per server and process: a rollout round's requests in flight
(``answers.MAX_IN_FLIGHT``); a round that opens more closes the extra ones after use."""

MAX_IDLE_S = 2.0
"""A kept-alive connection idle longer than this is not reused but replaced. SGLang's server
closes a connection idle for ``SGLANG_TIMEOUT_KEEP_ALIVE`` (5 s); a request sent on it as the
server closes it is reset ("Connection reset by peer", seen by benchmarks/bench_http.py when
rounds came ~5 s apart), which would read as a dead engine."""


class _Connection(urllib3.connection.HTTPConnection):
    """An HTTP connection that counts as dropped once idle for :data:`MAX_IDLE_S` (urllib3's
    pool asks ``is_connected`` before it reuses one)."""

    answered_at: float | None = None

    def getresponse(self, *args, **kwargs):
        response = super().getresponse(*args, **kwargs)
        self.answered_at = time.monotonic()
        return response

    @property
    def is_connected(self) -> bool:
        if self.answered_at is not None and time.monotonic() - self.answered_at > MAX_IDLE_S:
            return False
        return super().is_connected


class _Pool(urllib3.HTTPConnectionPool):
    ConnectionCls = _Connection


_pools: dict[tuple[int, str], urllib3.HTTPConnectionPool] = {}
_pools_lock = threading.Lock()


def pool(base_url: str) -> urllib3.HTTPConnectionPool:
    """This process's pool of kept-alive connections to ``base_url`` (``http://host:port``; one
    per server: every :class:`Http` to it shares them; a forked child makes its own). urllib3's
    pool, without requests' per-request layer, which halved the rate of a server that answers at
    once (docs/benchmarks.md)."""
    key = (os.getpid(), base_url)
    with _pools_lock:
        if key not in _pools:
            u = urllib3.util.parse_url(base_url)
            if u.scheme != "http" or not u.host:
                raise RolloutEngineError(f"{base_url!r} is not an http://host:port URL")
            _pools[key] = _Pool(u.host, u.port or 80, maxsize=POOL_SIZE, retries=False)
        return _pools[key]


class Http:
    """The few JSON calls the engine makes, over :func:`pool`'s kept-alive connections.

    Errors: an HTTP 5xx, no answer within ``timeout`` (connecting or reading), or a connection
    refused or dropped is :class:`ServerGone` (the engine is relaunched); any other HTTP error is
    :class:`RolloutEngineError`. A kept-alive connection to a server that died is found dropped
    when it is next taken from the pool and replaced, so a relaunched server at the same URL
    gets a fresh connection."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(
        self, path: str, payload: dict | None = None, *, timeout: float, method: str | None = None
    ) -> Any:
        """The answer's JSON (its text where it is not JSON; None where it is empty)."""
        body = self.raw(path, payload, timeout=timeout, method=method)
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def raw(
        self, path: str, payload: dict | None = None, *, timeout: float, method: str | None = None
    ) -> bytes:
        """The answer's bytes (a GET without ``payload``, else a POST of its JSON)."""
        data = None if payload is None else json.dumps(payload).encode()
        try:
            resp = pool(self.base_url).request(
                method or ("GET" if data is None else "POST"),
                path,
                body=data,
                headers={"Content-Type": "application/json"},
                timeout=urllib3.Timeout(connect=timeout, read=timeout),  # as urllib's was
                retries=False,
            )
            body = resp.data
        except urllib3.exceptions.NewConnectionError as e:  # (a ConnectTimeoutError subclass)
            raise ServerGone(f"{path}: {_reason(e)}") from e
        except urllib3.exceptions.TimeoutError as e:  # a hung server: relaunched like a dead one
            raise ServerGone(f"{path}: no answer within {timeout:g} s") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ServerGone(f"{path}: {_reason(e)}") from e
        if resp.status >= 400:
            detail = body.decode(errors="replace")[:2000]
            if resp.status >= 500:
                raise ServerGone(f"{path}: HTTP {resp.status}: {detail}")
            raise RolloutEngineError(f"{path}: HTTP {resp.status}: {detail}")
        return body

    def ok(self, path: str, payload: dict | None = None, *, timeout: float) -> dict:
        """POST expecting SGLang's ``{"success": true, ...}``."""
        out = self.call(path, payload if payload is not None else {}, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise RolloutEngineError(f"{path} failed: {out.get('message')}")
        return out


def _reason(e: BaseException) -> str:
    """The innermost cause of a connection error in one line ("[Errno 111] Connection refused"),
    not urllib3's wrapper chain of pool and URL reprs."""
    while True:
        inner = getattr(e, "reason", None) or (
            e.args[-1] if e.args and isinstance(e.args[-1], BaseException) else None
        )
        if not isinstance(inner, BaseException) or inner is e:
            break
        e = inner
    # urllib3's NewConnectionError reads "<Connection class>(host=..., port=...): Failed to ...".
    return re.sub(r"^\w+\(host=[^)]*\): ", "", str(e))
