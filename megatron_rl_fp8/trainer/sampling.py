"""The rollout phase: prompts -> completions -> rewards on the driver, shared with every rank.

Global rank 0 (the *driver*) owns the rollout engine: it samples ``rollout.n_samples_per_prompt``
completions per prompt and scores them with the task's verifiers (plus DAPO overlong shaping when
configured); its dataset position goes to every rank (the trainer turns the completions into
tensors and scatters each data-parallel rank its rows).

DAPO dynamic sampling: groups whose rewards are all equal carry no advantage signal, so they are
dropped and more prompts are sampled, up to ``loss.max_sampling_rounds`` rounds, until
``train.prompts_per_step`` groups remain (short batches are filled with dropped groups). The
driver's dataset position is then shared, so every rank's dataset stays in step (and resumes).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.data import PromptDataset, PromptEncoder
from megatron_rl_fp8.loss import dynamic_sampling_keep_mask, overlong_reward_penalty
from megatron_rl_fp8.metrics.garbled import garbled_stats
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.reward import Rewarder
from megatron_rl_fp8.reward.verifiers import FORMAT_CHECKS
from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.rollout.errors import RolloutLost
from megatron_rl_fp8.rollout.turns import TurnLoop, turn_stats
from megatron_rl_fp8.trainer.collectives import broadcast_object

T = TypeVar("T")


class Sampler:
    def __init__(
        self,
        cfg: RunConfig,
        groups: Groups,
        engine,
        tokenizer: PromptEncoder,
        train_data: PromptDataset,
        val_data: PromptDataset,
    ):
        self.cfg = cfg
        self.groups = groups
        self.engine = engine  # None except on the driver
        self.tokenizer = tokenizer
        self.train_data = train_data
        self.val_data = val_data
        # Rewards are scored on the driver, in a process pool (reward.num_workers) with a
        # per-sample timeout; the pool starts once and lives as long as the sampler.
        self.rewarder = self.eval_rewarder = None
        # Multi-turn rollouts (env.tools): the turn loop and its tool workers, on the driver.
        self.turns: TurnLoop | None = None
        if groups.is_driver and cfg.env.tools is not None:
            self.turns = TurnLoop(
                cfg.env, encode=tokenizer.encode_inserted, decode=tokenizer.decode_response
            )
        if groups.is_driver:
            self.rewarder = Rewarder(cfg.task.name, cfg.reward)
            # Evaluation measures correctness only; the format bonus shapes training.
            self.eval_rewarder = (
                self.rewarder
                if cfg.reward.format_weight == 0
                else Rewarder(cfg.task.name, dataclasses.replace(cfg.reward, format_weight=0.0))
            )

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()
        for rewarder in {id(r): r for r in (self.rewarder, self.eval_rewarder) if r}.values():
            rewarder.close()

    @staticmethod
    def prompt_ids(records) -> list[list[int]]:
        # Encoded (chat template applied, length checked) once, when the data was loaded.
        return [r["prompt_ids"] for r in records]

    def decode(self, c: Completion) -> str:
        """The text the reward scores: the response, or a multi-turn one's last policy turn."""
        return self.tokenizer.decode_response(c.response_ids[c.final_start :])

    def generate(self, records, **sampling) -> list[Completion]:
        """The engine's completions for ``records``' prompts, over turns with ``env.tools``."""
        if self.turns is None:
            return self.engine.generate(self.prompt_ids(records), **sampling)
        completions = self.turns.generate(
            self.engine, self.prompt_ids(records), records, **sampling
        )
        if self.turns.last_error is not None:
            print_rank0(
                f"env: a tool call failed and ended its trajectory: {self.turns.last_error}"
            )
        return completions

    def _sample_round(self, records, step: int, round_: int):
        """One rollout round on the driver: completions, their decoded texts and (shaped) rewards
        for ``records``, and the round's stats (scoring, generation time)."""
        r, loss_cfg = self.cfg.rollout, self.cfg.loss
        t0 = time.perf_counter()
        completions = self.generate(
            records,
            n=r.n_samples_per_prompt,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            seed=r.seed + step + round_ * 1_000_003,
        )
        # Summed over the sampling rounds (the scoring stats are counters). No device sync is
        # needed: the completions are host lists when generate returns.
        timing = {
            "perf/rollout_generate_time_s": time.perf_counter() - t0,
            "perf/rollout_wait_time_s": getattr(self.engine, "wait_s", 0.0),
        }
        texts = [self.decode(c) for c in completions]
        rewards, reward_stats = self._score(records, texts, r.n_samples_per_prompt)
        reward_stats = {**reward_stats, **timing}
        if loss_cfg.overlong_buffer:
            # The policy's own tokens (a multi-turn response's inserted answers are not its).
            lengths = torch.tensor([sum(c.sampled()) for c in completions])
            rewards = rewards + overlong_reward_penalty(
                lengths, r.max_new_tokens, loss_cfg.overlong_buffer, loss_cfg.overlong_penalty
            )
        return completions, texts, rewards, reward_stats

    def _score(self, records, texts: list[str], n: int, *, evaluation: bool = False):
        """Rewards of the decoded completions ``texts`` (``n`` per record, grouped) and the
        scoring stats."""
        rewarder = self.eval_rewarder if evaluation else self.rewarder
        return rewarder.score(
            texts,
            [rec["answer"] for rec in records for _ in range(n)],
            # User reward functions get the record as the file had it (every field).
            [rec.get("record", rec) for rec in records for _ in range(n)],
        )

    def sample(self, step: int):
        """RL step ``step``'s (completions, rewards, stats) on the driver, which alone calls it:
        every sampling round of dynamic sampling, scored. It touches only the driver's engine,
        rewarder and dataset and makes no collective call, so it may run beside the trainer's
        update in another thread (``trainer/pipeline.py``) while nothing else uses the engine.
        The dataset advances past the prompts it took."""
        r, loss_cfg = self.cfg.rollout, self.cfg.loss
        n, want = r.n_samples_per_prompt, self.cfg.train.prompts_per_step
        t0 = time.perf_counter()
        kept, dropped, all_rewards, all_completions, all_texts = [], [], [], [], []
        scoring = collections.Counter()
        rounds = 0
        while rounds < (loss_cfg.max_sampling_rounds if loss_cfg.dynamic_sampling else 1):
            completions, texts, rewards, reward_stats = self._sample_round(
                self.train_data.next_batch(want), step, rounds
            )
            scoring.update(reward_stats)
            rounds += 1
            all_rewards.append(rewards)
            all_completions += completions
            all_texts += texts
            keep = (
                dynamic_sampling_keep_mask(rewards, n)
                if loss_cfg.dynamic_sampling
                else torch.ones(want, dtype=torch.bool)
            )
            for gi in range(want):
                group = (completions[gi * n : (gi + 1) * n], rewards[gi * n : (gi + 1) * n])
                (kept if keep[gi] else dropped).append(group)
            if len(kept) >= want:
                break
        filled = max(0, want - len(kept))
        groups = (kept + dropped[:filled])[:want]
        completions = [c for g in groups for c in g[0]]
        rewards = torch.cat([g[1] for g in groups])
        sampled = torch.cat(all_rewards)
        lengths = torch.tensor([sum(c.sampled()) for c in all_completions], dtype=torch.float32)
        stats = {
            "rollout/reward_mean": sampled.mean().item(),
            "rollout/response_len_mean": lengths.mean().item(),
            "rollout/truncated_frac": sum(not c.finished for c in all_completions)
            / len(all_completions),
            "perf/rollout_time_s": time.perf_counter() - t0,
            **self.engine.metrics(),
            **scoring,
            **(turn_stats(all_completions) if self.turns is not None else {}),
            **garbled_stats(
                all_texts,
                [sampled_ids(c) for c in all_completions],
                # A user reward function defines its own answer format: no no_answer share.
                None if self.cfg.reward.function else FORMAT_CHECKS.get(self.cfg.task.name),
            ),
        }
        if loss_cfg.dynamic_sampling:
            stats.update(
                {
                    "rollout/sampling_rounds": float(rounds),
                    "rollout/kept_group_frac": len(kept) / (rounds * want),
                    "rollout/dynamic_fill_frac": filled / want,
                    "rollout/batch_reward_mean": rewards.mean().item(),
                }
            )
        return completions, rewards, stats

    def on_driver(self, phase: Callable[[], T]) -> T | None:
        """``phase()`` on the driver, None elsewhere. Collective: when the engines lost the
        synced weights in it (``RolloutLost``), every rank raises it, so all of them can sync
        the engines again."""
        result, lost = None, None
        if self.groups.is_driver:
            try:
                result = phase()
            except RolloutLost as e:
                lost = str(e)
        lost = broadcast_object(lost, self.groups.driver_rank)
        if lost is not None:
            raise RolloutLost(lost)
        return result

    def rollout(self, step: int) -> tuple[list[Completion] | None, torch.Tensor | None, dict]:
        """(completions, rewards, rollout stats) of RL step ``step`` on the driver, ``(None, None,
        {})`` elsewhere (collective: every rank's dataset takes the driver's position; the rows
        themselves reach the ranks as tensors, ``collectives.scatter_rows``). A rollout the
        engines lost leaves the dataset where it was: its repeat samples the same prompts."""
        position = self.train_data.state_dict()
        try:
            sampled = self.on_driver(lambda: self.sample(step))
        except RolloutLost:
            self.train_data.load_state_dict(position)
            raise
        completions, rewards, stats = sampled if sampled is not None else (None, None, {})
        self.share_position()
        return completions, rewards, stats

    def share_position(self) -> None:
        """Every rank's dataset at the driver's position. Collective."""
        data_state = broadcast_object(
            self.train_data.state_dict() if self.groups.is_driver else None,
            self.groups.driver_rank,
        )
        if not self.groups.is_driver:
            self.train_data.load_state_dict(data_state)

    def evaluate(self) -> dict:
        """Greedy decoding of ``train.eval_prompts`` held-out prompts: the scores on the driver,
        ``{}`` elsewhere (collective)."""
        return self.on_driver(self._evaluate_on_driver) or {}

    def _evaluate_on_driver(self) -> dict:
        n = min(self.cfg.train.eval_prompts, len(self.val_data))
        records = [self.val_data[i] for i in range(n)]
        completions = self.generate(
            records,
            n=1,
            greedy=True,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            temperature=1.0,
        )
        rewards, stats = self._score(
            records, [self.decode(c) for c in completions], 1, evaluation=True
        )
        out = {
            "eval/reward_timeouts": stats["reward/timeouts"],
            "eval/reward_mean": rewards.mean().item(),
            "eval/response_len_mean": sum(sum(c.sampled()) for c in completions) / n,
        }
        if self.turns is not None:
            out["eval/tool_used_frac"] = sum(c.tool_calls > 0 for c in completions) / n
        return out


def sampled_ids(c: Completion) -> list[int]:
    """The ids the policy sampled in ``c`` (a multi-turn response without its inserted ones)."""
    if c.response_mask is None:
        return c.response_ids
    return [t for t, m in zip(c.response_ids, c.response_mask) if m]
