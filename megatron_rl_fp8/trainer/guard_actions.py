"""What the stability guard's decisions do to the run (the rules themselves are ``guard.py``):
the driver checks a step's metrics, every rank receives the action and takes it together with
the others: BF16 steps, a recalibration, a rollback to the last healthy checkpoint with a lower
learning rate, or a stop that leaves no unhealthy checkpoint behind (docs/stability.md)."""

from __future__ import annotations

from megatron_rl_fp8.metrics.logger import MetricsLogger, print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
from megatron_rl_fp8.trainer.checkpointer import Checkpointer, iter_name
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.trainer.config import GuardConfig
from megatron_rl_fp8.trainer.engine_link import EngineLink
from megatron_rl_fp8.trainer.guard import GuardStop, StabilityGuard, event_metrics


class GuardActions:
    def __init__(
        self,
        cfg: GuardConfig,
        groups: Groups,
        guard: StabilityGuard,
        *,
        actor: Actor,
        calibrator: ClipCalibrator,
        checkpointer: Checkpointer,
        logger: MetricsLogger,
        engines: EngineLink,
    ):
        self.cfg, self.groups, self.guard = cfg, groups, guard
        self.actor, self.calibrator = actor, calibrator
        self.checkpointer, self.logger, self.engines = checkpointer, logger, engines
        self.pending_metrics: dict = {}  # guard/ keys of a rollback, for the next line written

    def check(self, step: int, metrics: dict) -> str | None:
        """Check step ``step``'s metrics (driver), agree on the action (every rank) and take it,
        except a rollback (:meth:`rollback`, which the loop calls). Returns the action (None when
        the step is healthy); a stop raises GuardStop."""
        is_driver = self.groups.is_driver
        decision = None
        if is_driver:
            events = self.guard.check(step, metrics)
            action, why = self.guard.resolve(events)
            decision = (events, action, why, self.guard.state_dict())
        events, action, why, state = broadcast_object(decision, self.groups.driver_rank)
        if not is_driver:
            self.guard.load_state_dict(state)
        if action is None:
            return None
        metrics.update(event_metrics(events, action))
        healthy = self.guard.healthy_checkpoint
        for e in events:
            print_rank0(f"guard: step {step}: {e.rule}: {e.evidence} -> {e.action}")
            self.logger.event(step, rule=e.rule, action=action, evidence=e.evidence)
        if why:
            print_rank0(f"guard: step {step}: {action} instead: {why}")
        if action == "stop":
            self.logger.log(step, metrics)
            left = self.discard_unhealthy(step)
            where = (
                f"the last healthy checkpoint, {iter_name(healthy)}"
                if healthy is not None and left == iter_name(healthy)
                else f"{left}, the newest checkpoint left"
                if left is not None
                else "scratch (no checkpoint was verified healthy)"
            )
            raise GuardStop(
                f"stopped at step {step}: {'; '.join(e.evidence for e in events)}"
                + (f" ({why})" if why else "")
                + f". A restart resumes from {where}; lower optim.lr or change the run first"
            )
        if action == "bf16":
            self.guard.bf16_until = step + self.cfg.bf16_steps
            print_rank0(f"guard: steps {step + 1}-{self.guard.bf16_until} train without FP8")
        elif action == "recalibrate":
            self.calibrator.request()
        return action

    def discard_unhealthy(self, step: int) -> str | None:
        """Remove checkpoints newer than the last healthy one, and a distrusted one (they may
        hold the damage), and point ``latest`` at the newest left, so no restart resumes from
        them. Returns the name ``latest`` now holds (None: no checkpoint left). Collective."""
        removed, left = self.checkpointer.discard_from(self.guard.first_suspect(step))
        if removed:
            print_rank0(f"guard: removed checkpoints that may hold the damage: {removed}")
        return left

    def rollback(self, failed: int, metrics: dict) -> int:
        """Back to the last healthy checkpoint with a lower learning rate; returns its step.
        The guard keeps its own state (the rollback count). Collective."""
        self.discard_unhealthy(failed)
        # `latest` now names the healthy checkpoint (a damaged one falls back to an older one).
        restored = self.checkpointer.restore(skip=("guard",))
        if restored is None:
            raise GuardStop(
                f"stopped at step {failed}: no checkpoint is left to roll back to (the newest "
                "ones were distrusted or damaged). A restart begins from scratch; check "
                f"{self.checkpointer.root} and the storage first"
            )
        path, state = restored
        step = state["step"]
        self.guard.rolled_back(step)
        self.actor.set_lr_scale(self.guard.lr_scale)
        # The replayed steps rewrite these lines; the event stays in guard_events.jsonl and in
        # the next line written (the first replayed step).
        self.logger.truncate_after(step)
        self.pending_metrics = {
            **{k: v for k, v in metrics.items() if k.startswith("guard/")},
            "guard/rolled_back_from": float(failed),
            "guard/lr_scale": self.guard.lr_scale,
        }
        print_rank0(
            f"guard: rolled back from step {failed} to {path.name} (rollback "
            f"{self.guard.rollbacks} of {self.cfg.max_rollbacks}); learning rate now "
            f"{self.actor.lr:.4g} (the schedule's, times {self.guard.lr_scale:.4g})"
        )
        self.engines.sync(version=step)
        return step

    def take_pending_metrics(self) -> dict:
        out, self.pending_metrics = self.pending_metrics, {}
        return out
