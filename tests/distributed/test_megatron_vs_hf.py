"""The actor (Megatron GPTModel, local spec) and transformers agree after the HF mapping, TP=1/2.

Both compute in fp32 from identical weights; the only differences are summation orders inside
GEMMs and softmax, so logits agree to ~1e-6 absolute at these sizes. We assert 1e-4.
"""

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank, world, arch, tp, rope_scaling_factor=None, shape=(3, 12)):
    import transformers

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
    from megatron_rl_fp8.models.hf_mapping import hf_config, mcore_state_to_hf
    from megatron_rl_fp8.models.logprobs import token_entropy, token_logprobs
    from megatron_rl_fp8.sync.gather import iter_full_params

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=tp), seed=3)
    mc = ModelConfig(
        arch=arch,
        vocab_size=50,
        tie_word_embeddings=arch == "llama",
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=max(128, shape[1]),
        rope_theta=500000.0 if rope_scaling_factor else 10000.0,
    )
    model = build_gpt_model(mc, transformer_config(mc, tensor_model_parallel_size=tp))
    with torch.no_grad():  # make norms and biases non-trivial so their mapping is exercised
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "layernorm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    hf_sd = dict(mcore_state_to_hf(iter_full_params(model, tp_group=g.tp, pp_group=g.pp), mc))
    ids = torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(shape[1])[None].expand(shape[0], -1)
    with torch.no_grad():
        logits = model(ids, pos, None)
        lp = token_logprobs(logits, ids, vocab_size=50, tp_rank=g.tp_rank)
        ent = token_entropy(logits, vocab_size=50, tp_rank=g.tp_rank, tp_group=g.tp)
    result = None
    if rank == 0:
        hm = transformers.AutoModelForCausalLM.from_config(hf_config(mc), dtype=torch.float32)
        hm.load_state_dict(hf_sd, strict=not mc.tie_word_embeddings)
        with torch.no_grad():
            ref = torch.log_softmax(hm(ids).logits.float(), -1)
        ref_lp = ref.gather(-1, ids[..., None])[..., 0]
        ref_ent = -(ref.exp() * ref).sum(-1)
        result = ((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item(), len(hf_sd))
    parallel.destroy()
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_match_transformers(arch, tp):
    lp_err, ent_err, n = run_distributed(_body, world_size=tp, args=(arch, tp))[0]
    assert lp_err < 1e-4 and ent_err < 1e-4, (lp_err, ent_err)
    assert n > 0


def test_llama31_rope_scaling_matches_transformers():
    """Megatron's Llama 3.1 RoPE scaling and transformers' rope_type 'llama3' (through hf_config)
    agree. The scaling only slows the low rotary frequencies (wavelengths > 2048 positions), so
    logits need long positions to show it (3000 tokens: 1.8e-4 without Megatron's scaling, over the
    1e-4 bound); the rotary inverse frequencies are compared directly as well."""
    lp_err, ent_err, _ = run_distributed(_body, world_size=1, args=("llama", 1, 8.0, (1, 3000)))[0]
    assert lp_err < 1e-4 and ent_err < 1e-4, (lp_err, ent_err)
    mine, theirs, unscaled = map(torch.tensor, run_distributed(_inv_freq_body, world_size=1)[0])
    assert torch.allclose(mine, theirs, rtol=1e-6, atol=0)  # the frequencies themselves agree
    assert not torch.allclose(mine, unscaled, rtol=1e-3)  # and the scaling did change them


def _inv_freq_body(rank, world):
    import transformers

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
    from megatron_rl_fp8.models.hf_mapping import hf_config

    parallel.initialize(parallel.ParallelConfig(), seed=3)
    out = []
    for factor in (8.0, None):
        mc = ModelConfig(
            arch="llama", vocab_size=50, rope_theta=500000.0, rope_scaling_factor=factor
        )
        out.append(build_gpt_model(mc, transformer_config(mc)).rotary_pos_emb.inv_freq.float())
        if factor:
            hm = transformers.AutoModelForCausalLM.from_config(hf_config(mc))
            out.append(hm.model.rotary_emb.inv_freq.float())
    parallel.destroy()
    return [t.tolist() for t in out]  # plain lists: tensors cannot cross the result queue
