"""The RL loop. One step reads as its phases; each phase is a call into the module that owns it:

    rollout (driver rank, engine)  -> reward (verifiers)  -> GRPO advantages (loss/)
    -> old logprobs (actor)        -> clipped policy update (actor + loss/)
    -> weight sync Megatron -> HF -> engine (sync/)  -> metrics (metrics/)  -> checkpoint

Roles: global rank 0 is the *driver*: it owns the rollout engine (standing in for a rollout server)
and the logs. The rollout batch is broadcast to every rank; each data-parallel rank trains on its
contiguous slice of rows, with losses normalised by the token count of the whole mini-batch, so the
update does not depend on how the batch is split (TP=2 or DP=2 give the 1-rank loss).
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8 import parallel
from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import to_dict
from megatron_rl_fp8.data import (
    PromptDataset,
    build_datasets,
    collate,
    load_tokenizer,
    prompt_token_ids,
    sft_examples,
)
from megatron_rl_fp8.loss import (
    calibrated_clip_bounds,
    dynamic_sampling_keep_mask,
    ema_bounds,
    grpo_advantages,
    overlong_reward_penalty,
    policy_loss,
)
from megatron_rl_fp8.metrics.logger import MetricsLogger, atomic_write_text, print_rank0
from megatron_rl_fp8.models.fp8 import weight_quantization_errors
from megatron_rl_fp8.reward.verifiers import compute_rewards
from megatron_rl_fp8.rollout import build_engine
from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.sync.gather import iter_full_params
from megatron_rl_fp8.sync.hf_mapping import hf_config, mcore_state_to_hf
from megatron_rl_fp8.sync.quantize import quantize_for_rollout
from megatron_rl_fp8.trainer import checkpoint
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.batch import (
    build_rl_batch,
    build_sft_batch,
    order_for_updates,
    rows_for_rank,
)

# Metrics that are reduced with max/min instead of a token-weighted mean.
_MAX_KEYS = ("ratio_max",)
_MIN_KEYS = ("ratio_min",)


def _broadcast_object(obj, src: int):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.groups = parallel.initialize(cfg.parallel, seed=cfg.train.seed)
        cfg.validate(dist.get_world_size())
        self.rank = dist.get_rank()
        self.is_driver = self.rank == self.groups.driver_rank
        self.out_dir = Path(cfg.train.output_dir)
        self.ckpt_root = self.out_dir / "checkpoints"

        self.tokenizer = load_tokenizer()
        if cfg.model.vocab_size < len(self.tokenizer):
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                             f"tokenizer's {len(self.tokenizer)} tokens")
        self.train_data, self.val_data = build_datasets(cfg.task)
        self.actor = Actor(cfg.model, cfg.optim, self.groups, fp8=cfg.fp8)
        print_rank0(f"actor: {self.actor.describe()}")
        # Clip bounds in use: nominal until the first calibration, then the EMA of calibrations.
        self.calib = {"lower": 1.0 - cfg.loss.eps_low, "upper": 1.0 + cfg.loss.eps_high, "count": 0}
        self.engine = None
        if self.is_driver:
            tok = self.tokenizer
            self.engine = build_engine(
                cfg.rollout,
                hf_config(cfg.model, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id),
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                output_dir=str(self.out_dir), device=self.groups.device,
                dtype=self.actor.config.params_dtype,
            )
        self.logger = MetricsLogger(self.out_dir, enabled=self.is_driver)
        self.step = 0

    # -- phases ----------------------------------------------------------------------------------
    def _prompt_ids(self, records) -> list[list[int]]:
        return [prompt_token_ids(self.tokenizer, r["prompt"], max_prompt_len=self.cfg.task.max_prompt_len)
                for r in records]

    def _decode(self, c: Completion) -> str:
        ids = [t for t in c.response_ids if t != self.tokenizer.eos_token_id]
        return self.tokenizer.decode(ids)

    def _sample_round(self, records, step: int, round_: int):
        """One rollout round on the driver: completions and (shaped) rewards for ``records``."""
        r, loss_cfg = self.cfg.rollout, self.cfg.loss
        completions = self.engine.generate(
            self._prompt_ids(records), n=r.n_samples_per_prompt, max_new_tokens=r.max_new_tokens,
            temperature=r.temperature, top_p=r.top_p, seed=r.seed + step + round_ * 1_000_003,
        )
        answers = [rec["answer"] for rec in records for _ in range(r.n_samples_per_prompt)]
        rewards = compute_rewards(self.cfg.task.name, [self._decode(c) for c in completions],
                                  answers, format_weight=self.cfg.reward.format_weight)
        if loss_cfg.overlong_buffer:
            lengths = torch.tensor([len(c.response_ids) for c in completions])
            rewards = rewards + overlong_reward_penalty(
                lengths, r.max_new_tokens, loss_cfg.overlong_buffer, loss_cfg.overlong_penalty)
        return completions, rewards

    def rollout(self, step: int) -> tuple[list[Completion], torch.Tensor, dict]:
        """Sample on the driver, score, and broadcast (completions, rewards) to every rank.

        With DAPO dynamic sampling, groups whose rewards are all equal are dropped and more prompts
        are sampled (up to ``loss.max_sampling_rounds`` rounds) until ``prompts_per_step`` groups
        remain; the driver's dataset position is then shared so every rank stays in step.
        """
        r, loss_cfg = self.cfg.rollout, self.cfg.loss
        n, want = r.n_samples_per_prompt, self.cfg.train.prompts_per_step
        payload = None
        if self.is_driver:
            t0 = time.perf_counter()
            kept, dropped, all_rewards, all_completions = [], [], [], []
            rounds = 0
            while rounds < (loss_cfg.max_sampling_rounds if loss_cfg.dynamic_sampling else 1):
                completions, rewards = self._sample_round(
                    self.train_data.next_batch(want), step, rounds)
                rounds += 1
                all_rewards.append(rewards)
                all_completions += completions
                keep = (dynamic_sampling_keep_mask(rewards, n) if loss_cfg.dynamic_sampling
                        else torch.ones(want, dtype=torch.bool))
                for gi in range(want):
                    group = (completions[gi * n:(gi + 1) * n], rewards[gi * n:(gi + 1) * n])
                    (kept if keep[gi] else dropped).append(group)
                if len(kept) >= want:
                    break
            filled = max(0, want - len(kept))
            groups = (kept + dropped[:filled])[:want]
            completions = [c for g in groups for c in g[0]]
            rewards = torch.cat([g[1] for g in groups])
            sampled = torch.cat(all_rewards)
            lengths = torch.tensor([len(c.response_ids) for c in all_completions], dtype=torch.float32)
            stats = {
                "rollout/reward_mean": sampled.mean().item(),
                "rollout/response_len_mean": lengths.mean().item(),
                "rollout/truncated_frac": sum(not c.finished for c in all_completions)
                / len(all_completions),
                "perf/rollout_time_s": time.perf_counter() - t0,
            }
            if loss_cfg.dynamic_sampling:
                stats.update({
                    "rollout/sampling_rounds": float(rounds),
                    "rollout/kept_group_frac": len(kept) / (rounds * want),
                    "rollout/dynamic_fill_frac": filled / want,
                    "rollout/batch_reward_mean": rewards.mean().item(),
                })
            payload = (completions, rewards, stats, self.train_data.state_dict())
        completions, rewards, stats, data_state = _broadcast_object(payload, self.groups.driver_rank)
        if not self.is_driver:
            self.train_data.load_state_dict(data_state)
        return completions, rewards, stats

    def _global_count(self, batch: dict, update: int) -> float:
        """The loss denominator of mini-batch ``update`` over all DP ranks (known everywhere):
        response tokens for ``loss.agg=token-mean``, sequences with at least one response token
        for the seq-mean modes (the local denominators of ``aggregate_loss``, made global)."""
        g, n_up = self.groups, self.cfg.train.updates_per_step
        total = 0.0
        for dp_rank in range(g.dp_size):
            mask = rows_for_rank(batch, dp_rank, g.dp_size)["loss_mask"].chunk(n_up)[update]
            if self.cfg.loss.agg == "token-mean":
                total += mask.sum().item()
            else:
                total += (mask.sum(dim=-1) > 0).sum().item()
        return max(total, 1.0)

    # -- calibrated clipping ---------------------------------------------------------------------
    def _calibrating(self, step: int) -> bool:
        """Calibration steps: 1, 1 + interval, ... when training runs FP8 (BF16 has nothing to
        calibrate against itself)."""
        c = self.cfg.loss.calib
        return self.cfg.fp8.enabled and c.enabled and (step - 1) % c.interval == 0

    def _calibrate(self, mini: dict) -> dict:
        """BF16 shadow + FP8 forward of the current policy on ``mini``; new EMA clip bounds.

        ``mini`` carries FP8 and BF16 old logprobs. Histograms are merged over the data-parallel
        group only (tensor-parallel ranks hold the same tokens); under pipeline parallelism the
        last stage calibrates and broadcasts the bounds so every rank (and the checkpoint) agrees.
        """
        cfg, g = self.cfg, self.groups
        loss_cfg = cfg.loss
        t0 = time.perf_counter()
        kw = dict(temperature=cfg.rollout.temperature)
        cur8 = self.actor.compute_logprobs(mini, cfg.train.micro_batch_size, **kw)
        with self.actor.full_precision():
            cur16 = self.actor.compute_logprobs(mini, cfg.train.micro_batch_size, **kw)
        result = None
        if g.is_last_stage:
            lower, upper, stats = calibrated_clip_bounds(
                cur8["logprobs"] - mini["old_logprobs"], cur16["logprobs"] - mini["old_logprobs_bf16"],
                mini["advantages"], mini["loss_mask"], loss_cfg.eps_low, loss_cfg.eps_high,
                group=g.dp if g.dp_size > 1 else None, return_stats=True,
                **loss_cfg.calib.solver_kwargs())
            prev = None if self.calib["count"] == 0 else (self.calib["lower"], self.calib["upper"])
            lower, upper = ema_bounds(prev, (lower, upper), loss_cfg.calib.ema_decay)
            result = (lower, upper, stats)
        lower, upper, stats = _broadcast_object(result, g.last_stage_rank)
        self.calib.update(lower=lower, upper=upper, count=self.calib["count"] + 1)
        out = {f"calib/{k}": v for k, v in stats.items()
               if k in ("bf16_neg_lower_clipfrac", "fp8_neg_lower_clipfrac_nominal",
                        "fp8_neg_lower_clipfrac_calibrated", "bf16_balance", "fp8_balance_nominal",
                        "fp8_balance_calibrated", "hist_bytes", "fp8_out_of_range_frac")}
        out["calib/raw_lower"], out["calib/raw_upper"] = stats["lower"], stats["upper"]
        out["perf/shadow_time_s"] = time.perf_counter() - t0
        return out

    def update(self, batch: dict) -> dict:
        """Old logprobs, then ``updates_per_step`` clipped policy-gradient optimizer steps."""
        cfg, g = self.cfg, self.groups
        t0 = time.perf_counter()
        # This rank's rows, on its device (collectives on them must use the backend's device).
        local = {k: v.to(g.device) for k, v in rows_for_rank(batch, g.dp_rank, g.dp_size).items()}
        old = self.actor.compute_logprobs(local, cfg.train.micro_batch_size,
                                          temperature=cfg.rollout.temperature)
        calibrating = self._calibrating(self.step)
        shadow_time = 0.0
        if calibrating:
            ts = time.perf_counter()
            with self.actor.full_precision():
                old16 = self.actor.compute_logprobs(local, cfg.train.micro_batch_size,
                                                    temperature=cfg.rollout.temperature)
            shadow_time += time.perf_counter() - ts
            local["old_logprobs_bf16"] = old16["logprobs"] if old16 is not None else \
                torch.zeros_like(local["rollout_logprobs"])
        metric_sums: dict[str, float] = {}
        if old is not None:
            mask = local["loss_mask"]
            local["old_logprobs"] = old["logprobs"]
            # rollout - train: positive when the rollout engine was more confident.
            diff = (local["rollout_logprobs"] - old["logprobs"]) * mask
            metric_sums.update({
                "n_tokens": mask.sum().item(),
                "train/entropy": (old["entropy"] * mask).sum().item(),
                "fp8/logprob_abs_diff": diff.abs().sum().item(),
                # NeMo RL's metric: mean of exp(|logp_rollout - logp_train|); 1.0 = identical.
                "fp8/token_mult_prob_error": (torch.exp(diff.abs()) * mask).sum().item(),
                # KL(rollout || train) from rollout samples, k3 estimator (>= 0, low variance).
                "fp8/rollout_train_kl": ((torch.exp(-diff) - 1 + diff) * mask).sum().item(),
            })
        else:
            local["old_logprobs"] = torch.zeros_like(local["rollout_logprobs"])
        logprob_time = time.perf_counter() - t0

        loss_cfg = cfg.loss
        grad_norms = []
        extremes: dict[str, float] = {}
        calib_metrics: dict[str, float] = {}
        for u, mini in enumerate(_chunks(local, cfg.train.updates_per_step)):
            count = self._global_count(batch, u)
            counts = ({"global_token_count": count} if loss_cfg.agg == "token-mean"
                      else {"global_seq_count": count})
            if calibrating and u >= 1:
                # Update 0 sees pi_theta == pi_old (all ratios 1): calibrate from update 1 on.
                calib_metrics = self._calibrate(mini)
                shadow_time += calib_metrics.pop("perf/shadow_time_s")
            clip_low, clip_high = self.calib["lower"], self.calib["upper"]

            def token_loss(mb, logprobs, _counts=counts, _lo=clip_low, _hi=clip_high):
                loss, m = policy_loss(
                    logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                    clip_low=_lo, clip_high=_hi, clip_c=loss_cfg.clip_c, agg=loss_cfg.agg,
                    is_correction=loss_cfg.is_correction, **_counts,
                    # Needed only to reweight (TIS/MIS): the trainer reports the rollout mismatch
                    # itself (fp8/), once per step, so the loss need not recompute it.
                    rollout_log_prob=mb["rollout_logprobs"] if loss_cfg.is_correction else None,
                )
                m.pop("rollout_kl_k1", None)
                m.pop("token_mult_prob_error", None)
                ntok = mb["loss_mask"].sum()
                # Weighted sums, so micro-batches and DP ranks combine into token means.
                return loss, {**{k: v.detach() * ntok for k, v in m.items()}, "_ntok": ntok}

            outs, grad_norm, _ = self.actor.train_step(mini, cfg.train.micro_batch_size, token_loss,
                                                       temperature=cfg.rollout.temperature)
            grad_norms.append(grad_norm)
            for o in outs:
                metric_sums["train/loss"] = metric_sums.get("train/loss", 0.0) + o["loss"].item()
                for k, v in o.items():
                    if k in ("loss", "_ntok"):
                        continue
                    if k.endswith(_MAX_KEYS) or k.endswith(_MIN_KEYS):
                        val = v.item() / max(o["_ntok"].item(), 1.0)
                        pick = max if k.endswith(_MAX_KEYS) else min
                        extremes[k] = pick(extremes.get(k, val), val)
                        continue
                    metric_sums["pg/" + k] = metric_sums.get("pg/" + k, 0.0) + v.item()
                metric_sums["pg_tokens"] = metric_sums.get("pg_tokens", 0.0) + o["_ntok"].item()

        metrics = self._reduce_metrics(metric_sums, extremes)
        if self.is_driver:
            metrics["train/grad_norm"] = grad_norms[-1]
            metrics["perf/logprob_time_s"] = logprob_time
            metrics["perf/update_time_s"] = time.perf_counter() - t0 - logprob_time - shadow_time
            if self.cfg.fp8.enabled:
                metrics["calib/lower"], metrics["calib/upper"] = self.calib["lower"], self.calib["upper"]
            if calibrating:
                metrics.update(calib_metrics)
                metrics["perf/shadow_time_s"] = shadow_time
        return metrics

    def _reduce_metrics(self, sums: dict[str, float], extremes: dict[str, float]) -> dict:
        """Sum over DP on the last stage, divide into means, hand the result to the driver."""
        g = self.groups
        result = None
        if g.is_last_stage and g.tp_rank == 0:
            keys = sorted(sums)
            vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=g.device)
            if g.dp_size > 1:
                dist.all_reduce(vec, group=g.dp)
                for k in list(extremes):
                    t = torch.tensor([extremes[k]], dtype=torch.float64, device=g.device)
                    op = dist.ReduceOp.MAX if k.endswith(_MAX_KEYS) else dist.ReduceOp.MIN
                    dist.all_reduce(t, op=op, group=g.dp)
                    extremes[k] = t.item()
            total = dict(zip(keys, vec.tolist()))
            n = max(total.pop("n_tokens", 0.0), 1.0)
            pg_n = max(total.pop("pg_tokens", 0.0), 1.0)
            result = {}
            for k, v in total.items():
                if k == "train/loss":
                    result[k] = v / self.cfg.train.updates_per_step
                elif k.startswith("pg/"):
                    result["train/" + k[3:]] = v / pg_n
                else:
                    result[k] = v / n
            result.update({"train/" + k: v for k, v in extremes.items()})
            result["train/response_tokens"] = n
        if g.last_stage_rank != g.driver_rank:
            result = _broadcast_object(result, g.last_stage_rank)
        return result if self.is_driver else {}

    def sync_weights(self, version: int) -> float:
        """Megatron shards -> full HF tensors -> engine. Collective over the DP-rank-0 replica."""
        t0 = time.perf_counter()
        if self.groups.dp_rank == 0:
            full = iter_full_params(self.actor.model, tp_group=self.groups.tp,
                                    pp_group=self.groups.pp, dst_global_rank=self.groups.driver_rank)
            hf = quantize_for_rollout(mcore_state_to_hf(full, self.cfg.model), self.cfg.rollout.fp8)
            if self.is_driver:
                self.engine.update_weights(hf, version=version)
            else:
                # Drive the gather's collectives; non-driver ranks receive nothing.
                collections.deque(hf, maxlen=0)
        dist.barrier()
        return time.perf_counter() - t0

    def fp8_weight_errors(self) -> dict:
        """Per-layer relative FP8 quantization error of the actor's weights (collective; the
        driver gets every stage's layers; tensor-parallel rank 0's shards stand for the layer)."""
        if not self.cfg.fp8.enabled:
            return {}
        g = self.groups
        mine = {}
        if g.dp_rank == 0 and g.tp_rank == 0:
            mine = weight_quantization_errors(self.actor.module, self.cfg.fp8)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {f"fp8/weight_qerr/{k}": v for d in everyone for k, v in d.items()}
        if merged:
            merged["fp8/weight_qerr_mean"] = sum(merged.values()) / len(merged)
        return merged if self.is_driver else {}

    def evaluate(self) -> dict:
        """Greedy decoding on held-out prompts (driver only) and FP8 weight-error diagnostics."""
        fp8_errors = self.fp8_weight_errors()
        if not self.is_driver:
            return {}
        n = min(self.cfg.train.eval_prompts, len(self.val_data))
        records = [self.val_data[i] for i in range(n)]
        completions = self.engine.generate(self._prompt_ids(records), n=1, greedy=True,
                                           max_new_tokens=self.cfg.rollout.max_new_tokens,
                                           temperature=1.0)
        rewards = compute_rewards(self.cfg.task.name, [self._decode(c) for c in completions],
                                  [r["answer"] for r in records])
        return {"eval/reward_mean": rewards.mean().item(),
                "eval/response_len_mean": sum(len(c.response_ids) for c in completions) / n,
                **fp8_errors}

    # -- warm start ------------------------------------------------------------------------------
    def _warm_start_key(self) -> str:
        c = self.cfg
        blob = json.dumps({"model": to_dict(c.model), "task": to_dict(c.task), "sft": to_dict(c.sft),
                           "seed": c.train.seed, "vocab": self.tokenizer.get_vocab()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def warm_start(self) -> dict:
        """SFT the fresh actor (or load the cached result), then reset the optimizer state."""
        sft = self.cfg.sft
        if sft.steps == 0:
            return {}
        cache_root = Path(self.cfg.train.cache_dir).expanduser()
        name = f"warmstart-{self._warm_start_key()}"
        cached = cache_root / name
        if sft.cache and (cached / "trainer_state.json").exists():
            loaded, state = checkpoint.load(cached, self.actor.sharded_state_dict(with_optimizer=False))
            self.actor.load_sharded(loaded)
            print_rank0(f"warm start: loaded cached SFT policy {cached}")
            return {"sft/final_loss": state["final_loss"]}
        t0 = time.perf_counter()
        g, tok = self.groups, self.tokenizer
        data = PromptDataset(self.train_data.records, seed=self.cfg.train.seed + 1, shuffle=True)
        self.actor.set_lr(sft.lr)
        loss_value = float("nan")
        for s in range(sft.steps):
            records = data.next_batch(sft.batch_size)
            batch = build_sft_batch(collate(sft_examples(tok, records)), pad_id=tok.pad_token_id)
            total = max(batch["loss_mask"].sum().item(), 1.0)

            def nll(mb, logprobs, _n=total):
                loss = -(logprobs * mb["loss_mask"]).sum() / _n
                return loss, {}

            # SFT runs without FP8 so that every precision mode starts RL from one warm start
            # (and shares its cache): mode comparisons then measure RL alone.
            with self.actor.full_precision():
                outs, _, _ = self.actor.train_step(rows_for_rank(batch, g.dp_rank, g.dp_size),
                                                   self.cfg.train.micro_batch_size, nll)
            if outs:
                local = torch.tensor([sum(o["loss"].item() for o in outs)], dtype=torch.float64,
                                     device=g.device)
                if g.dp_size > 1:
                    dist.all_reduce(local, group=g.dp)
                loss_value = local.item()
            if (s + 1) % 50 == 0 or s == sft.steps - 1:
                loss_value = _broadcast_object(loss_value, g.last_stage_rank)
                print_rank0(f"warm start: SFT step {s + 1}/{sft.steps} loss {loss_value:.4f}")
        self.actor.set_lr(self.cfg.optim.lr)
        self.actor.reset_optimizer()
        if sft.cache:
            checkpoint.save(cache_root, name, self.actor.sharded_state_dict(with_optimizer=False),
                            {"final_loss": loss_value})
        return {"sft/final_loss": loss_value, "perf/sft_time_s": time.perf_counter() - t0}

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> None:
        state = {"step": self.step, "train_data": self.train_data.state_dict(), "calib": self.calib}
        checkpoint.save(self.ckpt_root, f"iter_{self.step:07d}",
                        self.actor.sharded_state_dict(with_optimizer=True), state)
        if self.is_driver:
            checkpoint.prune(self.ckpt_root, keep=2)

    def try_resume(self) -> bool:
        path = checkpoint.latest(self.ckpt_root)
        if path is None:
            return False
        loaded, state = checkpoint.load(
            path, self.actor.sharded_state_dict(with_optimizer=True, is_loading=True))
        self.actor.load_sharded(loaded)
        self.step = state["step"]
        self.train_data.load_state_dict(state["train_data"])
        self.calib = state.get("calib", self.calib)
        print_rank0(f"resumed from {path} at step {self.step}")
        return True

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        if self.is_driver:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out_dir / "config.yaml", cfg.to_yaml())
        resumed = self.try_resume()
        # Lines past the restored step are replayed by this run; drop them so none is duplicated.
        self.logger.truncate_after(self.step if resumed else -1)
        if not resumed:
            first = self.warm_start()
            self.sync_weights(version=0)
            first.update(self.evaluate())
            self.logger.log(0, first)
            if self.is_driver:
                _print_step(0, first)
        else:
            self.sync_weights(version=self.step)

        progress = _progress(self.is_driver, cfg.train.steps, self.step)
        steps_this_run = 0
        while self.step < cfg.train.steps:
            self.step += 1
            t0 = time.perf_counter()
            completions, rewards, rollout_stats = self.rollout(self.step)
            advantages = grpo_advantages(rewards, cfg.rollout.n_samples_per_prompt,
                                         norm_std=cfg.loss.norm_adv_by_std)
            batch = order_for_updates(
                build_rl_batch(completions, advantages, pad_id=self.tokenizer.pad_token_id),
                self.groups.dp_size, cfg.train.updates_per_step)
            metrics = self.update(batch)
            sync_time = self.sync_weights(version=self.step)
            if self.is_driver:
                metrics.update(rollout_stats)
                metrics["perf/sync_time_s"] = sync_time
                metrics["perf/step_time_s"] = time.perf_counter() - t0
            if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0 \
                    or self.step == cfg.train.steps:
                metrics.update(self.evaluate())
            self.logger.log(self.step, metrics)
            if self.is_driver:
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")
                if self.step % cfg.train.log_interval == 0:
                    _print_step(self.step, metrics, progress)
            if (cfg.train.save_interval and self.step % cfg.train.save_interval == 0) \
                    or self.step == cfg.train.steps:
                self.save()
            steps_this_run += 1
            if cfg.train.exit_after_steps is not None and steps_this_run >= cfg.train.exit_after_steps:
                break
        progress.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.logger.close()


def _chunks(batch: dict, n: int) -> list[dict]:
    return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]


def _progress(enabled: bool, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="rl", dynamic_ncols=True,
                leave=False)


_SHOWN = ("rollout/reward_mean", "eval/reward_mean", "train/loss", "train/entropy",
          "train/pg_clipfrac", "fp8/token_mult_prob_error", "calib/lower", "calib/upper",
          "perf/step_time_s", "sft/final_loss")


def _print_step(step: int, metrics: dict, progress=None) -> None:
    parts = [f"{k.removeprefix('rollout/').replace('/', '_')}={metrics[k]:.4g}"
             for k in _SHOWN if k in metrics]
    line = f"step {step}: " + " ".join(parts)
    (progress.write if progress is not None else print)(line)
