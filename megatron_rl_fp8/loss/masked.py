"""Masked reductions over [B, T] token tensors (padding and prompt tokens carry mask 0)."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (bool or float mask), over ``dim`` or everything."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1, over ``dim`` or everything.

    An all-zero mask gives 0 rather than NaN: an empty micro-batch (every response filtered out by
    dynamic sampling) must not poison the step's metrics or gradients.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum() if dim is None else mask_f.sum(dim=dim)
    return masked_sum(values, mask_f, dim) / count.clamp_min(1.0)
