"""One SGLang engine (a fleet of one, no router) against the in-process LocalEngine, on the same
synced weights.

Tolerances. Both engines run fp32 on CPU with identical weights (the FP8-rounded values of a
blockwise e4m3 export: SGLang's CPU engine gets them dequantized, LocalEngine dequantizes the same
codes itself and, configured with weight_quant=bf16 here, adds no activation quantization). What
differs is only the kernels (SGLang's torch-native attention + its RMSNorm/rotary vs transformers'),
i.e. fp32 summation order: measured differences are ~2e-7 in logprob. We assert 1e-4 on logprobs,
and identical greedy tokens (a flip would need two logits within ~1e-6 of each other; the prompts
below have no such ties for these seeds). Sampled-token logprobs are checked against
log softmax(logits / T) recomputed by a transformers forward pass on prompt + completion.

Recovery. One engine (module fixture) is killed deterministically (``KillServerAt``, the hook
behind ``MRF8_SGLANG_FAULT``) at each step of a sync and in a rollout; each time it is relaunched on
placeholder weights, the trainer's repeat of the sync (``SyncFailed``, ``RolloutLost``) gives it
exactly the new version, and it answers like the in-process engine. Every relaunch costs a 30-50 s
start on 2 CPU cores, so each point costs one; cheap failures (killed in startup) ride along. No
weight file is written at any point.
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
from megatron_rl_fp8.rollout.config import RolloutConfig
from megatron_rl_fp8.rollout.errors import RolloutEngineError, RolloutLost, SyncFailed
from megatron_rl_fp8.rollout.local import LocalEngine
from megatron_rl_fp8.rollout.sglang import KillServerAt, SGLangFleet, server_group_pids
from megatron_rl_fp8.rollout.sglang.config import SGLangConfig
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


def hf_cfg():
    return hf_config(MC, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def seeded_weights(seed: int, hf=None) -> dict[str, torch.Tensor]:
    """Random HF weights of `hf` (default: this file's model) for `seed`, on the CPU."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf or hf_cfg(), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():  # larger weights than the init: peaked, seed-dependent outputs
        v.mul_(1.0 if "norm" in k else 4.0)
    return sd


def _buckets(eng, named):
    """HF-named weights as the engine takes them: the export path's buckets, with its options."""
    return rollout_buckets(named, eng.fp8, **eng.export_options)


def sglang_engine(py, tmp, transport, **kw) -> SGLangFleet:
    cfg = RolloutConfig(
        engine="sglang",
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
    return SGLangFleet(cfg, hf_cfg(), pad_token_id=0, eos_token_id=EOS)


def sync_weights(eng, sd, version):
    eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)


def local_engine(sd, version):
    # Same FP8 weights, no activation quantization: the weights-only numerics of SGLang on CPU.
    eng = LocalEngine(hf_cfg(), pad_token_id=0, eos_token_id=EOS, fp8=RolloutFP8Config())
    eng.update_weights(_buckets(eng, quantize_for_rollout(sd.items(), FP8)), version=version)
    return eng


def _assert_greedy_match(eng, sd, version):
    ref = local_engine(sd, version).generate(
        PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0
    )
    got = eng.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    for a, b in zip(got, ref):
        assert a.response_ids == b.response_ids
        assert (
            max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < LOGPROB_TOL
        )


@pytest.fixture(scope="module")
def one(sglang_py, tmp_path_factory):
    eng = sglang_engine(sglang_py, tmp_path_factory.mktemp("sgl"), "tensor")
    yield eng
    pgid = _pgid(eng)
    eng.shutdown()
    assert server_group_pids(pgid) == []
    assert not list(eng.work_dir.rglob("*.safetensors"))  # no weight copy, ever


def _pgid(eng) -> int:
    """The engine's process group (its guard's pid, also ``<work_dir>/engine0.pid``)."""
    return int((eng.work_dir / "engine0.pid").read_text())


def test_both_transports_greedy_match_local_engine_across_syncs(one):
    # The transport is read at every sync: the first and last go through shared memory, the
    # middle one through the private gloo group.
    for version, transport in enumerate(("tensor", "distributed", "tensor")):
        one.cfg.transport = transport
        sd = seeded_weights(seed=version)
        sync_weights(one, sd, version)
        assert one.weight_version() == version and one.health()
        # Both transports time their parts (perf/sync_transfer_time_s, perf/sync_load_time_s).
        assert one.sender.times.transfer > 0 and one.sender.times.load > 0, transport
        _assert_greedy_match(one, sd, version)
        assert one.wait_s == 0.0  # one engine, no router: nothing waits on a slower engine
    one.cfg.transport = "tensor"
    assert one.stats["restarts"] == 0


def test_sampled_logprobs_are_log_softmax_at_temperature(one):
    import transformers

    eng, t = one, 0.7
    version = eng.weight_version()
    sd = dict(quantize_for_rollout(seeded_weights(seed=version).items(), FP8))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg(), dtype=torch.float32)
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


