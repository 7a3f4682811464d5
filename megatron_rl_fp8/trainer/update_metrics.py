"""The update's statistics: what each micro-batch's token loss reports (:class:`TokenStats`),
how they add up over micro-batches (:func:`account`, on the device) and how they become the
step's ``train/`` metrics (:func:`reduce`: over DP x CP, one host read).

Token-weighted sums (and extremes) over micro-batches: how rows are grouped into micro-batches
(``train.max_tokens_per_gpu``) does not change the step's metrics.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_rl_fp8.metrics.accumulator import MetricAccumulator
from megatron_rl_fp8.metrics.ratios import ratio_stats
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.collectives import broadcast_object

# Policy-loss metrics that combine with max / min instead of a token-weighted mean.
MAX_KEYS = ("ratio_max",)
MIN_KEYS = ("ratio_min",)
# Shares of the negative / positive-advantage tokens only: weighted by those tokens' counts, so
# micro-batches, token budgets and CP ranks with different mixes combine into the exact share.
NEGATIVE_SHARE, POSITIVE_SHARE = "pg_clipfrac_neg_lower", "pg_clipfrac_pos_upper"
# The accumulator's token counts: every response token, and those of each advantage sign.
TOKENS, NEG_TOKENS, POS_TOKENS = "pg_tokens", "pg_tokens_neg", "pg_tokens_pos"
_SIDE = {NEGATIVE_SHARE: NEG_TOKENS, POSITIVE_SHARE: POS_TOKENS}


def share_side(key: str) -> str | None:
    """The share ``key`` is of one advantage sign's tokens (``NEGATIVE_SHARE``, its variants
    such as ``..._carrying``, or the positive ones), or None (a mean over every token)."""
    return next((side for side in _SIDE if key.startswith(side)), None)


# The rollout-vs-train mismatch of the rows of one policy-version lag: "<BY_LAG><lag>/<name>",
# over "<BY_LAG><lag>/tokens"; reported as fp8/<name>_lag<lag> for the lags present.
BY_LAG = "by_lag/"


@dataclasses.dataclass
class TokenStats:
    """One micro-batch's statistics, detached, on the device where they were made."""

    pg_loss: torch.Tensor  # already divided by the global count, as the loss is
    tokens: torch.Tensor  # response tokens
    neg_tokens: torch.Tensor  # response tokens of negative / positive advantage
    pos_tokens: torch.Tensor
    useful: torch.Tensor  # tokens whose gradient is not zero by construction
    ratio_hist: torch.Tensor  # log-ratio histogram (metrics/ratios.py)
    # policy_loss's per-micro-batch means times their weight: the tokens, or for the two shares
    # of one advantage sign, that sign's tokens
    weighted: dict[str, torch.Tensor]

    @classmethod
    def of(cls, mb: dict, pg_loss: torch.Tensor, means: dict, hist: torch.Tensor) -> TokenStats:
        mask = mb["loss_mask"]
        adv = mb["advantages"]
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        tokens = mask.sum()
        neg, pos = (mask * adv.lt(0)).sum(), (mask * adv.gt(0)).sum()
        weight = {NEGATIVE_SHARE: neg, POSITIVE_SHARE: pos, None: tokens}
        return cls(
            pg_loss=pg_loss.detach(),
            tokens=tokens,
            neg_tokens=neg,
            pos_tokens=pos,
            useful=(mask * adv.ne(0)).sum(),
            ratio_hist=hist,
            weighted={k: v.detach() * weight[share_side(k)] for k, v in means.items()},
        )


def account(outs: list[dict], acc: MetricAccumulator, applied: bool) -> None:
    """Add one optimizer step's micro-batches (``{"loss", "stats": TokenStats}`` each) to
    ``acc``; nothing is read to the host."""
    for o in outs:
        s: TokenStats = o["stats"]
        acc.add("train/loss", o["loss"])
        acc.add("train/pg_loss", s.pg_loss)
        acc.add("useful_tokens", s.useful if applied else torch.zeros_like(s.useful))
        acc.add_vector("ratio_hist", s.ratio_hist)
        for k, v in s.weighted.items():
            if k.endswith(MAX_KEYS + MIN_KEYS):
                # A micro-batch without response tokens (a token budget groups such rows) has
                # no extreme: it adds the identity, -inf for a max and +inf for a min (its
                # weighted value, 0, would pass for a ratio_min). The key stays, as the
                # all-reduce needs the same keys on every rank.
                largest = k.endswith(MAX_KEYS)
                n = s.tokens.to(torch.float64)
                identity = torch.full_like(n, -math.inf if largest else math.inf)
                value = torch.where(n > 0, v.to(torch.float64) / n.clamp(min=1), identity)
                (acc.max if largest else acc.min)(k, value)
            else:
                acc.add("pg/" + k, v)
        acc.add(TOKENS, s.tokens)
        acc.add(NEG_TOKENS, s.neg_tokens)
        acc.add(POS_TOKENS, s.pos_tokens)


def _by_lag(total: dict) -> dict:
    """Takes the per-lag sums out of ``total``; their means for the lags that have tokens."""
    out = {}
    for key in [k for k in total if k.startswith(BY_LAG) and k.endswith("/tokens")]:
        lag = key.removeprefix(BY_LAG).removesuffix("/tokens")
        tokens = total.pop(key)
        for name in ("token_mult_prob_error", "rollout_train_kl"):
            value = total.pop(f"{BY_LAG}{lag}/{name}")
            if tokens > 0:
                out[f"fp8/{name}_lag{lag}"] = value / tokens
    return out


def reduce(acc: MetricAccumulator, groups: Groups, updates_per_step: int) -> dict:
    """Sum over DP x CP on the last stage, divide into means, hand the result to the driver
    (``{}`` elsewhere). Collective."""
    g = groups
    result = None
    if g.is_last_stage and g.tp_rank == 0:
        # Token statistics of the update are per CP rank's tokens: summed over DP x CP.
        group = None
        if g.dp_size * g.cp_size > 1:
            group = g.dp_cp if g.cp_size > 1 else g.dp
        totals = acc.reduce(group, g.device)
        total = {k: totals.sums[k] for k in sorted(totals.sums)}
        n = max(total.pop("n_tokens", 0.0), 1.0)
        pg_n = max(total.pop(TOKENS, 0.0), 1.0)
        side_n = {key: max(total.pop(count, 0.0), 1.0) for key, count in _SIDE.items()}
        result = {"perf/useful_tokens": total.pop("useful_tokens", 0.0)}
        result.update(_by_lag(total))
        if "ratio_hist" in totals.vectors:
            stats = ratio_stats(totals.vectors["ratio_hist"])
            result.update({"train/" + k: v for k, v in stats.items()})
        for k, v in total.items():
            if k in ("train/loss", "train/pg_loss"):  # per update, summed over micro-batches
                result[k] = v / updates_per_step
            elif k.startswith("pg/"):
                result["train/" + k[3:]] = v / side_n.get(share_side(k[3:]), pg_n)
            else:
                result[k] = v / n
        # A step without response tokens keeps the identities; report the on-policy ratio 1, as
        # policy_loss does for an empty mask.
        for table, identity in ((totals.maxima, -math.inf), (totals.minima, math.inf)):
            result.update({"train/" + k: 1.0 if v == identity else v for k, v in table.items()})
        result["train/response_tokens"] = n
    if g.last_stage_rank != g.driver_rank:
        result = broadcast_object(result, g.last_stage_rank)
    return result if g.is_driver else {}
