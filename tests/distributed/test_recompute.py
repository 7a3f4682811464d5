"""Activation recomputation (memory.*) gives the same gradients as keeping the activations: bit
for bit, in full precision and under emulated FP8, for every granularity and method."""

import itertools

import torch

from tests.dist_utils import run_distributed

SETTINGS = {
    "none": {},
    "full-uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full-block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
    # layernorm / mlp need Transformer Engine (MemoryConfig.check_backend): GPU tests only.
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


def _counter(calls: dict, key: str):
    def hook(*_):
        calls[key] += 1

    return hook


def _body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.memory import MemoryConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(tensor_model_parallel_size=world), seed=1)
    ids = torch.randint(0, 53, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(4, 12)}

    def nll(mb, lp):
        return -(lp * mb["loss_mask"]).sum() / 48.0, {}

    out, calls_per_micro_batch = {}, {}
    for recipe, (name, kwargs) in itertools.product(("bf16", "blockwise"), SETTINGS.items()):
        torch.manual_seed(1)
        actor = Actor(
            ModelConfig(vocab_size=53),
            OptimConfig(lr=1e-3),
            g,
            fp8=FP8Config(recipe=recipe),
            memory=MemoryConfig(**kwargs),
        )
        # Recomputation shows as a second forward call per micro-batch in the backward pass.
        layer = actor.module.decoder.layers[0]
        calls = {"layer": 0, "core_attn": 0}
        layer.register_forward_hook(_counter(calls, "layer"))
        layer.self_attention.core_attention.register_forward_hook(_counter(calls, "core_attn"))
        losses, grad_norm, applied = actor.train_step(batch, 2, nll)
        assert applied
        calls_per_micro_batch[recipe, name] = {k: v / 2 for k, v in calls.items()}
        out[recipe, name] = (
            [o["loss"].item() for o in losses],
            grad_norm,
            [p.main_grad.clone() for p in actor.module.parameters()],
            [p.detach().clone() for p in actor.module.parameters()],
        )
    parallel.destroy()
    return out, calls_per_micro_batch


def test_recompute_gives_bit_identical_gradients():
    """In full precision and under emulated blockwise FP8 (one process for both: it is the spawn
    and Megatron's import that cost here)."""
    ((out, calls),) = run_distributed(_body, world_size=1)
    for recipe in ("bf16", "blockwise"):
        assert {name: calls[recipe, name] for name in SETTINGS} == {
            "none": {"layer": 1, "core_attn": 1},
            "full-uniform": {"layer": 2, "core_attn": 2},
            "full-block": {"layer": 2, "core_attn": 2},  # block: layer 0 of the 2 is recomputed
            "selective": {"layer": 1, "core_attn": 2},
        }
        ref_loss, ref_norm, ref_grads, ref_params = out[recipe, "none"]
        assert ref_norm > 0
        for name in SETTINGS:
            loss, norm, grads, params = out[recipe, name]
            assert loss == ref_loss and norm == ref_norm, (recipe, name)
            assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), (recipe, name)
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (recipe, name)
