"""The clip calibrator: which clip bounds the policy update uses, and when they are recalibrated.

Bounds start nominal (1 - eps_low, 1 + eps_high). Under FP8 training with ``loss.calib`` on,
calibration steps are 1, 1 + interval, 1 + 2*interval, ...: there a BF16 shadow pass of the
current policy runs next to the FP8 one on the same mini-batch, ``calibrated_clip_bounds`` turns
the two sets of log ratios into bounds (histograms merged over the data-parallel group), and the
bounds in use become their EMA over calibrations. The state (bounds and how many calibrations made
them) travels in checkpoints, so a resumed run clips exactly as the uninterrupted one.

Every calibration checks its own bounds on the batch it came from (``loss/calibration.py``'s
invariant): when the bounds about to be used (after the EMA) clip a sign's tokens further from
BF16's nominal share than ``loss.calib.invariant_tolerance`` and than the nominal bounds would,
they are not used: the bounds fall back to nominal, ``calib/fallback`` is 1 and the stability
guard records a ``calib`` event (its action: ``guard.on_calib``).

``loss.calib.mode=oracle`` calibrates nothing: every mini-batch after the first runs the BF16
shadow forward of the current policy (:meth:`ClipCalibrator.oracle_log_ratio`), and each token's
clip decision comes from its BF16 ratio at the nominal bounds while the FP8 ratio carries the
gradient: what calibration approximates at one shadow pass per ``interval`` steps.

``loss.calib.mode=share`` calibrates on the same schedule but keeps the nominal bounds: each
calibration measures, per sign, the share of FP8's nominally clipped tokens that BF16 clips too
(``loss/thinning.py``; the counts smoothed per mini-batch position over calibrations and summed
over positions), and every later update clips only that share, each row's most extreme tokens.
With ``loss.calib.share_min_tokens`` a position's counts instead pool its newest calibrations back
until FP8 clipped that many tokens of the sign (the window travels in checkpoints too).
"""

from __future__ import annotations

import time

import torch

from megatron_rl_fp8.loss import (
    bounds_from_histogram,
    clip_shares,
    ema_bounds,
    invariant_violations,
    keep_fraction,
    merged_calibration_histogram,
    salt,
    share_counts,
)
from megatron_rl_fp8.loss.config import PolicyLossConfig
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.collectives import broadcast_object

# share_min_tokens looks back at most this many calibrations of a position.
WINDOW_CAP = 64

# Diagnostics of calibrated_clip_bounds reported as calib/<name> on calibration steps.
_REPORTED = (
    "bf16_neg_lower_clipfrac",
    "bf16_pos_upper_clipfrac",
    "fp8_neg_lower_clipfrac_nominal",
    "fp8_pos_upper_clipfrac_nominal",
    "fp8_neg_lower_clipfrac_calibrated",
    "fp8_pos_upper_clipfrac_calibrated",
    "bf16_balance",
    "fp8_balance_nominal",
    "fp8_balance_calibrated",
    "hist_bytes",
    "fp8_out_of_range_frac",
    "keep_neg_lower",
    "keep_pos_upper",
)


