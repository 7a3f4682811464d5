"""The upper-bound rules of calibrated clipping (``loss.calib.strategy``), registered by name.

A calibration reads the lower bound from BF16's negative-advantage clip share (one rule for all);
the upper bound is a choice, and each choice is a function here, registered with
:func:`upper_rule`: its name is a value ``loss.calib.strategy`` accepts, its help is that value's
sentence in the setting's help, and the solver (``calibration.py: bounds_from_histogram``) calls it
with an :class:`UpperInputs`. A new rule is one decorated function in this file; nothing else
names it (``config.py`` takes its accepted values from the registry when it is imported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl_fp8.loss.histogram import hist_inverse_mass

__all__ = ["UPPER_RULES", "UpperInputs", "UpperRule", "rules_help", "upper_rule"]


@dataclass(frozen=True)
class UpperInputs:
    """What an upper rule reads from one calibration: the positive-advantage FP8 histograms, BF16's
    statistics at the nominal bounds, and the lower bound already chosen."""

    pos_cnt: torch.Tensor
    """FP8 positive-advantage tokens per log-ratio bin."""
    pos_sum: torch.Tensor
    """... and their ratio mass (sum of ratios) per bin."""
    n_pos: float
    pos_total: float
    lower: float
    """The calibrated (clamped) lower bound."""
    nominal_lower: float
    nominal_upper: float
    q_plus: float
    """BF16's A>0 upper-clip share at the nominal upper bound."""
    bf16_balance: float
    """BF16's unclipped positive / negative ratio mass at the nominal bounds (NaN: undefined)."""
    fp8_neg_unclipped: float
    """FP8's unclipped negative ratio mass at ``lower``."""
    log_ratio_range: tuple[float, float]

    def unclip_all(self, weights: torch.Tensor) -> float:
        """The right edge of the last non-empty positive bin of ``weights``, never below nominal:
        the tightest bound that clips no positive token."""
        return max(
            self.nominal_upper, math.exp(hist_inverse_mass(weights, math.inf, self.log_ratio_range))
        )


@dataclass(frozen=True)
class UpperRule:
    name: str
    help: str
    fn: Callable[[UpperInputs], float]
    needs_positive_tokens: bool = True
    """Without positive-advantage tokens the bound stays nominal (the solver does not call it)."""


UPPER_RULES: dict[str, UpperRule] = {}
"""Every registered rule by name, in registration order (the first is the default's)."""


def upper_rule(name: str, *, help: str, needs_positive_tokens: bool = True):
    """Register the decorated ``fn(inputs: UpperInputs) -> upper bound`` as rule ``name``."""

    def register(fn: Callable[[UpperInputs], float]) -> Callable[[UpperInputs], float]:
        if name in UPPER_RULES:
            raise ValueError(f"upper rule {name!r} is registered twice")
        UPPER_RULES[name] = UpperRule(name, help, fn, needs_positive_tokens)
        return fn

    return register


def rules_help() -> str:
    """``loss.calib.strategy``'s help: one sentence per rule."""
    return "Upper-bound rule: " + "; ".join(f"'{r.name}' {r.help}" for r in UPPER_RULES.values())


@upper_rule(
    "balance",
    help="matches BF16's positive/negative update balance, widening the nominal upper bound but "
    "never tightening it",
)
def balance(x: UpperInputs) -> float:
    if math.isnan(x.bf16_balance):
        return x.nominal_upper
    target = x.bf16_balance * x.fp8_neg_unclipped
    if target >= x.pos_total:
        # Unreachable: unclip every positive token this batch has. Going further, e.g. to the
        # safety maximum, would not move this batch's balance at all, only drop the upper clip for
        # every step until the next calibration.
        return x.unclip_all(x.pos_sum)
    # One-sided: the balance may widen the upper bound, never tighten it (calibration.py's module
    # docstring: a bulk shift of the positive ratios would pull it into the bulk).
    return max(x.nominal_upper, math.exp(hist_inverse_mass(x.pos_sum, target, x.log_ratio_range)))


@upper_rule(
    "quantile",
    help="clips the share of positive-advantage tokens BF16 clips at the nominal upper bound (the "
    "lower rule's mirror)",
)
def quantile(x: UpperInputs) -> float:
    if x.q_plus == 0:
        return x.unclip_all(x.pos_cnt)
    return math.exp(hist_inverse_mass(x.pos_cnt, (1.0 - x.q_plus) * x.n_pos, x.log_ratio_range))


@upper_rule(
    "shift",
    help="keeps the nominal log-width of the clip interval",
    needs_positive_tokens=False,
)
def shift(x: UpperInputs) -> float:
    return x.lower * x.nominal_upper / x.nominal_lower


@upper_rule(
    "lower_only",
    help="keeps the nominal upper bound (the paper's ablation: it over-penalises)",
)
def lower_only(x: UpperInputs) -> float:
    return x.nominal_upper
