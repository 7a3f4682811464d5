"""GPU-library contracts checked on the CPU (docs/gpu_contracts.md has the whole list).

Each test is named after the library's precondition and states it with the source it was read
from. Where the library's own code runs here (Megatron-Core: tests/distributed/test_gpu_defaults.py)
it is called; where it cannot (Transformer Engine, ATen's CUDA GEMMs) the precondition is written
out in the test (or in tests/aten_scaled_mm.py) and the project's code is checked against it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8 import backend as backend_mod
from megatron_rl_fp8.fp8.backend import backend_problem, resolve_backend
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.te import fp8_weight_shapes, te_fp8_dims_problem
from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch, fp8_mm, quantize_gemm_operand
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.trainer.schedule import seq_multiple, split_micro_batches
from tests import aten_scaled_mm
from tests.aten_scaled_mm import block_scaled_mm

H100, ADA, B200 = (9, 0), (8, 9), (10, 0)


# -- Transformer Engine: FP8 GEMM shapes -------------------------------------------------------
def _te_assert_dim_for_fp8_exec(shape) -> bool:
    """TE 2.x ``transformer_engine/pytorch/utils.py: assert_dim_for_fp8_exec`` (called on the
    input and weight by ``module/linear.py``, ``layernorm_linear.py``, ``layernorm_mlp.py``
    whenever FP8 is on): the product of all dims but the last divisible by 8, the last by 16."""
    return math.prod(shape[:-1]) % 8 == 0 and shape[-1] % 16 == 0


def _batch(lengths, width):
    n = len(lengths)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, length in enumerate(lengths):
        mask[i, :length] = True
    ids = torch.arange(n * width).reshape(n, width) % 97
    return {"input_ids": ids, "labels": ids, "loss_mask": mask, "advantages": torch.ones(n)}


@pytest.mark.parametrize(
    "tp, sp, cp", [(1, False, 1), (2, True, 1), (4, True, 1), (2, False, 2), (2, True, 2)]
)
@pytest.mark.parametrize("budget", [None, 40], ids=["rows", "token-budget"])
def test_te_fp8_gemm_dims(tp, sp, cp, budget):
    """Every micro-batch a TE FP8 linear sees, [S_local, B, hidden] with S_local this rank's
    share of the (padded) sequence (1/CP of it, and 1/TP under sequence parallelism), meets TE's
    rule for any row count B: micro-batch size 1 and token-budget micro-batches included."""
    config = SimpleNamespace(
        context_parallel_size=cp, tensor_model_parallel_size=tp, sequence_parallel=sp, fp8="e4m3"
    )
    hidden = 64
    lengths = [13, 7, 29, 5, 17, 3, 11]  # odd lengths, as rollouts come
    batch = _batch(lengths, width=31)
    for mbs in (1, 3):
        mbs_split = split_micro_batches(batch, mbs, budget, multiple=seq_multiple(config))
        for mb in mbs_split.batches:
            rows, s = mb["input_ids"].shape
            local = s // cp // (tp if sp else 1)
            assert local * cp * (tp if sp else 1) == s, "the split must be exact"
            assert _te_assert_dim_for_fp8_exec((local, rows, hidden)), (s, rows, tp, sp, cp)
    # And the BF16 path (config.fp8 cleared, as full_precision does) keeps its old padding.
    config.fp8 = None
    assert seq_multiple(config) == (2 * cp if cp > 1 else 1) * (tp if sp else 1)


def test_te_mxfp8_gemm_dims():
    """Under MXFP8 TE quantizes 1x32 blocks along both dims (``tensor/mxfp8_tensor.py:
    MXFP8Quantizer.is_quantizable``; Megatron-Core's ``fp8_utils.get_fp8_align_size`` is 32 for
    it): rows and the last dim multiples of 32. Every micro-batch meets it at any row count."""
    config = SimpleNamespace(
        context_parallel_size=1, tensor_model_parallel_size=2, sequence_parallel=True,
        fp8="e4m3", fp8_recipe="mxfp8",
    )  # fmt: skip
    batch = _batch([13, 7, 29, 5], width=31)
    for mb in split_micro_batches(batch, 1, None, multiple=seq_multiple(config)).batches:
        rows, s = mb["input_ids"].shape
        assert (s // 2 * rows) % 32 == 0, (s, rows)
    assert te_fp8_dims_problem((16, 1, 64), "mxfp8") is not None  # 16 rows
    assert te_fp8_dims_problem((16, 1, 64)) is None
    assert te_fp8_dims_problem((32, 1, 48), "mxfp8") is not None  # 48 % 32


@pytest.mark.parametrize(
    "capability, cuda, runs",
    [(H100, "12.9", True), (B200, "13.0", True), (ADA, "12.9", False), (H100, "12.8", False)],
)
def test_te_block_scaling_needs_sm90_and_cuda_12_9(monkeypatch, capability, cuda, runs):
    """TE's ``pytorch/quantization.py: _compute_fp8_block_scaling_support``: Float8BlockScaling
    needs compute capability >= 9.0 and CUDA >= 12.9, else ``fp8_autocast`` raises at the first
    forward; the project's backend selection says the same before start-up."""
    monkeypatch.setattr(backend_mod, "have_te", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert (backend_problem("te", "blockwise", capability) is None) == runs
    assert backend_problem("te", "tensorwise_current", capability) is None


def test_te_fp8_weight_dims_checked_at_config():
    """The weights' side of the same rule is the model's widths per TP rank: the flagship
    shapes pass, a width TE would refuse is a one-line config error before any rank starts."""
    qwen3_8b = ModelConfig(
        arch="qwen3", hidden_size=4096, ffn_hidden_size=12288, num_layers=2,
        num_attention_heads=32, num_query_groups=8, head_dim=128, vocab_size=1000,
    )  # fmt: skip
    for tp in (1, 2, 4, 8):
        for name, shape in fp8_weight_shapes(qwen3_8b, tp).items():
            assert te_fp8_dims_problem(shape) is None, (name, shape, tp)
            assert _te_assert_dim_for_fp8_exec(shape) == (te_fp8_dims_problem(shape) is None)
    assert te_fp8_dims_problem((7, 3, 64)) is not None  # 21 rows
    assert te_fp8_dims_problem((8, 1, 72)) is not None  # 72 % 16
    cfg = load_config(
        "examples/tiny_cpu.yaml",
        ["fp8.recipe=tensorwise_current", "fp8.backend=te", "model.ffn_hidden_size=136"],
    )
    with pytest.raises(ConfigError, match="linear_fc2 weight") as e:
        cfg.validate(1, this_machine=False)
    assert "\n" not in str(e.value) and "fp8.backend=torch" in str(e.value)
    cfg = load_config("examples/tiny_cpu.yaml", ["fp8.recipe=tensorwise_current", "fp8.backend=te"])
    cfg.validate(1, this_machine=False)


# -- ATen: block-scaled scaled_mm --------------------------------------------------------------
def _linear_fwd_bwd(cfg, tokens=(3, 50), k=200, n=136):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*tokens, k, generator=gen, requires_grad=True)
    w = (torch.randn(n, k, generator=gen) * 0.1).requires_grad_()
    y = FP8LinearTorch(cfg)(x, w, None)
    y.backward(torch.randn(*tokens, n, generator=gen))


