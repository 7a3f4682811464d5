"""Per-token log-probabilities and entropy from vocab-sharded logits.

With tensor parallelism the output layer keeps logits split along the vocabulary (each TP rank
holds V/tp columns). The log-probability of a label then needs the global log-sum-exp, which
Megatron's ``vocab_parallel_cross_entropy`` computes with two all-reduces over the TP group and a
correct backward. Entropy needs one more reduction (sum of p * logit); it is a metric here, so it is
computed without gradient.
"""

from __future__ import annotations

import torch

# Finite stand-in for -inf on padded vocabulary columns: exp() gives exactly 0 and 0 * it stays
# finite, so entropy sums never see inf * 0.
_MASKED_LOGIT = -1e30


def mask_padded_vocab(
    logits: torch.Tensor, vocab_size: int | None, tp_rank: int = 0
) -> torch.Tensor:
    """Hide the columns Megatron added to pad the vocabulary to a multiple of 128 * TP.

    The HF export strips those rows, so the rollout engine's softmax never sees them; masking them
    here keeps trainer and engine log-probabilities over the same support.
    """
    if vocab_size is None:
        return logits
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    cols = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, _MASKED_LOGIT)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_rank: int = 0,
) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature); logits [B, S, V/tp], labels [B, S].

    The TP group is Megatron's (``vocab_parallel_cross_entropy`` reads it from parallel_state).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    if temperature != 1.0:
        logits = logits / temperature
    # Megatron expects [S, B, V]; it returns the per-token loss -log p.
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.t().contiguous())
    return -nll.t()


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_rank: int = 0,
    tp_group=None,
) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, reduced over the TP-sharded vocabulary."""
    import torch.distributed as dist

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    if temperature != 1.0:
        logits = logits / temperature
    distributed = tp_group is not None and dist.get_world_size(tp_group) > 1
    lmax = logits.max(dim=-1, keepdim=True).values
    if distributed:
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - lmax
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    sum_exp_logit = (exp * shifted).sum(-1)
    if distributed:
        stacked = torch.stack([sum_exp, sum_exp_logit])
        dist.all_reduce(stacked, group=tp_group)
        sum_exp, sum_exp_logit = stacked[0], stacked[1]
    # H = log Z - E_p[logit], with logits shifted by their max.
    return sum_exp.log() - sum_exp_logit / sum_exp
