"""The engines' HTTP client: a new TCP connection per request (urllib, the package's client
before issue 49) against pooled, kept-alive connections (a requests.Session, and the package's
``rollout/sglang/http.py: Http``: urllib3's pool without requests' layer), side by side in one
run, on real SGLang CPU engines and sglang-router (issue 49).

    python benchmarks/bench_http.py [--rows 64] [--tokens 32] [--reps 5] [--json out.json]

A fleet of two engines behind a router (.venv-sglang, as ``make test-sglang`` installs it) serves
a tiny Qwen3-shaped model with random weights. Per target (one engine called directly, and the
router), alternating the clients, best of ``--reps``:

* ``health/s``: 2 x ``--requests`` ``GET /health`` calls, 64 in flight: the client's own cost
  per request (connection set-up, HTTP), with almost no engine work;
* ``requests/s``: ``--requests`` ``/generate`` calls of one new token, 64 in flight (the rollout
  round's threads): what a round pays per request beyond the engine's work;
* ``round s``: one rollout round (``answers.answer_round``'s shape: ``--rows`` requests at once,
  ``--tokens`` new tokens each, answers decoded and checked by ``parse_completion``);
* ``decode %``: the share of the round's wall time spent in ``json.loads`` of its answers (summed
  over the answers; the decoding holds the GIL, docs/pipelining.md).

The ratio column is each client's number over urllib's (above 1 for the rates and below 1 for
seconds is that client faster). The engines run with ``SGLANG_TIMEOUT_KEEP_ALIVE=600``: with
SGLang's 5 s, a pooled connection left idle while the other clients' rounds ran was closed by the
server as the next request went out on it ("Connection reset by peer", seen in a first run), a
hazard the package's client handles by replacing connections idle for more than 2 s.
On 2 CPU cores the engines, the router and the clients share the cores, so the engine's own time
dominates the /generate workloads; the ratio is what a client change buys on this box, not on a
GPU node.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import requests
import torch
from requests.adapters import HTTPAdapter

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.sglang import SGLangFleet
from megatron_rl_fp8.rollout.sglang.answers import MAX_IN_FLIGHT
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.http import Http, parse_completion, row_requests
from megatron_rl_fp8.sync.buckets import rollout_buckets

ROOT = Path(__file__).resolve().parents[1]
EOS = 2
MC = ModelConfig(
    arch="qwen3",
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=512,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    max_position_embeddings=256,
)


class UrllibHttp:
    """The package's client before issue 49: a new connection per request (urllib)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(self, path: str, payload: dict | None, *, timeout: float) -> bytes:
        req = urllib.request.Request(
            self.base_url + path,
            data=None if payload is None else json.dumps(payload).encode(),
            method="GET" if payload is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()


class RequestsPooled:
    """A requests.Session per server, its pool sized to the round's threads."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        if base_url not in _SESSIONS:
            s = requests.Session()
            s.trust_env = False
            s.mount("http://", HTTPAdapter(pool_connections=1, pool_maxsize=MAX_IN_FLIGHT))
            _SESSIONS[base_url] = s
        self.session = _SESSIONS[base_url]

    def call(self, path: str, payload: dict | None, *, timeout: float) -> bytes:
        resp = self.session.request(
            "GET" if payload is None else "POST",
            self.base_url + path,
            data=None if payload is None else json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )
        resp.raise_for_status()
        return resp.content


class PackageHttp:
    """The package's client (``rollout/sglang/http.py: Http``): urllib3's pool per server, its
    idle connections replaced, requests' layer left out."""

    def __init__(self, base_url: str):
        self.http = Http(base_url)

    def call(self, path: str, payload: dict | None, *, timeout: float) -> bytes:
        return self.http.raw(path, payload, timeout=timeout)


_SESSIONS: dict[str, requests.Session] = {}
CLIENTS = {
    "urllib (connection per request)": UrllibHttp,
    "requests.Session (pooled)": RequestsPooled,
    "package (urllib3 pool)": PackageHttp,
}


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf(), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf():
    return hf_config(MC, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)


def one_round(client, bodies: list[dict], rows: list[list[int]], version: str) -> dict:
    """``bodies`` all in flight (``MAX_IN_FLIGHT`` threads); wall seconds and decode seconds."""

    def call(i: int) -> float:
        if bodies[i] is None:  # the client's own cost: an endpoint with no engine work
            client.call("/health", None, timeout=300)
            return 0.0
        body = client.call("/generate", bodies[i], timeout=300)
        t0 = time.perf_counter()
        answer = json.loads(body)
        spent = time.perf_counter() - t0
        parse_completion(rows[i], answer, eos_token_id=EOS, expected_version=version)
        return spent

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(len(bodies), MAX_IN_FLIGHT)) as pool:
        decode = sum(pool.map(call, range(len(bodies))))
    return {"s": time.perf_counter() - t0, "decode_s": decode}


