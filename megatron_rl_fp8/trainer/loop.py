"""The RL loop: the order of the phases, each a call into the module that owns it.

    rollout + reward (sampling.py)  -> GRPO/DAPO advantages (loss/)  -> batch (batch.py)
    -> old logprobs + clipped policy updates, calibrated under FP8 (update.py, calibrator.py)
    -> weight sync Megatron -> HF -> engine (engine_link.py, sync/)  -> evaluation  -> metrics
    -> checkpoint

Roles: global rank 0 is the *driver*: it owns the rollout engine and the logs. It builds the
rollout batch and scatters each data-parallel rank its slice of rows, as tensors. Before the first
step: resume from the run's own checkpoint, or the SFT warm start (warm_start.py). New phases
(a stability guard, a reference model, asynchronous rollout) are a module each and one line here.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl_fp8 import parallel
from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import ConfigError, to_dict
from megatron_rl_fp8.data import build_datasets, load_prompt_encoder
from megatron_rl_fp8.data.prompts import check_vocab
from megatron_rl_fp8.loss import grpo_advantages
from megatron_rl_fp8.metrics.console import print_step, progress_bar
from megatron_rl_fp8.metrics.logger import MetricsLogger, print_rank0
from megatron_rl_fp8.metrics.step_time import StepClock
from megatron_rl_fp8.models.fp8 import weight_quantization_errors
from megatron_rl_fp8.models.hf_mapping import hf_config_with_tokens
from megatron_rl_fp8.models.pretrained import load_converted, load_hf_weights
from megatron_rl_fp8.rollout import build_engine
from megatron_rl_fp8.trainer import checkpoint, run_dir
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.batch import build_rl_batch, order_for_updates
from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
from megatron_rl_fp8.trainer.collectives import broadcast_object, scatter_rows
from megatron_rl_fp8.trainer.engine_link import EngineLink
from megatron_rl_fp8.trainer.guard import GuardStop, StabilityGuard, event_metrics
from megatron_rl_fp8.trainer.offload import TrainerOffload
from megatron_rl_fp8.trainer.preemption import PreemptionSignal
from megatron_rl_fp8.trainer.reference import Reference
from megatron_rl_fp8.trainer.sampling import Sampler
from megatron_rl_fp8.trainer.update import PolicyUpdate
from megatron_rl_fp8.trainer.warm_start import warm_start


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.groups = parallel.initialize(cfg.parallel, seed=cfg.train.seed)
        cfg.validate(dist.get_world_size())
        self.is_driver = self.groups.is_driver
        self.out_dir = Path(cfg.train.output_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        # One writer per run directory, writable paths: checked on every rank before any compute,
        # and refused on all ranks together (one gather) so none is left waiting in a collective.
        self.lock, problem = run_dir.prepare(cfg, is_driver=self.is_driver, rank=dist.get_rank())
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            if self.lock is not None:
                self.lock.release()
            raise ConfigError(next(p for p in problems if p))
        if self.lock is not None and self.lock.previous:
            who = self.lock.previous
            print_rank0(
                f"run directory: taking over from pid {who.get('pid')} on {who.get('host')}, "
                "which ended without releasing it"
            )
        try:
            self._build(cfg)
        except BaseException:
            if self.lock is not None:  # a refused start leaves the directory free
                self.lock.release()
            raise

    def _build(self, cfg: RunConfig) -> None:
        # Tokenizer and every prompt are checked before any weight exists (one-line errors).
        self.tokenizer = load_prompt_encoder(cfg.tokenizer, hf_checkpoint=cfg.model.hf_checkpoint)
        check_vocab(self.tokenizer, cfg.model.vocab_size)
        self.train_data, self.val_data, dropped = build_datasets(cfg.task, self.tokenizer)
        if any(dropped.values()):
            print_rank0(
                f"data: dropped {dropped['train']} train and {dropped['val']} val prompts longer "
                f"than task.max_prompt_len={cfg.task.max_prompt_len} tokens"
            )
        # A pretrained start loads every weight, so Megatron's random init is skipped.
        self.actor = Actor(
            cfg.model,
            cfg.optim,
            self.groups,
            fp8=cfg.fp8,
            memory=cfg.memory,
            parallel=cfg.parallel,
            init_weights=not cfg.model.pretrained,
            total_steps=cfg.train.steps * cfg.train.updates_per_step,
        )
        print_rank0(f"actor: {self.actor.describe()}")
        self.calibrator = ClipCalibrator(cfg.loss, fp8_training=cfg.fp8.enabled)
        # The frozen reference of the KL penalty exists only when the penalty is on.
        self.reference = Reference(self.actor) if cfg.loss.kl_coef > 0 else None
        self.policy_update = PolicyUpdate(
            cfg, self.actor, self.groups, self.calibrator, self.reference
        )
        self.engine = None
        # Colocated: the trainer's state waits in host memory while the engines generate.
        self.offload = (
            TrainerOffload(self.actor, self.reference, keep_grads=False)
            if cfg.rollout.placement == "colocated" and cfg.rollout.offload_trainer
            else None
        )
        if self.is_driver:
            tok = self.tokenizer
            self.engine = build_engine(
                cfg.rollout,
                hf_config_with_tokens(cfg.model, tok),
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_ids,
                output_dir=str(self.out_dir),
                device=self.groups.device,
                dtype=self.actor.config.params_dtype,
                pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
            )
        self.engines = EngineLink(cfg, self.groups, self.actor, self.engine, self.offload)
        self.sampler = Sampler(
            cfg, self.groups, self.engine, self.tokenizer, self.train_data, self.val_data
        )
        self.logger = MetricsLogger(
            self.out_dir, cfg.logging, enabled=self.is_driver, run_config=to_dict(cfg)
        )
        # Every rank holds the guard's state; the driver decides and broadcasts (it has the metrics).
        self.guard = StabilityGuard(cfg.guard)
        self.pending_metrics: dict = {}  # guard/ keys of a rollback, for the next line written
        self.restored_state: dict | None = None
        self.step = 0
        # Throughput per useful update over this process's RL steps (rollbacks included).
        self.useful_tokens = 0.0
        self.started = 0.0
        self.clock = StepClock()  # the step windows of the perf/ breakdown (metrics/step_time.py)

    def fp8_weight_errors(self) -> dict:
        """Per-layer relative FP8 quantization error of the actor's weights (collective; the
        driver gets every stage's layers; tensor-parallel rank 0's shards stand for the layer)."""
        if not self.cfg.fp8.enabled:
            return {}
        g = self.groups
        mine = {}
        if g.dp_rank == 0 and g.cp_rank == 0 and g.tp_rank == 0:
            mine = weight_quantization_errors(self.actor.module, self.cfg.fp8)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {f"fp8/weight_qerr/{k}": v for d in everyone for k, v in d.items()}
        if merged:
            merged["fp8/weight_qerr_mean"] = sum(merged.values()) / len(merged)
        return merged if self.is_driver else {}

    def evaluate(self) -> dict:
        """Greedy decoding on held-out prompts (driver) and FP8 weight-error diagnostics.
        Colocated engines keep their weights after it: the next rollout needs them, and no
        update comes in between."""
        fp8_errors = self.fp8_weight_errors()
        scores = self.engines.generation(self.sampler.evaluate, release=("kv_cache",))
        return {**scores, **fp8_errors} if self.is_driver else {}

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> None:
        if not math.isfinite(self.policy_update.param_norm):
            # Reached only with guard.enabled=false: a checkpoint nobody can resume from is worse
            # than none (the previous one stays latest).
            raise RuntimeError(
                f"refusing to write the step {self.step} checkpoint: the weights are not finite "
                f"(train/param_norm={self.policy_update.param_norm}); turn on the guard "
                "(guard.enabled=true) or lower optim.lr"
            )
        state = {
            "step": self.step,
            "train_data": self.train_data.state_dict(),
            "calib": self.calibrator.state_dict(),
            "opt_param_scheduler": self.actor.lr_schedule_state_dict(),
            "guard": self.guard.state_dict(),
        }
        checkpoint.save(
            self.ckpt_root,
            f"iter_{self.step:07d}",
            self.actor.sharded_state_dict(with_optimizer=True),
            state,
            rank_state=self.actor.rank_state(),
        )
        self.guard.saved(self.step)
        if self.is_driver:
            keep = [] if self.guard.healthy_checkpoint is None else [self.guard.healthy_checkpoint]
            checkpoint.prune(
                self.ckpt_root,
                keep=self.cfg.train.keep_checkpoints,
                protect=[f"iter_{k:07d}" for k in keep],
            )

    def try_resume(self) -> bool:
        path = self._load_newest_intact()
        if path is None:
            return False
        if "guard" in self.restored_state:
            self.guard.load_state_dict(self.restored_state["guard"])
            self.actor.set_lr_scale(self.guard.lr_scale)
        # This checkpoint is vouched for once the next step passes the guard.
        self.guard.saved(self.step)
        self.guard.loaded_from(self.step)
        print_rank0(f"resumed from {path} at step {self.step}")
        return True

    def _load_newest_intact(self) -> Path | None:
        """Restore the newest checkpoint that verifies against its manifest and loads (a damaged
        one is named in one line and an older one tried). Collective."""
        found = checkpoint.load_newest_intact(
            self.ckpt_root,
            lambda: self.actor.sharded_state_dict(with_optimizer=True, is_loading=True),
            verify=self.cfg.train.checkpoint_verify,
            required={"step": int, "train_data": dict},
        )
        if found is None:
            return None
        path, loaded, state = found
        self._apply_restored(loaded, state)
        return path

    def _apply_restored(self, loaded: dict, state: dict) -> None:
        self.actor.load_sharded(loaded)
        self.actor.load_rank_state(loaded.get(checkpoint.RANK_STATE))
        self.step = state["step"]
        self.train_data.load_state_dict(state["train_data"])
        if "calib" in state:
            self.calibrator.load_state_dict(state["calib"])
        # Absent in checkpoints written before lr schedules existed: the schedule starts at step 0.
        if "opt_param_scheduler" in state:
            self.actor.load_lr_schedule_state_dict(state["opt_param_scheduler"])
        self.restored_state = state

    # -- the stability guard ---------------------------------------------------------------------
    def guard_step(self, metrics: dict) -> str | None:
        """Check this step's metrics (driver), agree on the action (every rank) and take it.
        Returns the action taken (None when the step is healthy); a stop raises GuardStop."""
        decision = None
        if self.is_driver:
            events = self.guard.check(self.step, metrics)
            action, why = self.guard.resolve(events)
            decision = (events, action, why, self.guard.state_dict())
        events, action, why, state = broadcast_object(decision, self.groups.driver_rank)
        if not self.is_driver:
            self.guard.load_state_dict(state)
        if action is None:
            return None
        metrics.update(event_metrics(events, action))
        healthy = self.guard.healthy_checkpoint
        for e in events:
            print_rank0(f"guard: step {self.step}: {e.rule}: {e.evidence} -> {e.action}")
            self.logger.event(self.step, rule=e.rule, action=action, evidence=e.evidence)
        if why:
            print_rank0(f"guard: step {self.step}: {action} instead: {why}")
        if action == "stop":
            self.logger.log(self.step, metrics)
            left = self._discard_unhealthy_checkpoints()
            where = (
                f"the last healthy checkpoint, iter_{healthy:07d}"
                if healthy is not None and left == f"iter_{healthy:07d}"
                else f"{left}, the newest checkpoint left"
                if left is not None
                else "scratch (no checkpoint was verified healthy)"
            )
            raise GuardStop(
                f"stopped at step {self.step}: {'; '.join(e.evidence for e in events)}"
                + (f" ({why})" if why else "")
                + f". A restart resumes from {where}; lower optim.lr or change the run first"
            )
        if action == "rollback":
            self.rollback(metrics)
        elif action == "bf16":
            self.guard.bf16_until = self.step + self.cfg.guard.bf16_steps
            print_rank0(f"guard: steps {self.step + 1}-{self.guard.bf16_until} train without FP8")
        elif action == "recalibrate":
            self.calibrator.request()
        return action

    def _discard_unhealthy_checkpoints(self) -> str | None:
        """Remove checkpoints newer than the last healthy one, and a distrusted one (they may
        hold the damage), and point ``latest`` at the newest left, so no restart resumes from
        them. Returns the name ``latest`` now holds (None: no checkpoint left). Collective."""
        left = None
        if self.is_driver:
            removed = checkpoint.discard_from(self.ckpt_root, self.guard.first_suspect(self.step))
            if removed:
                print_rank0(f"guard: removed checkpoints that may hold the damage: {removed}")
            left = checkpoint.latest_name(self.ckpt_root)
        return broadcast_object(left, self.groups.driver_rank)

    def rollback(self, metrics: dict) -> None:
        """Back to the last healthy checkpoint with a lower learning rate. Collective."""
        failed = self.step
        self._discard_unhealthy_checkpoints()
        # `latest` now names the healthy checkpoint (a damaged one falls back to an older one).
        path = self._load_newest_intact()
        if path is None:
            raise GuardStop(
                f"stopped at step {failed}: no checkpoint is left to roll back to (the newest "
                "ones were distrusted or damaged). A restart begins from scratch; check "
                f"{self.ckpt_root} and the storage first"
            )
        self.guard.rolled_back(self.step)
        self.actor.set_lr_scale(self.guard.lr_scale)
        # The replayed steps rewrite these lines; the event stays in guard_events.jsonl and in
        # the next line written (the first replayed step).
        self.logger.truncate_after(self.step)
        self.pending_metrics = {
            **{k: v for k, v in metrics.items() if k.startswith("guard/")},
            "guard/rolled_back_from": float(failed),
            "guard/lr_scale": self.guard.lr_scale,
        }
        print_rank0(
            f"guard: rolled back from step {failed} to {path.name} (rollback "
            f"{self.guard.rollbacks} of {self.cfg.guard.max_rollbacks}); learning rate now "
            f"{self.actor.lr:.4g} (the schedule's, times {self.guard.lr_scale:.4g})"
        )
        self.engines.sync(version=self.step)

    def load_start_weights(self) -> None:
        """A fresh run's weights: ``model.load`` (converted) or ``model.hf_checkpoint``, else the
        random init already there. Collective over all ranks."""
        m, g = self.cfg.model, self.groups
        if m.load is not None:
            path = load_converted(self.actor, m.load)
            print_rank0(f"start weights: {path} (converted checkpoint)")
        elif m.hf_checkpoint is not None:
            t0 = time.perf_counter()
            n = load_hf_weights(
                self.actor.module, m.hf_checkpoint, m, tp_rank=g.tp_rank, tp_size=g.tp_size
            )
            self.actor.params_changed()
            dist.barrier()
            print_rank0(
                f"start weights: {m.hf_checkpoint} ({n} tensors on rank 0, "
                f"{time.perf_counter() - t0:.1f} s)"
            )

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> bool:
        """Resume or start, then train to ``train.steps``. Returns True when it stopped early on
        a preemption signal, after writing a checkpoint (``trainer/preemption.py``)."""
        cfg = self.cfg
        if self.is_driver:
            run_dir.report_changed_settings(self.out_dir, to_dict(cfg))
        resumed = self.try_resume()  # a refused resume keeps the config.yaml of the checkpoints
        if self.is_driver:
            run_dir.save_config(self.out_dir, cfg.to_yaml())
        # Lines past the restored step are replayed by this run; drop them so none is duplicated.
        self.logger.truncate_after(self.step if resumed else -1)
        if not resumed:
            self.load_start_weights()
            first = warm_start(
                self.cfg, self.actor, self.groups, self.tokenizer, self.train_data.records
            )
            self.engines.sync(version=0)
            first.update(self.evaluate())
            self.logger.log(0, first)
            if self.is_driver:
                print_step(0, first)
        else:
            self.engines.sync(version=self.step)
        if self.reference is not None:  # the RL-start policy, known only now
            self.reference.load_weights(cfg, self.actor, resumed=resumed)

        progress = progress_bar(self.is_driver, cfg.train.steps, self.step)
        self.started = time.perf_counter()  # throughput counts RL steps, not the warm start
        self.clock = StepClock()  # the first step's window opens here
        preemption = PreemptionSignal(self.groups.device)
        try:
            steps_this_run = 0
            while self.step < cfg.train.steps:
                self.step += 1
                metrics = self.rl_step()
                steps_this_run += 1
                if metrics is None:  # rolled back: the replayed steps count again
                    progress.n = self.step
                    progress.refresh()
                    continue
                if self.is_driver:
                    self.clock.finish(metrics)  # step time, other, running means
                self.logger.log(self.step, metrics)
                if self.is_driver:
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")
                    if self.step % cfg.train.log_interval == 0:
                        print_step(self.step, metrics, progress)
                saved = (
                    cfg.train.save_interval and self.step % cfg.train.save_interval == 0
                ) or self.step == cfg.train.steps
                if saved:
                    t_save = time.perf_counter()
                    self.save()
                    # In the next line's window: this step's line is already written (it comes
                    # first, so a crash during the save loses no line).
                    self.clock.add("perf/checkpoint_time_s", time.perf_counter() - t_save)
                if self.step < cfg.train.steps and preemption.requested():
                    if not saved:
                        self.save()
                    # No rank may exit before every rank's part is on disk: the launcher kills
                    # the others as soon as one exits.
                    dist.barrier()
                    print_rank0(
                        f"preemption: stopped after step {self.step} with its checkpoint; a run "
                        "in the same train.output_dir resumes from it"
                    )
                    return True
                if (
                    cfg.train.exit_after_steps is not None
                    and steps_this_run >= cfg.train.exit_after_steps
                ):
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
        completions, rewards, rollout_stats = self.engines.generation(
            lambda: self.sampler.rollout(self.step), release=("weights", "kv_cache")
        )
        batch = None
        if self.is_driver:
            advantages = grpo_advantages(
                rewards, cfg.rollout.n_samples_per_prompt, norm_std=cfg.loss.norm_adv_by_std
            )
            batch = order_for_updates(
                build_rl_batch(completions, advantages, pad_id=self.tokenizer.pad_token_id),
                self.groups.dp_size,
                cfg.train.updates_per_step,
            )
        self.policy_update.bf16 = self.guard.bf16(self.step)
        metrics = self.policy_update(scatter_rows(batch, self.groups), self.step)
        if self.is_driver:
            metrics.update(rollout_stats)
            if self.offload is not None:
                metrics.update(self.offload.metrics())
        if self.guard_step(metrics) == "rollback":
            return None
        sync_time = self.engines.sync(version=self.step)
        if self.is_driver:
            metrics.update(self.pending_metrics)
            self.pending_metrics = {}
            metrics["perf/sync_time_s"] = sync_time
            metrics.update(self.engines.times.metrics())
            # Tokens that carried gradient per second of the training phases (rollout to sync:
            # evaluations and checkpoints excluded), and of this process's run (time lost to
            # rolled-back steps and dynamic-sampling refills counts against it).
            self.useful_tokens += metrics["perf/useful_tokens"]
            metrics["perf/useful_tokens_per_s"] = metrics["perf/useful_tokens"] / (
                time.perf_counter() - t0
            )
            elapsed = time.perf_counter() - self.started
            metrics["perf/useful_tokens_per_s_run"] = self.useful_tokens / elapsed
        if (
            cfg.train.eval_interval
            and self.step % cfg.train.eval_interval == 0
            or self.step == cfg.train.steps
        ):
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
