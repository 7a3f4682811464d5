"""GPU checks of the FP8 path (marked ``gpu``; skipped without CUDA, and without TE where noted).

* The emulation computes what an FP8 tensor core computes: per-tensor e4m3 operands through
  ``torch._scaled_mm`` equal the emulator's dequantized float32 GEMM up to accumulation order.
* With Transformer Engine installed, the actor runs a real TE FP8 training step for each recipe TE
  has, and the BF16 shadow switch turns FP8 off.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="needs transformer-engine (pip install -e '.[gpu]')")


@needs_cuda
def test_emulated_per_tensor_gemm_matches_scaled_mm():
    from megatron_rl_fp8.fp8 import quantize_per_tensor
    from megatron_rl_fp8.fp8.emulation import quantize_operand

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm_89+")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=g)
    w = torch.randn(384, 512, device="cuda", generator=g) * 0.05
    xq, sx = quantize_per_tensor(x)
    wq, sw = quantize_per_tensor(w)
    hw = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.float32)
    emu = quantize_operand(x, "tensorwise_current", "input", dim=-1) @ \
        quantize_operand(w, "tensorwise_current", "weight", dim=-1).t()
    # Same FP8 operands; only the accumulation order inside the tensor core differs (fp32).
    torch.testing.assert_close(hw, emu, rtol=1e-4, atol=1e-4)


def _te_step(rank, world, recipe):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8 import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    mc = ModelConfig(arch="qwen3", num_layers=2, hidden_size=256, ffn_hidden_size=512,
                     num_attention_heads=4, num_query_groups=2, vocab_size=128,
                     max_position_embeddings=64, params_dtype="bfloat16")
    actor = Actor(mc, OptimConfig(), g, fp8=FP8Config(recipe=recipe))
    assert not actor.fp8_emulated and actor.config.fp8 == "e4m3"
    ids = torch.randint(4, 128, (16, 32), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones_like(ids).float()}
    lp8 = actor.compute_logprobs(batch, 16)["logprobs"]
    with actor.full_precision():
        lp16 = actor.compute_logprobs(batch, 16)["logprobs"]
    assert actor.config.fp8 == "e4m3"  # restored after the shadow block

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].numel(), {}

    _, grad_norm, ok = actor.train_step(batch, 16, nll)
    parallel.destroy()
    return (lp8 - lp16).abs().max().item(), grad_norm, ok


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise_delayed", "tensorwise_current", "blockwise"])
def test_te_fp8_training_step(recipe):
    from tests.dist_utils import run_distributed

    gap, grad_norm, ok = run_distributed(_te_step, world_size=1, args=(recipe,))[0]
    assert ok and torch.isfinite(torch.tensor(grad_norm))
    assert 0 < gap < 0.5  # FP8 changes the logprobs, but only by quantization noise
