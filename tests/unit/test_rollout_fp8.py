"""FP8 rollout weights: the sync-path quantization and the in-process engine's W8A8 numerics."""

import pytest
import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.fp8.quantize import dequantize_blockwise, fake_quant_groups
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import hf_config
from megatron_rl_fp8.rollout.local import LocalEngine
from megatron_rl_fp8.sync.buckets import rollout_buckets
from megatron_rl_fp8.sync.quantize import (
    dequantize_stream,
    is_fp8_weight,
    quantize_for_rollout,
)

MODEL = ModelConfig(
    arch="qwen3",
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=320,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=53,
    max_position_embeddings=32,
)
BLOCKWISE = RolloutFP8Config(weight_quant="blockwise")


def _hf_state(seed=0):
    torch.manual_seed(seed)
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(MODEL))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_which_weights_are_fp8():
    assert is_fp8_weight("model.layers.0.self_attn.q_proj.weight")
    assert is_fp8_weight("model.layers.11.mlp.down_proj.weight")
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert not is_fp8_weight(name), name


@pytest.mark.parametrize("quant", ["blockwise", "per_tensor"])
def test_quantize_stream_round_trip(quant):
    state = _hf_state()
    cfg = RolloutFP8Config(weight_quant=quant)
    sent = list(quantize_for_rollout(state.items(), cfg))
    names = [n for n, _ in sent]
    for name, t in state.items():
        if is_fp8_weight(name):
            i = names.index(name)
            codes, scale = sent[i][1], sent[i + 1][1]
            assert names[i + 1] == name + "_scale_inv"  # scale follows its weight (streaming)
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == t.shape
            assert scale.dtype == torch.float32
            if quant == "blockwise":
                # ffn 320 is not a multiple of 128: ragged edge blocks get their own scale.
                assert scale.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:
            assert names.count(name) == 1
    back = dict(dequantize_stream(sent, block=cfg.weight_block))
    assert back.keys() == state.keys()
    for name, t in state.items():
        if is_fp8_weight(name):
            # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 relative to each element's scale group
            # amax; the relative Frobenius error of Gaussian-like weights is ~2.5%.
            rel = (back[name] - t).norm() / t.norm()
            assert 0 < rel < 0.05, (name, rel)
        else:
            assert torch.equal(back[name], t), name


def test_bf16_rollout_passes_tensors_through():
    state = _hf_state()
    sent = list(quantize_for_rollout(state.items(), RolloutFP8Config()))
    assert [n for n, _ in sent] == list(state)
    assert all(a is b for (_, a), b in zip(sent, state.values()))


def test_dequantize_stream_rejects_orphans():
    w = torch.randn(8, 8)
    sent = list(quantize_for_rollout([("model.layers.0.mlp.up_proj.weight", w)], BLOCKWISE))
    with pytest.raises(ValueError, match="without its FP8 weight"):
        list(dequantize_stream(sent[1:]))
    with pytest.raises(ValueError, match="without a _scale_inv"):
        list(dequantize_stream(sent[:1]))


def _engine(fp8):
    tok = dict(pad_token_id=0, eos_token_id=2)
    return LocalEngine(hf_config(MODEL, bos_token_id=1, **tok), fp8=fp8, **tok)


def test_engine_loads_fp8_weights_and_quantizes_linear_inputs():
    state = _hf_state()
    engine = _engine(BLOCKWISE)
    engine.update_weights(rollout_buckets(state.items(), BLOCKWISE), version=3)
    assert engine.weight_version() == 3
    params = dict(engine.model.named_parameters())
    codes, scale = (
        t
        for n, t in quantize_for_rollout(
            [("model.layers.1.mlp.gate_proj.weight", state["model.layers.1.mlp.gate_proj.weight"])],
            BLOCKWISE,
        )
    )
    assert torch.equal(
        params["model.layers.1.mlp.gate_proj.weight"],
        dequantize_blockwise(codes, scale, dtype=torch.float32),
    )
    assert torch.equal(params["model.embed_tokens.weight"], state["model.embed_tokens.weight"])

    # Every FP8 linear sees an input already on the e4m3 grid of its 1x128 groups: quantizing
    # it again changes nothing. Non-FP8 modules (the LM head) see unquantized activations.
    seen = {}

    def grab(name):
        def hook(_m, args, _out):
            seen[name] = args[0].detach()

        return hook

    for name, mod in engine.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(grab(name))
    engine.model(torch.tensor([[1, 10, 11, 12, 13]]))
    fp8_inputs = [n for n in seen if is_fp8_weight(n + ".weight")]
    assert len(fp8_inputs) == 14
    for n in fp8_inputs:
        assert torch.equal(fake_quant_groups(seen[n], 128), seen[n]), n
    assert not torch.equal(fake_quant_groups(seen["lm_head"], 128), seen["lm_head"])


def test_fp8_engine_logprobs_close_to_bf16():
    state = _hf_state()
    ref, fp8 = _engine(RolloutFP8Config()), _engine(BLOCKWISE)
    ref.update_weights(rollout_buckets(state.items(), RolloutFP8Config()), version=0)
    fp8.update_weights(rollout_buckets(state.items(), BLOCKWISE), version=0)
    prompts = [[1, 10, 11, 12], [1, 20, 21]]
    a = ref.generate(prompts, n=1, max_new_tokens=4, temperature=1.0, greedy=True)
    ids = torch.tensor([prompts[0] + a[0].response_ids])
    with torch.no_grad():
        la = torch.log_softmax(ref.model(ids).logits, -1)
        lb = torch.log_softmax(fp8.model(ids).logits, -1)
    diff = (la - lb).abs().max().item()
    # FP8 noise is real (nonzero) but small for a random init: ~1e-3..1e-2 nats.
    assert 0 < diff < 0.1
