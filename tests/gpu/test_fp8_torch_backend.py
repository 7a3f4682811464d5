"""GPU checks of the torch FP8 backend (``fp8.backend: torch``; marked ``gpu``, skipped without a
CUDA GPU with FP8 tensor cores).

* Each recipe's three GEMMs run on the tensor cores (``torch._scaled_mm``, and block-scaled
  ``torch.nn.functional.scaled_mm`` for blockwise, which CPU torch lacks) and agree with the
  emulation on the same inputs. The CPU suite (tests/unit/test_fp8_backend.py) checks the same
  against a derived bound; here the hardware also accumulates in its own way (about 13 mantissa
  bits between promotions, see tests/gpu/test_fp8_gpu.py), so the check is a relative one: far
  below FP8's own quantization noise (a few percent), far above what a wrong scale or layout gives.
* ``fp8.compile_casts`` (Triton-fused casts) gives the eager casts' results bit for bit.
* A tiny full-FP8 actor runs through the torch backend: its logprobs match the emulation's on the
  same weights much more closely than either matches BF16, the shadow switch turns it off, and a
  training step is applied.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(
    not _fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)"
)


def _skip_where_the_backend_cannot(recipe: str, fmt: str) -> None:
    """Skip what ``fp8/backend.py`` refuses here (blockwise: Hopper, cuBLASLt >= 12.9, e4m3
    only, as ATen's block-scaled scaled_mm; the CPU tests check that rule)."""
    from megatron_rl_fp8.fp8.backend import backend_problem

    problem = backend_problem("torch", recipe, tuple(torch.cuda.get_device_capability()), fmt=fmt)
    if problem is not None:
        pytest.skip(problem)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_fp8_gpu
@pytest.mark.parametrize(
    "recipe", ["tensorwise_current", "tensorwise_delayed", "rowwise", "blockwise"]
)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("shape", [(512, 1024, 768), (200, 300, 136)], ids=["aligned", "ragged"])
def test_torch_backend_gemms_match_emulation(recipe, fmt, shape):
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch

    _skip_where_the_backend_cannot(recipe, fmt)
    t, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    dy = torch.randn(t, n, device="cuda", generator=g).bfloat16()
    cfg = FP8Config(recipe=recipe, format=fmt)
    outs = []
    for linear in (FP8LinearEmulator(cfg), FP8LinearTorch(cfg)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(xx, ww)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, ww.grad))
    torch.cuda.synchronize()
    exact = x.float() @ w.float().t()
    fp8_noise = _rel(outs[0][0], exact)
    for name, emu, got in zip(("y", "dx", "dw"), *outs):
        assert torch.isfinite(got).all()
        rel = _rel(got, emu)
        print(f"\n{recipe} {fmt} {shape} {name}: torch vs emulation {rel:.2e}")
        assert rel < 2**-6, f"{name}: {rel:.3g} relative to the emulation"
    assert fp8_noise > 4 * _rel(outs[1][0], outs[0][0])  # FP8 noise dominates the difference


@needs_fp8_gpu
@pytest.mark.parametrize(
    "recipe", ["tensorwise_current", "tensorwise_delayed", "rowwise", "blockwise"]
)
def test_compiled_casts_are_the_eager_casts_on_the_gpu(recipe):
    """``fp8.compile_casts``: Triton's fused cast gives the eager kernels' codes and scales, and
    the linear the same outputs and gradients, bit for bit (the CPU suite checks inductor's C++)."""
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch

    _skip_where_the_backend_cannot(recipe, "e4m3")
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(768, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    for tokens in (512, 200):
        x = torch.randn(tokens, 1024, device="cuda", generator=g).bfloat16()
        dy = torch.randn(tokens, 768, device="cuda", generator=g).bfloat16()
        outs = []
        for compiled in (False, True):
            linear = FP8LinearTorch(
                FP8Config(recipe=recipe, format="hybrid", compile_casts=compiled)
            )
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = linear(xx, ww)
            y.backward(dy)
            outs.append((y.detach(), xx.grad, ww.grad))
        for name, eager, got in zip(("y", "dx", "dw"), *outs):
            assert torch.equal(eager, got), f"{recipe} {tokens} tokens: {name} differs"


def _actor_step(rank, world, recipe):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator
    from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.models.fp8 import emulated_linears
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(), seed=1)
    mc = ModelConfig(
        arch="qwen3",
        num_layers=2,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        max_position_embeddings=64,
        params_dtype="bfloat16",
    )
    fp8 = FP8Config(recipe=recipe, backend="torch")
    actor = Actor(mc, OptimConfig(), g, fp8=fp8)
    gemms = [gemm for _, _, gemm in emulated_linears(actor.module)]
    assert actor.fp8_backend == "torch" and not actor.use_te and len(gemms) == 8
    assert all(isinstance(gm.emulator, FP8LinearTorch) for gm in gemms)
    ids = torch.randint(4, 128, (16, 32), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones_like(ids).float()}
    lp_torch = actor.compute_logprobs(batch, 4)["logprobs"]  # 4 micro-batches: weight cache
    with actor.full_precision():
        lp16 = actor.compute_logprobs(batch, 16)["logprobs"]
    real = [gm.emulator for gm in gemms]
    for gm in gemms:  # the same weights through the emulation
        gm.emulator = FP8LinearEmulator(fp8)
    lp_emu = actor.compute_logprobs(batch, 4)["logprobs"]
    for gm, linear in zip(gemms, real):
        gm.emulator = linear

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].numel(), {}

    _, grad_norm, ok = actor.train_step(batch, 4, nll)
    parallel.destroy()
    mean_abs = lambda a, b: (a - b).abs().mean().item()  # noqa: E731
    return mean_abs(lp_torch, lp_emu), mean_abs(lp_emu, lp16), grad_norm, ok


