"""SGLang server engine against the in-process LocalEngine, on the same synced weights.

Tolerances. Both engines run fp32 on CPU with identical weights (the FP8-rounded values of a
blockwise e4m3 export: SGLang's CPU engine gets them dequantized, LocalEngine dequantizes the same
codes itself and, configured with weight_quant=bf16 here, adds no activation quantization). What
differs is only the kernels (SGLang's torch-native attention + its RMSNorm/rotary vs transformers'),
i.e. fp32 summation order: measured differences are ~2e-7 in logprob. We assert 1e-4 on logprobs,
and identical greedy tokens (a flip would need two logits within ~1e-6 of each other; the prompts
below have no such ties for these seeds). Sampled-token logprobs are checked against
log softmax(logits / T) recomputed by a transformers forward pass on prompt + completion.

Recovery. One server (module fixture) is killed deterministically (``KillServerAt``, the hook
behind ``MRF8_SGLANG_FAULT``) at every point where the engine talks to it; each time the next
rollout must come from a relaunched server serving exactly the new version, with the same
logprobs as the in-process engine. Every relaunch costs a 30-50 s server start on 2 CPU cores, so
each point costs one, and cheap failures (a relaunch killed in startup) ride along.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.rollout.base import RolloutConfig, SGLangConfig
from megatron_rl_fp8.rollout.local import LocalEngine
from megatron_rl_fp8.rollout.sglang import (
    KillServerAt,
    SGLangEngine,
    SGLangServerError,
    server_group_pids,
)
from megatron_rl_fp8.sync.buckets import rollout_buckets
from megatron_rl_fp8.sync.quantize import quantize_for_rollout

pytestmark = pytest.mark.sglang

MC = ModelConfig(
    arch="qwen3",
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=512,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=53,
    max_position_embeddings=32,
)
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 20, 21, 22, 23, 24, 25], [1, 30]]
FP8 = RolloutFP8Config(weight_quant="blockwise")
LOGPROB_TOL = 1e-4
EOS = [2, 3]  # two end ids, as Qwen's chat models have (<|im_end|>, <|endoftext|>)


def _hf_cfg():
    return hf_config(MC, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_cfg(), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():  # larger weights than the init: peaked, seed-dependent outputs
        v.mul_(1.0 if "norm" in k else 4.0)
    return sd


def _buckets(eng, named):
    """HF-named weights as the engine takes them: the export path's buckets, with its options."""
    return rollout_buckets(named, eng.fp8, **eng.export_options)


def _engine(py, tmp, transport, **kw) -> SGLangEngine:
    cfg = RolloutConfig(
        fp8=FP8,
        sglang=SGLangConfig(
            python=py,
            transport=transport,
            work_dir=str(tmp),
            bucket_mb=0.25,
            startup_timeout_s=240,
            request_timeout_s=120,
            **kw,
        ),
    )
    return SGLangEngine(cfg, _hf_cfg(), pad_token_id=0, eos_token_id=EOS)


def _local(sd, version):
    # Same FP8 weights, no activation quantization: the weights-only numerics of SGLang on CPU.
    eng = LocalEngine(_hf_cfg(), pad_token_id=0, eos_token_id=EOS, fp8=RolloutFP8Config())
    eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)
    return eng


def _assert_greedy_match(eng, sd, version):
    ref = _local(sd, version).generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    got = eng.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    for a, b in zip(got, ref):
        assert a.response_ids == b.response_ids
        assert (
            max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < LOGPROB_TOL
        )


@pytest.fixture(scope="module")
def tensor_engine(sglang_py, tmp_path_factory):
    eng = _engine(sglang_py, tmp_path_factory.mktemp("sgl"), "tensor")
    yield eng
    pgid = eng.server_pid()
    eng.shutdown()
    assert pgid is None or server_group_pids(pgid) == []


def test_tensor_transport_greedy_matches_local_engine_across_syncs(tensor_engine):
    eng = tensor_engine
    for version in (0, 1):  # 0 starts the server from disk, 1 goes through the transport
        sd = _weights(seed=version)
        eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)
        assert eng.weight_version() == version and eng.health()
        _assert_greedy_match(eng, sd, version)
    assert eng.stats["buckets"] > 1  # the second sync really went through several buckets
    assert eng.stats["restarts"] == 0
    kept = sorted(p.name for p in eng.weights_root.iterdir())
    assert kept == ["v1"]  # only the last complete version is kept (the restart source)


