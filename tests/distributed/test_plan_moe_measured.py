"""The planner's MoE layer against the real one: the bytes the first transformer layer of the
actor (Megatron's MoE layer, local spec, fp32, one rank) saves for its backward, counted per
storage through saved_tensors_hooks (``plan/measure.py: FirstLayerSaved``), against
``layer_activation_bytes``. The planner leaves out a few hundred bytes per token of small
tensors (norm statistics, RoPE tables, the causal mask: 336 for the dense layer, and 332 here);
the test allows 400."""

import pytest

from tests.dist_utils import run_distributed

SHAPE = [
    "model.hidden_size=256",
    "model.ffn_hidden_size=768",
    "model.num_attention_heads=8",
    "model.head_dim=32",
    "model.num_query_groups=2",
    "model.max_position_embeddings=64",
    "task.max_prompt_len=32",
    "rollout.max_new_tokens=32",
    "train.micro_batch_size=2",
]


def _body(rank, world, experts, topk):
    import torch

    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.config import EXAMPLES_DIR, load_config
    from megatron_rl_fp8.plan.measure import FirstLayerSaved
    from megatron_rl_fp8.plan.model_bytes import layer_activation_bytes
    from megatron_rl_fp8.trainer.actor import Actor

    moe = [
        f"model.num_experts={experts}",
        f"model.moe_topk={topk}",
        "model.moe_ffn_hidden_size=192",
    ]
    cfg = load_config(EXAMPLES_DIR / "tiny_cpu.yaml", [*SHAPE, *moe])
    cfg.validate(1)
    g = parallel.initialize(cfg.parallel, seed=1)
    actor = Actor(cfg.model, cfg.optim, g, cfg.fp8, memory=cfg.memory)
    saved = FirstLayerSaved(actor.module)
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(2, 64)}
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        actor.train_step(batch, 2, lambda mb, lp: (-lp.sum(), {}))
    parallel.destroy()
    predicted = layer_activation_bytes(
        cfg.model, a=4, tp=1, sequence_parallel=False, seq=64, spec="local", fused_swiglu=False,
        sdpa=cfg.model.uses_sdpa(on_cpu=True),
    )  # fmt: skip
    return saved.nbytes / 128, predicted


@pytest.mark.parametrize("experts, topk", [(4, 2), (8, 4)])
def test_moe_layer_activations_match_the_tensors_autograd_saves(experts, topk):
    measured, predicted = run_distributed(_body, world_size=1, args=(experts, topk))[0]
    assert 0 <= measured - predicted <= 400, (measured, predicted)