def bench(rows: int, tokens: int, n_requests: int, reps: int, python: str) -> list[dict]:
    out = []
    os.environ["SGLANG_TIMEOUT_KEEP_ALIVE"] = "600"  # the engines inherit it (module docstring)
    with tempfile.TemporaryDirectory() as work:
        cfg = RolloutConfig(
            engine="sglang",
            sglang=SGLangConfig(python=python, num_engines=2, work_dir=work, startup_timeout_s=600),
        )
        fleet = SGLangFleet(cfg, hf(), pad_token_id=0, eos_token_id=EOS)
        try:
            fp8 = RolloutFP8Config()
            fleet.update_weights(
                rollout_buckets(random_weights().items(), fp8, **fleet.export_options), version=0
            )
            version = "0"
            gen = torch.Generator().manual_seed(0)
            prompts = [
                [1, *torch.randint(4, MC.vocab_size, (8,), generator=gen).tolist()]
                for _ in range(max(rows, n_requests))
            ]
            common = dict(temperature=1.0, top_p=1.0, greedy=False, seed=1, eos_token_id=EOS)
            workloads = {
                "health/s": ([None] * (2 * n_requests), [[]] * (2 * n_requests)),
                "requests/s": (
                    row_requests(prompts[:n_requests], max_new_tokens=1, **common),
                    prompts[:n_requests],
                ),
                "round s": (
                    row_requests(prompts[:rows], max_new_tokens=tokens, **common),
                    prompts[:rows],
                ),
            }
            targets = {"one engine": fleet.engines[0].url, "router": fleet.router.url}
            for (target, url), (work_name, (bodies, prompt_rows)) in (
                (t, w) for t in targets.items() for w in workloads.items()
            ):
                best = {name: None for name in CLIENTS}
                for cls in CLIENTS.values():  # warm-up: connections, engine caches
                    one_round(cls(url), bodies[:8], prompt_rows[:8], version)
                for _ in range(reps):
                    for name, cls in CLIENTS.items():
                        r = one_round(cls(url), bodies, prompt_rows, version)
                        if best[name] is None or r["s"] < best[name]["s"]:
                            best[name] = r
                for name in CLIENTS:
                    r = best[name]
                    value = r["s"] if work_name == "round s" else len(bodies) / r["s"]
                    out.append(
                        {
                            "target": target,
                            "workload": work_name,
                            "client": name,
                            "value": value,
                            "decode_share": r["decode_s"] / r["s"],
                            "requests": len(bodies),
                        }
                    )
        finally:
            fleet.shutdown()
    return out


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'target':<11} {'workload':<11} {'client':<32} {'value':>9} {'ratio':>6} {'decode %':>8}"
    )
    base: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["target"], r["workload"])
        base.setdefault(key, r["value"])
        print(
            f"{r['target']:<11} {r['workload']:<11} {r['client']:<32} {r['value']:>9.2f} "
            f"{r['value'] / base[key]:>6.2f} {100 * r['decode_share']:>7.1f}%"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="requests of the rollout round")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request of the round")
    p.add_argument("--requests", type=int, default=256, help="one-token requests for requests/s")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--python", default=str(ROOT / ".venv-sglang" / "bin" / "python"))
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    if not Path(a.python).exists():
        raise SystemExit(f"--python {a.python} does not exist: run `make install-sglang` first")
    rows = bench(a.rows, a.tokens, a.requests, a.reps, a.python)
    print_rows(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
