"""The GPU-library contracts of docs/gpu_contracts.md, checked against the hardware (marked
``gpu``; ``scripts/gpu_check.sh`` runs them first). Their CPU halves are
tests/unit/test_gpu_contracts.py and tests/unit/test_sync_contracts.py; here each precondition
written there is confirmed on the GPU, and the project's code is run where it meets it.

* TE's FP8 GEMM shape rule: a TE linear refuses 13 input rows in FP8; the actor's FP8 passes run
  on ragged rollout lengths with micro-batch size 1 and with a token budget.
* ATen's block-scaled ``scaled_mm``: runs exactly where ``fp8/backend.py`` says it does (Hopper
  with cuBLASLt >= 12.9), refuses an e5m2 operand, and computes what tests/aten_scaled_mm.py (the
  CPU tests' written-out preconditions) computes, for the operands the torch backend makes.
* NCCL: two ranks of one communicator on one GPU fail (the launcher's colocation rule).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="needs transformer-engine (pip install -e '.[gpu]')",
)


def _capability():
    return tuple(torch.cuda.get_device_capability())


# -- Transformer Engine ------------------------------------------------------------------------
@needs_cuda
@needs_te
def test_te_linear_refuses_unaligned_rows_in_fp8():
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    lin = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
        lin(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="divisible by 8"):
            lin(torch.randn(13, 64, device="cuda", dtype=torch.bfloat16))


def _te_ragged_step(rank, world):
    from megatron_rl_fp8 import parallel
    from megatron_rl_fp8.fp8.config import FP8Config
    from megatron_rl_fp8.models.config import ModelConfig
    from megatron_rl_fp8.trainer.actor import Actor
    from megatron_rl_fp8.trainer.config import OptimConfig

    g = parallel.initialize(parallel.ParallelConfig(), seed=3)
    mc = ModelConfig(
        arch="qwen3", hidden_size=128, ffn_hidden_size=256, num_layers=2,
        num_attention_heads=4, num_query_groups=2, vocab_size=128,
        max_position_embeddings=64, params_dtype="bfloat16",
    )  # fmt: skip
    actor = Actor(mc, OptimConfig(), g, fp8=FP8Config(recipe="tensorwise_current"))
    assert actor.config.fp8 == "e4m3"
    ids = torch.randint(4, 128, (5, 29), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids, dtype=torch.float)
    for i, n in enumerate((29, 13, 7, 21, 3)):
        mask[i, :n] = 1
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": mask}

    def nll(mb, logprobs):
        return -(logprobs * mb["loss_mask"]).sum() / mask.sum(), {}

    ok = []
    for mbs, budget in ((1, None), (5, None), (5, 40)):
        actor.compute_logprobs(batch, mbs, max_tokens=budget)
        ok.append(actor.train_step(batch, mbs, nll, max_tokens=budget)[2])
    parallel.destroy()
    return ok


@needs_cuda
@needs_te
def test_te_fp8_gemm_dims_on_the_gpu():
    from tests.dist_utils import run_distributed

    assert run_distributed(_te_ragged_step, world_size=1)[0] == [True, True, True]


# -- ATen block-scaled scaled_mm ---------------------------------------------------------------
def _operands(fmt_a="e4m3"):
    from megatron_rl_fp8.fp8.torch_backend import quantize_gemm_operand

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 512, device="cuda", generator=gen)
    w = 0.05 * torch.randn(256, 512, device="cuda", generator=gen)
    return (
        quantize_gemm_operand(x, "blockwise", "input", fmt_a),
        quantize_gemm_operand(w, "blockwise", "weight", "e4m3"),
    )


def _raw_block_mm(a, b):
    """ATen's block-scaled GEMM on the layouts fp8_mm hands over, without fp8_mm's own checks."""
    st = F.ScalingType
    kb = b.scale_inv.shape[1]
    grid = F.pad(b.scale_inv, (0, (-kb) % 4))
    return F.scaled_mm(
        a.codes, b.codes.t(), a.scale_inv.t().contiguous().t(), st.BlockWise1x128,
        grid.t(), st.BlockWise128x128, output_dtype=torch.bfloat16,
    )  # fmt: skip


@needs_cuda
def test_aten_blockwise_scaled_mm_sm90_only_on_the_gpu():
    """``fp8/backend.py`` says the torch backend's blockwise runs here exactly when ATen does."""
    from megatron_rl_fp8.fp8.backend import backend_problem, have_blockwise_scaled_mm

    if not have_blockwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__} has no block-scaled F.scaled_mm")
    problem = backend_problem("torch", "blockwise", _capability())
    a, b = _operands()
    try:
        _raw_block_mm(a, b)
        ran, why = True, ""
    except (NotImplementedError, RuntimeError) as e:
        ran, why = False, str(e).splitlines()[0]
    print(f"block-scaled scaled_mm on sm_{''.join(map(str, _capability()))}: ran={ran} {why}")
    assert ran == (problem is None), (problem, why)


@needs_cuda
def test_aten_blockwise_scaled_mm_e4m3_only_on_the_gpu():
    """ATen refuses an e5m2 block-scaled operand; the e4m3 result is what the CPU tests'
    written-out ATen (tests/aten_scaled_mm.py) computes, within bf16 output rounding."""
    from megatron_rl_fp8.fp8.backend import backend_problem
    from megatron_rl_fp8.fp8.torch_backend import fp8_mm
    from tests.aten_scaled_mm import block_scaled_mm

    if backend_problem("torch", "blockwise", _capability()) is not None:
        pytest.skip("no block-scaled scaled_mm on this GPU / torch")
    with pytest.raises(RuntimeError):
        _raw_block_mm(*_operands("e5m2"))
    a, b = _operands()
    got = fp8_mm(a, b).float()
    st = F.ScalingType
    kb = b.scale_inv.shape[1]
    want = block_scaled_mm(
        a.codes.cpu(), b.codes.cpu().t(), a.scale_inv.cpu().t().contiguous().t(),
        st.BlockWise1x128, F.pad(b.scale_inv.cpu(), (0, (-kb) % 4)).t(), st.BlockWise128x128,
        output_dtype=torch.float32,
    )  # fmt: skip
    err = (got.cpu() - want).abs().max() / want.abs().max()
    assert err < 2**-7, err


# -- NCCL --------------------------------------------------------------------------------------
_TWO_RANKS_ONE_GPU = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    rank = int(sys.argv[1])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank,
                            world_size=2, device_id=torch.device("cuda", 0))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("all_reduce ok", t.item())
    """
)


@needs_cuda
def test_nccl_sync_group_no_duplicate_gpu_on_the_gpu():
    """The precondition behind the launcher's colocation rule (tests/unit/test_sync_contracts.py):
    NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected")."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_RANKS_ONE_GPU, str(r), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    text = "\n".join(outs)
    print(text[-2000:])
    assert any(p.returncode != 0 for p in procs), "two ranks on one GPU formed an NCCL group"
    assert "all_reduce ok" not in text
