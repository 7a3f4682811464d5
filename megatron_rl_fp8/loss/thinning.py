"""Share-matched clipping (``loss.calib.mode=share``): clip, per advantage sign, BF16's share.

Calibration compares, on one mini-batch, how many tokens of each sign the nominal bounds clip under
FP8 and under BF16 (exact counts at the nominal bounds). Their ratio is the *keep fraction*::

    keep_neg = #(A<0, BF16 r < 1 - eps_low) / #(A<0, FP8 r < 1 - eps_low)     (at most 1)
    keep_pos = #(A>0, BF16 r > 1 + eps_high) / #(A>0, FP8 r > 1 + eps_high)   (at most 1)

Later updates keep the nominal bounds but clip only that fraction of the tokens FP8 puts past
them: in each sequence, its most extreme ones, through a per-row bound moved out to the row's
k-th most extreme ratio. Unlike a calibrated bound, a fraction of the clipped set carries over to
batches whose ratio spread differs from the calibration batch's (each row's bound comes from its
own ratios), which is what stale bounds did not. A fraction is at most 1: the rule never clips a
token the nominal bounds would not, so it can only widen the trust region towards BF16's.

Per row, k = floor(keep * n + u) of its n tokens past the bound, where u in [0, 1) is a hash of
the row's response tokens and a salt (run seed, step, mini-batch): the expected count is exact even
where a row holds one clipped token (A>0 clips are rare), no host sync is needed, and the decision
depends on the row alone, so DP, PP, TP and micro-batch layouts clip the same tokens. (Context
parallelism splits a row's positions: each rank then thins its part of the row.)
"""

from __future__ import annotations

import torch

from megatron_rl_fp8.loss.calibration import unpack_histogram
from megatron_rl_fp8.loss.ppo import MAX_LOG_RATIO

_PRIME = 2**31 - 1  # the hash's modulus (products stay below 2^63)


def token_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor):
    """The detached ratio ``policy_loss`` clips (padding at 1), with its clamp."""
    mask_b = mask.bool()
    log_ratio = torch.where(mask_b, log_prob.detach() - old_log_prob.detach(), 0.0)
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def salt(*parts: int) -> int:
    """One integer in [0, 2^31 - 1) from several (seed, step, mini-batch position)."""
    mixed = 0
    for part in parts:
        mixed = (mixed * 1_000_003 + int(part)) % _PRIME
    return mixed


def row_offsets(labels: torch.Tensor, mask: torch.Tensor, salt_: int) -> torch.Tensor:
    """[B, 1] float64 offsets in [0, 1): a hash of each row's response tokens and ``salt_``.

    Only response positions count (a micro-batch may be trimmed to its longest row), each token
    weighted by a per-position constant, so the row gives the same offset in any layout."""
    t = torch.arange(labels.shape[-1], device=labels.device, dtype=torch.int64)
    weight = (t * 2_654_435_761 + 97) % 1_048_573 + 1  # < 2^20 per position
    tokens = (labels.long() % 65_521 + 1) * mask.long()  # < 2^16
    h = (tokens * weight).sum(dim=-1, keepdim=True) % _PRIME
    for _ in range(2):  # Lehmer steps mix the salt in
        h = (h * 48_271 + salt_) % _PRIME
    return h.double() / _PRIME


def _row_kth(values: torch.Tensor, past: torch.Tensor, k: torch.Tensor, nominal, largest: bool):
    """[B, 1] bounds leaving exactly the ``k`` (per row) most extreme past values beyond them.

    Lower side (``largest=False``): clipped is ``r < bound``, so the bound is the row's (k+1)-th
    smallest past value; all of them clipped (k = n) is the nominal bound. Ties at the bound stay
    unclipped.
    """
    nominal = torch.as_tensor(nominal, dtype=values.dtype, device=values.device)
    fill = -torch.inf if largest else torch.inf
    ordered = torch.where(past, values, fill).sort(dim=-1, descending=largest).values
    n = past.sum(dim=-1, keepdim=True)
    at = ordered.gather(-1, k.clamp(max=max(values.shape[-1] - 1, 0)))
    return torch.where(k < n, at, nominal)


def thinned_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    keep: tuple[float, float],
    salt_: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1] (lower, upper) ratio bounds per row that clip ``keep`` of each sign's tokens past
    the nominal ``(clip_low, clip_high)`` (module docstring); ``ratio`` from :func:`token_ratio`."""
    for name, v in zip(("keep_neg", "keep_pos"), keep):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}={v!r} must lie in [0, 1] (a share of the clipped set).")
    if ratio.dim() != 2 or ratio.shape[0] == 0 or ratio.shape[1] == 0:
        raise ValueError(f"ratio must be a non-empty [B, T] tensor, got shape {tuple(ratio.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    adv = advantages.detach().expand_as(ratio)
    mask_b = mask.bool()
    u = row_offsets(labels, mask_b, salt_)
    out = []
    sides = ((adv < 0, ratio < clip_low, clip_low), (adv > 0, ratio > clip_high, clip_high))
    for i, (sign, beyond, nominal) in enumerate(sides):
        past = mask_b & sign & beyond
        k = (keep[i] * past.sum(dim=-1, keepdim=True).double() + u).floor().long()
        out.append(_row_kth(ratio, past, k, nominal, largest=i == 1))
    return out[0], out[1]


def share_counts(packed: torch.Tensor, bins: int) -> list[float]:
    """(BF16 A<0 below, FP8 A<0 below, BF16 A>0 above, FP8 A>0 above) token counts at the nominal
    bounds, from a merged calibration histogram (its exact sums)."""
    s = unpack_histogram(packed, bins)[1]
    return [s["bf16_neg_below"], s["fp8_neg_below"], s["bf16_pos_above"], s["fp8_pos_above"]]


def keep_fraction(bf16_count: float, fp8_count: float) -> float:
    """BF16's clipped count over FP8's at the nominal bound, at most 1 (1 where FP8 clips none)."""
    if fp8_count <= 0:
        return 1.0
    return min(1.0, bf16_count / fp8_count)
