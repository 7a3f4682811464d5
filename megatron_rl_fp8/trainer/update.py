"""The update phase: old logprobs, then ``train.updates_per_step`` clipped policy-gradient steps.

Each data-parallel rank trains on its contiguous slice of the rollout batch (``rows_for_rank``,
scattered to it by the driver), split into one mini-batch per optimizer step. Losses are normalised by the mini-batch's *global*
denominator (response tokens for ``loss.agg=token-mean``, sequences for the seq-mean modes, summed
over every DP rank), so the update does not depend on how rows are split across micro-batches and
ranks: TP=2, PP=2 or DP=2 give the 1-rank loss.

On calibration steps (``ClipCalibrator.due``) the old logprobs are also computed by the BF16
shadow pass, and the calibrator resets the clip bounds before every mini-batch after the first
(update 0 sees pi_theta == pi_old: all ratios 1, nothing to calibrate). Under
``loss.calib.mode=oracle`` every step computes the BF16 old logprobs, and every mini-batch after
the first gets the BF16 shadow's log ratio (``clip_log_ratio``), which decides its clip. Under
``mode=share`` the bounds stay nominal and every mini-batch after the first clips only the
calibrated share of the tokens past them, the most extreme of each row (``loss/thinning.py``).

With ``loss.kl_coef > 0`` the frozen reference (``reference.py``) adds ``ref_logprobs`` in the same
phase, and each token's loss gains ``kl_coef * kl_penalty(logp, ref, loss.kl_type)``, aggregated
with the policy loss's mask and global denominator (so the layouts still agree). ``train/loss``
includes it; ``train/kl`` is the mean per-token estimate over the step's response tokens.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.fp8.backend import holds_step_scales
from megatron_rl_fp8.loss import (
    aggregate_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
    thinned_bounds,
    token_ratio,
)
from megatron_rl_fp8.metrics.accumulator import MetricAccumulator
from megatron_rl_fp8.metrics.ratios import log_ratio_histogram
from megatron_rl_fp8.models.fp8 import step_fp8_scaling
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.calibrator import ClipCalibrator
from megatron_rl_fp8.trainer.reference import Reference
from megatron_rl_fp8.trainer.update_metrics import BY_LAG, TokenStats, account, reduce


def global_loss_counts(local: dict, *, agg: str, updates: int, groups) -> list[float]:
    """The loss denominator of every mini-batch over all DP ranks, from this rank's rows: response
    tokens for ``agg=token-mean``, sequences with at least one response token for the seq-mean
    modes (the local denominators of ``aggregate_loss``, made global; one all-reduce)."""
    masks = local["loss_mask"].chunk(updates)
    if agg == "token-mean":
        counts = [m.sum() for m in masks]
    else:
        counts = [(m.sum(dim=-1) > 0).sum() for m in masks]
    total = torch.stack(counts).to(torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(total, group=groups.dp)
    return [max(c, 1.0) for c in total.tolist()]


def _phase_done(t: torch.Tensor) -> None:
    """Wait for the kernels that made ``t`` when it is on a GPU (nothing on CPU), so the phase
    that made it owns their time (perf/ timers; one synchronisation per phase, not per metric)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def chunks(batch: dict, n: int) -> list[dict]:
    return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]


