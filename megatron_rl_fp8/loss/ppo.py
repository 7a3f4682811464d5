"""The PPO/GRPO/DAPO clipped policy-gradient loss as a pure function of tensors.

Per response token t with log ratio ``log r = log pi_theta - log pi_old`` and advantage A::

    loss_t = -min(r * A, clip(r, clip_low, clip_high) * A)          (PPO clip)
    loss_t = min(loss_t, -clip_c * A)            if A < 0 and clip_c (dual clip, as in verl)

``clip_low`` / ``clip_high`` are *ratio* bounds (1 - eps_low, 1 + eps_high; DAPO's "clip higher" is
just an asymmetric pair such as 0.8 / 1.28). Clipping zeroes a token's gradient only on the side
that would push the ratio further: A > 0 tokens above ``clip_high`` and A < 0 tokens below
``clip_low``. That second set is what FP8 noise inflates and what calibrated clipping
(``calibration.py``) restores; the metrics here report it separately (``pg_clipfrac_neg_lower``).

Aggregation (how the [B, T] token losses become one scalar) follows verl's names:

* ``token-mean``:          sum over all response tokens / number of response tokens;
* ``seq-mean-token-sum``:  per sequence sum over tokens, then mean over sequences;
* ``seq-mean-token-mean``: per sequence mean over tokens, then mean over sequences.

With gradient accumulation over micro-batches and data-parallel ranks, a local mean per micro-batch
weights short micro-batches too much. Passing the global denominator (``global_token_count`` or
``global_seq_count``: the count over all micro-batches and ranks of the step) makes each micro-batch
loss a partial sum, so the sum over micro-batches (and the DP gradient all-reduce SUM) equals the
full-batch mean exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from megatron_rl_fp8.loss.importance import ISCorrectionConfig, importance_weights
from megatron_rl_fp8.loss.masked import masked_mean, masked_sum

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

# exp(20) ~ 5e8: far outside any clip bound, so clamping the log ratio changes no clipped loss, but
# it keeps exp() finite when a bad token has log ratio in the hundreds (same guard as verl).
MAX_LOG_RATIO = 20.0


def aggregate_loss(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    agg: AggMode = "token-mean",
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] token loss to a scalar with the chosen aggregation (module docstring).

    Sequences with no response token (fully masked rows) do not count as sequences in the local
    seq-mean denominators. A global count, when given, replaces the local denominator; passing the
    count that does not belong to ``agg`` raises, since it would silently be ignored.
    """
    mask_f = mask.to(loss_tok.dtype)
    if agg == "token-mean":
        if global_seq_count is not None:
            raise ValueError(
                "global_seq_count is for the seq-mean aggregations; "
                "with agg='token-mean' pass global_token_count."
            )
        denom = mask_f.sum().clamp_min(1.0) if global_token_count is None else global_token_count
        return masked_sum(loss_tok, mask_f) / denom
    if agg not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(
            f"agg={agg!r} is not supported; use 'token-mean', "
            "'seq-mean-token-sum' or 'seq-mean-token-mean'."
        )
    if global_token_count is not None:
        raise ValueError(
            f"global_token_count is for agg='token-mean'; with agg={agg!r} pass global_seq_count."
        )
    tokens_per_seq = mask_f.sum(dim=-1)
    seq_loss = masked_sum(loss_tok, mask_f, dim=-1)
    if agg == "seq-mean-token-mean":
        seq_loss = seq_loss / tokens_per_seq.clamp_min(1.0)
    if global_seq_count is None:
        denom = (tokens_per_seq > 0).to(loss_tok.dtype).sum().clamp_min(1.0)
    else:
        denom = global_seq_count
    return seq_loss.sum() / denom


