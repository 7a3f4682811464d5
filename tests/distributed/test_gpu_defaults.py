"""What the actor picks on a GPU, checked where it can be on the CPU.

* ``model.params_dtype=auto`` is bf16 on CUDA (fp32 main parameters in the optimizer) and fp32 on
  the CPU; an explicit value wins.
* Megatron fusions: each is on for CUDA exactly when its kernel exists in this install (gradient
  accumulation fusion: apex's, with TE too, since the output layer is Megatron's own linear); all
  off on the CPU. The two that are plain torch.jit code (SwiGLU and bias-dropout fusion) run on the CPU
  too, so the GPU configuration is built here and must compute what the unfused model computes.
"""

import torch

from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.gpt import megatron_fusions, params_dtype
from megatron_rl_fp8.utils.imports import module_exists
from tests.dist_utils import run_distributed


def test_params_dtype_auto_is_bf16_on_gpu_only():
    assert params_dtype(ModelConfig(), on_cpu=False) == torch.bfloat16
    assert params_dtype(ModelConfig(), on_cpu=True) == torch.float32
    assert params_dtype(ModelConfig(params_dtype="float32"), on_cpu=False) == torch.float32
    assert params_dtype(ModelConfig(params_dtype="bfloat16"), on_cpu=True) == torch.bfloat16


def test_fusions_follow_the_kernels_that_exist():
    assert not any(megatron_fusions(on_cpu=True, use_te=True).values())
    te = megatron_fusions(on_cpu=False, use_te=True)
    apex = module_exists("fused_weight_gradient_mlp_cuda")
    assert te["apply_rope_fusion"] and te["gradient_accumulation_fusion"] == apex
    assert te["bias_activation_fusion"] and te["bias_dropout_fusion"]
    assert not te["masked_softmax_fusion"]  # TE's attention brings its own softmax
    local = megatron_fusions(on_cpu=False, use_te=False)
    assert not local["apply_rope_fusion"]  # Megatron refuses it without TE
    assert not local["persist_layer_norm"]


def _body(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config

    parallel.initialize(parallel.ParallelConfig(), seed=5)
    mc = ModelConfig(arch="qwen3", vocab_size=50)
    fused = dict(bias_activation_fusion=True, bias_dropout_fusion=True)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None].expand(2, -1)
    out = []
    for extra in ({}, fused):
        torch.manual_seed(5)
        model = build_gpt_model(mc, transformer_config(mc, use_te=False, **extra))
        logits = model(ids, pos, None)
        logits.float().square().mean().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        out.append((logits.detach(), grads))
    parallel.destroy()
    return [(a - b).abs().max().item() for a, b in zip(*out)]


def test_jit_fusions_compute_the_unfused_model():
    logit_err, grad_err = run_distributed(_body, world_size=1)[0]
    assert logit_err < 1e-5 and grad_err < 1e-5, (logit_err, grad_err)


def _build_with_gpu_fusions(rank, world, use_te):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config

    parallel.initialize(parallel.ParallelConfig(), seed=5)
    try:
        mc = ModelConfig(arch="qwen3", vocab_size=50)
        flag = megatron_fusions(on_cpu=False, use_te=use_te)["gradient_accumulation_fusion"]
        config = transformer_config(mc, use_te=False, gradient_accumulation_fusion=flag)
        try:
            model = build_gpt_model(mc, config, use_te=False)
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"
        return type(model.output_layer).__name__
    finally:
        parallel.destroy()


def test_megatron_grad_accum_fusion_needs_apex():
    """Megatron-Core 0.16.1 ``tensor_parallel/layers.py``: ``ColumnParallelLinear.__init__`` raises
    RuntimeError when ``config.gradient_accumulation_fusion`` is set and apex's
    ``fused_weight_gradient_mlp_cuda`` does not import. ``GPTModel.output_layer`` is that class in
    the TE spec too, so the flag the actor picks for a GPU, with or without TE, must build the
    real Megatron model (the CPU build is the same constructor; this box has no apex)."""
    for use_te in (True, False):
        built = run_distributed(_build_with_gpu_fusions, world_size=1, args=(use_te,))[0]
        assert built == "ColumnParallelLinear", built
