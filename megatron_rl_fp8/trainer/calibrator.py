"""The clip calibrator: which clip bounds the policy update uses, and when they are recalibrated.

Bounds start nominal (1 - eps_low, 1 + eps_high). Under FP8 training with ``loss.calib`` on,
calibration steps are 1, 1 + interval, 1 + 2*interval, ...: there a BF16 shadow pass of the
current policy runs next to the FP8 one on the same mini-batch, ``calibrated_clip_bounds`` turns
the two sets of log ratios into bounds (histograms merged over the data-parallel group), and the
bounds in use become their EMA over calibrations. The state (bounds and how many calibrations made
them) travels in checkpoints, so a resumed run clips exactly as the uninterrupted one.
"""

from __future__ import annotations

import time

from megatron_rl_fp8.loss import calibrated_clip_bounds, ema_bounds
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.trainer.config import PolicyLossConfig

# Diagnostics of calibrated_clip_bounds reported as calib/<name> on calibration steps.
_REPORTED = (
    "bf16_neg_lower_clipfrac",
    "fp8_neg_lower_clipfrac_nominal",
    "fp8_neg_lower_clipfrac_calibrated",
    "bf16_balance",
    "fp8_balance_nominal",
    "fp8_balance_calibrated",
    "hist_bytes",
    "fp8_out_of_range_frac",
)


class ClipCalibrator:
    def __init__(self, loss_cfg: PolicyLossConfig, *, fp8_training: bool):
        self.loss_cfg = loss_cfg
        self.fp8_training = fp8_training
        self.lower = 1.0 - loss_cfg.eps_low
        self.upper = 1.0 + loss_cfg.eps_high
        self.count = 0  # calibrations folded into the EMA so far
        self.requested = False  # the stability guard asked for a calibration at the next step

    @property
    def bounds(self) -> tuple[float, float]:
        return self.lower, self.upper

    @property
    def nominal(self) -> tuple[float, float]:
        """The uncalibrated PPO bounds (1 - eps_low, 1 + eps_high)."""
        return 1.0 - self.loss_cfg.eps_low, 1.0 + self.loss_cfg.eps_high

    def due(self, step: int) -> bool:
        """Whether RL step ``step`` (1-based) calibrates. BF16 has nothing to calibrate against."""
        c = self.loss_cfg.calib
        scheduled = (step - 1) % c.interval == 0
        return self.fp8_training and c.enabled and (scheduled or self.requested)

    def request(self) -> None:
        """Calibrate at the next step, whatever the interval (the guard's recalibrate action)."""
        self.requested = True

    def calibrate(
        self,
        actor,
        mini: dict,
        groups: Groups,
        *,
        micro_batch_size: int,
        temperature: float,
        max_tokens: int | None = None,
    ) -> dict:
        """BF16 shadow + FP8 forward of the current policy on ``mini``; new EMA bounds.

        ``mini`` carries FP8 and BF16 old logprobs. Histograms are merged over the data-parallel
        group only (tensor-parallel ranks hold the same tokens); under pipeline parallelism the
        last stage calibrates and broadcasts the bounds so every rank (and the checkpoint) agrees.
        Returns ``calib/`` metrics and ``perf/shadow_time_s``.
        """
        loss_cfg, g = self.loss_cfg, groups
        t0 = time.perf_counter()
        kwargs = {"temperature": temperature, "max_tokens": max_tokens, "entropy": False}
        cur8 = actor.compute_logprobs(mini, micro_batch_size, **kwargs)
        with actor.full_precision():
            cur16 = actor.compute_logprobs(mini, micro_batch_size, **kwargs)
        result = None
        if g.is_last_stage:
            lower, upper, stats = calibrated_clip_bounds(
                cur8["logprobs"] - mini["old_logprobs"],
                cur16["logprobs"] - mini["old_logprobs_bf16"],
                mini["advantages"],
                mini["loss_mask"],
                loss_cfg.eps_low,
                loss_cfg.eps_high,
                group=g.dp if g.dp_size > 1 else None,
                return_stats=True,
                **loss_cfg.calib.solver_kwargs(),
            )
            prev = None if self.count == 0 else self.bounds
            lower, upper = ema_bounds(prev, (lower, upper), loss_cfg.calib.ema_decay)
            result = (lower, upper, stats)
        self.lower, self.upper, stats = broadcast_object(result, g.last_stage_rank)
        self.count += 1
        self.requested = False
        out = {f"calib/{k}": v for k, v in stats.items() if k in _REPORTED}
        out["calib/raw_lower"], out["calib/raw_upper"] = stats["lower"], stats["upper"]
        out["perf/shadow_time_s"] = time.perf_counter() - t0
        return out

    # {"lower", "upper", "count"} is the format runs were first saved with; "requested" is newer.
    def state_dict(self) -> dict:
        return {
            "lower": self.lower,
            "upper": self.upper,
            "count": self.count,
            "requested": self.requested,
        }

    def load_state_dict(self, state: dict) -> None:
        self.lower, self.upper, self.count = state["lower"], state["upper"], state["count"]
        self.requested = state.get("requested", False)
