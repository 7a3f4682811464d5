"""The ``loss.*`` section: the policy objective (:class:`PolicyLossConfig`) and the knobs of
calibrated clipping (``loss.calib.*``, :class:`CalibConfig`) with the checks its solver shares.

The solver itself is :mod:`megatron_rl_fp8.loss.calibration`; the trainer's
:class:`~megatron_rl_fp8.trainer.calibrator.ClipCalibrator` owns the state (bounds, count).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from megatron_rl_fp8.config_utils import check_literals, field
from megatron_rl_fp8.loss.importance import ISCorrectionConfig
from megatron_rl_fp8.loss.kl import KLType
from megatron_rl_fp8.loss.upper_rules import UPPER_RULES, rules_help

STRATEGIES = tuple(UPPER_RULES)
"""The upper rules ``loss.calib.strategy`` accepts: every one registered in ``upper_rules.py``."""
Strategy = Literal[STRATEGIES]
DEFAULT_STRATEGY = "balance"
"""The default upper rule of ``mode: calibrate`` (docs/reproduction.md has the evidence it was
chosen on; the default mode, ``share``, uses no upper rule)."""
Mode = Literal["calibrate", "oracle", "share"]

DEFAULT_BINS = 4096
DEFAULT_LOG_RATIO_RANGE = (-2.0, 2.0)
DEFAULT_LOWER_LIMITS = (0.5, 0.999)
DEFAULT_UPPER_LIMITS = (1.001, 3.0)


@dataclass(kw_only=True)
class CalibConfig:
    """Calibrated clipping knobs. The trainer owns the state (previous bounds, step counter)."""

    enabled: bool = field(
        default=True,
        help="Calibrate the FP8 clip bounds against a BF16 shadow forward. Only "
        "meaningful when training runs in FP8.",
    )
    interval: int = field(
        default=5,
        help="Calibrate every this many optimizer steps (each calibration costs one "
        "BF16 shadow forward of pi_old and pi_theta; the paper calibrates every 20, the share "
        "mode's default every 5: docs/reproduction.md).",
    )
    mode: Mode = field(
        default="share",
        help="'share' (the default, docs/reproduction.md): the bounds stay nominal and each sign "
        "clips only the share of the tokens past them that BF16 clipped at the last calibrations "
        "(each row's most extreme ones; the counts smoothed with ema_decay per mini-batch "
        "position and summed over positions; strategy is unused). 'calibrate': bounds from a "
        "BF16 shadow pass every `interval` steps by `strategy` (the paper's method). 'oracle': "
        "every mini-batch runs the BF16 shadow forward and the clip decision of each token comes "
        "from its BF16 ratio at the nominal bounds (gradient still FP8): what calibration "
        "approximates, at one shadow forward per mini-batch (a study arm, not a production "
        "mode).",
    )
    strategy: Strategy = field(
        default=DEFAULT_STRATEGY,
        help=rules_help() + " (loss/upper_rules.py).",
    )
    invariant_tolerance: float = field(
        default=0.01,
        help="At every calibration, FP8's A<0 lower-clip share and A>0 upper-clip share under the "
        "bounds about to be used are compared with BF16's under the nominal bounds; a sign whose "
        "share is further than this (absolute share of that sign's tokens) from BF16's and "
        "further than the nominal bounds' share is a violation: the bounds fall back to nominal "
        "and the guard records a `calib` event.",
    )
    bins: int = field(
        default=DEFAULT_BINS,
        help="Histogram bins over log_ratio_range; the bound resolution is "
        "(hi - lo) / bins in log ratio (4096 over (-2, 2): ~0.1% in ratio).",
    )
    log_ratio_range: tuple[float, float] = field(
        default=DEFAULT_LOG_RATIO_RANGE,
        help="(lo, hi) log-ratio range of the histograms; values outside are "
        "clamped into the edge bins. Must contain the safety limits.",
    )
    ema_decay: float = field(
        default=0.0,
        help="Weight of the previous bounds (share mode: counts) when smoothing a new "
        "calibration (0, the default = use each calibration as is; the paper smooths with 0.5).",
    )
    share_min_tokens: int = field(
        default=0,
        help="Share mode, for a sign FP8 rarely clips: a position's counts pool its newest "
        "calibrations (BF16's and FP8's alike), going back until FP8 clipped at least this many "
        "tokens of the sign, at most 64 calibrations back; needs ema_decay 0. 0 (the default): "
        "the newest calibration where FP8 clipped any (docs/reproduction.md, 'Learning rate').",
    )
    lower_limits: tuple[float, float] = field(
        default=DEFAULT_LOWER_LIMITS,
        help="(min, max) allowed calibrated lower ratio bound; max < 1 so that an "
        "unchanged token (r = 1) is never clipped.",
    )
    upper_limits: tuple[float, float] = field(
        default=DEFAULT_UPPER_LIMITS,
        help="(min, max) allowed calibrated upper ratio bound; min > 1.",
    )

    def __post_init__(self) -> None:
        self.log_ratio_range = tuple(self.log_ratio_range)
        self.lower_limits = tuple(self.lower_limits)
        self.upper_limits = tuple(self.upper_limits)
        if self.interval < 1:
            raise ValueError(
                f"CalibConfig.interval={self.interval!r} must be >= 1 "
                "(calibrate every `interval` steps; 5 is the default, 20 the paper's)."
            )
        if self.ema_decay < 0 or self.ema_decay >= 1:
            raise ValueError(
                f"CalibConfig.ema_decay={self.ema_decay!r} must lie in [0, 1); "
                "use 0 to disable smoothing."
            )
        if self.share_min_tokens < 0:
            raise ValueError(
                f"CalibConfig.share_min_tokens={self.share_min_tokens!r} must be >= 0 "
                "(0: no pooling, the default)."
            )
        if self.share_min_tokens and self.mode != "share":
            raise ValueError(
                f"CalibConfig.share_min_tokens={self.share_min_tokens} pools the share mode's "
                f"counts; mode={self.mode!r} has none: set mode='share' or share_min_tokens=0."
            )
        if self.share_min_tokens and self.ema_decay:
            raise ValueError(
                f"CalibConfig.share_min_tokens={self.share_min_tokens} pools calibrations, and "
                f"ema_decay={self.ema_decay} smooths them: use one; set ema_decay to 0 to pool."
            )
        if not 0 < self.invariant_tolerance < 1:
            raise ValueError(
                f"CalibConfig.invariant_tolerance={self.invariant_tolerance!r} must lie in (0, 1): "
                "it is a share of one sign's tokens (0.01 = one percentage point)."
            )
        if self.mode not in ("calibrate", "oracle", "share"):
            raise ValueError(
                f"CalibConfig.mode={self.mode!r} is not supported; use 'share' (default), "
                "'calibrate' or 'oracle'."
            )
        if self.mode == "oracle" and not self.enabled:
            # Off, the BF16 shadow never runs: the "oracle" would silently be nominal FP8.
            raise ValueError(
                "CalibConfig.mode='oracle' needs enabled=true (loss.calib.enabled: the BF16 "
                "shadow that decides every clip); with enabled=false the bounds are nominal."
            )
        check_solver_args(
            strategy=self.strategy,
            bins=self.bins,
            log_ratio_range=self.log_ratio_range,
            lower_limits=self.lower_limits,
            upper_limits=self.upper_limits,
            owner="CalibConfig.",
        )

    def solver_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`calibrated_clip_bounds` taken from this config."""
        d = asdict(self)
        return {
            k: d[k] for k in ("strategy", "bins", "log_ratio_range", "lower_limits", "upper_limits")
        }


