"""policy_loss against a float64, token-by-token hand implementation of the clipped objective."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import (
    ISCorrectionConfig,
    aggregate_loss,
    importance_weights,
    masked_mean,
    masked_sum,
    policy_loss,
)

LOW, HIGH, CLIP_C = 0.8, 1.28, 3.0
AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def _batch(seed: int = 0, b: int = 6, t: int = 9, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    log_prob = old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.75
    mask[0] = False  # one fully padded sequence
    mask[1, :] = True
    return log_prob, old, adv, mask


def _hand_token(lp: float, old: float, a: float, clip_c: float | None) -> tuple[float, float]:
    """Loss and d loss / d log_prob for one token, written out case by case."""
    r = math.exp(lp - old)
    if a > 0:
        return (-a * HIGH, 0.0) if r > HIGH else (-a * r, -a * r)
    if a < 0:
        if r < LOW:
            return -a * LOW, 0.0
        if clip_c is not None and r > clip_c:
            return -a * clip_c, 0.0
        return -a * r, -a * r
    return 0.0, 0.0


def _hand(log_prob, old, adv, mask, agg, clip_c=None, token_weight=None):
    b, t = log_prob.shape
    lens = [int(mask[i].sum()) for i in range(b)]
    n_tok, n_seq = sum(lens), sum(1 for n in lens if n > 0)
    loss, grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            lt, gt = _hand_token(float(log_prob[i, j]), float(old[i, j]), float(adv[i]), clip_c)
            w = 1.0 if token_weight is None else float(token_weight[i, j])
            scale = {
                "token-mean": 1 / n_tok,
                "seq-mean-token-sum": 1 / n_seq,
                "seq-mean-token-mean": 1 / (n_seq * lens[i]),
            }[agg]
            loss += scale * w * lt
            grad[i, j] = scale * w * gt
    return loss, grad


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip_c", [None, CLIP_C])
def test_loss_and_grad_match_hand_implementation(agg, clip_c):
    log_prob, old, adv, mask = _batch(spread=0.8)
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        lp, old, adv, mask, clip_low=LOW, clip_high=HIGH, clip_c=clip_c, agg=agg
    )
    loss.backward()
    ref_loss, ref_grad = _hand(log_prob, old, adv, mask, agg, clip_c)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    log_prob, old, adv, mask = _batch()
    a = policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH)[0]
    b = policy_loss(
        log_prob, old, adv[:, None].expand_as(log_prob), mask, clip_low=LOW, clip_high=HIGH
    )[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-14)


def test_clip_metrics_match_hand_counts():
    log_prob, old, adv, mask = _batch(seed=3, b=16, t=32, spread=0.6)
    _, m = policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH, clip_c=CLIP_C)
    r = torch.exp(log_prob - old)[mask]
    a = adv[:, None].expand_as(log_prob)[mask]
    n = r.numel()
    lower = ((a < 0) & (r < LOW)).sum().item()
    upper = ((a > 0) & (r > HIGH)).sum().item()
    assert m["pg_clipfrac_lower"].item() == pytest.approx(lower / n)
    assert m["pg_clipfrac_upper"].item() == pytest.approx(upper / n)
    assert m["pg_clipfrac"].item() == pytest.approx((lower + upper) / n)
    assert m["pg_clipfrac_neg_lower"].item() == pytest.approx(lower / (a < 0).sum().item())
    assert m["pg_clipfrac_pos_upper"].item() == pytest.approx(upper / (a > 0).sum().item())
    assert m["pg_clipfrac_dual"].item() == pytest.approx(((a < 0) & (r > CLIP_C)).sum().item() / n)
    assert m["ppo_kl"].item() == pytest.approx((old - log_prob)[mask].mean().item())
    assert m["ratio_mean"].item() == pytest.approx(r.mean().item())
    assert m["ratio_max"].item() == pytest.approx(r.max().item())
    assert m["ratio_min"].item() == pytest.approx(r.min().item())


@pytest.mark.parametrize("agg", AGGS)
def test_global_counts_make_micro_batch_losses_sum_to_full_batch(agg):
    log_prob, old, adv, mask = _batch(seed=5, b=12, t=10)
    full = policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH, agg=agg)[0]
    if agg == "token-mean":
        counts = {"global_token_count": mask.sum()}
    else:
        counts = {"global_seq_count": float((mask.sum(-1) > 0).sum())}
    total = sum(
        policy_loss(
            log_prob[s], old[s], adv[s], mask[s], clip_low=LOW, clip_high=HIGH, agg=agg, **counts
        )[0]
        for s in (slice(0, 3), slice(3, 4), slice(4, 12))  # uneven micro-batches
    )
    assert total.item() == pytest.approx(full.item(), rel=1e-12)


def test_wrong_global_count_for_agg_raises():
    log_prob, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="global_seq_count"):
        policy_loss(
            log_prob,
            old,
            adv,
            mask,
            clip_low=LOW,
            clip_high=HIGH,
            agg="seq-mean-token-sum",
            global_token_count=10,
        )
    with pytest.raises(ValueError, match="global_token_count"):
        aggregate_loss(log_prob, mask, "token-mean", global_seq_count=3)
    with pytest.raises(ValueError, match="agg="):
        aggregate_loss(log_prob, mask, "sum")


def test_bad_arguments_raise():
    log_prob, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="ratio bounds"):
        policy_loss(log_prob, old, adv, mask, clip_low=0.2, clip_high=0.28)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH, clip_c=0.5)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        policy_loss(
            log_prob,
            old,
            adv,
            mask,
            clip_low=LOW,
            clip_high=HIGH,
            is_correction=ISCorrectionConfig(),
        )


def test_empty_mask_gives_zero_loss_and_finite_metrics():
    log_prob, old, adv, _ = _batch()
    mask = torch.zeros_like(log_prob, dtype=torch.bool)
    loss, m = policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH)
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())


def test_nan_and_inf_padding_do_not_leak_into_loss_or_grad():
    log_prob, old, adv, mask = _batch(seed=9)
    is_cfg = ISCorrectionConfig(level="sequence")

    def run(lp, old_lp, rollout_lp):
        lp = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(
            lp,
            old_lp,
            adv,
            mask,
            clip_low=LOW,
            clip_high=HIGH,
            rollout_log_prob=rollout_lp,
            is_correction=is_cfg,
        )
        loss.backward()
        return loss, lp.grad, metrics

    ref_loss, ref_grad, _ = run(log_prob, old, old + 0.05)
    dirty_old = old.masked_fill(~mask, float("-inf"))
    loss, grad, metrics = run(
        log_prob.masked_fill(~mask, float("nan")), dirty_old, dirty_old + 0.05
    )
    assert metrics["is_weight_mean"].item() < 1  # the sequence weights really act
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-14)
    torch.testing.assert_close(grad, ref_grad)
    assert all(torch.isfinite(v) for v in metrics.values())


def _hand_is_weights(old, rollout, mask, level, mode, cap=2.0, lo=0.5, hi=2.0):
    w = torch.zeros_like(old)
    for i in range(old.shape[0]):
        idx = [j for j in range(old.shape[1]) if mask[i, j]]
        logs = [float(old[i, j] - rollout[i, j]) for j in idx]
        for j, lw in zip(idx, logs):
            if level == "sequence":
                lw = sum(logs)
            elif level == "geometric":
                lw = sum(logs) / len(logs)
            raw = math.exp(lw)
            w[i, j] = min(raw, cap) if mode == "truncate" else (raw if lo <= raw <= hi else 0.0)
    return w


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_weights_and_corrected_loss(level, mode):
    log_prob, old, adv, mask = _batch(seed=7, spread=0.3)
    g = torch.Generator().manual_seed(1)
    rollout = old + 0.4 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    cfg = ISCorrectionConfig(level=level, mode=mode)
    weights, m = importance_weights(old, rollout, mask, cfg)
    ref_w = _hand_is_weights(old, rollout, mask, level, mode)
    torch.testing.assert_close(weights, ref_w, rtol=1e-12, atol=1e-12)
    assert m["is_weight_mean"].item() == pytest.approx(ref_w[mask].mean().item())

    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        lp,
        old,
        adv,
        mask,
        clip_low=LOW,
        clip_high=HIGH,
        rollout_log_prob=rollout,
        is_correction=cfg,
    )
    loss.backward()
    ref_loss, ref_grad = _hand(log_prob, old, adv, mask, "token-mean", token_weight=ref_w)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert "is_modified_frac" in metrics and "token_mult_prob_error" in metrics


def test_rollout_log_prob_alone_only_adds_mismatch_metrics():
    log_prob, old, adv, mask = _batch()
    rollout = old - 0.1
    plain, _ = policy_loss(log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH)
    loss, m = policy_loss(
        log_prob, old, adv, mask, clip_low=LOW, clip_high=HIGH, rollout_log_prob=rollout
    )
    assert loss.item() == plain.item()
    assert m["rollout_kl_k1"].item() == pytest.approx(-0.1)
    assert m["token_mult_prob_error"].item() == pytest.approx(math.exp(0.1))


def test_is_config_validation_names_the_field():
    with pytest.raises(ValueError, match="level"):
        ISCorrectionConfig(level="batch")
    with pytest.raises(ValueError, match="cap"):
        ISCorrectionConfig(cap=0.0)
    with pytest.raises(ValueError, match="mask_low"):
        ISCorrectionConfig(mask_low=1.5)


def test_masked_helpers():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_sum(x, m).item() == 4.0
    assert masked_mean(x, m).item() == 2.0
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([2.0, 0.0]))


def test_clip_decided_by_another_ratio_keeps_the_gradient_of_the_training_ratio():
    """Calibrated clipping's oracle: the BF16 ratio decides which tokens are clipped, the FP8
    ratio carries the gradient. Token by token: -A * r (gradient -A * r) unless the deciding
    ratio is past the bound on the advantage's side, then no gradient."""
    log_prob, old, adv, mask = _batch(seed=7)
    g = torch.Generator().manual_seed(8)  # its own: the global generator depends on test order
    decide = (log_prob - old) + 0.3 * torch.randn(log_prob.shape, generator=g, dtype=torch.float64)
    lp = log_prob.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=LOW, clip_high=HIGH, clip_log_ratio=decide)
    loss.backward()
    a = adv[:, None].expand_as(lp)
    r = torch.exp(log_prob - old)
    rd = torch.exp(decide)
    clipped = ((a < 0) & (rd < LOW)) | ((a > 0) & (rd > HIGH))
    n = mask.sum()
    want_grad = torch.where(clipped | ~mask, 0.0, -a * r) / n
    assert torch.allclose(lp.grad, want_grad, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(((-a * r) * mask).sum().item() / n.item(), rel=1e-12)
    neg = mask & (a < 0)
    want_lower = ((rd < LOW) & neg).sum().item() / neg.sum().item()
    assert m["pg_clipfrac_neg_lower"].item() == pytest.approx(want_lower, rel=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx((clipped & mask).sum().item() / n.item())
    # Beside them, what the training ratio alone would have clipped, per advantage sign.
    pos = mask & (a > 0)
    own_lower = ((r < LOW) & neg).sum().item() / neg.sum().item()
    own_upper = ((r > HIGH) & pos).sum().item() / pos.sum().item()
    assert m["pg_clipfrac_neg_lower_carrying"].item() == pytest.approx(own_lower, rel=1e-12)
    assert m["pg_clipfrac_pos_upper_carrying"].item() == pytest.approx(own_upper, rel=1e-12)
    assert not torch.equal((r < LOW) & neg, (rd < LOW) & neg)  # they clip other tokens here
    # Deciding with its own log ratio is the plain PPO clip, value and gradient.
    lp2 = log_prob.clone().requires_grad_(True)
    own, _ = policy_loss(
        lp2, old, adv, mask, clip_low=LOW, clip_high=HIGH, clip_log_ratio=log_prob - old
    )
    own.backward()
    lp3 = log_prob.clone().requires_grad_(True)
    plain, _ = policy_loss(lp3, old, adv, mask, clip_low=LOW, clip_high=HIGH)
    plain.backward()
    assert torch.equal(lp2.grad, lp3.grad)