def test_generation_stops_on_every_end_id(one):
    """Weights that make one token the argmax at every position (blocks add nothing to the
    residual stream, every embedding is the ones vector, so logits are lm_head row sums): greedy
    decoding emits that token first, and the server stops there iff it is one of the end ids."""
    eng = one
    for target in (*EOS, 7):
        sd = seeded_weights(seed=0)
        for name, w in sd.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.zero_()
        sd["model.embed_tokens.weight"].fill_(1.0)
        sd["model.norm.weight"].fill_(1.0)
        sd["lm_head.weight"].zero_()
        sd["lm_head.weight"][target] = 1.0
        sync_weights(eng, sd, eng.weight_version() + 1)
        got = eng.generate(PROMPTS[:2], n=1, greedy=True, max_new_tokens=5, temperature=1.0)
        if target in EOS:
            assert all(c.response_ids == [target] and c.finished for c in got), got
        else:
            assert all(c.response_ids == [target] * 5 and not c.finished for c in got), got


def test_rollout_answers_are_decoded_outside_the_trainer_and_equal_the_threads(one, monkeypatch):
    """The default rollout.sglang.parse_answers=process (issue 43 #6): the real engine's answers,
    decoded in the helper process, are the ones its threads decode in the trainer's process."""
    from megatron_rl_fp8.rollout.sglang import answers

    eng, kw = one, dict(n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    sync_weights(eng, seeded_weights(seed=1), eng.weight_version() + 1)  # runs alone too
    helper = eng._answers
    assert helper is not None

    def refuse(*args, **kwargs):
        raise AssertionError("an answer was decoded in the trainer's process")

    monkeypatch.setattr(answers, "parse_completion", refuse)
    got = eng.generate(PROMPTS, **kw)
    monkeypatch.undo()
    eng._answers = None  # parse_answers=thread
    try:
        ref = eng.generate(PROMPTS, **kw)
    finally:
        eng._answers = helper
    for a, b in zip(got, ref, strict=True):
        assert (a.prompt_ids, a.response_ids, a.finished) == (
            b.prompt_ids,
            b.response_ids,
            b.finished,
        )
        # Two generate calls of the engine: float32 ulps apart where SGLang batched differently
        # (the decoding itself is exact: tests/unit/test_rollout_answers.py).
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=LOGPROB_TOL)


class _Recorder(KillServerAt):
    """KillServerAt that also records what the engine reported at each point it passed."""

    def __init__(self, engine, spec):
        super().__init__(engine, spec)
        self.versions: dict[str, list[int]] = {}

    def __call__(self, point):
        self.versions.setdefault(point, []).append(self.engine.weight_version())
        super().__call__(point)


