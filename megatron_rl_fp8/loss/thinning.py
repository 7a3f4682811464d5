"""Share-matched clipping (``loss.calib.mode=share``): clip, per advantage sign, BF16's share.

Calibration compares, on one mini-batch, how many tokens of each sign the nominal bounds clip under
FP8 and under BF16 (exact counts at the nominal bounds). Their ratio is the *keep fraction*::

    keep_neg = #(A<0, BF16 r < 1 - eps_low) / #(A<0, FP8 r < 1 - eps_low)     (at most 1)
    keep_pos = #(A>0, BF16 r > 1 + eps_high) / #(A>0, FP8 r > 1 + eps_high)   (at most 1)

Later updates keep the nominal bounds but clip only that fraction of the tokens FP8 puts past
them: the most extreme ones, i.e. a per-micro-batch bound moved out to the k-th most extreme
ratio. Unlike a calibrated bound, a fraction of the clipped set carries over to batches whose
ratio spread differs from the calibration batch's (the bound is a quantile of *this* micro-batch),
which is what stale bounds did not. A fraction is at most 1: the rule never clips a token the
nominal bounds would not, so it can only widen the trust region towards BF16's.

k is ``keep * n`` rounded systematically: a fractional carry passes from one micro-batch to the
next, started from a seeded offset in [0, 1), so the expected count is exact even where a
micro-batch holds less than one clipped token (A>0 clips are rare) and no host sync is needed.
"""

from __future__ import annotations

import torch

from megatron_rl_fp8.loss.calibration import unpack_histogram

# Same clamp as ppo.policy_loss, so the thinned ratio is the one the loss clips.
_MAX_LOG_RATIO = 20.0


def token_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor):
    """The detached ratio ``policy_loss`` clips (padding at 1), computed the same way."""
    mask_b = mask.bool()
    log_ratio = torch.where(mask_b, log_prob.detach() - old_log_prob.detach(), 0.0)
    return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()


def _kth_past(values: torch.Tensor, past: torch.Tensor, k: torch.Tensor, nominal, largest: bool):
    """The bound that leaves exactly the ``k`` most extreme of the ``past`` values beyond it.

    Lower side (``largest=False``): clipped is ``r < bound``, so the bound is the (k+1)-th smallest
    past value; all of them clipped (k = n) is the nominal bound. Ties at the bound stay unclipped.
    """
    nominal = torch.as_tensor(nominal, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return nominal
    fill = -torch.inf if largest else torch.inf
    ordered = torch.where(past, values, fill).flatten().sort(descending=largest).values
    n = past.sum()
    # index_select, not ordered[k]: a 0-d index tensor would be read on the host (a GPU sync).
    at = ordered.index_select(0, k.clamp(max=ordered.numel() - 1).reshape(1)).squeeze(0)
    return torch.where(k < n, at, nominal)


class ClipThinner:
    """One mini-batch's thinning state: keep fractions and the carries between its micro-batches.

    ``offsets`` are the two starting carries in [0, 1) (seeded by the trainer per step, mini-batch
    and rank, so a resumed run thins as the uninterrupted one).
    """

    def __init__(self, keep: tuple[float, float], offsets: tuple[float, float]):
        for name, v in zip(("keep_neg", "keep_pos"), keep):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v!r} must lie in [0, 1] (a share of the clipped set).")
        self.keep = keep
        self.carry = [torch.tensor(float(o), dtype=torch.float64) for o in offsets]

    def bounds(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_low: float,
        clip_high: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's (lower, upper) ratio bounds; advances the carries."""
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1)
        adv = advantages.detach().expand_as(ratio)
        mask_b = mask.bool()
        out = []
        sides = (
            (adv < 0, ratio < clip_low, clip_low, False),
            (adv > 0, ratio > clip_high, clip_high, True),
        )
        for i, (sign, beyond, nominal, largest) in enumerate(sides):
            past = mask_b & sign & beyond
            carry = self.carry[i].to(ratio.device)
            x = self.keep[i] * past.sum().double() + carry
            k = x.floor()
            self.carry[i] = x - k
            out.append(_kth_past(ratio, past, k.long(), nominal, largest))
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
