"""A fleet of two SGLang CPU engines behind sglang-router, against the in-process LocalEngine.

One module fixture launches the fleet once (two ~40 s engine starts on 2 cores), colocated, so
the same fleet shows:

* after every broadcast sync, *each* engine (called directly, not through the router) gives the
  in-process engine's greedy tokens and logprobs on the same weights (tolerances: test_engine.py);
  rollouts through the router reach both engines; no weight file is written anywhere;
* the colocated sequencing: release -> (sync and rollout refused) -> resume weights -> sync ->
  resume KV cache -> rollout, recorded by the fleet in that order (on CPU the memory calls are
  logged no-ops); an engine relaunched while the fleet is released is asked to resume only what
  it released, and joins released at the next sync;
* a router that dies (SIGKILL) is relaunched in front of both engines and the rollout's failed
  requests go through the new one;
* an engine that hangs (SIGSTOP) while a rollout's requests are in flight: its requests time out
  and are retried, the rollout completes on the other engine with the right answers, the hung
  engine fails /health, leaves the router, is relaunched on placeholder weights, is re-synced by
  the next sync, rejoins the router and serves the new weights.
"""

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.errors import RolloutEngineError
from megatron_rl_fp8.rollout.sglang import SGLangFleet, server_group_pids
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
from megatron_rl_fp8.rollout.sglang.http import Http, generate_request, parse_completion
from megatron_rl_fp8.sync.buckets import rollout_buckets
from tests.sglang.test_engine import EOS, LOGPROB_TOL, PROMPTS, hf_cfg, local_engine, seeded_weights

pytestmark = pytest.mark.sglang
FP8 = RolloutFP8Config(weight_quant="blockwise")


@pytest.fixture(scope="module")
def fleet(sglang_py, tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    cfg = RolloutConfig(
        engine="sglang",
        placement="colocated",
        fp8=FP8,
        sglang=SGLangConfig(
            python=sglang_py,
            num_engines=2,
            work_dir=str(work),
            bucket_mb=0.25,
            startup_timeout_s=240,
            request_timeout_s=120,
        ),
    )
    fl = SGLangFleet(cfg, hf_cfg(), pad_token_id=0, eos_token_id=EOS)
    yield fl
    groups = [e.proc.pid for e in fl.engines if e.proc is not None] + [fl.router.proc.pid]
    fl.shutdown()
    assert all(server_group_pids(g) == [] for g in groups)
    assert not list(Path(work).rglob("*.safetensors"))  # no weight copy, ever


def _sync(fleet, seed, version):
    sd = seeded_weights(seed)
    fleet.update_weights(rollout_buckets(sd.items(), FP8, **fleet.export_options), version=version)
    return sd


def _greedy(url, version):
    """Greedy completions of PROMPTS from one engine, called directly."""
    req = generate_request(
        PROMPTS,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        greedy=True,
        seed=0,
        eos_token_id=EOS,
    )
    answers = Http(url).call("/generate", req, timeout=120)
    return [
        parse_completion(p, a, eos_token_id=EOS, expected_version=str(version))
        for p, a in zip(PROMPTS, answers)
    ]


def _assert_same(got, ref):
    for a, b in zip(got, ref, strict=True):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < (
            LOGPROB_TOL
        )


def _reference(sd, version):
    return local_engine(sd, version).generate(
        PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0
    )


def test_every_engine_serves_the_broadcast_weights_and_the_router_uses_both(fleet):
    for version, seed in ((1, 11), (2, 12)):
        sd = _sync(fleet, seed, version)
        ref = _reference(sd, version)
        for eng in fleet.engines:
            _assert_same(_greedy(eng.url, version), ref)
        before = fleet.request_counts()
        t0 = time.perf_counter()
        _assert_same(
            fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0), ref
        )
        # The time short of two requests in flight (perf/rollout_wait_time_s) is inside the call.
        assert 0 <= fleet.wait_s <= time.perf_counter() - t0
        after = fleet.request_counts()
        assert all(b > a for a, b in zip(before, after)), (before, after)
    assert fleet.weight_version() == 2


