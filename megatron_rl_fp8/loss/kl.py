"""Per-token estimators of KL(pi_theta || pi_ref) for a KL penalty against a frozen reference.

The response tokens x were sampled from the policy (by the rollout engine, with pi_old's weights;
later mini-batches of a step reuse them for pi_theta without reweighting, as GRPO and verl do), and
for each one we know two numbers, ``logp = log pi_theta(x)`` and ``ref = log pi_ref(x)``. The exact KL needs the whole vocabulary at every position; these estimators
need only those two numbers (Schulman, "Approximating KL divergence", 2020; verl's
``kl_penalty``). With the log ratio ``log r = ref - logp`` (note the sign: r = pi_ref / pi_theta)::

    k1 = -log r                   = logp - ref
    k2 = 0.5 * (log r)^2
    k3 = (r - 1) - log r          = exp(ref - logp) - (ref - logp) - 1
    low_var_kl = k3 with log r clamped to [-20, 20] and the result clamped to [-10, 10]

Their values, as estimates of KL(pi_theta || pi_ref) = E_{x ~ pi_theta}[-log r]:

* k1 is unbiased but noisy, and negative on about half the tokens (a per-token "KL" below 0).
* k2 is biased (its mean is KL plus third-order terms in log r), never negative, low variance when
  the policies are close.
* k3 is unbiased *and* never negative: it is k1 plus the control variate r - 1, whose mean under
  pi_theta is 0 (E[r] = sum_x pi_ref(x) = 1), and (r - 1) - log r >= 0 because log r <= r - 1.
  Near r = 1 it behaves like 0.5 * (log r)^2, so each token's value is small when the policies are
  close: that is why it is low variance.

Their gradients, which is what matters in a loss. The penalty is added per token and
differentiated through ``logp`` only (the sampled tokens are fixed), so the expected gradient is
E_{pi_theta}[dk/dlogp * grad log pi_theta]:

* k1: dk/dlogp = 1, and E[grad log pi_theta] = 0: in expectation k1 pushes nowhere; its gradient
  is pure noise, although its value is unbiased.
* k2: dk/dlogp = logp - ref, so E = E[(log pi_theta - log pi_ref) grad log pi_theta]: exactly the
  gradient of KL(pi_theta || pi_ref). The estimator with the biased value has the right gradient.
* k3: dk/dlogp = 1 - r, so E = -sum_x pi_ref(x) grad log pi_theta(x): the gradient of the *forward*
  KL(pi_ref || pi_theta). Close to the reverse KL's when the policies are close, and mass-covering
  rather than mode-seeking when they are not. This is GRPO's (and verl's default) choice.

``low_var_kl`` is verl's numerically safe k3, and the default here: k3 itself overflows float32
once ref - logp exceeds ~88 (a token the policy now finds vanishingly unlikely), while the clamps
keep every value and gradient finite. Clamping the result at 10 zeroes the gradient of those
rare, very off-reference tokens instead of letting one token dominate the step.
"""

from __future__ import annotations

from typing import Literal

import torch

KLType = Literal["k1", "k2", "k3", "low_var_kl"]

# verl's bounds: exp(20) ~ 5e8 is far past any useful log ratio, and a per-token KL of 10 nats
# already means the token is e^10 times likelier under one policy than the other.
_MAX_LOG_RATIO = 20.0
_MAX_KL = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (module docstring), the shape of the inputs.

    ``logprobs`` carries the gradient; ``ref_logprobs`` is detached (the reference is frozen).
    Masking is the caller's: give finite values on padding (the trainer masks before calling).
    """
    ref_logprobs = ref_logprobs.detach()
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "k3":
        log_r = ref_logprobs - logprobs
        return torch.exp(log_r) - log_r - 1
    if kind == "low_var_kl":
        log_r = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(log_r) - log_r - 1).clamp(-_MAX_KL, _MAX_KL)
    raise ValueError(f"kind={kind!r} is not a KL estimator; use 'k1', 'k2', 'k3' or 'low_var_kl'")
