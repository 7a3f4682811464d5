"""Chunked log-probabilities over a vocabulary split in halves on 2 gloo ranks (TP=2) equal the
one-rank result on the whole vocabulary, and the gradient of each rank's half equals that half of
the one-rank gradient (fp32 tolerance: only the order of the cross-rank sums differs).

A second test, with Megatron's parallel_state initialised at TP=2: the default group
(tp_group=None) is Megatron's, and the values and gradients equal the implementation this module
replaced (fp32 upcast + mask + temperature + Megatron's ``vocab_parallel_cross_entropy``).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

B, S, V = 2, 9, 64  # 18 tokens, 32 columns per rank
CASES = [  # (dtype, temperature, vocab_size, chunk_tokens)
    (torch.float32, 1.0, None, 4),
    (torch.float32, 0.6, 50, 5),  # rank 1 holds the 14 padded columns
    (torch.bfloat16, 1.3, 50, 1),
    (torch.float32, 0.8, 20, 7),  # rank 1's whole slice is padding
]


def _data(dtype, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(B, S, V, generator=g)).to(dtype)
    labels = torch.randint(0, vocab_size or V, (B, S), generator=g)
    grad_out = torch.randn(B, S, generator=g)
    return logits, labels, grad_out


def _run(fn, logits, labels, grad_out, **kw):
    x = logits.clone().requires_grad_(True)
    lp = fn(x, labels, **kw)
    (lp * grad_out).sum().backward()
    return lp.detach(), x.grad


def _old_token_logprobs(logits, labels, *, temperature, vocab_size, tp_rank):
    """The implementation before chunking (Megatron's cross entropy on full fp32 copies)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl_fp8.models.logprobs import mask_padded_vocab

    z = mask_padded_vocab(logits.float(), vocab_size, tp_rank) / temperature
    return -vocab_parallel_cross_entropy(
        z.transpose(0, 1).contiguous(), labels.t().contiguous()
    ).t()


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _body(rank, world):
    import torch.distributed as dist

    from megatron_rl_fp8.models.logprobs import (
        token_entropy,
        token_logprobs,
        token_logprobs_and_entropy,
    )

    half = slice(rank * V // 2, (rank + 1) * V // 2)
    errors = []
    for i, (dtype, temperature, vocab_size, chunk) in enumerate(CASES):
        logits, labels, grad_out = _data(dtype, vocab_size, seed=i)
        kw = {"temperature": temperature, "vocab_size": vocab_size, "chunk_tokens": chunk}
        # One rank, whole vocabulary (Megatron is not imported yet: no default group).
        lp1, grad1 = _run(token_logprobs, logits, labels, grad_out, **kw)
        ent1 = token_entropy(logits, **kw)
        # TP=2: this rank's half of the columns, reduced over the world group.
        shard = logits[..., half].contiguous()
        tp = {**kw, "tp_rank": rank, "tp_group": dist.group.WORLD}
        lp2, grad2 = _run(token_logprobs, shard, labels, grad_out, **tp)
        ent2 = token_entropy(shard, **tp)
        lp3, ent3 = token_logprobs_and_entropy(shard, labels, **tp)
        grad_scale = grad1.abs().max().item()
        errors.append(
            {
                "lp": _max_err(lp2, lp1),
                "grad": _max_err(grad2, grad1[..., half]) / grad_scale,
                "ent": _max_err(ent2, ent1),
                "fused": max(_max_err(lp3, lp2), _max_err(ent3, ent2)),
                "dtype_ok": grad2.dtype == dtype,
            }
        )
    try:
        token_logprobs(logits[..., half], labels, tp_rank=1 - rank, tp_group=dist.group.WORLD)
        wrong_rank_raised = False
    except ValueError:
        wrong_rank_raised = True

    return errors, wrong_rank_raised


def _megatron_body(rank, world):
    """With Megatron's parallel_state at TP=2: the default group, against the old implementation."""
    from megatron.core import parallel_state

    from megatron_rl_fp8.models.logprobs import token_logprobs

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    half = slice(rank * V // 2, (rank + 1) * V // 2)
    vs_old = []
    for i, (dtype, temperature, vocab_size, chunk) in enumerate(CASES):
        logits, labels, grad_out = _data(dtype, vocab_size, seed=i)
        shard = logits[..., half].contiguous()
        kw = {"temperature": temperature, "vocab_size": vocab_size, "tp_rank": rank}
        new_lp, new_grad = _run(token_logprobs, shard, labels, grad_out, chunk_tokens=chunk, **kw)
        old_lp, old_grad = _run(_old_token_logprobs, shard, labels, grad_out, **kw)
        scale = old_grad.float().abs().max().item() or 1.0  # all zero on an all-padding slice
        vs_old.append((_max_err(new_lp, old_lp), _max_err(new_grad, old_grad) / scale))
    parallel_state.destroy_model_parallel()
    return vs_old


def _grad_tol(dtype):
    # fp32: sums in another order, relative to the largest gradient. bf16: both sides are an fp32
    # gradient rounded to bf16, so one bf16 ulp.
    return 2**-8 if dtype == torch.bfloat16 else 1e-5


def test_tp2_equals_tp1():
    for errors, wrong_rank_raised in run_distributed(_body, world_size=2):
        assert wrong_rank_raised
        for case, err in zip(CASES, errors):
            assert err["dtype_ok"], case
            # fp32 sums in another order: ~1e-6 on values of size ~10.
            assert err["lp"] < 1e-4 and err["ent"] < 1e-4 and err["fused"] == 0, (case, err)
            assert err["grad"] < _grad_tol(case[0]), (case, err)


# ~25 s of Megatron imports; the layout and HF tests cover the default-group path at TP=2.
@pytest.mark.slow
def test_tp2_equals_megatron_cross_entropy():
    """Megatron's import dominates this test's time (~10 s of CPU per rank)."""
    for vs_old in run_distributed(_megatron_body, world_size=2):
        for case, (lp_err, grad_err) in zip(CASES, vs_old):
            assert lp_err < 1e-4 and grad_err < _grad_tol(case[0]), (case, lp_err, grad_err)
