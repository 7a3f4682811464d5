"""The HTTP side of the SGLang engines: the JSON client, and the ``/generate`` request and answer
formats (one server's endpoints are ``server.SGLangServer``'s methods)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

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
) -> dict:
    """The ``/generate`` body for ``rows`` (token ids), asking for the sampled tokens' logprobs.
    ``first_row``: the batch index of ``rows[0]`` when a batch is sent as several requests (the
    per-row seeds follow the batch index, so the split does not change what is sampled)."""
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
    return {
        "input_ids": rows,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
    }


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
    prompt: list[int], answer: dict, *, eos_token_id: int | Iterable[int], expected_version: str
) -> Completion:
    """A ``/generate`` answer -> Completion, after checking it came from ``expected_version``."""
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
    )


class Http:
    """The few JSON calls the engine makes (stdlib only: the trainer's venv needs no extra)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(
        self, path: str, payload: dict | None = None, *, timeout: float, method: str | None = None
    ) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method or ("GET" if data is None else "POST"),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code >= 500:
                raise ServerGone(f"{path}: HTTP {e.code}: {detail}") from e
            raise RolloutEngineError(f"{path}: HTTP {e.code}: {detail}") from e
        except TimeoutError as e:  # a hung server: it is relaunched like a dead one
            raise ServerGone(f"{path}: no answer within {timeout:g} s") from e
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            raise ServerGone(f"{path}: {e}") from e
        try:
            return json.loads(body) if body else None
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def ok(self, path: str, payload: dict | None = None, *, timeout: float) -> dict:
        """POST expecting SGLang's ``{"success": true, ...}``."""
        out = self.call(path, payload if payload is not None else {}, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise RolloutEngineError(f"{path} failed: {out.get('message')}")
        return out
