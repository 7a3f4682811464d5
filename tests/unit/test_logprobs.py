"""Chunked log-probabilities and entropy (models/logprobs.py) against a float64 log_softmax.

One process, no TP group (the 2-rank split is tests/distributed/test_logprobs_tp.py). Every chunk
size must give the reference values and gradients: 1, one that does not divide the token count,
and one larger than the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.models.logprobs import (
    _token_rows,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

B, S, LOCAL = 3, 7, 40  # 21 tokens, 40 columns


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, S, LOCAL, generator=g)).to(dtype)
    labels = torch.randint(0, LOCAL, (B, S), generator=g)
    grad_out = torch.randn(B, S, generator=g)
    return logits, labels, grad_out


def _reference(logits, labels, grad_out, temperature, vocab_size):
    """float64 log_softmax over the real columns: (logprobs, entropy, d(sum lp * g)/d logits)."""
    x = logits.detach().double().requires_grad_(True)
    z = x / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(LOCAL) >= vocab_size, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, labels[..., None])[..., 0]
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    (lp * grad_out.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


# (dtype, atol on logprobs/entropy, relative tolerance on the gradient): the inputs are the
# reference's inputs (bf16 values upcast exactly), so only fp32 arithmetic and, for bf16, the
# rounding of the gradient to bf16 (2^-8 relative) separate the two.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 2**-8)]


@pytest.mark.parametrize("dtype,atol,grad_rtol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_size", [None, 33])  # 33 < 40 columns: the last 7 are padding
@pytest.mark.parametrize("chunk", [1, 5, 4096])  # 5 does not divide 21; 4096 > 21 tokens
def test_values_and_gradients_match_float64(dtype, atol, grad_rtol, temperature, vocab_size, chunk):
    logits, labels, grad_out = _inputs(dtype)
    if vocab_size is not None:
        labels = labels % vocab_size
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, grad_out, temperature, vocab_size)
    kw = {"temperature": temperature, "vocab_size": vocab_size, "chunk_tokens": chunk}

    x = logits.clone().requires_grad_(True)
    lp = token_logprobs(x, labels, **kw)
    (lp * grad_out).sum().backward()
    assert lp.dtype == torch.float32 and lp.shape == (B, S)
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    torch.testing.assert_close(lp.double(), ref_lp, atol=atol, rtol=0)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), ref_grad, atol=grad_rtol * scale, rtol=grad_rtol)
    if vocab_size is not None:
        assert (x.grad[..., vocab_size:] == 0).all()

    ent = token_entropy(logits, temperature=temperature, vocab_size=vocab_size, chunk_tokens=chunk)
    torch.testing.assert_close(ent.double(), ref_ent, atol=atol, rtol=0)
    lp2, ent2 = token_logprobs_and_entropy(logits, labels, **kw)
    assert torch.equal(lp2, lp.detach()) and torch.equal(ent2, ent)  # same arithmetic, one pass


def test_chunking_does_not_change_results():
    """Each token's row is reduced the same way whatever chunk it falls in."""
    logits, labels, grad_out = _inputs(torch.float32, seed=1)
    outs = []
    for chunk in (1, 4, 21, 100):
        x = logits.clone().requires_grad_(True)
        lp = token_logprobs(x, labels, temperature=0.9, chunk_tokens=chunk)
        (lp * grad_out).sum().backward()
        outs.append((lp.detach(), x.grad))
    for lp, grad in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, outs[0][1], atol=1e-7, rtol=1e-6)


def test_transposed_layout_is_read_without_copy_and_matches():
    """Logits that are a [B, S, V] transpose of a contiguous [S, B, V] (Megatron's layout) give
    the same values and a gradient of the same layout."""
    logits, labels, grad_out = _inputs(torch.float32, seed=2)
    sbv = logits.transpose(0, 1).contiguous().requires_grad_(True)
    rows, transposed = _token_rows(sbv.transpose(0, 1))
    assert transposed and rows.data_ptr() == sbv.data_ptr()  # a view: no copy of the logits
    lp_t = token_logprobs(sbv.transpose(0, 1), labels, chunk_tokens=4)
    (lp_t * grad_out).sum().backward()
    x = logits.clone().requires_grad_(True)
    lp = token_logprobs(x, labels, chunk_tokens=4)
    (lp * grad_out).sum().backward()
    torch.testing.assert_close(lp_t, lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(sbv.grad.transpose(0, 1), x.grad, atol=1e-7, rtol=1e-6)
    ent_t = token_entropy(sbv.detach().transpose(0, 1), chunk_tokens=4)
    torch.testing.assert_close(ent_t, token_entropy(logits), atol=1e-6, rtol=0)


def test_extreme_logits_stay_finite():
    """Huge and tiny logits: the max shift keeps exp in range, masked columns add exact zeros."""
    logits = torch.tensor([[[1e4, -1e4, 0.0, 5.0], [-3e4, -3e4, -3e4, -3e4]]])
    labels = torch.tensor([[1, 2]])
    x = logits.clone().requires_grad_(True)
    lp = token_logprobs(x, labels, vocab_size=3)
    lp.sum().backward()
    ent = token_entropy(logits, vocab_size=3)
    assert torch.isfinite(lp).all() and torch.isfinite(x.grad).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp, torch.tensor([[-2e4, -torch.log(torch.tensor(3.0))]]))
    torch.testing.assert_close(ent[0, 1], torch.log(torch.tensor(3.0)))


def test_bad_arguments_name_the_argument():
    logits, labels, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(logits, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(logits, temperature=0.0)


def test_strided_vocab_slice_is_copied_and_matches():
    """A layout no view can flatten (a column slice) is copied once and gives the same results."""
    logits, labels, grad_out = _inputs(torch.float32, seed=3)
    labels = labels % 30
    wide = logits.clone().requires_grad_(True)
    lp_s = token_logprobs(wide[..., :30], labels, chunk_tokens=4)
    (lp_s * grad_out).sum().backward()
    x = logits[..., :30].clone().requires_grad_(True)
    lp = token_logprobs(x, labels, chunk_tokens=4)
    (lp * grad_out).sum().backward()
    torch.testing.assert_close(lp_s, lp, atol=0, rtol=0)
    torch.testing.assert_close(wide.grad[..., :30], x.grad, atol=0, rtol=0)
    assert (wide.grad[..., 30:] == 0).all()
