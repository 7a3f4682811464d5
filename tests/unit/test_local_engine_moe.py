"""The in-process rollout engine serves a Qwen3-MoE model synced as the trainer exports it: the
Megatron state's experts under HF's per-expert names (what the HF files and SGLang hold), copied
into transformers' fused in-memory experts. BF16 sync: the engine's logits are transformers' own
from the same HF files, bit for bit. FP8 sync: each expert's weights are its block-FP8
dequantization. A sync missing one expert's tensor is refused as incomplete."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.fp8.quantize import dequantize_blockwise, quantize_blockwise
from megatron_rl_fp8.models.hf_mapping import hf_config, hf_state_to_mcore
from megatron_rl_fp8.rollout.local import LocalEngine
from megatron_rl_fp8.sync.buckets import export_for_rollout
from tests.unit.test_convert import make_hf_model, read_hf, tiny_model_config

TOKENS = {"pad_token_id": 0, "eos_token_id": 2}
BLOCKWISE = RolloutFP8Config(weight_quant="blockwise")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    hf_dir = make_hf_model(tmp_path_factory.mktemp("moe") / "hf", "qwen3_moe", hidden=128)
    m = tiny_model_config("qwen3_moe", hidden=128)
    return hf_dir, m, hf_state_to_mcore(read_hf(hf_dir), m)


def _engine(m, fp8=None):
    return LocalEngine(hf_config(m, bos_token_id=1, **TOKENS), fp8=fp8, **TOKENS)


def test_a_bf16_sync_serves_transformers_own_moe_model(moe):
    import transformers

    hf_dir, m, megatron_state = moe
    engine = _engine(m)
    engine.update_weights(
        export_for_rollout(megatron_state.items(), m, RolloutFP8Config()), version=1
    )
    assert engine.weight_version() == 1
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 53, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, ref(ids).logits)


def test_an_fp8_sync_loads_each_experts_block_fp8_weights(moe):
    _, m, megatron_state = moe
    engine = _engine(m, BLOCKWISE)
    engine.update_weights(export_for_rollout(megatron_state.items(), m, BLOCKWISE), version=2)
    experts = engine.model.model.layers[1].mlp.experts
    for e in (0, 3):
        fc1 = megatron_state[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        fc2 = megatron_state[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"]
        gate, up = fc1.chunk(2)
        want = [
            dequantize_blockwise(*quantize_blockwise(w, (128, 128)), dtype=torch.float32)
            for w in (gate, up, fc2)
        ]
        assert torch.equal(experts.gate_up_proj[e], torch.cat(want[:2]))
        assert torch.equal(experts.down_proj[e], want[2])
    assert len(experts._forward_pre_hooks) == 1  # the routed hidden states are fake-quantized
    router = megatron_state["decoder.layers.1.mlp.router.weight"]
    assert torch.equal(engine.model.model.layers[1].mlp.gate.weight, router)  # not FP8


def test_a_sync_missing_one_expert_is_incomplete(moe):
    _, m, megatron_state = moe
    engine = _engine(m)
    partial = {
        k: v
        for k, v in megatron_state.items()
        if k != "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"
    }
    with pytest.raises(RuntimeError, match="incomplete.*down_proj"):
        engine.update_weights(export_for_rollout(partial.items(), m, RolloutFP8Config()), version=1)
    assert engine.weight_version() == -1


def test_the_engine_returns_each_tokens_experts(moe):
    """``return_routes``: every prompt and response position but the last, the experts each
    layer's router chose there while generating (prefill, then one position per decode step;
    left padding dropped), equal to a forward over the whole sequence without the KV cache (fp32;
    up to a near-tie, which the cached and uncached attention may break differently)."""
    _, m, megatron_state = moe
    engine = LocalEngine(hf_config(m, bos_token_id=1, **TOKENS), return_routes=True, **TOKENS)
    engine.update_weights(
        export_for_rollout(megatron_state.items(), m, RolloutFP8Config()), version=1
    )
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]  # different lengths: the shorter is left-padded
    completions = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=1)
    routers = [layer.mlp.gate for layer in engine.model.model.layers]
    differ = total = 0
    for c in completions:
        seq = c.prompt_ids + c.response_ids
        assert c.routed_experts.shape == (len(seq) - 1, m.num_layers, m.moe_topk)
        seen = []
        hooks = [
            r.register_forward_hook(lambda _m, _a, out, s=seen: s.append(out[2])) for r in routers
        ]
        with torch.no_grad():
            engine.model(torch.tensor([seq[:-1]]))
        for h in hooks:
            h.remove()
        want = torch.stack(seen, dim=1)  # [positions, layers, k]
        same = (want.sort(-1).values == c.routed_experts.long().sort(-1).values).all(-1)
        differ += int((~same).sum())
        total += same.numel()
    assert differ <= 0.01 * total, (differ, total)