class ClipCalibrator:
    def __init__(self, loss_cfg: PolicyLossConfig, *, fp8_training: bool):
        self.loss_cfg = loss_cfg
        self.fp8_training = fp8_training
        self.lower = 1.0 - loss_cfg.eps_low
        self.upper = 1.0 + loss_cfg.eps_high
        self.count = 0  # calibrations folded into the EMA so far
        # mode=share: mini-batch position -> smoothed share_counts() of its calibrations.
        self.kept: dict[int, list[float]] = {}
        # share_min_tokens: position -> the share_counts() of its calibrations, newest first.
        self.window: dict[int, list[list[float]]] = {}
        self.requested = False  # the stability guard asked for a calibration at the next step

    @property
    def bounds(self) -> tuple[float, float]:
        return self.lower, self.upper

    @property
    def nominal(self) -> tuple[float, float]:
        """The uncalibrated PPO bounds (1 - eps_low, 1 + eps_high)."""
        return 1.0 - self.loss_cfg.eps_low, 1.0 + self.loss_cfg.eps_high

    @property
    def oracle(self) -> bool:
        """Whether every mini-batch's clip is decided by the BF16 shadow (``mode=oracle``)."""
        c = self.loss_cfg.calib
        return self.fp8_training and c.enabled and c.mode == "oracle"

    @property
    def sharing(self) -> bool:
        """Whether the nominal clip set is thinned to BF16's share (``mode=share``)."""
        c = self.loss_cfg.calib
        return self.fp8_training and c.enabled and c.mode == "share"

    def keep(self, kept: dict[int, list[float]] | None = None) -> tuple[float, float]:
        """(A<0, A>0) keep fractions: the smoothed counts summed over the mini-batch positions
        (one calibration batch holds a handful of clipped tokens; the sum is what the updates'
        clips add up to); 1 (nominal) before any calibration."""
        kept = self.kept if kept is None else kept
        total = [sum(c[i] for c in kept.values()) for i in range(4)]
        return keep_fraction(total[0], total[1]), keep_fraction(total[2], total[3])

    def share(self, position: int, *, seed: int, step: int) -> tuple[tuple[float, float], int]:
        """(keep fractions, rounding salt) for mini-batch ``position`` at RL step ``step``: what
        ``loss.thinned_bounds`` takes. The salt depends on the run's seed, the step and the
        position only, so every layout and a resumed run thin the same tokens."""
        return self.keep(), salt(seed, step, position)

    def due(self, step: int) -> bool:
        """Whether RL step ``step`` (1-based) calibrates. BF16 has nothing to calibrate against;
        the oracle does not calibrate, it decides every clip."""
        c = self.loss_cfg.calib
        scheduled = (step - 1) % c.interval == 0
        return self.fp8_training and c.enabled and not self.oracle and (scheduled or self.requested)

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
        position: int = 1,
    ) -> dict:
        """BF16 shadow + FP8 forward of the current policy on ``mini`` (the step's mini-batch
        ``position``); new EMA bounds, or under ``mode=share`` that position's new keep fractions.

        ``mini`` carries FP8 and BF16 old logprobs. Histograms are merged over the data-parallel
        group only (tensor-parallel ranks hold the same tokens); under pipeline parallelism the
        last stage calibrates and broadcasts the bounds so every rank (and the checkpoint) agrees.
        Returns ``calib/`` metrics and ``perf/shadow_time_s``.
        """
        loss_cfg, g = self.loss_cfg, groups
        calib = loss_cfg.calib
        t0 = time.perf_counter()
        kwargs = {"temperature": temperature, "max_tokens": max_tokens, "entropy": False}
        # The FP8 ratios calibrated on are the ones the update is about to clip: under delayed
        # scaling the extra pass must neither see other scales nor move them.
        with actor.frozen_fp8_scaling():
            cur8 = actor.compute_logprobs(mini, micro_batch_size, **kwargs)
        with actor.full_precision():
            cur16 = actor.compute_logprobs(mini, micro_batch_size, **kwargs)
        result = None
        if g.is_last_stage:
            hist = {"bins": calib.bins, "log_ratio_range": calib.log_ratio_range}
            packed = merged_calibration_histogram(
                cur8["logprobs"] - mini["old_logprobs"],
                cur16["logprobs"] - mini["old_logprobs_bf16"],
                mini["advantages"],
                mini["loss_mask"],
                loss_cfg.eps_low,
                loss_cfg.eps_high,
                group=g.dp if g.dp_size > 1 else None,
                **hist,
            ).cpu()
            if self.sharing:
                bounds, kept, stats, violated = self._share(packed, position)
            else:
                kept = None
                lower, upper, stats = bounds_from_histogram(
                    packed, loss_cfg.eps_low, loss_cfg.eps_high, **calib.solver_kwargs()
                )
                prev = None if self.count == 0 else self.bounds
                bounds = ema_bounds(prev, (lower, upper), calib.ema_decay)
                # The invariant judges the bounds the next updates clip with: the smoothed ones.
                shares = clip_shares(packed, *bounds, **hist)
                violated = invariant_violations(shares, calib.invariant_tolerance)
                if violated:
                    bounds = self.nominal
                stats |= shares
            stats |= {"fallback": float(bool(violated))}
            stats |= {f"invariant_violated/{sign}": 1.0 for sign in violated}
            result = (*bounds, stats, kept)
        self.lower, self.upper, stats, kept = broadcast_object(result, g.last_stage_rank)
        if kept is not None:
            self.kept, self.window = kept
        self.count += 1
        self.requested = False
        out = {f"calib/{k}": v for k, v in stats.items() if k in _REPORTED}
        out |= {f"calib/{k}": v for k, v in stats.items() if k.startswith("invariant_violated/")}
        out["calib/fallback"] = stats["fallback"]
        out["calib/raw_lower"], out["calib/raw_upper"] = stats["lower"], stats["upper"]
        out["perf/shadow_time_s"] = time.perf_counter() - t0
        return out

    def _share(self, packed: torch.Tensor, position: int):
        """(nominal bounds, (every position's counts, the pooling windows), stats, violated
        signs) of a share calibration. The invariant judges the keep fractions the next updates
        use on this batch; a sign whose thinned share breaks it falls back to the whole nominal
        clip set until the next calibration, which then starts that sign's smoothing afresh (its
        counts are zeroed: keep 1 now, and the next EMA or window keeps the new ratio as it is)."""
        calib = self.loss_cfg.calib
        hist = {"bins": calib.bins, "log_ratio_range": calib.log_ratio_range}
        new = share_counts(packed, calib.bins)
        prev, d = self.kept.get(position), calib.ema_decay
        window = {k: [list(c) for c in v] for k, v in self.window.items()}
        if calib.share_min_tokens:
            window[position] = [new, *window.get(position, [])][:WINDOW_CAP]
            counts = pooled_counts(window[position], calib.share_min_tokens)
        elif prev is None:
            counts = new
        else:
            counts = [d * p + (1 - d) * n for p, n in zip(prev, new)]
            # A batch where FP8 clips no token of a sign says nothing of the share BF16 keeps:
            # that sign's counts stay as they were (without this, EMA 0 reset its keep to 1, the
            # whole nominal clip set, at about half the shipped job's calibrations).
            for at, fp8 in ((slice(0, 2), new[1]), (slice(2, 4), new[3])):
                if fp8 <= 0:
                    counts[at] = prev[at]
        kept = {k: list(v) for k, v in self.kept.items()} | {position: counts}
        keep = self.keep(kept)
        shares = clip_shares(packed, *self.nominal, **hist)
        for i, sign in enumerate(("neg_lower", "pos_upper")):
            nominal = shares[f"fp8_{sign}_clipfrac_nominal"]
            shares[f"fp8_{sign}_clipfrac_calibrated"] = keep[i] * nominal
        violated = invariant_violations(shares, calib.invariant_tolerance)
        for sign in violated:
            at = slice(0, 2) if sign == "neg_lower" else slice(2, 4)
            for c in (*kept.values(), *(c for w in window.values() for c in w)):
                c[at] = [0.0, 0.0]
        keep = self.keep(kept)
        stats = shares | {"keep_neg_lower": keep[0], "keep_pos_upper": keep[1]}
        # What the calibration all-reduced (bounds_from_histogram reports it for the other mode).
        stats["hist_bytes"] = float(packed.numel() * packed.element_size())
        stats |= dict(zip(("lower", "upper"), self.nominal))
        return self.nominal, (kept, window), stats, violated

    def oracle_log_ratio(
        self,
        actor,
        mini: dict,
        *,
        micro_batch_size: int,
        temperature: float,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """The BF16 log ratio of the current policy on ``mini`` (``mode=oracle``): the shadow
        forward minus ``old_logprobs_bf16``; zeros off the last pipeline stage (no loss there)."""
        with actor.full_precision():
            cur16 = actor.compute_logprobs(
                mini,
                micro_batch_size,
                temperature=temperature,
                max_tokens=max_tokens,
                entropy=False,
            )
        if cur16 is None:
            return torch.zeros_like(mini["old_logprobs"])
        return cur16["logprobs"] - mini["old_logprobs_bf16"]

    # {"lower", "upper", "count"} is the format runs were first saved with; "requested", "kept"
    # (mode=share) and "window" (share_min_tokens) are newer.
    def state_dict(self) -> dict:
        return {
            "lower": self.lower,
            "upper": self.upper,
            "count": self.count,
            "requested": self.requested,
            "kept": {str(k): list(v) for k, v in self.kept.items()},
            "window": {str(k): [list(c) for c in v] for k, v in self.window.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.lower, self.upper, self.count = state["lower"], state["upper"], state["count"]
        self.requested = state.get("requested", False)
        self.kept = {int(k): list(v) for k, v in state.get("kept", {}).items()}
        self.window = {int(k): [list(c) for c in v] for k, v in state.get("window", {}).items()}
        if self.sharing:  # the share mode clips at the nominal bounds, whatever a run resumed
            self.lower, self.upper = self.nominal  # from calibrated (before 12-07's default)


def pooled_counts(window: list[list[float]], min_tokens: int) -> list[float]:
    """``share_counts()`` summed per sign over ``window`` (a position's calibrations, newest
    first), each sign going back until FP8's count reaches ``min_tokens`` (all of them if it never
    does). BF16's counts of the same calibrations come along, those where FP8 clipped none too,
    up to FP8's pooled count: thinning this position's clip set cannot clip more than it holds,
    and the excess, summed with the other positions, would clip more there instead."""
    counts = [0.0, 0.0, 0.0, 0.0]
    for bf16, fp8 in ((0, 1), (2, 3)):
        for c in window:
            counts[bf16] += c[bf16]
            counts[fp8] += c[fp8]
            if counts[fp8] >= min_tokens:
                break
        counts[bf16] = min(counts[bf16], counts[fp8])
    return counts