def test_sampled_logprobs_are_log_softmax_at_temperature(tensor_engine):
    import transformers

    eng, t = tensor_engine, 0.7
    sd = dict(quantize_for_rollout(_weights(seed=1).items(), FP8))
    model = transformers.AutoModelForCausalLM.from_config(_hf_cfg(), dtype=torch.float32)
    from megatron_rl_fp8.sync.quantize import dequantize_stream

    model.load_state_dict(dict(dequantize_stream(sd.items())))
    completions = eng.generate(PROMPTS, n=3, max_new_tokens=8, temperature=t, seed=5)
    assert len(completions) == len(PROMPTS) * 3
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
        want = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(c.response_ids)[:, None])[
            :, 0
        ]
        assert torch.allclose(torch.tensor(c.response_logprobs), want, atol=LOGPROB_TOL), (
            c.response_logprobs,
            want.tolist(),
        )


def test_generation_stops_on_every_end_id(tensor_engine):
    """Weights that make one token the argmax at every position (blocks add nothing to the
    residual stream, every embedding is the ones vector, so logits are lm_head row sums): greedy
    decoding emits that token first, and the server stops there iff it is one of the end ids."""
    eng = tensor_engine
    for target in (*EOS, 7):
        sd = _weights(seed=0)
        for name, w in sd.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.zero_()
        sd["model.embed_tokens.weight"].fill_(1.0)
        sd["model.norm.weight"].fill_(1.0)
        sd["lm_head.weight"].zero_()
        sd["lm_head.weight"][target] = 1.0
        version = eng.weight_version() + 1
        eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)
        got = eng.generate(PROMPTS[:2], n=1, greedy=True, max_new_tokens=5, temperature=1.0)
        if target in EOS:
            assert all(c.response_ids == [target] and c.finished for c in got), got
        else:
            assert all(c.response_ids == [target] * 5 and not c.finished for c in got), got


class _Recorder(KillServerAt):
    """KillServerAt that also records what the engine reported at each point it passed."""

    def __init__(self, engine, spec):
        super().__init__(engine, spec)
        self.versions: dict[str, list[int]] = {}

    def __call__(self, point):
        self.versions.setdefault(point, []).append(self.engine.weight_version())
        super().__call__(point)


def _sync_through_fault(eng, version, spec, restarts=1):
    """Sync ``version`` with the server killed per ``spec``; check it recovered onto ``version``."""
    sd = _weights(seed=version)
    pgid, before = eng.server_pid(), eng.stats["restarts"]
    eng.fault_hook = hook = _Recorder(eng, spec)
    try:
        eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)
        _assert_greedy_match(eng, sd, version)
    finally:
        eng.fault_hook = None
    assert hook.fired == [p if "@" in p else p + "@1" for p in spec.split(",")]
    assert eng.stats["restarts"] == before + restarts and eng.weight_version() == version
    assert eng.server_pid() != pgid and server_group_pids(pgid) == []  # nothing of it is left
    assert sorted(p.name for p in eng.weights_root.iterdir()) == [f"v{version}"]
    # While a sync is under way the engine vouches for no version at all.
    for point in ("begin_update", "push", "end_update", "disk_update"):
        assert set(hook.versions.get(point, [])) <= {-1}, (point, hook.versions)


@pytest.mark.parametrize(
    "spec",
    [
        "begin_update",  # seen in CI: died after a rollout, before the sync
        "push@3",  # a few buckets in: the server holds a mix of two versions
        "end_update",
        "check_version",
    ],
)
def test_server_killed_during_a_sync_is_relaunched_on_the_new_version(tensor_engine, spec):
    _sync_through_fault(tensor_engine, tensor_engine.weight_version() + 1, spec)


def test_server_killed_in_a_rollout_and_again_in_its_relaunch_recovers_within_max_restarts(
    tensor_engine,
):
    eng = tensor_engine
    version = eng.weight_version()
    sd, before = _weights(seed=version), eng.stats["restarts"]
    eng.cfg.max_restarts = 2
    eng.fault_hook = hook = KillServerAt(eng, "generate,startup")
    try:
        _assert_greedy_match(eng, sd, version)
    finally:
        eng.fault_hook = None
    assert hook.fired == ["generate@1", "startup@1"]
    assert eng.stats["restarts"] == before + 2 and eng.weight_version() == version