@pytest.mark.parametrize(
    "spec",
    [
        # begin_update (seen in CI: died after a rollout, before the sync) is the trainer-level
        # test's fault, test_train_sglang.py; each point costs a 50 s relaunch.
        "push@3",  # a few buckets in: the server holds a mix of two versions
        "end_update",  # every bucket arrived; the version was not switched yet
    ],
)
def test_engine_killed_during_a_sync_is_relaunched_and_the_sync_runs_again(one, spec):
    # What the trainer does (trainer/engine_link.py EngineLink.sync): a SyncFailed sync is run again.
    version = one.weight_version() + 1
    sd, pgid, before = seeded_weights(seed=version), _pgid(one), one.stats["restarts"]
    one.fault_hook = hook = _Recorder(one, spec)
    try:
        with pytest.raises(SyncFailed, match=f"sync to version {version} failed"):
            sync_weights(one, sd, version)
        assert one.weight_version() == -1  # nothing is vouched for after a failed sync
        sync_weights(one, sd, version)
    finally:
        one.fault_hook = None
    assert hook.fired == [spec if "@" in spec else spec + "@1"]
    assert one.stats["restarts"] == before + 1 and one.weight_version() == version
    assert _pgid(one) != pgid and server_group_pids(pgid) == []  # nothing of it is left
    # While a sync is under way the engine vouches for no version at all.
    for point in ("begin_update", "push", "end_update"):
        assert set(hook.versions.get(point, [])) <= {-1}, (point, hook.versions)
    _assert_greedy_match(one, sd, version)


def test_engine_killed_in_a_rollout_and_again_in_its_relaunch_is_resynced(one):
    # A fleet of one cannot finish a rollout whose engine died: RolloutLost asks the trainer to
    # sync the relaunched engine (here killed once more while starting) and roll out again.
    version = one.weight_version()
    sd, before = seeded_weights(seed=version), one.stats["restarts"]
    one.fault_hook = hook = KillServerAt(one, "generate,startup")
    try:
        with pytest.raises(RolloutLost, match=f"weight version {version}"):
            one.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
        sync_weights(one, sd, version)
    finally:
        one.fault_hook = None
    assert hook.fired == ["generate@1", "startup@1"]
    assert one.stats["restarts"] == before + 2 and one.weight_version() == version
    _assert_greedy_match(one, sd, version)


def test_restarts_are_bounded_and_a_failure_leaves_nothing_running(one):
    # Last on the module's engine: it ends with the engine given up. max_restarts=1: the one
    # relaunch after the rollout dies in startup, and the sync that would wait for it names the
    # setting and the log; nothing of either process group is left.
    one.cfg.max_restarts = 1
    pgid = _pgid(one)
    one.fault_hook = KillServerAt(one, "generate,startup")
    try:
        with pytest.raises(RolloutLost):
            one.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
        with pytest.raises(
            RolloutEngineError,
            match=r"rollout\.sglang\.max_restarts=1.*its log: .*engine0-\d+\.log",
        ):
            sync_weights(one, seeded_weights(0), one.weight_version() + 1)
    finally:
        one.fault_hook = None
    relaunched = _pgid(one)
    assert relaunched != pgid and one.weight_version() == -1
    assert server_group_pids(pgid) == [] and server_group_pids(relaunched) == []


def test_a_server_that_cannot_bind_its_port_fails_fast_with_a_clear_error(sglang_py, tmp_path):
    # SGLang 0.5.23 logs the bind error and then hangs instead of exiting; the fleet must not
    # wait out startup_timeout_s (240 s here). max_restarts=0: the first launch is all it gets.
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(
            RolloutEngineError,
            match=rf"could not bind port {port}.*max_restarts=0",
        ):
            sglang_engine(sglang_py, tmp_path, "tensor", port=port, max_restarts=0)
    assert time.monotonic() - t0 < 120
    assert server_group_pids(int((tmp_path / "engine0.pid").read_text())) == []


# A trainer in miniature: it launches one engine, syncs it and waits.
_TRAINER = """
import sys
from tests.sglang.test_engine import sglang_engine, sync_weights, seeded_weights
eng = sglang_engine(sys.argv[1], sys.argv[2], "tensor")
sync_weights(eng, seeded_weights(0), 0)
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
            if pgid is None and (tmp_path / "engine0.pid").exists():
                pgid = int((tmp_path / "engine0.pid").read_text())
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
