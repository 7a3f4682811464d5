"""The actor (Megatron GPTModel, local spec) and transformers agree after the HF mapping, TP=1/2.

Both compute in fp32 from identical weights; the only differences are summation orders inside
GEMMs and softmax, so logits agree to ~1e-6 absolute at these sizes. We assert 1e-4.
"""

import pytest
import torch

from tests.dist_utils import run_distributed


def _body(rank, world, arch, tp):
    import transformers

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
    from megatron_rl_fp8.models.logprobs import token_entropy, token_logprobs
    from megatron_rl_fp8.sync.gather import iter_full_params
    from megatron_rl_fp8.sync.hf_mapping import hf_config, mcore_state_to_hf

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=tp), seed=3)
    mc = ModelConfig(arch=arch, vocab_size=50, tie_word_embeddings=arch == "llama")
    model = build_gpt_model(mc, transformer_config(mc, tensor_model_parallel_size=tp))
    with torch.no_grad():  # make norms and biases non-trivial so their mapping is exercised
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "layernorm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    hf_sd = dict(mcore_state_to_hf(iter_full_params(model, tp_group=g.tp, pp_group=g.pp), mc))
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None].expand(3, -1)
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
        result = ((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item(),
                  len(hf_sd))
    parallel.destroy()
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_match_transformers(arch, tp):
    lp_err, ent_err, n = run_distributed(_body, world_size=tp, args=(arch, tp))[0]
    assert lp_err < 1e-4 and ent_err < 1e-4, (lp_err, ent_err)
    assert n > 0
