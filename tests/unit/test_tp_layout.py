"""TP shard merge/split (pure) and the HF mapping's QKV / gate-up layouts."""

import pytest
import torch

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import (
    MappingError,
    expected_hf_names,
    hf_state_to_mcore,
    mcore_to_hf,
)
from megatron_rl_fp8.sync.gather import merge_tp_shards, split_tp_shard, tp_partition_dim


@pytest.mark.parametrize(
    "name, shape",
    [
        ("decoder.layers.0.self_attention.linear_qkv.weight", (32, 8)),
        ("decoder.layers.0.mlp.linear_fc1.weight", (24, 8)),
        ("decoder.layers.0.mlp.linear_fc2.weight", (8, 12)),
        ("decoder.layers.0.self_attention.linear_proj.weight", (8, 16)),
        ("embedding.word_embeddings.weight", (256, 8)),
        ("decoder.layers.0.input_layernorm.weight", (8,)),
    ],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_then_merge_is_identity(name, shape, tp):
    full = torch.randn(shape)
    shards = [split_tp_shard(name, full, r, tp) for r in range(tp)]
    assert torch.equal(merge_tp_shards(name, shards), full)


def test_fc1_shards_hold_gate_and_up_halves():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    full = torch.cat([gate, up])
    shard0 = split_tp_shard("mlp.linear_fc1.weight", full, 0, 2)
    assert torch.equal(shard0, torch.cat([gate[:2], up[:2]]))
    assert tp_partition_dim("mlp.linear_fc2.weight") == 1


def test_qkv_split_follows_group_interleave():
    m = ModelConfig(
        arch="qwen2", hidden_size=8, num_attention_heads=4, num_query_groups=2, head_dim=2
    )
    # rows per group: q (2 heads * 2) + k (2) + v (2) = 8; two groups.
    rows = torch.arange(16.0)[:, None]
    out = dict(mcore_to_hf("decoder.layers.3.self_attention.linear_qkv.weight", rows, m))
    assert out["model.layers.3.self_attn.q_proj.weight"].flatten().tolist() == [
        0,
        1,
        2,
        3,
        8,
        9,
        10,
        11,
    ]
    assert out["model.layers.3.self_attn.k_proj.weight"].flatten().tolist() == [4, 5, 12, 13]
    assert out["model.layers.3.self_attn.v_proj.weight"].flatten().tolist() == [6, 7, 14, 15]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_to_mcore_to_hf_round_trip(arch):
    m = ModelConfig(arch=arch, vocab_size=50)
    hf = {}
    for name in expected_hf_names(m):
        hf[name] = torch.randn(3, 5)  # shapes are irrelevant except for the fused ones below
    d, h = m.kv_channels, m.hidden_size
    for i in range(m.num_layers):
        p = f"model.layers.{i}.self_attn."
        hf[p + "q_proj.weight"] = torch.randn(m.num_attention_heads * d, h)
        hf[p + "k_proj.weight"] = torch.randn(m.num_query_groups * d, h)
        hf[p + "v_proj.weight"] = torch.randn(m.num_query_groups * d, h)
        if m.qkv_bias:
            hf[p + "q_proj.bias"] = torch.randn(m.num_attention_heads * d)
            hf[p + "k_proj.bias"] = torch.randn(m.num_query_groups * d)
            hf[p + "v_proj.bias"] = torch.randn(m.num_query_groups * d)
    hf["model.embed_tokens.weight"] = torch.randn(50, h)
    hf["lm_head.weight"] = torch.randn(50, h)
    mc = hf_state_to_mcore(hf, m, padded_vocab_size=128)
    assert mc["embedding.word_embeddings.weight"].shape == (128, h)
    back = {}
    for name, t in mc.items():
        back.update(dict(mcore_to_hf(name, t, m)))
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_missing_and_unknown_tensors_are_named():
    m = ModelConfig(arch="llama")
    with pytest.raises(MappingError, match="missing .*lm_head.weight"):
        hf_state_to_mcore({}, m)
    with pytest.raises(MappingError, match="no HF mapping for Megatron tensor 'decoder.foo'"):
        mcore_to_hf("decoder.foo", torch.zeros(1), m)
