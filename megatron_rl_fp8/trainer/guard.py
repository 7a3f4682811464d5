"""The stability guard: rules on each step's metrics, and what the trainer does when one fires.

RL runs rarely fail loudly. A learning rate a little too high, an FP8 scale gone wrong or a bad
batch shows first as entropy climbing towards uniform, the rollout and training policies drifting
apart, the reward collapsing or the responses turning to repeated or undecodable text; by the time
the loss is NaN the kept checkpoints are already damaged. The guard reads the step's metrics after
the update and, when a rule fires, takes the action configured for that rule:

=================  =============================================================  ===================
rule               fires when                                                     actions
=================  =============================================================  ===================
``nonfinite``      loss or grad norm NaN/inf (the update was not applied: the      skip, rollback, stop
                   actor never steps on them), or the weights' norm overflows
``entropy``        ``train/entropy`` rose more than ``max_entropy_rise`` nats      rollback, bf16, stop
                   above its minimum over the last ``window`` healthy steps
``mismatch``       ``fp8/token_mult_prob_error`` above ``max_mismatch``            recalibrate, bf16,
                                                                                   rollback, stop
``reward``         ``rollout/reward_mean`` below ``reward_collapse_ratio`` x the    rollback, stop
                   best of the last ``window`` healthy steps
``garbled``        ``rollout/garbled_frac`` above ``max_garbled_frac``             rollback, bf16, stop
``calib``          a calibration broke its invariant and its bounds fell back to   recalibrate, bf16,
                   nominal (``calib/fallback``; ``loss.calib.invariant_tolerance``) stop
=================  =============================================================  ===================

* **skip**: the update stays unapplied; after ``max_consecutive_skips`` in a row, roll back.
* **recalibrate**: the next step is a calibration step (FP8 training with calibrated clipping).
* **bf16**: the next ``bf16_steps`` steps train without FP8 (rollout unchanged), nominal clip
  bounds, no calibration.
* **rollback**: back to the newest checkpoint *verified healthy*, learning rate times
  ``rollback_lr_factor``; at most ``max_rollbacks`` times, then stop.
* **stop**: end the run with the rule and its evidence; ``latest`` names the last healthy
  checkpoint, so the next start resumes from it.

Which checkpoint is healthy: step t's entropy, mismatch and rewards are measured on the policy the
update of step t-1 produced, so a checkpoint written at step k is vouched for only once step k+1
passed every rule on them (a non-finite update at step k+1 is that update's fault, not the
policy's). Checkpoints after the last healthy one are removed when the guard rolls back or
stops (they may hold the damage). The decisions are pure functions of metrics and state (tested
directly); the trainer carries them out (``guard_actions.py``); the settings are
``trainer/config.py``'s ``GuardConfig``.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from megatron_rl_fp8.trainer.config import ACTIONS, GuardConfig


class GuardStop(Exception):
    """The guard ended the run (the CLI prints it as one ``guard:`` line, exit code 3)."""


@dataclasses.dataclass
class Event:
    rule: str
    action: str
    evidence: str  # one human sentence with the numbers
    value: float


def strongest(events: list[Event]) -> str | None:
    return max((e.action for e in events), key=ACTIONS.index, default=None)


class StabilityGuard:
    """The guard's memory (baselines, rollbacks, checkpoints vouched for) and its decisions."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.entropy = collections.deque(maxlen=cfg.window)
        self.reward = collections.deque(maxlen=cfg.window)
        self.skips_in_a_row = 0
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.bf16_until = 0  # steps <= this train without FP8
        self.pending: list[int] = []  # checkpoint steps not yet vouched for
        self.healthy_checkpoint: int | None = None
        self.loaded: int | None = None  # the checkpoint just loaded, until the next step's check
        # A checkpoint whose weights went non-finite right after being loaded: never vouched for,
        # and discarded by a rollback (it may be damaged on disk in a way its sizes cannot show).
        self.distrusted: int | None = None
        self.suspect: int | None = None  # loaded, then a non-finite first step (once so far)

    # -- decisions ---------------------------------------------------------------------------
    def check(self, step: int, m: dict) -> list[Event]:
        """The rules that fire on step ``step``'s metrics ``m`` (empty when disabled or healthy).
        Updates the baselines and the healthy checkpoint when the step passes."""
        if not self.cfg.enabled:
            return []
        c, events = self.cfg, []
        just_loaded, self.loaded = self.loaded, None
        bad = [
            f"{k}={m[k]}"
            for k in ("train/loss", "train/grad_norm", "train/param_norm")
            if k in m and not math.isfinite(m[k])
        ]
        skipped = m.get("train/skipped_updates", 0)
        if bad or skipped:
            weights = not math.isfinite(m.get("train/param_norm", 0.0))
            self.skips_in_a_row += 1
            action = c.on_nonfinite
            why = ", ".join(bad) or f"{int(skipped)} update(s) with non-finite gradients"
            if action == "skip" and weights:
                action, why = "rollback", why + " (the weights themselves overflow)"
            elif action == "skip" and self.skips_in_a_row > c.max_consecutive_skips:
                action = "rollback"
                why += f" ({self.skips_in_a_row} skipped steps in a row)"
            if just_loaded is not None:
                why += self._nonfinite_after_load(just_loaded)
            events.append(Event("nonfinite", action, why, math.nan))
        else:
            self.skips_in_a_row = 0
            self.suspect = None  # finite again: whatever was loaded last trains

        def fire(rule: str, action: str, evidence: str, value: float) -> None:
            events.append(Event(rule, action, evidence, value))

        # "not x <= limit" rather than "x > limit": a NaN metric fires too.
        ent = m.get("train/entropy")
        if c.max_entropy_rise is not None and ent is not None and self.entropy:
            base = min(self.entropy)
            if not ent - base <= c.max_entropy_rise:
                fire(
                    "entropy",
                    c.on_entropy,
                    f"train/entropy {ent:.4g} rose {ent - base:.4g} above the minimum "
                    f"{base:.4g} of the last {len(self.entropy)} healthy steps "
                    f"(guard.max_entropy_rise={c.max_entropy_rise})",
                    ent,
                )
        mis = m.get("fp8/token_mult_prob_error")
        if c.max_mismatch is not None and mis is not None and not mis <= c.max_mismatch:
            fire(
                "mismatch",
                c.on_mismatch,
                f"fp8/token_mult_prob_error {mis:.4g} > guard.max_mismatch={c.max_mismatch}",
                mis,
            )
        rew = m.get("rollout/reward_mean")
        if c.reward_collapse_ratio is not None and rew is not None and self.reward:
            best = max(self.reward)
            if best > 0 and not rew >= c.reward_collapse_ratio * best:
                fire(
                    "reward",
                    c.on_reward,
                    f"rollout/reward_mean {rew:.4g} < guard.reward_collapse_ratio="
                    f"{c.reward_collapse_ratio} x {best:.4g} (best of the last "
                    f"{len(self.reward)} healthy steps)",
                    rew,
                )
        gar = m.get("rollout/garbled_frac")
        if c.max_garbled_frac is not None and gar is not None and not gar <= c.max_garbled_frac:
            fire(
                "garbled",
                c.on_garbled,
                f"rollout/garbled_frac {gar:.4g} > guard.max_garbled_frac={c.max_garbled_frac}",
                gar,
            )
        if m.get("calib/fallback") == 1.0:
            signs = sorted(
                k.removeprefix("calib/invariant_violated/")
                for k in m
                if k.startswith("calib/invariant_violated/")
            )
            shares = "; ".join(
                f"{s}: FP8 {m.get(f'calib/fp8_{s}_clipfrac_calibrated', math.nan):.4g} calibrated "
                f"vs BF16 {m.get(f'calib/bf16_{s}_clipfrac', math.nan):.4g} nominal"
                for s in signs
            )
            fire(
                "calib",
                c.on_calib,
                f"the calibrated clip bounds clipped {shares}, past loss.calib.invariant_tolerance;"
                " the updates after it clipped with the nominal bounds",
                1.0,
            )
        # A non-finite update concerns this step's update, and a calibration's fallback its clip
        # bounds; the policy measured here (the previous update's) passed if no other rule fired.
        if all(e.rule in ("nonfinite", "calib") for e in events):
            self._healthy(step, ent, rew)
        return events

    def _healthy(self, step: int, entropy: float | None, reward: float | None) -> None:
        if entropy is not None:
            self.entropy.append(entropy)
        if reward is not None:
            self.reward.append(reward)
        # The policy of every checkpoint written before this step was just measured healthy.
        vouched = [k for k in self.pending if k < step and k != self.distrusted]
        if vouched:
            self.healthy_checkpoint = max(vouched)
            self.pending = [k for k in self.pending if k >= step]
            if self.distrusted is not None and self.healthy_checkpoint > self.distrusted:
                self.distrusted = None  # the trajectory since then proved healthy

    def _nonfinite_after_load(self, step: int) -> str:
        """A non-finite first step after loading the step ``step`` checkpoint. Once may be the
        update's fault (a learning rate raised on resume); the same checkpoint again, after a
        rollback lowered the learning rate, is the checkpoint's: it is distrusted. Returns the
        words the event's evidence gains."""
        if self.suspect != step:
            self.suspect = step
            return ""
        self.distrusted = step
        self.pending = [k for k in self.pending if k != step]
        return (
            f", the second time right after loading the step {step} checkpoint: it is not "
            "healthy (damaged on disk? train.checkpoint_verify=full checks every byte)"
        )

    def loaded_from(self, step: int) -> None:
        """The weights were just loaded from the step ``step`` checkpoint (a resume or a
        rollback): the next step's check also judges that checkpoint's files."""
        self.loaded = step

    def first_suspect(self, step: int) -> int:
        """The first checkpoint step a rollback or stop at step ``step`` discards: everything
        after the last healthy checkpoint (step ``step - 1``'s and later when there is none),
        and a distrusted checkpoint with everything after it."""
        first = self.healthy_checkpoint + 1 if self.healthy_checkpoint is not None else step - 1
        return first if self.distrusted is None else min(first, self.distrusted)

    def saved(self, step: int) -> None:
        """A checkpoint of step ``step`` was written (vouched for once step + 1 passes)."""
        self.pending.append(step)

    def resolve(self, events: list[Event]) -> tuple[str | None, str]:
        """(action to take, why when it was escalated): a rollback with no healthy checkpoint or
        past ``max_rollbacks`` becomes a stop."""
        action = strongest(events)
        if action == "rollback":
            if self.healthy_checkpoint is None:
                return "stop", "no checkpoint has been verified healthy yet to roll back to"
            if self.rollbacks >= self.cfg.max_rollbacks:
                return "stop", f"guard.max_rollbacks={self.cfg.max_rollbacks} already used"
        return action, ""

    def rolled_back(self, step: int) -> None:
        """After a rollback to the step ``step`` checkpoint (``healthy_checkpoint``, or an older
        one when that was distrusted or damaged): the learning rate drops and the baselines
        restart (the replayed steps rebuild them)."""
        self.healthy_checkpoint = step
        if self.distrusted is not None and step < self.distrusted:
            self.distrusted = None  # discarded: a checkpoint of that step is a new one
        self.loaded_from(step)
        self.rollbacks += 1
        self.lr_scale *= self.cfg.rollback_lr_factor
        self.entropy.clear()
        self.reward.clear()
        self.skips_in_a_row = 0
        self.pending = []

    def bf16(self, step: int) -> bool:
        """Whether step ``step`` trains without FP8 (a bf16 action's steps)."""
        return step <= self.bf16_until

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "entropy": list(self.entropy),
            "reward": list(self.reward),
            "skips_in_a_row": self.skips_in_a_row,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "bf16_until": self.bf16_until,
            "pending": list(self.pending),
            "healthy_checkpoint": self.healthy_checkpoint,
            "distrusted": self.distrusted,
            "suspect": self.suspect,
        }

    def load_state_dict(self, state: dict) -> None:
        self.entropy.extend(state["entropy"])
        self.reward.extend(state["reward"])
        self.skips_in_a_row = state["skips_in_a_row"]
        self.rollbacks = state["rollbacks"]
        self.lr_scale = state["lr_scale"]
        self.bf16_until = state["bf16_until"]
        self.pending = list(state["pending"])
        self.healthy_checkpoint = state["healthy_checkpoint"]
        # Absent in checkpoints written before they existed.
        self.distrusted = state.get("distrusted")
        self.suspect = state.get("suspect")


def event_metrics(events: list[Event], action: str | None) -> dict[str, float]:
    """The ``guard/`` keys of a step's metrics line."""
    out = {"guard/events": float(len(events))}
    for e in events:
        out[f"guard/rule/{e.rule}"] = 1.0
    if action is not None:
        out[f"guard/action/{action}"] = 1.0
    return out