class PolicyUpdate:
    def __init__(
        self,
        cfg: RunConfig,
        actor: Actor,
        groups: Groups,
        calibrator: ClipCalibrator,
        reference: Reference | None = None,
    ):
        self.cfg = cfg
        self.actor = actor
        self.groups = groups
        self.calibrator = calibrator
        self.reference = reference  # None unless loss.kl_coef > 0
        # Set by the stability guard: this step trains without FP8 (nominal bounds, no shadow).
        self.bf16 = False
        self.param_norm = 0.0  # of the weights after the last step (every rank)

    def _logprobs(self, batch: dict, *, entropy: bool = True, count_routes=False) -> dict | None:
        t = self.cfg.train
        return self.actor.compute_logprobs(
            batch,
            t.micro_batch_size,
            temperature=self.cfg.rollout.temperature,
            max_tokens=t.max_tokens_per_gpu,
            entropy=entropy,
            count_routes=count_routes,
        )

    def old_logprobs(self, local: dict, acc: MetricAccumulator, calibrating: bool) -> float:
        """Fill ``old_logprobs`` (and ``old_logprobs_bf16`` when calibrating) into ``local`` and
        account the rollout-vs-train mismatch (a MoE's routing mismatch too); returns the BF16
        shadow time."""
        old = self._logprobs(local, count_routes=True)
        shadow_time = 0.0
        if calibrating:
            if old is not None:  # the FP8 pass's kernels are not the shadow's time
                _phase_done(old["logprobs"])
            ts = time.perf_counter()
            with self.actor.full_precision():
                old16 = self._logprobs(local, entropy=False)  # train/entropy is FP8's
            if old16 is not None:
                _phase_done(old16["logprobs"])
            shadow_time = time.perf_counter() - ts
            local["old_logprobs_bf16"] = (
                old16["logprobs"]
                if old16 is not None
                else torch.zeros_like(local["rollout_logprobs"])
            )
        if old is None:  # not the last pipeline stage: no logprobs here
            local["old_logprobs"] = torch.zeros_like(local["rollout_logprobs"])
            return shadow_time
        local["old_logprobs"] = old["logprobs"]
        # Whole sequences on every CP rank (gathered): CP rank 0 accounts them, as the update's
        # statistics are summed over DP x CP.
        first = self.groups.cp_rank == 0
        mask = local["loss_mask"] if first else torch.zeros_like(local["loss_mask"])
        # rollout - train: positive when the rollout engine was more confident.
        diff = (local["rollout_logprobs"] - old["logprobs"]) * mask
        acc.add("n_tokens", mask.sum())
        acc.add("train/entropy", (old["entropy"] * mask).sum())
        acc.add("fp8/logprob_abs_diff", diff.abs().sum())
        # NeMo RL's metric: mean of exp(|logp_rollout - logp_train|); 1.0 = identical.
        mult = torch.exp(diff.abs())
        acc.add("fp8/token_mult_prob_error", (mult * mask).sum())
        # KL(rollout || train) from rollout samples, k3 estimator (>= 0, low variance).
        k3 = torch.exp(-diff) - 1 + diff
        acc.add("fp8/rollout_train_kl", (k3 * mask).sum())
        if "policy_lag" in local:  # the same, per policy-version lag of the rows (pipeline.py)
            lag = local["policy_lag"].unsqueeze(-1)
            for n in range(self.cfg.train.max_staleness + 1):  # the same keys on every rank
                at = mask * lag.eq(n)
                acc.add(f"{BY_LAG}{n}/tokens", at.sum())
                acc.add(f"{BY_LAG}{n}/token_mult_prob_error", (mult * at).sum())
                acc.add(f"{BY_LAG}{n}/rollout_train_kl", (k3 * at).sum())
        return shadow_time

    def ref_logprobs(self, local: dict) -> None:
        """Fill ``ref_logprobs`` (the frozen reference's, for the KL penalty) into ``local``."""
        t = self.cfg.train
        ref = self.reference.compute_logprobs(
            local,
            t.micro_batch_size,
            temperature=self.cfg.rollout.temperature,
            max_tokens=t.max_tokens_per_gpu,
        )
        # Not the last pipeline stage: no logprobs here (and no loss either).
        local["ref_logprobs"] = ref if ref is not None else torch.zeros_like(local["old_logprobs"])

    def _kl_loss(self, mb: dict, logprobs: torch.Tensor, counts: dict):
        """(the KL penalty aggregated as the policy loss is, its detached per-token mean)."""
        mask = mb["loss_mask"].bool()
        # Padding goes in as logp = ref = 0 (KL 0, finite gradient): prompt and pad positions may
        # hold log-probs whose exp() overflows in k3.
        zero = torch.zeros_like(logprobs)
        kl_tok = kl_penalty(
            torch.where(mask, logprobs, zero),
            torch.where(mask, mb["ref_logprobs"], zero),
            self.cfg.loss.kl_type,
        )
        kl = aggregate_loss(kl_tok, mask, self.cfg.loss.agg, **counts)
        return kl, masked_mean(kl_tok.detach(), mask)

    def _token_loss(self, counts: dict, clip_low: float, clip_high: float, share=None):
        loss_cfg = self.cfg.loss

        def token_loss(mb, logprobs):
            low, high = clip_low, clip_high
            if share is not None:  # mode=share: per-row bounds thin the nominal clip set
                keep, salt_ = share
                low, high = thinned_bounds(
                    token_ratio(logprobs, mb["old_logprobs"], mb["loss_mask"]),
                    mb["advantages"],
                    mb["loss_mask"],
                    mb["labels"],
                    clip_low=low,
                    clip_high=high,
                    keep=keep,
                    salt_=salt_,
                )
            loss, m = policy_loss(
                logprobs,
                mb["old_logprobs"],
                mb["advantages"],
                mb["loss_mask"],
                clip_low=low,
                clip_high=high,
                clip_c=loss_cfg.clip_c,
                agg=loss_cfg.agg,
                is_correction=loss_cfg.is_correction,
                **counts,
                # Needed only to reweight (TIS/MIS): the trainer reports the rollout mismatch
                # itself (fp8/), once per step, so the loss need not recompute it.
                rollout_log_prob=mb["rollout_logprobs"] if loss_cfg.is_correction else None,
                clip_log_ratio=mb.get("clip_log_ratio"),
            )
            m.pop("rollout_kl_k1", None)
            m.pop("token_mult_prob_error", None)
            if loss_cfg.kl_coef > 0:
                kl, m["kl"] = self._kl_loss(mb, logprobs, counts)
                loss = loss + loss_cfg.kl_coef * kl
            # pg_loss is already divided by the global count, as the loss is: it sums over
            # micro-batches and ranks. The other metrics are per-token means of this micro-batch,
            # weighted into sums (update_metrics.py), so micro-batches and ranks combine.
            hist = log_ratio_histogram(logprobs - mb["old_logprobs"], mb["loss_mask"])
            return loss, {"stats": TokenStats.of(mb, m.pop("pg_loss"), m, hist)}

        return token_loss

    def __call__(self, batch: dict, step: int) -> dict:
        """Old logprobs and the optimizer steps on ``batch`` (this rank's rows of the ordered
        rollout batch, ``collectives.scatter_rows``); returns this step's ``train/``, ``fp8/``, ``calib/`` and ``perf/`` metrics on the driver."""
        g = self.groups
        t0 = time.perf_counter()
        # On this rank's device (collectives on them must use the backend's device).
        local = {k: v.to(g.device) for k, v in batch.items()}
        acc = MetricAccumulator()
        # A BF16 step (the guard's action) has no FP8 to calibrate and clips nominally.
        calibrating = self.calibrator.due(step) and not self.bf16
        oracle = self.calibrator.oracle and not self.bf16
        precision = self.actor.full_precision() if self.bf16 else contextlib.nullcontext()
        # fp8.scales_per_step on this run's backend: each step's forwards share its first scales.
        pinned = holds_step_scales(self.cfg.fp8, self.actor.fp8_backend) and not self.bf16
        scales = (
            step_fp8_scaling(self.actor.module, self.actor.config)
            if pinned
            else contextlib.nullcontext()
        )
        with precision, scales:
            metrics, logprob_time, shadow_time = self._update(local, acc, step, calibrating, oracle)
        # The rollout sync, checkpoints and the norm read the weights next: gather them now
        # when the distributed optimizer left that to the next forward pass.
        self.actor.finish_param_gather()
        self.param_norm = self.actor.param_norm()
        if g.is_driver:
            metrics["train/param_norm"] = self.param_norm
            metrics["train/bf16_step"] = float(self.bf16)
            # Disjoint phases of the driver's clock (metrics/step_time.py); each ends in a wait
            # for its kernels (_phase_done) or a host read of its results (the statistics' one
            # read, the norm). The update is the rest of this call.
            metrics["perf/logprob_time_s"] = logprob_time
            metrics["perf/update_time_s"] = time.perf_counter() - t0 - logprob_time - shadow_time
            if calibrating or oracle:
                metrics["perf/shadow_time_s"] = shadow_time
        return metrics

    def _update(
        self, local, acc, step: int, calibrating: bool, oracle: bool
    ) -> tuple[dict, float, float]:
        """The step's work; returns (driver's metrics, old-logprob seconds, BF16 shadow
        seconds: the shadow old logprobs and the calibration or oracle passes)."""
        cfg, g = self.cfg, self.groups
        bounds = self.calibrator.nominal if self.bf16 else None
        t0 = time.perf_counter()
        shadow_time = self.old_logprobs(local, acc, calibrating or oracle)
        if self.reference is not None:
            self.ref_logprobs(local)
            _phase_done(local["ref_logprobs"])
        _phase_done(local["old_logprobs"])  # the statistics stay on the device: wait here
        # The FP8 (and reference) passes only: the BF16 shadow pass inside is its own phase.
        logprob_time = time.perf_counter() - t0 - shadow_time

        n_up = cfg.train.updates_per_step
        grad_norms, skipped = [], 0
        calib_metrics: dict[str, float] = {}
        loss_counts = global_loss_counts(local, agg=cfg.loss.agg, updates=n_up, groups=g)
        for u, (mini, count) in enumerate(zip(chunks(local, n_up), loss_counts)):
            counts = (
                {"global_token_count": count}
                if cfg.loss.agg == "token-mean"
                else {"global_seq_count": count}
            )
            if calibrating and u >= 1:
                calib_metrics = self.calibrator.calibrate(
                    self.actor,
                    mini,
                    g,
                    micro_batch_size=cfg.train.micro_batch_size,
                    temperature=cfg.rollout.temperature,
                    max_tokens=cfg.train.max_tokens_per_gpu,
                    position=u,
                )
                shadow_time += calib_metrics.pop("perf/shadow_time_s")
            if oracle:
                ts = time.perf_counter()
                # Update 0 trains pi_old itself: every BF16 ratio is 1, no pass needed.
                mini["clip_log_ratio"] = (
                    torch.zeros_like(mini["old_logprobs"])
                    if u == 0
                    else self.calibrator.oracle_log_ratio(
                        self.actor,
                        mini,
                        micro_batch_size=cfg.train.micro_batch_size,
                        temperature=cfg.rollout.temperature,
                        max_tokens=cfg.train.max_tokens_per_gpu,
                    )
                )
                _phase_done(mini["clip_log_ratio"])
                shadow_time += time.perf_counter() - ts
            share = None
            if self.calibrator.sharing and not self.bf16 and u >= 1:
                share = self.calibrator.share(u, seed=cfg.train.seed, step=step)
            lr = self.actor.lr  # the lr this update uses (the schedule steps after it)
            with self.actor.counting_experts():  # the moe/ load metrics
                outs, grad_norm, applied = self.actor.train_step(
                    mini,
                    cfg.train.micro_batch_size,
                    self._token_loss(counts, *(bounds or self.calibrator.bounds), share),
                    temperature=cfg.rollout.temperature,
                    max_tokens=cfg.train.max_tokens_per_gpu,
                )
            grad_norms.append(grad_norm)
            skipped += not applied
            account(outs, acc, applied)

        metrics = reduce(acc, g, cfg.train.updates_per_step)
        load = self.actor.moe_metrics()  # collective; {} for a dense model
        if g.is_driver:
            metrics.update(load)
            metrics["train/grad_norm"] = grad_norms[-1]
            metrics["train/skipped_updates"] = float(skipped)
            metrics["train/lr"] = lr  # of the last update, as the grad norm
            if cfg.fp8.enabled:
                metrics["calib/lower"], metrics["calib/upper"] = bounds or self.calibrator.bounds
            if self.calibrator.sharing:  # the fractions of the clip sets that stayed clipped
                metrics["calib/keep_neg_lower"], metrics["calib/keep_pos_upper"] = (
                    self.calibrator.keep()
                )
            if calibrating:
                metrics.update(calib_metrics)
        return metrics, logprob_time, shadow_time
