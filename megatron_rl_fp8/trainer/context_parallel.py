"""Context parallelism's data path: which tokens of a sequence each CP rank holds, and back.

Megatron's context parallelism splits every sequence over the CP ranks of a model replica;
attention exchanges keys and values between them (Transformer Engine's ring attention), everything
else is per token. For causal attention the load is balanced by cutting the sequence into 2 x CP
equal chunks and giving rank r chunks r and 2 x CP - 1 - r (an early, cheap chunk with a late,
expensive one), the layout Megatron's own ``get_batch_on_this_cp_rank`` produces and its RoPE
slices for (``get_pos_emb_on_this_cp_rank``).

What the trainer does with it:

* every per-token tensor of a micro-batch ([B, S, ...], aligned with ``labels``) is cut to this
  rank's positions before the forward pass (``split_for_cp``), per-row tensors stay whole;
* a pass whose per-token outputs are used whole (old / reference logprobs, entropy) all-gathers them
  over the CP group back to [B, S] (``gather_from_cp``), so everything downstream (calibration
  histograms, rollout-mismatch metrics, DAPO's decisions) sees the same tensors on every CP rank;
* the training loss covers this rank's tokens only, normalised by the global count, so the CP
  ranks' losses (and gradients, which Megatron reduces over DP x CP) sum to the full one, and its
  token statistics (per-token metric sums, ratio histograms) are summed over DP x CP.

Per-sequence quantities that need a whole row (``loss.agg: seq-mean-token-mean``'s per-row token
count, sequence-level importance weights) are not split: the config refuses them under CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_positions(seq: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions (ascending) of a ``seq``-long sequence that CP rank ``cp_rank`` holds: chunks
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks."""
    chunks = 2 * cp_size
    if seq % chunks:
        raise ValueError(
            f"sequence length {seq} is not a multiple of 2 x context_parallel_size = {chunks} "
            "(split_micro_batches pads to it)"
        )
    size = seq // chunks
    first, second = cp_rank, chunks - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(first * size, (first + 1) * size),
            torch.arange(second * size, (second + 1) * size),
        ]
    )


def split_for_cp(mb: dict[str, torch.Tensor], cp_size: int, cp_rank: int) -> dict:
    """This CP rank's share of micro-batch ``mb``: per-token tensors (2-D or more, [B, S, ...])
    at ``cp_positions``, per-row tensors whole, plus ``position_ids`` [B, S / CP] (the tokens'
    positions in the full sequence)."""
    rows, seq = mb["input_ids"].shape
    index = cp_positions(seq, cp_size, cp_rank).to(mb["input_ids"].device)
    out = {k: v.index_select(1, index) if v.dim() >= 2 else v for k, v in mb.items()}
    out["position_ids"] = index.unsqueeze(0).expand(rows, -1)
    return out


def gather_from_cp(local: torch.Tensor, cp_group, cp_size: int) -> torch.Tensor:
    """The inverse of ``split_for_cp`` for one per-token output: every CP rank's [B, S / CP]
    share all-gathered (collective over ``cp_group``) into [B, S], each at its positions."""
    rows, share = local.shape[:2]
    seq = share * cp_size
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    out = local.new_empty((rows, seq, *local.shape[2:]))
    for rank, part in enumerate(parts):
        out[:, cp_positions(seq, cp_size, rank).to(local.device)] = part
    return out