def test_disk_and_distributed_transports_match_local_engine_and_recover(tensor_engine):
    # The transport is read at every sync, so the module's server serves all three.
    eng = tensor_engine
    version = eng.weight_version()
    buckets = eng.stats["buckets"]
    try:
        for transport in ("distributed", "disk", "distributed"):
            eng.cfg.transport = transport
            version += 1
            sd = _weights(seed=version)
            eng.update_weights(
                _buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version
            )
            _assert_greedy_match(eng, sd, version)
            pushed, buckets = eng.stats["buckets"] - buckets, eng.stats["buckets"]
            assert pushed > 1 if transport == "distributed" else pushed == 0
        eng.cfg.transport = "disk"
        _sync_through_fault(eng, version + 1, "disk_update")
        # A distributed push fails on a group whose peer died (gloo notices at once).
        eng.cfg.transport = "distributed"
        eng.update_weights(
            _buckets(eng, quantize_for_rollout(_weights(seed=version + 2).items(), FP8)),
            version=version + 2,
        )  # forms the group on the relaunched server
        _sync_through_fault(eng, version + 3, "push@2")
    finally:
        eng.cfg.transport = "tensor"


def test_restarts_are_bounded_and_a_failure_leaves_nothing_running(tensor_engine):
    # Last on the module's server: it ends with the server given up. max_restarts=1, and the one
    # relaunch dies in startup: a clear error naming the setting; no version is claimed; nothing
    # of either server is left.
    eng = tensor_engine
    eng.cfg.max_restarts = 1
    pgid = eng.server_pid()
    eng.fault_hook = KillServerAt(eng, "generate,startup")
    try:
        with pytest.raises(
            SGLangServerError,
            match=r"rollout\.sglang\.max_restarts=1.*server log: .*server-\d+\.log",
        ):
            eng.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    finally:
        eng.fault_hook = None
    relaunched = int((eng.work_dir / "server.pid").read_text())
    assert relaunched != pgid and eng.server_pid() is None and eng.weight_version() == -1
    assert server_group_pids(pgid) == [] and server_group_pids(relaunched) == []


def test_a_server_that_cannot_bind_its_port_fails_fast_with_a_clear_error(sglang_py, tmp_path):
    # SGLang 0.5.23 logs the bind error and then hangs instead of exiting; the engine must not
    # wait out startup_timeout_s (240 s here). max_restarts=0: the first launch is all it gets.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        eng = _engine(sglang_py, tmp_path, "tensor", port=port, max_restarts=0)
        t0 = time.monotonic()
        try:
            with pytest.raises(
                SGLangServerError,
                match=rf"max_restarts=0\); last error: .*"
                rf"could not bind port {port}",
            ):
                eng.update_weights(
                    _buckets(eng, quantize_for_rollout(_weights(0).items(), FP8)), version=0
                )
        finally:
            eng.shutdown()
    assert time.monotonic() - t0 < 120
    assert eng.weight_version() == -1
    assert server_group_pids(int((tmp_path / "server.pid").read_text())) == []


# A trainer in miniature: an SGLangEngine whose first sync launches the server.
_TRAINER = """
import sys
from megatron_rl_fp8.sync.quantize import quantize_for_rollout
from tests.sglang.test_engine import FP8, _buckets, _engine, _weights
eng = _engine(sys.argv[1], sys.argv[2], "tensor")
eng.update_weights(_buckets(eng, quantize_for_rollout(_weights(0).items(), FP8)), version=0)
print("serving", flush=True)
sys.stdin.read()  # until killed
"""


def _sglang_workers(pgid: int) -> int:
    n = 0
    for pid in server_group_pids(pgid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        n += cmdline.startswith(b"sglang::") or b"spawn_main" in cmdline
    return n


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigkilled_trainer_leaves_no_server_process_behind(sglang_py, tmp_path):
    # Killed while SGLang's scheduler and detokenizer are still importing, before they arm their
    # own parent-death signal: without the guard they survive the trainer (seen: for good).
    root = Path(__file__).resolve().parents[2]
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, sglang_py, str(tmp_path)],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    pgid = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and trainer.poll() is None:
            if pgid is None and (tmp_path / "server.pid").exists():
                pgid = int((tmp_path / "server.pid").read_text())
            if pgid is not None and _sglang_workers(pgid) >= 2:
                break
            time.sleep(0.1)
        assert pgid is not None and _sglang_workers(pgid) >= 2, "SGLang never started its workers"
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5
        while server_group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server_group_pids(pgid) == []
    finally:
        trainer.kill()
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