def check_solver_args(
    *,
    strategy: str,
    bins: int,
    log_ratio_range: tuple[float, float],
    lower_limits: tuple[float, float],
    upper_limits: tuple[float, float],
    owner: str = "",
) -> None:
    """Validate the calibration solver arguments; errors name ``owner + field``."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"{owner}strategy={strategy!r} is not supported; use one of "
            f"{', '.join(STRATEGIES)} ('{DEFAULT_STRATEGY}' is the default)."
        )
    if not isinstance(bins, int) or bins < 16:
        raise ValueError(f"{owner}bins={bins!r} must be an int >= 16 (4096 is a good default).")
    lo, hi = log_ratio_range
    if not lo < 0 < hi:
        raise ValueError(
            f"{owner}log_ratio_range={log_ratio_range!r} must satisfy lo < 0 < hi "
            "(e.g. (-2.0, 2.0)); it is a range of log ratios."
        )
    min_l, max_l = lower_limits
    if not 0 < min_l <= max_l < 1:
        raise ValueError(
            f"{owner}lower_limits={lower_limits!r} must satisfy "
            "0 < min <= max < 1 (e.g. (0.5, 0.999))."
        )
    min_u, max_u = upper_limits
    if not 1 < min_u <= max_u:
        raise ValueError(
            f"{owner}upper_limits={upper_limits!r} must satisfy 1 < min <= max (e.g. (1.001, 3.0))."
        )
    if math.log(min_l) <= lo or math.log(max_u) >= hi:
        raise ValueError(
            f"{owner}log_ratio_range={log_ratio_range!r} must strictly contain the "
            f"log of the limits (lower_limits={lower_limits!r}, "
            f"upper_limits={upper_limits!r}); widen the range or tighten the limits."
        )


def check_eps(eps_low: float, eps_high: float) -> None:
    if not 0 < eps_low < 1 or not eps_high > 0:
        raise ValueError(
            f"eps_low={eps_low!r}, eps_high={eps_high!r} must satisfy "
            "0 < eps_low < 1 and eps_high > 0 (the nominal bounds are "
            "1 - eps_low and 1 + eps_high)."
        )


@dataclass(kw_only=True)
class PolicyLossConfig:
    """The clipped policy-gradient objective (GRPO by default)."""

    eps_low: float = field(0.2, help="Lower clip: ratio bound 1 - eps_low.")
    eps_high: float = field(0.2, help="Upper clip: ratio bound 1 + eps_high (DAPO uses 0.28).")
    clip_c: float | None = field(None, help="Dual-clip constant (> 1) for negative advantages.")
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = field(
        "token-mean", help="Loss aggregation; token-mean counts tokens across all DP ranks."
    )
    norm_adv_by_std: bool = field(True, help="GRPO: divide group-centred rewards by group std.")
    is_correction: ISCorrectionConfig | None = field(
        None,
        help="TIS/MIS: reweight token losses by pi_old / pi_rollout (null = off; the "
        "mismatch is logged either way).",
    )
    calib: CalibConfig = field(
        default_factory=CalibConfig,
        help="Calibrated clipping (FP8 training only): clip bounds matched to a BF16 shadow pass "
        "every calib.interval steps, smoothed by EMA in between.",
    )
    dynamic_sampling: bool = field(
        False,
        help="DAPO: drop prompt groups whose rewards are all equal and sample more prompts "
        "until the batch is full.",
    )
    max_sampling_rounds: int = field(
        4,
        help="DAPO: most rollout rounds per step when refilling; if the batch is still short, "
        "dropped groups fill it (zero advantage) and rollout/dynamic_fill_frac says so.",
    )
    overlong_buffer: int = field(
        0,
        help="DAPO soft overlong punishment: responses longer than rollout.max_new_tokens - "
        "overlong_buffer lose reward linearly (0 = off).",
    )
    overlong_penalty: float = field(1.0, help="DAPO: reward lost at rollout.max_new_tokens.")
    kl_coef: float = field(
        0.0,
        help="Weight of a per-token KL(pi_theta || pi_ref) penalty against a frozen reference "
        "policy (model.ref_checkpoint); 0 = off and no reference model is built (DAPO drops it).",
    )
    kl_type: KLType = field(
        "low_var_kl",
        help="KL estimator (loss/kl.py): k1, k2, k3, or low_var_kl (k3 with verl's clamps).",
    )

    def __post_init__(self):
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(
                "overlong_buffer and overlong_penalty must be >= 0, got "
                f"{self.overlong_buffer} and {self.overlong_penalty}"
            )
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.clip_c is not None and self.clip_c <= 1:
            raise ValueError(f"clip_c must be > 1 (or null to disable), got {self.clip_c}")
        if not math.isfinite(self.kl_coef) or self.kl_coef < 0:
            raise ValueError(
                f"kl_coef must be a finite number >= 0 (0 = no KL penalty), got {self.kl_coef}"
            )
        check_literals(self, "loss")
