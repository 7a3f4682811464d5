"""Calibrated clipping: FP8 clip bounds that keep the semantics of the BF16 trust region.

The problem. In full-pipeline FP8 RL the log ratio ``log r = log pi_theta - log pi_old`` carries
compounded quantization noise, and for negative-advantage tokens it is biased downward. With the
nominal bounds (1 - eps_low, 1 + eps_high) many more negative tokens fall below the lower bound than
under BF16; PPO zeroes their gradient, bad outputs stop being penalised and entropy surges.

The fix, on a calibration step (every ``CalibConfig.interval`` steps) where a BF16 *shadow* forward
gives BF16 log ratios next to the FP8 ones for the same tokens:

1. **Lower bound by quantile.** ``q`` = share of negative-advantage tokens whose BF16 ratio is below
   1 - eps_low. The FP8 lower bound is the q-quantile of the negative-advantage FP8 ratios, so FP8
   clips the same share of negative tokens that BF16 would.
2. **Upper bound.** Loosening only the lower bound makes the update more negative overall (rewards
   drop, answers shorten), so the upper bound is re-chosen too. ``strategy="balance"`` (the
   paper's rule, the default) defines the balance of a (precision, bounds) pair as::

       sum_{A>0, r <= upper} |A| r   /   sum_{A<0, r >= lower} |A| r

   i.e. the effective update magnitude of the tokens whose gradient the clip does *not* zero, and
   chooses the FP8 upper bound u so that FP8's balance under (calibrated lower, u) equals BF16's
   balance under the nominal bounds. The numerator only grows with u, so u is found by inverting a
   cumulative histogram. Where the method departs from the paper: the solved u is never below the
   nominal 1 + eps_high. Matching a bulk quantity (update mass) with a tail mechanism (the clip)
   let a 1-2% bulk shift of the A>0 FP8 ratios pull u down into the bulk, where it clipped up to
   40% of the positive tokens (BF16 clips ~1%); like BAPO's adaptive bound, ``balance`` now only
   widens from the nominal floor. ``strategy="quantile"`` mirrors the lower rule instead:
   q+ = share of A>0 tokens whose BF16 ratio exceeds 1 + eps_high, and u is the (1 - q+)
   quantile of the A>0 FP8 ratios, so both signs lose to the clip what they lose under BF16.
   ``strategy="shift"`` keeps the log-width of the nominal interval:
   ``log u = log lower_fp8 + log((1 + eps_high) / (1 - eps_low))``; ``strategy="lower_only"``
   keeps the nominal upper bound, the ablation the paper reports over-penalising (kept to show it).
3. Bounds are clamped to safety limits, and the trainer smooths successive calibrations with
   :func:`ema_bounds`.
4. **The invariant** (:func:`clip_shares`, :func:`invariant_violations`): on the calibration batch
   itself, FP8's A<0 lower-clip share and A>0 upper-clip share under the bounds about to be used
   must stay within ``CalibConfig.invariant_tolerance`` of BF16's under the nominal bounds (or be
   no further from them than the nominal bounds' shares are). Whatever the rule, a calibration
   that breaks it is not used: the trainer falls back to the nominal bounds.

Distributed. Every rank builds one flat float64 tensor (:func:`build_calibration_histogram`):
FP8 log-ratio histograms (token counts and |A|*r sums, split by advantage sign) plus a few exact
scalar sums of the BF16 (and FP8) quantities at the nominal bounds. BF16 is only ever evaluated at
the nominal bounds, which are known before any data is seen, so exact sums replace its histograms.
One all-reduce (SUM) over the data-parallel (x context-parallel) group merges them; traffic is
``8 * (4 * bins + 9)`` bytes, independent of tokens and ranks. Reading the bounds is then a pure
function of the merged tensor (:func:`bounds_from_histogram`), so every rank gets identical bounds.
``loss/exact.py`` computes the same thing from raw tokens (O(tokens)): the reference the tests
and the calibration benchmark hold this path against.

Conventions: tokens with A == 0 or mask 0 are ignored (they get no policy gradient); the PPO dual
clip is not part of the balance (it touches only extreme ratios); "clipped below" is r < lower and
"unclipped" is r >= lower (A < 0) or r <= upper (A > 0), as in :func:`~.ppo.policy_loss`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl_fp8.loss.config import (
    DEFAULT_BINS,
    DEFAULT_LOG_RATIO_RANGE,
    DEFAULT_LOWER_LIMITS,
    DEFAULT_STRATEGY,
    DEFAULT_UPPER_LIMITS,
    CalibConfig,
    Strategy,
    check_eps,
    check_solver_args,
)
from megatron_rl_fp8.loss.histogram import hist_inverse_mass, hist_mass_below
from megatron_rl_fp8.loss.upper_rules import UPPER_RULES, UpperInputs

__all__ = [
    "CalibConfig",
    "bounds_from_histogram",
    "build_calibration_histogram",
    "calibrated_clip_bounds",
    "check_solver_args",
    "clip_shares",
    "ema_bounds",
    "invariant_violations",
    "merged_calibration_histogram",
]

# Exact scalar sums packed after the four histograms, in this order.
_SCALARS = (
    "bf16_neg_below",  # count, A < 0 and BF16 r < nominal lower
    "bf16_pos_above",  # count, A > 0 and BF16 r > nominal upper
    "bf16_pos_unclipped",  # sum |A| r, A > 0 and BF16 r <= nominal upper
    "bf16_neg_unclipped",  # sum |A| r, A < 0 and BF16 r >= nominal lower
    "fp8_neg_below",  # the same four for FP8 at the nominal bounds (the invariant, diagnostics)
    "fp8_pos_above",
    "fp8_pos_unclipped",
    "fp8_neg_unclipped",
    "fp8_out_of_range",  # count of tokens whose FP8 log ratio was clamped into an edge bin
)
NUM_SCALARS = len(_SCALARS)
_EXACT_FLOAT32_COUNT = 1 << 24  # float32 represents every integer count below this exactly


def ema_bounds(
    prev: tuple[float, float] | None,
    new: tuple[float, float],
    decay: float,
) -> tuple[float, float]:
    """Exponential moving average of (lower, upper): ``decay * prev + (1 - decay) * new``.

    ``prev=None`` (the first calibration) returns ``new``. The average of bounds that respect the
    safety limits respects them too, so no clamp is needed afterwards.
    """
    if prev is None:
        return float(new[0]), float(new[1])
    return (decay * prev[0] + (1 - decay) * new[0], decay * prev[1] + (1 - decay) * new[1])


def token_views(
    fp8_log_ratio: torch.Tensor,
    bf16_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """(x8, x16, adv, neg, pos): float log ratios, advantages and the token sets per sign.

    ``adv`` stays [B, 1] when advantages are per sequence: it broadcasts, so |A| and the sign tests
    cost B operations instead of B * T.
    """
    if advantages.dim() == 1 and fp8_log_ratio.dim() == 2:
        advantages = advantages.unsqueeze(-1)
    adv = advantages.detach().float()
    mask_b = mask.bool()
    # Padding may hold NaN or -inf log-probs (e.g. -inf - -inf); zero the ignored tokens so they
    # cannot poison a sum (NaN * 0 is NaN) or produce an invalid bin index.
    x8 = fp8_log_ratio.detach().float().masked_fill(~mask_b, 0.0)
    x16 = bf16_log_ratio.detach().float().masked_fill(~mask_b, 0.0)
    return x8, x16, adv, mask_b & (adv < 0), mask_b & (adv > 0)


@torch.no_grad()
def build_calibration_histogram(
    fp8_log_ratio: torch.Tensor,
    bf16_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    bins: int = DEFAULT_BINS,
    log_ratio_range: tuple[float, float] = DEFAULT_LOG_RATIO_RANGE,
) -> torch.Tensor:
    """This rank's calibration statistics as one flat float64 tensor (merge by summing).

    Layout (``bins`` = b)::

        [0, b)      FP8 log-ratio token counts, A < 0
        [b, 2b)     FP8 log-ratio token counts, A > 0
        [2b, 3b)    FP8 sum of |A| * r, A < 0
        [3b, 4b)    FP8 sum of |A| * r, A > 0
        [4b, 4b+9)  exact sums at the nominal bounds (see ``_SCALARS``)

    Inputs are [B, T] (advantages may be [B]); the tensor stays on the inputs' device and no
    host sync happens here. Log ratios must be finite on response tokens (+-inf is tolerated and
    lands in an edge bin); padding may hold anything.
    """
    x8, x16, adv, neg, pos = token_views(fp8_log_ratio, bf16_log_ratio, advantages, mask)
    valid = neg | pos
    abs_a = adv.abs()
    log_lower, log_upper = math.log1p(-eps_low), math.log1p(eps_high)
    lo, hi = log_ratio_range
    # |A| * r of every counted token, zero elsewhere. The clamp keeps exp() finite (an inf times a
    # zero mask would be NaN); in-place ops keep the number of 1M-token temporaries low.
    w8 = x8.clamp(max=20.0).exp_().mul_(abs_a).mul_(valid)
    w16 = x16.clamp(max=20.0).exp_().mul_(abs_a).mul_(valid)

    packed = torch.zeros(4 * bins + NUM_SCALARS, dtype=torch.float64, device=x8.device)
    # Negative-advantage tokens go to slot 0, positive to slot 1; ignored tokens add zero to
    # whichever slot, which is cheaper than filtering them out (and filtering would sync on GPU).
    # The slot offset is added before the one integer cast (bin_index's float path, inlined).
    scale = bins / (hi - lo)
    idx = ((x8 - lo).mul_(scale).clamp_(0, bins - 1).add_(bins * (adv > 0))).long().flatten()
    ones = valid.flatten().to(w8.dtype)
    if x8.numel() < _EXACT_FLOAT32_COUNT:
        # float32 counts are exact below 2^24 tokens per call and skip a float64 copy of the mask.
        packed[: 2 * bins] = (
            torch.zeros(2 * bins, dtype=w8.dtype, device=w8.device)
            .index_add_(0, idx, ones)
            .double()
        )
    else:
        packed[: 2 * bins].index_add_(0, idx, ones.double())
    packed[2 * bins : 4 * bins].index_add_(0, idx, w8.flatten().double())

    def count(t: torch.Tensor) -> torch.Tensor:
        return torch.count_nonzero(t).double()  # int64: exact

    def total(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # Per-sequence float32 sums (exact per row whatever the rank layout), then float64 across
        # rows: merged results do not depend on how rows split over ranks, without a float64
        # copy of every token.
        kept = torch.where(keep, w, 0.0)
        return (kept.sum(dim=-1) if kept.dim() > 1 else kept).double().sum()

    below8, below16 = x8 < log_lower, x16 < log_lower
    above8, above16 = x8 > log_upper, x16 > log_upper
    packed[4 * bins :] = torch.stack(
        [
            count(neg & below16),
            count(pos & above16),
            total(w16, pos & ~above16),
            total(w16, neg & ~below16),
            count(neg & below8),
            count(pos & above8),
            total(w8, pos & ~above8),
            total(w8, neg & ~below8),
            count(valid & ((x8 < lo) | (x8 > hi))),
        ]
    )
    return packed


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def clamp_to(x: float, limits: tuple[float, float]) -> float:
    return min(max(x, limits[0]), limits[1])


def unpack_histogram(packed: torch.Tensor, bins: int) -> tuple[torch.Tensor, dict[str, float]]:
    """([4, bins] histograms on the CPU: neg counts, pos counts, neg |A|r, pos |A|r; scalars)."""
    if packed.numel() != 4 * bins + NUM_SCALARS:
        raise ValueError(
            f"packed histogram has {packed.numel()} entries, expected "
            f"4 * bins + {NUM_SCALARS} = {4 * bins + NUM_SCALARS} for bins={bins}; "
            "pass the bins it was built with."
        )
    # The one host sync of a calibration: a few thousand float64 numbers to the CPU, where the
    # rest is cheap scalar work (a no-op when the caller already copied them).
    packed = packed.detach().to("cpu", torch.float64)
    return packed[: 4 * bins].view(4, bins), dict(zip(_SCALARS, packed[4 * bins :].tolist()))


def clip_shares(
    packed: torch.Tensor,
    lower: float,
    upper: float,
    *,
    bins: int = DEFAULT_BINS,
    log_ratio_range: tuple[float, float] = DEFAULT_LOG_RATIO_RANGE,
) -> dict[str, float]:
    """What the clip removes, per advantage sign, read from a (merged) packed histogram.

    ``bf16_*`` and ``fp8_*_nominal``: the exact shares at the nominal bounds (the sums the histogram
    was built with); ``fp8_*_calibrated``: FP8's shares under ``(lower, upper)``, read from the
    histogram (to within the mass of the bin each bound falls in). ``neg_lower`` is the share of
    A<0 tokens with r < lower, ``pos_upper`` the share of A>0 tokens with r > upper; NaN when the
    batch has no token of that sign.
    """
    hist, s = unpack_histogram(packed, bins)
    neg_cnt, pos_cnt = hist[0], hist[1]
    n_neg, n_pos = float(neg_cnt.sum()), float(pos_cnt.sum())
    return {
        "bf16_neg_lower_clipfrac": _ratio(s["bf16_neg_below"], n_neg),
        "bf16_pos_upper_clipfrac": _ratio(s["bf16_pos_above"], n_pos),
        "fp8_neg_lower_clipfrac_nominal": _ratio(s["fp8_neg_below"], n_neg),
        "fp8_pos_upper_clipfrac_nominal": _ratio(s["fp8_pos_above"], n_pos),
        "fp8_neg_lower_clipfrac_calibrated": _ratio(
            hist_mass_below(neg_cnt, math.log(lower), log_ratio_range), n_neg
        ),
        "fp8_pos_upper_clipfrac_calibrated": _ratio(
            n_pos - hist_mass_below(pos_cnt, math.log(upper), log_ratio_range), n_pos
        ),
    }


def invariant_violations(shares: dict[str, float], tolerance: float) -> list[str]:
    """The signs (``"neg_lower"``, ``"pos_upper"``) on which calibrated bounds do harm.

    A sign is violated when FP8's share under the calibrated bounds is further than ``tolerance``
    from BF16's under the nominal bounds *and* further from it than FP8's share under the nominal
    bounds: falling back to nominal then brings that sign closer to BF16. A sign without tokens
    (NaN shares) has nothing to violate. ``shares`` is :func:`clip_shares`' dict.
    """
    out = []
    for sign in ("neg_lower", "pos_upper"):
        bf16 = shares[f"bf16_{sign}_clipfrac"]
        cal = shares[f"fp8_{sign}_clipfrac_calibrated"]
        nominal = shares[f"fp8_{sign}_clipfrac_nominal"]
        if math.isnan(bf16) or math.isnan(cal):
            continue
        gap = abs(cal - bf16)
        if gap > tolerance and gap > abs(nominal - bf16):
            out.append(sign)
    return out


def bounds_from_histogram(
    packed: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    strategy: Strategy = DEFAULT_STRATEGY,
    bins: int = DEFAULT_BINS,
    log_ratio_range: tuple[float, float] = DEFAULT_LOG_RATIO_RANGE,
    lower_limits: tuple[float, float] = DEFAULT_LOWER_LIMITS,
    upper_limits: tuple[float, float] = DEFAULT_UPPER_LIMITS,
) -> tuple[float, float, dict[str, float]]:
    """Read the calibrated (lower, upper) ratio bounds from a (merged) packed histogram.

    Edge cases, each chosen so the answer degrades to the nominal behaviour:

    * no negative-advantage tokens: lower = nominal 1 - eps_low (there is nothing to calibrate);
    * q = 0 (BF16 clips no negative token): lower = min(nominal, left edge of the lowest non-empty
      FP8 bin), i.e. FP8 clips none either, loosening past nominal only as far as needed;
    * no positive-advantage tokens: upper = nominal 1 + eps_high, whatever the strategy but shift;
    * ``quantile`` with q+ = 0 (BF16 clips no positive token): upper = max(nominal, right edge of
      the highest non-empty positive FP8 bin), the mirror of q = 0;
    * ``balance`` with no unclipped BF16 negative mass (balance undefined): upper = nominal;
    * ``balance`` unreachable (even unclipping every positive token gives too little mass):
      upper = the larger of nominal and the right edge of the last non-empty positive bin (the
      tightest bound that unclips every positive token; looser would change nothing now);
    * ``balance`` below nominal (FP8's positive ratios shifted up in bulk): upper = nominal.

    Both bounds are finally clamped to ``lower_limits`` / ``upper_limits``; the balance is solved
    with the clamped lower bound. Returns ``(lower, upper, stats)`` with Python floats; ``stats``
    holds :func:`clip_shares` at the returned bounds too.
    """
    check_eps(eps_low, eps_high)
    check_solver_args(
        strategy=strategy,
        bins=bins,
        log_ratio_range=log_ratio_range,
        lower_limits=lower_limits,
        upper_limits=upper_limits,
    )
    hist, s = unpack_histogram(packed, bins)
    neg_cnt, pos_cnt, neg_sum, pos_sum = hist
    n_neg, n_pos = float(neg_cnt.sum()), float(pos_cnt.sum())
    neg_total, pos_total = float(neg_sum.sum()), float(pos_sum.sum())
    nominal_lower, nominal_upper = 1.0 - eps_low, 1.0 + eps_high

    q = _ratio(s["bf16_neg_below"], n_neg)
    if n_neg == 0:
        lower = nominal_lower
    elif q == 0:
        lower = min(nominal_lower, math.exp(hist_inverse_mass(neg_cnt, 0.0, log_ratio_range)))
    else:
        lower = math.exp(hist_inverse_mass(neg_cnt, q * n_neg, log_ratio_range))
    lower = clamp_to(lower, lower_limits)
    log_l = math.log(lower)

    def fp8_neg_unclipped(log_lower: float) -> float:
        return neg_total - hist_mass_below(neg_sum, log_lower, log_ratio_range)

    bf16_balance = _ratio(s["bf16_pos_unclipped"], s["bf16_neg_unclipped"])
    rule = UPPER_RULES[strategy]
    if n_pos == 0 and rule.needs_positive_tokens:
        upper = nominal_upper
    else:
        upper = rule.fn(
            UpperInputs(
                pos_cnt=pos_cnt,
                pos_sum=pos_sum,
                n_pos=n_pos,
                pos_total=pos_total,
                lower=lower,
                nominal_lower=nominal_lower,
                nominal_upper=nominal_upper,
                q_plus=_ratio(s["bf16_pos_above"], n_pos),
                bf16_balance=bf16_balance,
                fp8_neg_unclipped=fp8_neg_unclipped(log_l),
                log_ratio_range=log_ratio_range,
            )
        )
    upper = clamp_to(upper, upper_limits)
    log_u = math.log(upper)

    stats = {
        "lower": lower,
        "upper": upper,
        **clip_shares(packed, lower, upper, bins=bins, log_ratio_range=log_ratio_range),
        "bf16_balance": bf16_balance,
        "fp8_balance_nominal": _ratio(s["fp8_pos_unclipped"], s["fp8_neg_unclipped"]),
        "fp8_balance_calibrated": _ratio(
            hist_mass_below(pos_sum, log_u, log_ratio_range), fp8_neg_unclipped(log_l)
        ),
        "fp8_out_of_range_frac": _ratio(s["fp8_out_of_range"], n_neg + n_pos),
        "num_neg_tokens": n_neg,
        "num_pos_tokens": n_pos,
        "hist_bytes": float(packed.numel() * packed.element_size()),
    }
    return lower, upper, stats


def merged_calibration_histogram(
    fp8_log_ratio: torch.Tensor,
    bf16_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    group: Any = None,
    bins: int = DEFAULT_BINS,
    log_ratio_range: tuple[float, float] = DEFAULT_LOG_RATIO_RANGE,
) -> torch.Tensor:
    """:func:`build_calibration_histogram` summed over ``group`` (one all-reduce; ``None``: this
    rank's tokens only). Every rank of the group must call it; every rank gets the same tensor."""
    packed = build_calibration_histogram(
        fp8_log_ratio,
        bf16_log_ratio,
        advantages,
        mask,
        eps_low,
        eps_high,
        bins=bins,
        log_ratio_range=log_ratio_range,
    )
    if group is not None:
        # lazy: docs/architecture.md keeps loss/ module tops free of torch.distributed
        import torch.distributed as dist

        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return packed


def calibrated_clip_bounds(
    fp8_log_ratio: torch.Tensor,
    bf16_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    strategy: Strategy = DEFAULT_STRATEGY,
    group: Any = None,
    bins: int = DEFAULT_BINS,
    log_ratio_range: tuple[float, float] = DEFAULT_LOG_RATIO_RANGE,
    lower_limits: tuple[float, float] = DEFAULT_LOWER_LIMITS,
    upper_limits: tuple[float, float] = DEFAULT_UPPER_LIMITS,
    return_stats: bool = False,
) -> tuple[float, float] | tuple[float, float, dict[str, float]]:
    """Calibrated FP8 clip bounds (lower, upper) as Python floats; stateless.

    Args:
        fp8_log_ratio: [B, T] log pi_theta - log pi_old from the FP8 passes.
        bf16_log_ratio: [B, T] the same from the BF16 shadow passes on the same tokens.
        advantages: [B, T] or [B]; mask: [B, T] response mask.
        eps_low, eps_high: nominal clip epsilons (bounds 1 - eps_low, 1 + eps_high).
        strategy, bins, log_ratio_range, lower_limits, upper_limits: see :class:`CalibConfig`
            (``CalibConfig.solver_kwargs()`` gives them).
        group: a ``torch.distributed`` process group (data-parallel x context-parallel) to merge
            the histograms over with one all-reduce; ``None`` uses only local tokens. Every rank of
            the group must call this, and every rank gets the same bounds.
        return_stats: also return the diagnostics dict of :func:`bounds_from_histogram`
            (clip shares before/after, balances, ``hist_bytes`` all-reduced per calibration).
    """
    check_eps(eps_low, eps_high)
    check_solver_args(
        strategy=strategy,
        bins=bins,
        log_ratio_range=log_ratio_range,
        lower_limits=lower_limits,
        upper_limits=upper_limits,
    )
    packed = merged_calibration_histogram(
        fp8_log_ratio,
        bf16_log_ratio,
        advantages,
        mask,
        eps_low,
        eps_high,
        group=group,
        bins=bins,
        log_ratio_range=log_ratio_range,
    )
    lower, upper, stats = bounds_from_histogram(
        packed,
        eps_low,
        eps_high,
        strategy=strategy,
        bins=bins,
        log_ratio_range=log_ratio_range,
        lower_limits=lower_limits,
        upper_limits=upper_limits,
    )
    return (lower, upper, stats) if return_stats else (lower, upper)