def test_aten_blockwise_scaled_mm_e4m3_only(monkeypatch):
    """ATen's ``check_deepseek_recipe`` (``ScaledBlas.cpp`` / ``CUDAScaledBlas.cpp``) accepts a
    block-scaled GEMM only with both operands float8_e4m3fn; ``format: hybrid`` quantizes the
    output gradient to e5m2. The torch backend refuses the pair at config time, ``auto`` never
    picks it, and its GEMM refuses an e5m2 block-scaled operand in one line; with e4m3 all three
    GEMMs of a linear hand ATen what it accepts (tests/aten_scaled_mm.py)."""
    with pytest.raises(ValueError, match="e4m3 operands only") as e:
        FP8Config(recipe="blockwise", format="hybrid", backend="torch")
    assert "\n" not in str(e.value) and "format 'e4m3'" in str(e.value)
    monkeypatch.setattr(backend_mod, "have_te", lambda: False)
    monkeypatch.setattr(backend_mod, "have_blockwise_scaled_mm", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.9")  # not this build's toolkit
    hybrid = FP8Config(recipe="blockwise", format="hybrid")
    assert resolve_backend(hybrid, capability=H100) == "emulate"
    assert resolve_backend(FP8Config(recipe="blockwise"), capability=H100) == "torch"
    # Rowwise takes an e5m2 gradient (check_rowwise_recipe): hybrid stays on torch there.
    assert backend_problem("torch", "rowwise", H100, fmt="hybrid") is None

    g = quantize_gemm_operand(torch.randn(16, 256), "blockwise", "grad_output", "e5m2")
    w = quantize_gemm_operand(torch.randn(128, 256), "blockwise", "weight", "e4m3")
    with pytest.raises(ValueError, match="e4m3 operands only"):
        fp8_mm(g, w)

    monkeypatch.setattr(F, "scaled_mm", block_scaled_mm)
    aten_scaled_mm.CALLS.clear()
    _linear_fwd_bwd(FP8Config(recipe="blockwise"))
    st = F.ScalingType
    assert [c["recipes"] for c in aten_scaled_mm.CALLS] == [
        (st.BlockWise1x128, st.BlockWise128x128),  # fprop: x x W
        (st.BlockWise1x128, st.BlockWise128x128),  # dgrad: dy x W^T
        (st.BlockWise1x128, st.BlockWise1x128),  # wgrad: dy^T x x^T
    ]


@pytest.mark.parametrize(
    "capability, cuda, runs",
    [(H100, "12.9", True), (H100, "13.0", True), (H100, None, True), (H100, "12.8", False),
     (ADA, "12.9", False), (B200, "13.0", False), ((12, 0), "13.0", False)],
)  # fmt: skip
def test_aten_blockwise_scaled_mm_sm90_only(monkeypatch, capability, cuda, runs):
    """ATen's ``_check_deepseek_support`` (``ScaledBlas.cpp``): block-scaled 1x128 / 128x128
    ``scaled_mm`` raises NotImplementedError unless the GPU's major compute capability is 9
    and cuBLASLt is >= 12.9 (``CUBLAS_VERSION`` at build, ``cublasLtGetVersion`` at run time;
    torch's CUDA toolkit version stands for both here, None: a CPU build). Ada and Blackwell
    have FP8 tensor cores, so the old >= 8.9 rule let them through to the first GEMM."""
    monkeypatch.setattr(backend_mod, "have_te", lambda: False)
    monkeypatch.setattr(backend_mod, "have_blockwise_scaled_mm", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    problem = backend_problem("torch", "blockwise", capability)
    assert (problem is None) == runs, problem
    auto = resolve_backend(FP8Config(recipe="blockwise"), capability=capability)
    assert auto == ("torch" if runs else "emulate")
    if not runs:
        assert ("9.x" in problem) or ("12.9" in problem)
        with pytest.raises(ValueError, match="cannot run recipe='blockwise' here") as e:
            resolve_backend(FP8Config(recipe="blockwise", backend="torch"), capability=capability)
        assert "\n" not in str(e.value)
    # The other torch-backend recipes keep the FP8 tensor-core rule (>= 8.9).
    assert backend_problem("torch", "tensorwise_current", capability) is None


def test_te_block_scaling_split_accumulation(monkeypatch):
    """TE's ``Float8BlockScaling`` (``transformer_engine/common/recipe/__init__.py``,
    ``__post_init__``) asserts ``use_split_accumulator`` for fprop, dgrad and wgrad: block scales
    change every 128 elements of K, so partial sums must be promoted. The torch backend's
    blockwise GEMMs therefore never ask ATen for fast accumulation, whatever
    ``fp8.accum_fast_fprop`` says (it still applies to the per-tensor and per-row recipes)."""
    assert not FP8Config(recipe="blockwise", accum_fast_fprop=True).fprop_fast_accum
    assert FP8Config(recipe="tensorwise_current", accum_fast_fprop=True).fprop_fast_accum
    assert FP8Config(recipe="rowwise", accum_fast_fprop=True).fprop_fast_accum
    assert not FP8Config(recipe="rowwise", accum_fast_fprop=False).fprop_fast_accum
    monkeypatch.setattr(F, "scaled_mm", block_scaled_mm)
    aten_scaled_mm.CALLS.clear()
    _linear_fwd_bwd(FP8Config(recipe="blockwise", accum_fast_fprop=True))
    assert [c["fast_accum"] for c in aten_scaled_mm.CALLS] == [False, False, False]


def test_torchao_scaled_mm_weight_dims_checked_at_config():
    """torchao 0.18 ``float8/float8_ops.py: preprocess_addmm`` pads only the contraction dim
    (``pad_inner_dim``); ATen's ``_scaled_mm`` (``ScaledBlas.cpp: _scaled_mm_out_cuda``) still
    needs both dims of its second operand, the weight in fprop and dgrad, multiples of 16."""
    cfg = load_config(
        "examples/tiny_cpu.yaml",
        ["fp8.recipe=tensorwise_current", "fp8.backend=torchao", "model.ffn_hidden_size=136"],
    )
    with pytest.raises(ConfigError, match="fp8.backend=torchao: the linear_fc2 weight") as e:
        cfg.validate(1, this_machine=False)
    assert "\n" not in str(e.value)
    cfg = load_config(
        "examples/tiny_cpu.yaml", ["fp8.recipe=tensorwise_current", "fp8.backend=torchao"]
    )
    cfg.validate(1, this_machine=False)


def test_te_moe_spec_asks_for_the_grouped_expert_gemm(monkeypatch):
    """TE-8. Megatron-Core 0.16.1 builds TE's grouped expert GEMM (``TEGroupedMLP`` of
    ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``) only when the TE spec is
    asked for ``num_experts`` *and* ``moe_grouped_gemm=True``
    (``extensions/transformer_engine_spec_provider.py: grouped_mlp_modules``); without the flag
    it builds one TE linear pair per expert. TransformerConfig's ``moe_grouped_gemm`` must agree
    (``transformer_config.py: __post_init__`` checks it against TE's version under FP8). The TE
    spec cannot be built without TE, so its arguments are recorded; a dense model's call is
    the one it always was."""
    from megatron_rl_fp8.models import gpt

    calls = []
    monkeypatch.setattr(
        gpt.specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kw: calls.append(kw)
    )
    gpt.layer_spec(ModelConfig(num_experts=4), use_te=True, on_cpu=False)
    gpt.layer_spec(ModelConfig(), use_te=True, on_cpu=False)
    assert calls == [
        {"qk_layernorm": True, "num_experts": 4, "moe_grouped_gemm": True},
        {"qk_layernorm": True},
    ]
    assert gpt.moe_config(ModelConfig(num_experts=4), use_te=True)["moe_grouped_gemm"] is True
    assert gpt.moe_config(ModelConfig(num_experts=4), use_te=False)["moe_grouped_gemm"] is False
