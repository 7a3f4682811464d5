"""The RL loop: the order of the phases, each a call into the component that owns it.

    rollout + reward (sampling.py; pipeline.py: one_step_off generates beside the update)
    -> GRPO/DAPO advantages (loss/)  -> batch (batch.py)
    -> old logprobs + clipped policy updates, calibrated under FP8 (update.py, calibrator.py)
    -> the stability guard (guard.py rules, guard_actions.py actions)
    -> weight sync Megatron -> HF -> engine (engine_link.py, sync/)  -> evaluation  -> metrics
    -> checkpoint (checkpointer.py)

Global rank 0 is the *driver*: it owns the rollout engine and the logs, builds the rollout batch
and scatters each data-parallel rank its rows. Before the first step: startup.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl_fp8 import parallel
from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import to_dict
from megatron_rl_fp8.metrics.console import StepProgress
from megatron_rl_fp8.metrics.logger import MetricsLogger
from megatron_rl_fp8.metrics.step_time import StepClock, Throughput
from megatron_rl_fp8.models.fp8 import gather_weight_quantization_errors
from megatron_rl_fp8.trainer import run_dir, startup
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.batch import rollout_batch
from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
from megatron_rl_fp8.trainer.checkpointer import Checkpointer, StateOf
from megatron_rl_fp8.trainer.collectives import scatter_rows
from megatron_rl_fp8.trainer.engine_link import EngineLink
from megatron_rl_fp8.trainer.guard import StabilityGuard
from megatron_rl_fp8.trainer.guard_actions import GuardActions
from megatron_rl_fp8.trainer.offload import TrainerOffload
from megatron_rl_fp8.trainer.pipeline import RolloutPipeline
from megatron_rl_fp8.trainer.preemption import PreemptionSignal
from megatron_rl_fp8.trainer.reference import Reference
from megatron_rl_fp8.trainer.sampling import Sampler
from megatron_rl_fp8.trainer.update import PolicyUpdate


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        # The random init belongs to the warm start (the base policy): sft.seed seeds it.
        self.groups = g = parallel.initialize(cfg.parallel, seed=cfg.sft.seed)
        cfg.validate(dist.get_world_size())
        self.is_driver = g.is_driver
        self.out_dir = Path(cfg.train.output_dir)
        self.lock = run_dir.claim(cfg, g)
        try:
            self._build(cfg, g)
        except BaseException:
            if self.lock is not None:  # a refused start leaves the directory free
                self.lock.release()
            raise

    def _build(self, cfg: RunConfig, g: parallel.Groups) -> None:
        self.tokenizer, self.train_data, self.val_data = startup.load_prompts(cfg)
        # A pretrained start loads every weight, so Megatron's random init is skipped.
        self.actor = actor = Actor(
            cfg.model,
            cfg.optim,
            g,
            fp8=cfg.fp8,
            memory=cfg.memory,
            parallel=cfg.parallel,
            init_weights=not cfg.model.pretrained,
            total_steps=cfg.train.steps * cfg.train.updates_per_step,
            routing_replay=cfg.rollout.routing_replay,
        )
        startup.describe_actor(cfg, actor)
        self.calibrator = ClipCalibrator(cfg.loss, fp8_training=cfg.fp8.enabled)
        # The frozen reference of the KL penalty exists only when the penalty is on.
        self.reference = Reference(actor) if cfg.loss.kl_coef > 0 else None
        self.policy_update = PolicyUpdate(cfg, actor, g, self.calibrator, self.reference)
        # Colocated: the trainer's state waits in host memory while the engines generate.
        self.offload = None
        if cfg.rollout.placement == "colocated" and cfg.rollout.offload_trainer:
            self.offload = TrainerOffload(actor, self.reference, keep_grads=False)
        self.engine = startup.rollout_engine(cfg, self.tokenizer, actor, g, str(self.out_dir))
        self.engines = EngineLink(cfg, g, actor, self.engine, self.offload)
        self.sampler = Sampler(cfg, g, self.engine, self.tokenizer, self.train_data, self.val_data)
        self.pipeline = RolloutPipeline(cfg, g, self.sampler, self.engines)
        self.logger = MetricsLogger(
            self.out_dir, cfg.logging, enabled=self.is_driver, run_config=to_dict(cfg)
        )
        # Every rank holds the guard's state; the driver decides and broadcasts (it has the metrics).
        self.guard = StabilityGuard(cfg.guard)
        lr_schedule = StateOf(actor.lr_schedule_state_dict, actor.load_lr_schedule_state_dict)
        self.checkpointer = Checkpointer.for_run(
            cfg.train,
            g,
            actor,
            rank_components={"rollout": self.pipeline},
            train_data=self.train_data,
            calib=self.calibrator,
            opt_param_scheduler=lr_schedule,
            guard=self.guard,
        )
        self.guard_actions = GuardActions(
            cfg.guard,
            g,
            self.guard,
            actor=actor,
            calibrator=self.calibrator,
            checkpointer=self.checkpointer,
            logger=self.logger,
            engines=self.engines,
        )
        self.step = 0
        self.clock = StepClock()  # the step windows of the perf/ breakdown (metrics/step_time.py)

    def evaluate(self) -> dict:
        """Greedy decoding on held-out prompts (driver) and FP8 weight-error diagnostics.
        Colocated engines keep their weights after it: the next rollout needs them, and no
        update comes in between."""
        errors = gather_weight_quantization_errors(self.actor.module, self.cfg.fp8, self.groups)
        scores = self.engines.generation(self.sampler.evaluate, release=("kv_cache",))
        return {**scores, **errors} if self.is_driver else {}

    def save(self) -> None:
        healthy = self.guard.healthy_checkpoint
        self.checkpointer.save(
            self.step,
            param_norm=self.policy_update.param_norm,
            protect=[] if healthy is None else [healthy],
        )
        self.guard.saved(self.step)

    def run(self) -> bool:
        """Resume or start, then train to ``train.steps``. Returns True when it stopped early on
        a preemption signal, after writing a checkpoint (``trainer/preemption.py``)."""
        t = self.cfg.train
        startup.resume_or_start(self)
        progress = StepProgress(self.is_driver, t.steps, self.step, t.log_interval)
        self.throughput = Throughput()  # counts RL steps, not the warm start
        self.clock = StepClock()  # the first step's window opens here
        preemption = PreemptionSignal(self.groups.device)
        try:
            steps_this_run = 0
            while self.step < t.steps:
                self.step += 1
                metrics = self.rl_step()
                steps_this_run += 1
                if metrics is None:  # rolled back: the replayed steps count again
                    progress.rewound(self.step)
                    continue
                if self.is_driver:
                    self.clock.finish(metrics)  # step time, other, running means
                self.logger.log(self.step, metrics)
                progress.done(self.step, metrics)
                saved = (
                    t.save_interval and self.step % t.save_interval == 0
                ) or self.step == t.steps
                if saved:
                    t_save = time.perf_counter()
                    self.save()
                    # In the next line's window: this step's line is already written (it comes
                    # first, so a crash during the save loses no line).
                    self.clock.add("perf/checkpoint_time_s", time.perf_counter() - t_save)
                if self.step < t.steps and preemption.requested():
                    if not saved:
                        self.save()
                    preemption.stopped(self.step)
                    return True
                if t.exit_after_steps is not None and steps_this_run >= t.exit_after_steps:
                    break
        finally:
            # Before any error reaches the console: the bar would share its line.
            progress.close()
            preemption.close()
        return False

    def rl_step(self) -> dict | None:
        """RL step ``self.step``: rollout, advantages, update, guard, sync, evaluation. Returns
        its metrics (driver; ``{}`` elsewhere), or None when the guard rolled back."""
        cfg = self.cfg
        t0 = time.perf_counter()
        completions, rewards, rollout_stats = self.pipeline.take(self.step)
        self.pipeline.launch(self.step + 1)  # one_step_off: generated beside this update
        batch = None
        if self.is_driver:
            lags, dp = self.pipeline.lags(completions), self.groups.dp_size
            batch = rollout_batch(cfg, completions, rewards, lags, dp, self.tokenizer)
        self.policy_update.bf16 = self.guard.bf16(self.step)
        metrics = self.policy_update(scatter_rows(batch, self.groups), self.step)
        if self.is_driver:
            metrics.update(rollout_stats)
            if self.offload is not None:
                metrics.update(self.offload.metrics())
        if self.guard_actions.check(self.step, metrics) == "rollback":
            self.pipeline.drop()
            self.step = self.guard_actions.rollback(self.step, metrics)
            return None
        self.pipeline.finish(metrics)  # no sync lands while the engines generate
        sync_time = self.engines.sync(version=self.step)
        if self.is_driver:
            metrics.update(self.guard_actions.take_pending_metrics())
            metrics["perf/sync_time_s"] = sync_time
            metrics.update(self.engines.times.metrics())
            self.throughput.add(metrics, t0)
        every = cfg.train.eval_interval
        if every and self.step % every == 0 or self.step == cfg.train.steps:
            t_eval = time.perf_counter()
            metrics.update(self.evaluate())
            if self.is_driver:
                metrics["perf/eval_time_s"] = time.perf_counter() - t_eval
        # perf/step_time_s and the rest of the breakdown: run() (metrics/step_time.py).
        return metrics

    def close(self) -> None:
        self.sampler.close()
        self.engines.close()
        if self.lock is not None:
            self.lock.release()
        self.logger.close()
