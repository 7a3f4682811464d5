"""Outcome advantages for GRPO and the DAPO reward-side pieces, as pure tensor functions.

Layout convention: ``rewards`` is a flat [N] tensor holding ``N / group_size`` prompt groups, the
``group_size`` samples of one prompt adjacent (prompt-major), which is the order the rollout stage
emits them in.
"""

from __future__ import annotations

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [N] tensor; got shape {tuple(rewards.shape)}.")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards "
            f"({rewards.numel()}); rewards are [num_prompts * group_size]."
        )
    return rewards.view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """GRPO group-relative advantages: ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g``.

    The standard deviation is the population one (``unbiased=False``) by default: it is defined for
    any group size (a group of 1 gets advantage 0 instead of NaN) and only rescales the advantages
    by sqrt((G-1)/G) against verl's unbiased choice, which ``unbiased=True`` reproduces.
    ``norm_std=False`` is Dr. GRPO's mean-only baseline. A group with identical rewards gets
    advantage 0 for every sample either way.

    Returns an [N] tensor in ``rewards``' dtype (float rewards recommended; ints are promoted).
    """
    grouped = _grouped(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if norm_std:
        std = (
            grouped.std(dim=-1, keepdim=True, unbiased=unbiased)
            if group_size > 1
            else torch.zeros_like(centred[:, :1])
        )
        centred = centred / (std + eps)
    return centred.reshape(-1)


def dynamic_sampling_keep_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: which prompt groups to keep (bool [N / group_size]).

    A group whose samples all got the same reward has zero advantage everywhere and contributes no
    gradient, only noise to the token denominators; DAPO drops it and samples more prompts.
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=-1) != grouped.amin(dim=-1)


def overlong_reward_penalty(
    response_lengths: torch.Tensor,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the task reward (float [N], values in [-factor, 0]).

    With ``L`` the response length and ``start = max_len - buffer_len``:
    0 for ``L <= start``, falling linearly to ``-penalty_factor`` at ``L = max_len``, and
    ``-penalty_factor`` for ``L > max_len`` (truncated responses).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"buffer_len={buffer_len} must satisfy 0 < buffer_len <= max_len "
            f"(max_len={max_len}); DAPO uses e.g. max_len=20480, buffer_len=4096."
        )
    start = max_len - buffer_len
    lengths = response_lengths.to(torch.float32)
    ramp = (lengths - start).clamp(0.0, float(buffer_len)) / buffer_len
    return -penalty_factor * ramp