def test_colocated_memory_calls_come_in_order_and_guard_sync_and_rollout(fleet):
    fleet.memory_calls.clear()
    fleet.release_memory()
    with pytest.raises(RolloutEngineError, match="released"):
        _sync(fleet, 13, 3)
    with pytest.raises(RolloutEngineError, match="released"):
        fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    fleet.resume_memory(("weights",))
    sd = _sync(fleet, 13, 3)
    fleet.resume_memory(("kv_cache",))
    fleet.resume_memory(("kv_cache",))  # nothing released: no call
    _assert_same(
        fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0),
        _reference(sd, 3),
    )
    both = tuple(e.index for e in fleet.engines)
    assert fleet.memory_calls == [
        ("release_memory_occupation", ("weights", "kv_cache"), both),
        ("resume_memory_occupation", ("weights",), both),
        ("resume_memory_occupation", ("kv_cache",), both),
    ]


def test_a_relaunched_engine_is_asked_only_for_what_it_released(fleet):
    # Contract SG-7 (docs/gpu_contracts.md): SGLang's WeightUpdater.resume_memory_occupation
    # removes each tag from the process's offload_tags and raises on one it never released. An
    # engine relaunched while the others are released holds all its memory: resuming the weights
    # skips it, and the next sync makes it release its KV cache before all resume it at once.
    _sync(fleet, 17, 7)
    fleet.memory_calls.clear()
    fleet.release_memory()
    first, fresh = fleet.engines
    generation = fresh.generation
    fleet.relaunch(fresh, "test: a new process while the fleet is released")
    assert fresh.released == set() and first.released == {"weights", "kv_cache"}
    assert fresh.generation == generation + 1  # SG-11: its sync forms a new weight group
    fleet.resume_memory(("weights",))
    sd = _sync(fleet, 18, 8)  # waits for the relaunched engine
    fleet.resume_memory(("kv_cache",))
    _assert_same(
        fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0),
        _reference(sd, 8),
    )
    assert fleet.memory_calls == [
        ("release_memory_occupation", ("weights", "kv_cache"), (first.index, fresh.index)),
        ("resume_memory_occupation", ("weights",), (first.index,)),
        ("release_memory_occupation", ("kv_cache",), (fresh.index,)),
        ("resume_memory_occupation", ("kv_cache",), (first.index, fresh.index)),
    ]
    assert first.released == fresh.released == set()


def test_a_router_that_died_is_relaunched_in_front_of_the_engines(fleet):
    sd = _sync(fleet, 16, 6)
    old = fleet.router.proc
    os.killpg(old.pid, signal.SIGKILL)
    old.wait()
    got = fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    _assert_same(got, _reference(sd, 6))  # the failed requests were retried through a new router
    assert fleet.stats["router_restarts"] == 1 and fleet.router.proc is not old
    assert server_group_pids(old.pid) == []
    assert set(fleet.router.workers()) == {e.url for e in fleet.engines}


def test_engine_hung_mid_rollout_is_replaced_and_resynced(fleet):
    # SIGSTOP: the engine keeps its sockets but answers nothing (a hang; the trainer-level test
    # in test_train_sglang.py SIGKILLs one instead). Its requests time out, /health does too.
    sd = _sync(fleet, 14, 4)
    ref = _reference(sd, 4)
    hung = fleet.engines[-1]
    old_url = hung.url

    def stop(point):
        if point == "generate" and fleet.fault_hook is stop:
            fleet.fault_hook = None
            os.killpg(hung.proc.pid, signal.SIGSTOP)

    restarts = fleet.stats["restarts"]  # a CPU start can fail at random and be relaunched
    cfg = fleet.cfg
    fleet.cfg = dataclasses.replace(cfg, request_timeout_s=10)
    fleet.fault_hook = stop
    try:
        got = fleet.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    finally:
        fleet.cfg, fleet.fault_hook = cfg, None
    _assert_same(got, ref)  # the rollout finished, on the other engine
    assert fleet.stats["restarts"] == restarts + 1 == fleet.metrics()["rollout/engine_restarts"]
    assert fleet.stats["retried_requests"] >= 1
    assert hung.url != old_url and not hung.in_router  # relaunched, not yet synced
    assert old_url not in fleet.router.workers()
    assert fleet.metrics()["rollout/engines_serving"] == 1
    sd = _sync(fleet, 15, 5)  # waits for the relaunched engine, re-forms the group
    ref = _reference(sd, 5)
    for eng in fleet.engines:
        _assert_same(_greedy(eng.url, 5), ref)
    assert set(fleet.router.workers()) == {e.url for e in fleet.engines}
    assert fleet.metrics()["rollout/engines_serving"] == 2
