"""Turn sampled completions into the trainer's tensors (pure; no Megatron, no distributed).

Layout, one row per completion, right-padded to a common length S:

    input_ids  = prompt + response            (pad after)
    labels[t]  = input_ids[t + 1]             (the token predicted at position t)
    loss_mask[t] = 1 where labels[t] is a response token the policy sampled (eos included; 0 on
                   an environment's observation tokens between turns: Completion.response_mask)

so every per-token tensor (logprobs, rollout logprobs, advantages) is aligned with ``labels``.

Micro-batches by token budget (``train.max_tokens_per_gpu``, slime's name): instead of a fixed row
count padded to the batch's longest row, :func:`pack_by_tokens` groups rows so that each
micro-batch's padded size (rows x its own longest row) stays within a budget; :func:`take_rows`
cuts one out and :func:`merge_rows` puts per-token outputs back in the batch's row order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl_fp8.loss import grpo_advantages
from megatron_rl_fp8.models.routing_replay import ROUTES, encode_routes, route_dtype
from megatron_rl_fp8.rollout.base import Completion


def build_rl_batch(
    completions: list[Completion],
    advantages: torch.Tensor,
    *,
    pad_id: int,
    pad_to: int | None = None,
) -> dict[str, torch.Tensor]:
    lengths = [len(c.prompt_ids) + len(c.response_ids) for c in completions]
    width = max(max(lengths), pad_to or 0)
    n = len(completions)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, c in enumerate(completions):
        seq = c.prompt_ids + c.response_ids
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:])
        start = len(c.prompt_ids) - 1  # position whose label is the first response token
        end = start + len(c.response_ids)
        loss_mask[i, start:end] = torch.tensor(c.sampled(), dtype=torch.float32)
        rollout_logprobs[i, start:end] = torch.tensor(c.response_logprobs, dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "rollout_logprobs": rollout_logprobs,
        "advantages": advantages.to(torch.float32).reshape(n),
    }
    routes = [c.routed_experts for c in completions]
    if any(r is not None for r in routes):
        # A MoE engine's routes ([positions, layers, k] per row; models/routing_replay.py):
        # expert + 1 at each position it ran, 0 (route freely) elsewhere.
        layers, k = next(r for r in routes if r is not None).shape[1:]
        dtype = route_dtype(
            max((int(r.max()) for r in routes if r is not None and r.numel()), default=0)
        )
        batch[ROUTES] = torch.zeros((n, width, layers, k), dtype=dtype)
        for i, r in enumerate(routes):
            if r is not None:
                batch[ROUTES][i, : r.shape[0]] = encode_routes(r, dtype)
    return batch


def rollout_batch(
    cfg, completions: list[Completion], rewards, lags: torch.Tensor, dp_size: int, tokenizer
) -> dict[str, torch.Tensor]:
    """The step's batch of a rollout (the driver's): GRPO advantages of ``rewards`` over groups
    of ``rollout.n_samples_per_prompt``, the rows (:func:`build_rl_batch`) with each one's policy
    lag (``policy_lag``, trainer/pipeline.py), ordered for ``train.updates_per_step``."""
    n, norm = cfg.rollout.n_samples_per_prompt, cfg.loss.norm_adv_by_std
    advantages = grpo_advantages(rewards, n, norm_std=norm)
    rows = build_rl_batch(completions, advantages, pad_id=tokenizer.pad_token_id)
    rows["policy_lag"] = lags
    return order_for_updates(rows, dp_size, cfg.train.updates_per_step)


def build_sft_batch(collated: dict[str, torch.Tensor], *, pad_id: int) -> dict[str, torch.Tensor]:
    """SFT batch from ``data.collate`` output: the loss mask moves to label positions."""
    ids = collated["input_ids"]
    labels = torch.full_like(ids, pad_id)
    labels[:, :-1] = ids[:, 1:]
    loss_mask = torch.zeros_like(collated["loss_mask"])
    loss_mask[:, :-1] = collated["loss_mask"][:, 1:]
    return {"input_ids": ids, "labels": labels, "loss_mask": loss_mask}


def rows_for_rank(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Contiguous slice of rows for one data-parallel rank."""
    n = next(iter(batch.values())).shape[0]
    per = n // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def order_for_updates(
    batch: dict[str, torch.Tensor], dp_size: int, updates: int
) -> dict[str, torch.Tensor]:
    """Reorder rows so that mini-batch ``u`` is rows ``[u*M, (u+1)*M)`` of the original batch at
    any data-parallel size.

    Each DP rank takes a contiguous slice (:func:`rows_for_rank`) and splits it into ``updates``
    mini-batches. Without reordering, DP=2 would train update 0 on rows {0..M/2, N/2..N/2+M/2}
    instead of rows 0..M: a different (equally valid) split, but not the 1-rank run. After it, the
    optimizer sees the same mini-batches, and micro-batches, whatever the layout.
    """
    n = next(iter(batch.values())).shape[0]
    if n % (dp_size * updates):
        raise ValueError(f"{n} rows do not split into {updates} mini-batches over {dp_size} ranks")
    per_mini, per_rank = n // updates, n // (updates * dp_size)
    index = torch.tensor(
        [
            u * per_mini + r * per_rank + i
            for r in range(dp_size)
            for u in range(updates)
            for i in range(per_rank)
        ]
    )
    return {k: v[index] for k, v in batch.items()}


def row_lengths(loss_mask: torch.Tensor) -> list[int]:
    """The positions a forward pass of each row must cover: up to its last ``loss_mask`` position
    (whose label is the row's last response token), at least 1.

    Later positions are padding or the final input token, whose prediction no loss or metric reads;
    under the causal mask, leaving them out changes no earlier position's output. Host sync: the
    lengths go to the host to plan the micro-batches.
    """
    positions = torch.arange(1, loss_mask.shape[1] + 1, device=loss_mask.device)
    return (loss_mask.ne(0) * positions).amax(dim=1).clamp(min=1).tolist()


def pack_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group rows (by index) into micro-batches whose padded size, rows x the longest row in it,
    is at most ``max_tokens``; a row longer than ``max_tokens`` gets a micro-batch of its own.

    First-fit decreasing, deterministic: rows are taken longest first (ties by index). Then a
    micro-batch's first row is its longest, and one that could not take a row can take no later
    (shorter, so no cheaper) row either: first fit reduces to filling one micro-batch at a time.
    The micro-batches come longest first, rows inside each in that order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def take_rows(batch: dict[str, torch.Tensor], rows: list[int], width: int) -> dict:
    """Rows ``rows`` of ``batch``, every per-token tensor (2-D or more: [B, S, ...], aligned with
    ``labels``) cut to its first ``width`` positions; per-row tensors ([B]) just the rows."""
    out = {}
    for k, v in batch.items():
        index = torch.tensor(rows, device=v.device)
        out[k] = v[index, :width] if v.dim() >= 2 else v[index]
    return out


def merge_rows(parts: list[torch.Tensor], groups: list[list[int]], width: int) -> torch.Tensor:
    """The inverse of :func:`take_rows` over all micro-batches for per-token outputs: ``parts[i]``
    ([len(groups[i]), S_i]) holds rows ``groups[i]``; returns [B, width] in the batch's row order,
    zero past each micro-batch's width (positions no loss or metric reads)."""
    n = sum(len(g) for g in groups)
    out = parts[0].new_zeros((n, width))
    for rows, part in zip(groups, parts):
        part = part[:, :width]  # positions padded past the batch's S carry nothing
        out[torch.tensor(rows, device=part.device), : part.shape[1]] = part
    return out
