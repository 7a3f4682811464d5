"""``model.attention_backend: sdpa``: the local spec's core attention through torch's
scaled_dot_product_attention computes what Megatron's unfused DotProductAttention computes.

* The module in float64 against attention written out by hand (GQA, causal mask, scale).
* Whole models, same weights, unfused vs SDPA attention: logits and every gradient agree at TP=1
  and at TP=2 (each rank's heads), fp32 on the CPU.
"""

import math

import pytest
import torch

from megatron_rl_fp8.models.config import ModelConfig
from tests.dist_utils import run_distributed

MODEL = dict(arch="qwen3", vocab_size=64, num_attention_heads=4, num_query_groups=2)


def test_auto_is_sdpa_on_gpus_only():
    assert ModelConfig().uses_sdpa(on_cpu=False) and not ModelConfig().uses_sdpa(on_cpu=True)
    assert ModelConfig(attention_backend="sdpa").uses_sdpa(on_cpu=True)
    assert not ModelConfig(attention_backend="unfused").uses_sdpa(on_cpu=False)


def test_an_unknown_backend_is_refused_naming_the_field():
    from megatron_rl_fp8.config import RunConfig
    from megatron_rl_fp8.config_utils import ConfigError, from_dict

    with pytest.raises(ConfigError, match="attention_backend"):
        from_dict(RunConfig, {"model": {"attention_backend": "flash"}})


def _reference(q, k, v, scale):
    """[s, b, n, d] queries, [s, b, g, d] keys / values -> [s, b, n * d], causal, by hand."""
    s, b, n, d = q.shape
    rep = n // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(dim=-1), v)
    return out.reshape(s, b, n * d)


def _module_body(rank, world):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.attention import SDPAttention
    from megatron_rl_fp8.models.gpt import transformer_config

    parallel.initialize(parallel.ParallelConfig(), seed=5)
    mc = ModelConfig(**MODEL)
    attn = SDPAttention(transformer_config(mc), 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(12, 2, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    got = attn(q, k, v, None)
    parallel.destroy()
    return (got - _reference(q, k, v, 1 / math.sqrt(16))).abs().max().item()


def test_sdpa_attention_is_attention_in_float64():
    assert run_distributed(_module_body, world_size=1)[0] < 1e-12


def _models_body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.attention import SDPAttention
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config

    parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=world), seed=5)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None].expand(2, -1)
    out = []
    for backend in ("unfused", "sdpa"):
        mc = ModelConfig(**MODEL, attention_backend=backend)
        torch.manual_seed(5)
        model = build_gpt_model(mc, transformer_config(mc, tensor_model_parallel_size=world))
        core = model.decoder.layers[0].self_attention.core_attention
        assert isinstance(core, SDPAttention) == (backend == "sdpa")
        logits = model(ids, pos, None)
        logits.square().mean().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out.append((logits.detach(), grads))
    parallel.destroy()
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*out)]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_model_with_sdpa_attention_equals_the_unfused_one(tp):
    for logit_err, grad_err in run_distributed(_models_body, world_size=tp):
        assert logit_err < 1e-5 and grad_err < 1e-5, (logit_err, grad_err)


def _saved_body(rank, world):
    """Bytes per token the first layer saves for its backward, measured and planned, for each
    attention backend, fp32 and bf16, GQA and MHA."""

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
    from megatron_rl_fp8.plan.measure import FirstLayerSaved
    from megatron_rl_fp8.plan.model_bytes import layer_activation_bytes

    parallel.initialize(parallel.ParallelConfig(), seed=5)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    for groups in (2, 4):
        for dtype in ("float32", "bfloat16"):
            for backend in ("unfused", "sdpa"):
                mc = ModelConfig(
                    **{**MODEL, "num_query_groups": groups},
                    hidden_size=128,
                    ffn_hidden_size=256,
                    attention_backend=backend,
                    params_dtype=dtype,
                )
                model = build_gpt_model(mc, transformer_config(mc, on_cpu=True))
                saved = FirstLayerSaved(model)
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    model(ids, torch.arange(64)[None], None)
                a = 2 if dtype == "bfloat16" else 4
                kw = dict(a=a, tp=1, sequence_parallel=False, seq=64, spec="local")
                planned = layer_activation_bytes(
                    mc, **kw, fused_swiglu=False, sdpa=backend == "sdpa"
                )
                out[groups, dtype, backend] = (saved.nbytes / 64, planned)
    parallel.destroy()
    return out


def test_the_planner_counts_what_each_attention_keeps():
    """Per token of a 64-token row: in fp32 the unfused attention keeps the 4 x 4 heads x 64
    s^2 scores and the [64, 64] causal mask (64 bytes per token) that SDPA does not, and SDPA
    the fp32 log-sum-exp, 4 x 4 heads: the planner's difference plus the mask it leaves out is
    the measured one, exactly. Every combination of fp32 / bf16, GQA / MHA and backend is
    planned within 5% of what the layer saves (the small terms left out: norm statistics, RoPE
    tables, the mask; under MHA the QKV output, which V's view keeps alive, is counted)."""
    got = run_distributed(_saved_body, world_size=1)[0]
    (unfused, plan_u), (sdpa, plan_s) = got[2, "float32", "unfused"], got[2, "float32", "sdpa"]
    assert plan_u - plan_s == 4 * 4 * 64 - 4 * 4
    assert unfused - sdpa == plan_u - plan_s + 64
    for key, (measured, planned) in got.items():
        assert planned <= measured < 1.05 * planned, (key, measured, planned)


def _describe_body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    out = []
    for backend in ("auto", "sdpa"):
        g = parallel.initialize(parallel.ParallelConfig(), seed=5)
        out.append(
            Actor(ModelConfig(**MODEL, attention_backend=backend), OptimConfig(), g).describe()
        )
        parallel.destroy()
    return out


def test_the_actor_log_line_names_sdpa_attention():
    auto, sdpa = run_distributed(_describe_body, world_size=1)[0]
    # auto: Megatron's unfused attention on the CPU (the suite hides CUDA), SDPA on a GPU
    assert ("SDPA" in auto) == torch.cuda.is_available(), auto
    assert "(TP=1 PP=1 DP=1, SDPA attention)" in sdpa, sdpa