@needs_fp8_gpu
@pytest.mark.parametrize("recipe", ["tensorwise_current", "rowwise"])
def test_tiny_actor_through_torch_backend(recipe):
    from tests.dist_utils import run_distributed

    torch_vs_emu, emu_vs_bf16, grad_norm, ok = run_distributed(
        _actor_step, world_size=1, args=(recipe,)
    )[0]
    print(f"\n{recipe}: |lp torch - emu| {torch_vs_emu:.2e}, |lp emu - bf16| {emu_vs_bf16:.2e}")
    assert ok and torch.isfinite(torch.tensor(grad_norm))
    assert 0 < emu_vs_bf16 < 0.5
    assert torch_vs_emu < emu_vs_bf16  # same order as the emulation (CPU, fp32: ~0.35x)


needs_torchao = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torchao"), reason="needs torchao (pip install)"
)


@needs_fp8_gpu
@needs_torchao
@pytest.mark.parametrize(
    "recipe, compiled",
    [("tensorwise_current", False), ("rowwise", False), ("tensorwise_current", True)],
    ids=["tensorwise", "rowwise", "tensorwise-compiled"],  # one compile: gpu_check's time
)
def test_torchao_backend_gemms_on_the_gpu(recipe, compiled):
    """``fp8.backend: torchao`` on the tensor cores: tensorwise agrees with the emulation as the
    torch backend does (same codes); rowwise (torchao's power-of-two scales) has an error against
    the unquantized product of the emulation's order; compiled (``fp8.compile_casts``: the
    call, casts and GEMMs, through torch.compile) meets the same bounds."""
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator
    from megatron_rl_fp8.fp8.torchao_backend import FP8LinearTorchAO

    t, k, n = 512, 1024, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    dy = torch.randn(t, n, device="cuda", generator=g).bfloat16()
    cfg = FP8Config(recipe=recipe, backend="torchao", compile_casts=compiled)
    outs = []
    for linear in (FP8LinearEmulator(FP8Config(recipe=recipe)), FP8LinearTorchAO(cfg)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(xx, ww)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, ww.grad))
    xx, ww = x.float().requires_grad_(), w.float().requires_grad_()
    y = xx @ ww.t()
    y.backward(dy.float())
    exact = (y.detach(), xx.grad, ww.grad)
    for name, emu, ao, ref in zip(("y", "dx", "dw"), *outs, exact):
        if recipe == "tensorwise_current":
            assert _rel(ao, emu) < 0.01, (name, _rel(ao, emu))
        assert _rel(ao, ref) < 1.5 * _rel(emu, ref) + 1e-3, (name, _rel(ao, ref), _rel(emu, ref))
        print(
            f"torchao {recipe} {'compiled' if compiled else 'eager'} {name}: "
            f"vs emulation {_rel(ao, emu):.4f}, vs exact {_rel(ao, ref):.4f}"
        )
    # Inside the actor's weight-cache scope (tensorwise: one cast for both GEMMs) the results
    # are the per-call casts' on the tensor cores too.
    linear = FP8LinearTorchAO(cfg)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    with linear.weight_cache():
        y = linear(xx, ww)
        y.backward(dy)
    cached = (y.detach(), xx.grad, ww.grad)
    assert all(torch.equal(a, b) for a, b in zip(cached, outs[1]))
