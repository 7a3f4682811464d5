"""SGLang server engine against the in-process LocalEngine, on the same synced weights.

Tolerances. Both engines run fp32 on CPU with identical weights (the FP8-rounded values of a
blockwise e4m3 export: SGLang's CPU engine gets them dequantized, LocalEngine dequantizes the same
codes itself and, configured with weight_quant=bf16 here, adds no activation quantization). What
differs is only the kernels (SGLang's torch-native attention + its RMSNorm/rotary vs transformers'),
i.e. fp32 summation order: measured differences are ~2e-7 in logprob. We assert 1e-4 on logprobs,
and identical greedy tokens (a flip would need two logits within ~1e-6 of each other; the prompts
below have no such ties for these seeds). Sampled-token logprobs are checked against
log softmax(logits / T) recomputed by a transformers forward pass on prompt + completion.
"""

import os
import signal
import time

import pytest
import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.rollout.base import RolloutConfig, SGLangConfig
from megatron_rl_fp8.rollout.local import LocalEngine
from megatron_rl_fp8.rollout.sglang import SGLangEngine
from megatron_rl_fp8.sync.hf_mapping import hf_config
from megatron_rl_fp8.sync.quantize import quantize_for_rollout

pytestmark = pytest.mark.sglang

MC = ModelConfig(arch="qwen3", num_layers=2, hidden_size=128, ffn_hidden_size=512,
                 num_attention_heads=4, num_query_groups=2, vocab_size=53,
                 max_position_embeddings=32)
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 20, 21, 22, 23, 24, 25], [1, 30]]
FP8 = RolloutFP8Config(weight_quant="blockwise")
LOGPROB_TOL = 1e-4


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


def _engine(py, tmp, transport, **kw) -> SGLangEngine:
    cfg = RolloutConfig(fp8=FP8, sglang=SGLangConfig(
        python=py, transport=transport, work_dir=str(tmp), bucket_mb=0.25,
        startup_timeout_s=240, request_timeout_s=120, **kw))
    return SGLangEngine(cfg, _hf_cfg(), pad_token_id=0, eos_token_id=2)


def _local(sd, version):
    # Same FP8 weights, no activation quantization: the weights-only numerics of SGLang on CPU.
    eng = LocalEngine(_hf_cfg(), pad_token_id=0, eos_token_id=2, fp8=RolloutFP8Config())
    eng.update_weights(quantize_for_rollout(sd.items(), FP8), version=version)
    return eng


def _assert_greedy_match(eng, sd, version):
    ref = _local(sd, version).generate(PROMPTS, n=1, greedy=True, max_new_tokens=8,
                                       temperature=1.0)
    got = eng.generate(PROMPTS, n=1, greedy=True, max_new_tokens=8, temperature=1.0)
    for a, b in zip(got, ref):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) \
            < LOGPROB_TOL


@pytest.fixture(scope="module")
def tensor_engine(sglang_py, tmp_path_factory):
    eng = _engine(sglang_py, tmp_path_factory.mktemp("sgl"), "tensor")
    yield eng
    eng.shutdown()


def test_tensor_transport_greedy_matches_local_engine_across_syncs(tensor_engine):
    eng = tensor_engine
    for version in (0, 1):  # 0 starts the server from disk, 1 goes through the transport
        sd = _weights(seed=version)
        eng.update_weights(quantize_for_rollout(sd.items(), FP8), version=version)
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
            logits = model(ids).logits[0, len(c.prompt_ids) - 1:-1].float()
        want = torch.log_softmax(logits / t, -1).gather(
            -1, torch.tensor(c.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.response_logprobs), want, atol=LOGPROB_TOL), \
            (c.response_logprobs, want.tolist())


def test_killed_server_is_restarted_and_rollout_retried(tensor_engine):
    eng = tensor_engine
    version = eng.weight_version()
    sd = _weights(seed=version)
    before = eng.stats["restarts"]
    os.kill(eng.server_pid(), signal.SIGKILL)
    time.sleep(0.5)
    _assert_greedy_match(eng, sd, version)  # restarted from the disk copy of `version`
    assert eng.stats["restarts"] == before + 1 and eng.weight_version() == version


def test_server_dying_mid_sync_never_serves_a_mix(tensor_engine):
    eng = tensor_engine
    sd = _weights(seed=7)
    pid = eng.server_pid()

    def stream():
        for i, item in enumerate(quantize_for_rollout(sd.items(), FP8)):
            if i == 8:  # a few buckets in: the server dies half-way through the sync
                os.kill(pid, signal.SIGKILL)
            yield item

    eng.update_weights(stream(), version=7)
    assert eng.server_pid() != pid and eng.weight_version() == 7
    _assert_greedy_match(eng, sd, 7)


def test_distributed_and_disk_transports_match_local_engine(sglang_py, tmp_path):
    # The transport is read at every sync, so one server (one ~40 s CPU launch) serves both.
    eng = _engine(sglang_py, tmp_path, "distributed")
    try:
        eng.update_weights(quantize_for_rollout(_weights(seed=10).items(), FP8), version=0)
        for version, transport in ((1, "distributed"), (2, "disk"), (3, "distributed")):
            eng.cfg.transport = transport
            buckets = eng.stats["buckets"]
            sd = _weights(seed=10 + version)
            eng.update_weights(quantize_for_rollout(sd.items(), FP8), version=version)
            _assert_greedy_match(eng, sd, version)
            pushed = eng.stats["buckets"] - buckets
            assert pushed > 1 if transport == "distributed" else pushed == 0
        assert eng.stats["restarts"] == 0
    finally:
        eng.shutdown()
