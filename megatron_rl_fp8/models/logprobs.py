"""Per-token log-probabilities and entropy from vocab-sharded logits, in chunks of tokens.

With tensor parallelism the output layer keeps logits split along the vocabulary (each TP rank
holds V/tp columns). The log-probability of a label needs the global log-sum-exp (lse)::

    log p(y) = z_y - lse(z),   lse(z) = m + log sum_v exp(z_v - m),   m = max_v z_v

so each rank reduces its slice (max, then sum of exp) and two all-reduces over the TP group finish
the job; the label's logit lives on the one rank whose slice holds it, and a SUM all-reduce (zeros
elsewhere) brings it to all. Entropy needs one more sum in the same all-reduce::

    H = lse - E_p[z] = log S - sum_v p_v (z_v - m),   S = sum_v exp(z_v - m)

Memory is the point of this module. The logits of one micro-batch are the largest activation of
an RL step ([tokens, V/tp]: 16K tokens x 151936 vocab is 2.5 G elements, 10 GB per fp32 copy), and
a straightforward implementation makes several fp32 copies (upcast, padded-vocab mask,
temperature, transpose, exp) and keeps the fp32 softmax alive for the backward. Here:

* the tokens are processed in chunks of ``chunk_tokens`` (default 4096): each chunk is upcast into
  one reused fp32 buffer, masked, scaled and exponentiated in place, so the fp32 working set is
  one chunk (two for entropy), ``chunk_tokens * V/tp * 4`` bytes each, whatever the micro-batch;
* the backward saves the input logits by reference (no copy) and one fp32 lse per token, and
  recomputes each chunk's softmax from them: grad = (onehot(y) - softmax) / T * grad_out, written
  into a gradient of the logits' dtype (the one full-size tensor a backward has to produce).

The price is one more read of the logits in the backward (recomputing exp), and two small
all-reduces per chunk instead of per micro-batch. Nothing here syncs the host with the device.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

# Finite stand-in for -inf on padded vocabulary columns: exp() gives exactly 0 and 0 * it stays
# finite, so entropy sums never see inf * 0.
_MASKED_LOGIT = -1e30

# Tokens per fp32 working chunk. At V/tp = 151936 one chunk is 2.5 GB of fp32; the collectives
# (two per chunk, a few KB each) are negligible next to the passes over the chunk.
DEFAULT_CHUNK_TOKENS = 4096


def mask_padded_vocab(
    logits: torch.Tensor, vocab_size: int | None, tp_rank: int = 0
) -> torch.Tensor:
    """Hide the columns Megatron added to pad the vocabulary to a multiple of 128 * TP.

    The HF export strips those rows, so the rollout engine's softmax never sees them; masking them
    here keeps trainer and engine log-probabilities over the same support. (Returns a masked copy;
    the chunked functions below mask each fp32 chunk in place instead.)
    """
    if vocab_size is None:
        return logits
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    cols = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, _MASKED_LOGIT)


# -- helpers ------------------------------------------------------------------------------------
def _tp_group(tp_group):
    """The group to reduce over: the one given, else Megatron's TP group when Megatron's
    parallel_state is initialised, else None (one rank, no collectives).

    Megatron is looked up in ``sys.modules`` rather than imported: if nothing imported it, its
    parallel state cannot be initialised, and a CPU unit test does not pay Megatron's import."""
    if tp_group is not None:
        return tp_group
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps.get_tensor_model_parallel_group(check_initialized=False) if ps else None


def _reduce_group(tp_group, tp_rank: int):
    """The resolved TP group when it has more than one rank (collectives needed), else None."""
    group = _tp_group(tp_group)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    if dist.get_rank(group) != tp_rank:
        raise ValueError(
            f"tp_rank={tp_rank} but this process is rank {dist.get_rank(group)} of the TP group: "
            "pass the TP rank of the group the logits are sharded over"
        )
    return group


