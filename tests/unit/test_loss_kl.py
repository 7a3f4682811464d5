"""The KL estimators (loss/kl.py) against float64 hand computations and exact KLs of categoricals,
and the config fields that switch the penalty on."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_fp8.loss import kl_penalty

KINDS = ["k1", "k2", "k3", "low_var_kl"]


def _hand(kind: str, logp: float, ref: float) -> float:
    log_r = ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return math.exp(log_r) - log_r - 1
    log_r = min(max(log_r, -20.0), 20.0)
    return min(max(math.exp(log_r) - log_r - 1, -10.0), 10.0)


def _hand_grad(kind: str, logp: float, ref: float) -> float:
    """d kl / d logp, written out."""
    log_r = ref - logp
    if kind == "k1":
        return 1.0
    if kind == "k2":
        return -log_r
    if kind == "k3" or (abs(log_r) < 20 and math.exp(log_r) - log_r - 1 < 10):
        return 1.0 - math.exp(log_r)
    return 0.0  # a clamp is active: low_var_kl holds the token's value and stops its gradient


@pytest.mark.parametrize("kind", KINDS)
def test_values_and_gradients_match_hand(kind):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    ref = logp + 1.5 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    # Past the clamps: |log r| > 20, and a k3 value above 10 with |log r| < 20.
    logp[0, :3] = torch.tensor([-30.0, -0.1, -15.0], dtype=torch.float64)
    ref[0, :3] = torch.tensor([-0.1, -30.0, -0.5], dtype=torch.float64)
    lp = logp.clone().requires_grad_(True)
    out = kl_penalty(lp, ref, kind)
    out.sum().backward()
    want = torch.tensor(
        [[_hand(kind, float(a), float(b)) for a, b in zip(ra, rb)] for ra, rb in zip(logp, ref)],
        dtype=torch.float64,
    )
    want_grad = torch.tensor(
        [
            [_hand_grad(kind, float(a), float(b)) for a, b in zip(ra, rb)]
            for ra, rb in zip(logp, ref)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-12, atol=1e-12)


def test_ref_is_not_differentiated_and_unknown_kind_is_named():
    ref = torch.tensor([-1.0], requires_grad=True)
    kl_penalty(torch.tensor([-2.0], requires_grad=True), ref, "k3").sum().backward()
    assert ref.grad is None
    with pytest.raises(ValueError, match="'k4'.*low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_low_var_kl_is_k3_where_no_clamp_acts():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(1000, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(1000, generator=g, dtype=torch.float64) * 3
    k3 = kl_penalty(logp, ref, "k3")
    inside = k3 < 10  # |log r| < 3 everywhere; k3 reaches 10 only above log r ~ 2.6
    assert 0.9 < inside.float().mean() < 1
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl")[inside], k3[inside])


def _categoricals(n: int = 12, spread: float = 0.6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(n, generator=g, dtype=torch.float64)
    logits_q = logits_p + spread * torch.randn(n, generator=g, dtype=torch.float64)
    return torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_converge_to_exact_kl(kind):
    # Tokens sampled from pi_theta = p; the reference is q. Exact KL(p || q) = sum p log(p / q).
    log_p, log_q = _categoricals()
    p = log_p.exp()
    exact = float((p * (log_p - log_q)).sum())
    # The estimator's exact variance under p gives the standard error of an N-sample mean; 5 of
    # them is a two-sided tolerance a correct estimator misses with probability ~6e-7 (and the
    # seed is fixed, so the test is deterministic anyway).
    per_token = kl_penalty(log_p, log_q, kind)  # the estimator's value at each vocabulary entry
    var = float((p * per_token**2).sum()) - exact**2
    n = 200_000
    x = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(2))
    mean = float(kl_penalty(log_p[x], log_q[x], kind).mean())
    assert abs(mean - exact) < 5 * math.sqrt(var / n), (kind, mean, exact)
    # Both are exact in expectation (no sampling): the claim itself, to float64 precision.
    assert float((p * per_token).sum()) == pytest.approx(exact, rel=1e-12)


def test_k3_has_lower_variance_than_k1_and_is_never_negative():
    log_p, log_q = _categoricals(spread=0.3)
    p = log_p.exp()
    k1, k3 = kl_penalty(log_p, log_q, "k1"), kl_penalty(log_p, log_q, "k3")
    exact = float((p * k1).sum())
    var1 = float((p * k1**2).sum()) - exact**2
    var3 = float((p * k3**2).sum()) - exact**2
    assert var3 < 0.25 * var1
    assert (k3 >= 0).all() and (k1 < 0).any()


def test_expected_gradients_are_the_documented_ones():
    # E_{x~p}[d k / d theta] with p = softmax(theta), the samples fixed (the penalty is
    # differentiated through log p(x) only), computed exactly by weighting with detached p:
    # k1 -> 0, k2 -> grad KL(p || q), k3 -> grad KL(q || p) (the forward KL).
    theta = torch.randn(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    log_q = torch.log_softmax(
        torch.randn(10, generator=torch.Generator().manual_seed(4), dtype=torch.float64), -1
    )

    def grad(fn):
        t = theta.clone().requires_grad_(True)
        fn(torch.log_softmax(t, -1)).backward()
        return t.grad

    def expected(kind):
        return lambda log_p: (log_p.exp().detach() * kl_penalty(log_p, log_q, kind)).sum()

    reverse = grad(lambda log_p: (log_p.exp() * (log_p - log_q)).sum())
    forward = grad(lambda log_p: (log_q.exp() * (log_q - log_p)).sum())
    torch.testing.assert_close(grad(expected("k1")), torch.zeros(10, dtype=torch.float64))
    torch.testing.assert_close(grad(expected("k2")), reverse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(expected("k3")), forward, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(reverse, forward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_stay_finite_at_extreme_log_ratios(dtype):
    # low_var_kl: any finite log-probs, however far apart (a token the policy now finds
    # impossible, or the reverse). k3: the range its float32 exp() can represent (|log r| < 88);
    # beyond it k3 overflows, which is why low_var_kl is the default.
    far = torch.tensor([-1e4, -200.0, -60.0, -0.0, -1e-6], dtype=dtype)
    logp, ref = torch.meshgrid(far, far, indexing="ij")
    lp = logp.clone().requires_grad_(True)
    kl_penalty(lp, ref, "low_var_kl").sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert torch.isfinite(kl_penalty(logp, ref, "low_var_kl")).all()
    near = torch.tensor([-80.0, -40.0, -1.0, -1e-6], dtype=torch.float32)
    logp, ref = torch.meshgrid(near, near, indexing="ij")
    lp = logp.clone().requires_grad_(True)
    kl_penalty(lp, ref, "k3").sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_config_fields():
    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.config_utils import ConfigError
    from megatron_rl_fp8.loss.config import PolicyLossConfig
    from megatron_rl_fp8.models.config import ModelConfig

    cfg = load_config(None, [])
    assert (cfg.loss.kl_coef, cfg.loss.kl_type, cfg.model.ref_checkpoint) == (
        0.0,
        "low_var_kl",
        None,
    )
    assert load_config(None, ["loss.kl_coef=0.1", "loss.kl_type=k2"]).loss.kl_type == "k2"
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
            PolicyLossConfig(kl_coef=bad)
    with pytest.raises(ValueError, match="loss.kl_type='k4'"):
        PolicyLossConfig(kl_type="k4")
    with pytest.raises(ConfigError, match="kl_type"):
        load_config(None, ["loss.kl_type=kl"])
    with pytest.raises(ValueError, match="model.ref_checkpoint is empty"):
        ModelConfig(ref_checkpoint="")