def _masked_extreme(values: torch.Tensor, mask_b: torch.Tensor, largest: bool) -> torch.Tensor:
    fill = -math.inf if largest else math.inf
    filled = torch.where(mask_b, values, torch.full_like(values, fill))
    out = filled.max() if largest else filled.min()
    # An empty mask has no extreme; report the on-policy ratio 1 instead of +-inf.
    return torch.where(mask_b.any(), out, torch.ones_like(out))


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    agg: AggMode = "token-mean",
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    is_correction: ISCorrectionConfig | None = None,
    clip_log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss and its diagnostics (see the module docstring for the math).

    Args:
        log_prob: [B, T] log pi_theta of the sampled tokens (carries the gradient).
        old_log_prob: [B, T] log pi_old (no gradient needed; it is detached here).
        advantages: [B, T] per token or [B] per sequence (broadcast over T).
        mask: [B, T] bool or float, 1 = response token.
        clip_low, clip_high: ratio bounds, ``0 < clip_low <= 1 <= clip_high`` (e.g. 0.8 / 1.28).
        clip_c: dual-clip constant (> 1) capping the loss of A < 0 tokens at ``-clip_c * A``.
        agg: aggregation mode, see :func:`aggregate_loss`.
        global_token_count / global_seq_count: global denominators for gradient accumulation.
        rollout_log_prob: [B, T] rollout-engine log-probs. Alone, only mismatch metrics are
            reported; with ``is_correction`` the token losses are reweighted (TIS/MIS).
        is_correction: importance-sampling config, see :mod:`megatron_rl_fp8.loss.importance`.
            Rejected tokens get weight 0 but stay in the denominator, so the global counts stay
            valid and a rejection shrinks the update instead of renormalising it.
        clip_log_ratio: [B, T] the log ratio that *decides* the clip, when it is not the one
            carrying the gradient (calibrated clipping's oracle: the BF16 shadow's ratio decides,
            the FP8 ratio trains). A token is clipped (zero gradient) when its deciding ratio is
            past the bound on its advantage's side; otherwise its loss is ``-A * r``. The clip
            metrics then count the deciding ratio's clips, and ``pg_clipfrac_neg_lower_carrying``
            / ``pg_clipfrac_pos_upper_carrying`` what the carrying ratio alone would clip.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` maps names to detached 0-d
        tensors, averaged over this call's response tokens (the trainer namespaces them):
        ``pg_loss``, ``pg_clipfrac`` (any clip), ``pg_clipfrac_lower`` / ``pg_clipfrac_upper``
        (share of all tokens clipped by the lower / upper bound), ``pg_clipfrac_neg_lower`` /
        ``pg_clipfrac_pos_upper`` (the same, as a share of the negative / positive advantage
        tokens), ``pg_clipfrac_dual`` (with ``clip_c``), ``ppo_kl`` (k1 estimate,
        mean of old - new log-prob), ``ratio_mean`` / ``ratio_max`` / ``ratio_min``,
        ``ratio_above_2`` / ``ratio_below_half`` (share of tokens whose ratio left [0.5, 2]: the
        outliers a policy update or a train/rollout mismatch produces), plus
        the ``is_*`` / ``rollout_*`` metrics when those inputs are given.
    """
    if isinstance(clip_low, (int, float)) and isinstance(clip_high, (int, float)):
        if not 0.0 < clip_low <= 1.0 <= clip_high:
            raise ValueError(
                f"clip bounds must satisfy 0 < clip_low <= 1 <= clip_high; got "
                f"clip_low={clip_low}, clip_high={clip_high} (they are ratio bounds, "
                "e.g. 0.8 and 1.28, not epsilons)."
            )
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c={clip_c} must be > 1 (verl uses 3.0), or None to disable.")
    if is_correction is not None and rollout_log_prob is None:
        raise ValueError(
            "is_correction needs rollout_log_prob: pass the rollout engine's "
            "log-probs of the sampled tokens, or drop is_correction."
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach().expand_as(log_prob)
    mask_b = mask.bool()
    mask_f = mask_b.to(log_prob.dtype)
    old_log_prob = old_log_prob.detach()

    # Padding may hold -inf or NaN log-probs. Masking the log ratio *before* exp keeps both the loss
    # and its gradient finite there (masking the loss afterwards would still give NaN * 0 = NaN).
    log_ratio = torch.where(mask_b, log_prob - old_log_prob, torch.zeros_like(log_prob))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    neg = advantages < 0
    pos = advantages > 0
    loss_unclipped = -advantages * ratio
    if clip_log_ratio is None:
        decide = ratio
        loss_clipped = -advantages * ratio.clamp(clip_low, clip_high)
        loss_tok = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    else:
        # The same pessimistic clip, decided on the other ratio: past its bound on the side the
        # advantage pushes, a token keeps its loss value but loses its gradient.
        decide = torch.where(mask_b, clip_log_ratio.detach(), torch.zeros_like(log_ratio))
        decide = decide.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        clipped = (neg & (decide < clip_low)) | (pos & (decide > clip_high))
        loss_tok = torch.where(clipped, loss_unclipped.detach(), loss_unclipped)
    if clip_c is not None:
        # Dual clip: a very large ratio on a negative token would otherwise give an unbounded
        # loss (and gradient); cap it at -clip_c * A, which has zero gradient.
        loss_tok = torch.where(neg, torch.minimum(loss_tok, -clip_c * advantages), loss_tok)

    metrics: dict[str, torch.Tensor] = {}
    if rollout_log_prob is not None:
        rollout_log_prob = rollout_log_prob.detach()
        mismatch = (old_log_prob - rollout_log_prob).masked_fill(~mask_b, 0.0)
        metrics["rollout_kl_k1"] = masked_mean(-mismatch, mask_f).detach()
        # NeMo RL's `token_mult_prob_error`: mean multiplicative probability error per token.
        metrics["token_mult_prob_error"] = masked_mean(torch.exp(mismatch.abs()), mask_f).detach()
    if is_correction is not None:
        weights, is_metrics = importance_weights(
            old_log_prob, rollout_log_prob, mask_f, is_correction
        )
        loss_tok = loss_tok * weights
        metrics.update(is_metrics)
    pg_loss = aggregate_loss(
        loss_tok,
        mask_f,
        agg,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
    )
    loss = pg_loss

    with torch.no_grad():
        r = ratio.detach()
        lower = (neg & (decide < clip_low)).to(mask_f.dtype)
        upper = (pos & (decide > clip_high)).to(mask_f.dtype)
        metrics.update(
            pg_loss=pg_loss.detach(),
            pg_clipfrac=masked_mean(clipped.to(mask_f.dtype), mask_f),
            pg_clipfrac_lower=masked_mean(lower, mask_f),
            pg_clipfrac_upper=masked_mean(upper, mask_f),
            pg_clipfrac_neg_lower=masked_mean(lower, mask_f * neg),
            pg_clipfrac_pos_upper=masked_mean(upper, mask_f * pos),
            ppo_kl=masked_mean(-log_ratio.detach(), mask_f),
            ratio_mean=masked_mean(r, mask_f),
            ratio_max=_masked_extreme(r, mask_b, largest=True),
            ratio_min=_masked_extreme(r, mask_b, largest=False),
            ratio_above_2=masked_mean((r > 2.0).to(mask_f.dtype), mask_f),
            ratio_below_half=masked_mean((r < 0.5).to(mask_f.dtype), mask_f),
        )
        if clip_c is not None:
            metrics["pg_clipfrac_dual"] = masked_mean((neg & (r > clip_c)).to(mask_f.dtype), mask_f)
        if clip_log_ratio is not None:
            # What the gradient-carrying ratio alone would have clipped at these bounds (the
            # oracle's FP8 shares beside its BF16-decided ones, step by step).
            own_lower = (neg & (r < clip_low)).to(mask_f.dtype)
            own_upper = (pos & (r > clip_high)).to(mask_f.dtype)
            metrics["pg_clipfrac_neg_lower_carrying"] = masked_mean(own_lower, mask_f * neg)
            metrics["pg_clipfrac_pos_upper_carrying"] = masked_mean(own_upper, mask_f * pos)
    return loss, metrics