def _token_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` [..., V] as a [tokens, V] view, without a copy where the layout allows.

    Returns (rows, transposed): transposed=True means the rows are in [S, B] order (``t`` is a
    [B, S, V] transpose of a contiguous [S, B, V], Megatron's native layout). Any other layout is
    copied once, in ``t``'s own dtype (half an fp32 copy for bf16)."""
    v = t.shape[-1]
    try:
        return t.view(-1, v), False
    except RuntimeError:
        pass  # not row-contiguous: maybe Megatron's [S, B, V] seen as [B, S, V]
    if t.dim() == 3:
        try:
            return t.transpose(0, 1).view(-1, v), True
        except RuntimeError:
            pass  # some other strided layout: the one copy below
    return t.reshape(-1, v), False


def _from_rows(rows: torch.Tensor, shape: torch.Size, transposed: bool) -> torch.Tensor:
    """Per-token vector [tokens] back to the logits' leading shape (inverse of _token_rows)."""
    if transposed:
        return rows.view(shape[1], shape[0]).t().contiguous()
    return rows.view(shape)


def _check(temperature: float, chunk_tokens: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def _scaled_chunk(
    rows: torch.Tensor, lo: int, hi: int, valid: int, temperature: float, work: torch.Tensor
) -> torch.Tensor:
    """rows[lo:hi] in fp32, divided by the temperature, padded columns masked, written into the
    reused buffer ``work`` (one allocation per pass: on CPU each fresh chunk-sized allocation
    would be new pages to fault in; on GPU the caching allocator would hand back the same block).
    """
    z = work[: hi - lo]
    z.copy_(rows[lo:hi])
    if temperature != 1.0:
        z.div_(temperature)
    if valid < z.shape[1]:
        z[:, valid:] = _MASKED_LOGIT
    return z


def _work_buffer(rows: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The fp32 working chunk: [min(chunk_tokens, tokens), V/tp]."""
    n, local = rows.shape
    return torch.empty(min(chunk_tokens, n), local, dtype=torch.float32, device=rows.device)


def _local_labels(labels_rows: torch.Tensor, start: int, local: int):
    """(index into this rank's slice, clamped to it; whether the label is in the slice)."""
    idx = labels_rows - start
    inside = (idx >= 0) & (idx < local)
    return idx.clamp(0, local - 1), inside


def _valid_columns(local: int, vocab_size: int | None, tp_rank: int) -> int:
    """How many of this rank's columns are real vocabulary (the rest are padding, at the end)."""
    if vocab_size is None:
        return local
    return max(0, min(local, vocab_size - tp_rank * local))


def _forward_chunks(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    temperature: float,
    vocab_size: int | None,
    tp_rank: int,
    group,
    chunk_tokens: int,
    entropy: bool,
):
    """One pass over the logits, chunk by chunk.

    Returns ([tokens] fp32 vectors, in _token_rows order): lse of logits / T, log p(label) (None
    without labels), entropy (None unless asked), and whether the rows are transposed."""
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must be the logits' shape without the vocabulary "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    rows, transposed = _token_rows(logits)
    n, local = rows.shape
    valid = _valid_columns(local, vocab_size, tp_rank)
    out_lse = torch.empty(n, dtype=torch.float32, device=rows.device)
    out_lp = torch.empty_like(out_lse) if labels is not None else None
    out_ent = torch.empty_like(out_lse) if entropy else None
    if labels is not None:
        label_rows = labels.t().reshape(-1) if transposed else labels.reshape(-1)
        idx_all, inside_all = _local_labels(label_rows.to(rows.device), tp_rank * local, local)
    work = _work_buffer(rows, chunk_tokens)
    work_exp = torch.empty_like(work) if entropy else None
    for lo in range(0, n, chunk_tokens):
        hi = min(lo + chunk_tokens, n)
        z = _scaled_chunk(rows, lo, hi, valid, temperature, work)
        m = z.amax(dim=1)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z.sub_(m[:, None])  # z - m <= 0 everywhere: exp cannot overflow
        sums = []  # what the SUM all-reduce completes: sum exp, [label logit], [sum exp * z]
        if labels is not None:
            # Label logit (shifted) on the rank that holds it, zero on the others.
            picked = z.gather(1, idx_all[lo:hi, None])[:, 0]
            picked = torch.where(inside_all[lo:hi], picked, torch.zeros_like(picked))
        if entropy:
            e = torch.exp(z, out=work_exp[: hi - lo])
            sums.append(e.sum(dim=1))
            sums.append(e.mul_(z).sum(dim=1))  # masked columns: 0 * -1e30 = 0
        else:
            sums.append(z.exp_().sum(dim=1))
        if labels is not None:
            sums.append(picked)
        stacked = torch.stack(sums)
        if group is not None:
            dist.all_reduce(stacked, group=group)
        log_s = stacked[0].log()
        out_lse[lo:hi] = m + log_s
        if entropy:
            out_ent[lo:hi] = log_s - stacked[1] / stacked[0]
        if labels is not None:
            out_lp[lo:hi] = stacked[-1] - log_s
    return out_lse, out_lp, out_ent, transposed


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(label) from vocab-sharded logits; forward and backward chunk by chunk (see module
    docstring). Saves the logits by reference, the labels and one fp32 lse per token."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, tp_rank, group, chunk_tokens):
        lse, lp, _, transposed = _forward_chunks(
            logits,
            labels,
            temperature=temperature,
            vocab_size=vocab_size,
            tp_rank=tp_rank,
            group=group,
            chunk_tokens=chunk_tokens,
            entropy=False,
        )
        ctx.save_for_backward(logits, labels, lse)
        ctx.args = (temperature, vocab_size, tp_rank, chunk_tokens, transposed)
        return _from_rows(lp, labels.shape, transposed)

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        temperature, vocab_size, tp_rank, chunk_tokens, transposed = ctx.args
        rows, _ = _token_rows(logits)
        n, local = rows.shape
        valid = _valid_columns(local, vocab_size, tp_rank)
        label_rows = labels.t().reshape(-1) if transposed else labels.reshape(-1)
        idx_all, inside_all = _local_labels(label_rows.to(rows.device), tp_rank * local, local)
        g_rows = (grad_out.t() if transposed else grad_out).reshape(-1).float() / temperature
        grad = torch.empty(rows.shape, dtype=logits.dtype, device=rows.device)
        work = _work_buffer(rows, chunk_tokens)
        for lo in range(0, n, chunk_tokens):
            hi = min(lo + chunk_tokens, n)
            # d log p(y) / d z_v = onehot(y)_v - softmax_v; then / T through z = logits / T.
            p = _scaled_chunk(rows, lo, hi, valid, temperature, work)
            p.sub_(lse[lo:hi, None]).exp_().neg_()
            p.scatter_add_(1, idx_all[lo:hi, None], inside_all[lo:hi, None].to(p.dtype))
            p.mul_(g_rows[lo:hi, None])
            if valid < local:
                # Padded columns are constants (masked), as in the masked_fill they stand for:
                # no gradient, even for a label that points at one.
                p[:, valid:] = 0.0
            grad[lo:hi] = p
        if transposed:
            grad = grad.view(logits.shape[1], logits.shape[0], local).transpose(0, 1)
        else:
            grad = grad.view(logits.shape)
        return grad, None, None, None, None, None, None


# -- public API ---------------------------------------------------------------------------------
def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_rank: int = 0,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature), fp32 [B, S], differentiable.

    logits [B, S, V/tp] (any float dtype; this rank's vocabulary slice, columns
    ``tp_rank * V/tp ...``), labels [B, S] (global token ids). Columns at or past ``vocab_size``
    are padding and get no probability. ``tp_group``: the group the vocabulary is sharded over;
    None means Megatron's TP group when Megatron's parallel_state is initialised, else one rank.
    The gradient w.r.t. the logits has the logits' dtype.
    """
    _check(temperature, chunk_tokens)
    group = _reduce_group(tp_group, tp_rank)
    return _ChunkedTokenLogprobs.apply(
        logits, labels, float(temperature), vocab_size, tp_rank, group, chunk_tokens
    )


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_rank: int = 0,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, fp32 [B, S], reduced over the TP-sharded
    vocabulary (``tp_group`` as in ``token_logprobs``). A metric: no gradient."""
    _check(temperature, chunk_tokens)
    _, _, ent, transposed = _forward_chunks(
        logits,
        None,
        temperature=temperature,
        vocab_size=vocab_size,
        tp_rank=tp_rank,
        group=_reduce_group(tp_group, tp_rank),
        chunk_tokens=chunk_tokens,
        entropy=True,
    )
    return _from_rows(ent, logits.shape[:-1], transposed)


@torch.no_grad()
def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_rank: int = 0,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``token_logprobs``, ``token_entropy``) in one pass over the logits, without gradient.

    For the old-logprob pass, which needs both: the max, the sum of exp and their all-reduces are
    shared, so this reads the logits once instead of twice."""
    _check(temperature, chunk_tokens)
    _, lp, ent, transposed = _forward_chunks(
        logits,
        labels,
        temperature=temperature,
        vocab_size=vocab_size,
        tp_rank=tp_rank,
        group=_reduce_group(tp_group, tp_rank),
        chunk_tokens=chunk_tokens,
        entropy=True,
    )
    shape = logits.shape[:-1]
    return _from_rows(lp, shape, transposed), _from_rows(ent, shape, transposed)
