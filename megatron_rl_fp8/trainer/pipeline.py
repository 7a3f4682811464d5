"""Which rollout each RL step trains on, and when the next one is generated (``train.pipeline``).

    sync          step k generates its rollout from the weights of step k - 1, then trains on it:
                  every row is on-policy (lag 0)
    one_step_off  step k trains on the rollout generated during step k - 1 while the engines
                  generate step k + 1's from the same weights (those of step k - 1), in a thread of
                  the driver; before step k's sync the trainer waits for that rollout to finish,
                  so no sync lands while the engines generate and every row lags one version

A step of ``one_step_off`` (dedicated engines; colocated ones take turns with the trainer, and the
config refuses the pair):

    take(k)    the held rollout of step k, or (first step, after a lost rollout) step k's own,
               generated now; its rows' versions checked against ``train.max_staleness``
    launch(k+1)  the driver's thread starts step k + 1's rollout
    ... the update of step k on the main thread ...
    finish()   the thread's rollout is held for step k + 1 (a lost one: dropped, the dataset back
               where it was); the trainer's wait and the overlap go on step k's line
    ... sync of step k's weights, evaluation, checkpoint ...

A checkpoint holds the held rollout (the driver's rank state; ``checkpointer.py``), so a resume
trains step k + 1 on the same rows as an uninterrupted run: the in-flight rollout is *saved*,
complete, since every save comes after the step's ``finish``. A guard rollback drops the one in
flight (made by the weights it distrusts) and restores the checkpoint's own.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.rollout.errors import RolloutLost
from megatron_rl_fp8.trainer.collectives import broadcast_object
from megatron_rl_fp8.trainer.engine_link import EngineLink
from megatron_rl_fp8.trainer.sampling import Sampler

# A rollout's keys (sampling.py) that are its own phase's seconds: for a rollout generated in
# the background they go on the line of the step it ran in, under perf/pipeline/.
_ROLLOUT_TIMES = "perf/"


class StaleRollout(ConfigError):
    """Rows older than ``train.max_staleness`` policy versions (one line, like a config error:
    the setting refuses what the run holds)."""


def staleness_refusal(step: int, versions: list[int], now: int, max_staleness: int) -> str | None:
    """Why step ``step`` may not train on rows sampled by ``versions`` with the weights of
    version ``now``, or None when every row is within ``max_staleness`` versions."""
    oldest = min(versions)
    if now - oldest <= max_staleness:
        return None
    stale = sum(now - v > max_staleness for v in versions)
    return (
        f"step {step}: {stale} of {len(versions)} rollout rows were sampled by policy version "
        f"{oldest}, {now - oldest} behind the weights they would train (version {now}), and "
        f"train.max_staleness={max_staleness} refuses them; raise train.max_staleness (a "
        "one_step_off checkpoint holds rows one version old) or resume the run as it was"
    )


class Rollout:
    """One step's rollout on the driver: (completions, rewards, stats) as ``Sampler.sample``
    returns them, and the step it was sampled for."""

    def __init__(self, step: int, completions: list[Completion], rewards: torch.Tensor, stats):
        self.step, self.completions, self.rewards, self.stats = step, completions, rewards, stats

    def state_dict(self) -> dict:
        """Tensors and plain values (a checkpoint's rank state is read with weights_only)."""
        c = self.completions
        return {
            "step": self.step,
            "prompt_lens": torch.tensor([len(x.prompt_ids) for x in c]),
            "response_lens": torch.tensor([len(x.response_ids) for x in c]),
            "prompt_ids": torch.tensor([t for x in c for t in x.prompt_ids], dtype=torch.long),
            "response_ids": torch.tensor([t for x in c for t in x.response_ids], dtype=torch.long),
            # float32 is what the batch holds them in (batch.py): the trained rows are the same.
            "response_logprobs": torch.tensor(
                [p for x in c for p in x.response_logprobs], dtype=torch.float32
            ),
            "finished": torch.tensor([x.finished for x in c]),
            # 1 sampled / 0 observation per response token (multi-turn); all 1 for one turn.
            "response_mask": torch.tensor([m for x in c for m in x.sampled()], dtype=torch.uint8),
            "version": torch.tensor([x.version for x in c]),
            "rewards": self.rewards.clone(),
            "stats": dict(self.stats),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> Rollout:
        p_lens, r_lens = state["prompt_lens"].tolist(), state["response_lens"].tolist()
        prompts = torch.split(state["prompt_ids"], p_lens)
        responses = torch.split(state["response_ids"], r_lens)
        logprobs = torch.split(state["response_logprobs"], r_lens)
        # A state saved before multi-turn rollouts has no mask: every token was sampled.
        flat = state.get("response_mask")
        masks = [None] * len(r_lens) if flat is None else torch.split(flat, r_lens)
        completions = [
            Completion(
                prompt_ids=p.tolist(),
                response_ids=r.tolist(),
                response_logprobs=lp.tolist(),
                finished=bool(f),
                version=int(v),
                response_mask=None if m is None or bool(m.all()) else m.tolist(),
            )
            for p, r, lp, f, v, m in zip(
                prompts,
                responses,
                logprobs,
                state["finished"].tolist(),
                state["version"].tolist(),
                masks,
            )
        ]
        return cls(state["step"], completions, state["rewards"], state["stats"])


def _background(fn) -> concurrent.futures.Future:
    """``fn()`` in a daemon thread: a rollout stuck on a dead engine never holds the exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to finish(), on the main thread
            future.set_exception(e)

    threading.Thread(target=run, name="mrf8-rollout", daemon=True).start()
    return future


class RolloutPipeline:
    """Every method is collective over all ranks unless it says otherwise; the rollout itself
    exists on the driver only."""

    def __init__(self, cfg: RunConfig, groups: Groups, sampler: Sampler, engines: EngineLink):
        self.cfg = cfg
        self.groups = groups
        self.sampler = sampler
        self.engines = engines
        self.overlapped = cfg.train.pipeline == "one_step_off"
        self.max_staleness = cfg.train.max_staleness
        self.held: Rollout | None = None  # driver: finished, waiting for its step
        self.launched = False  # every rank: a rollout is in flight on the driver
        self._future: concurrent.futures.Future | None = None  # driver
        self._position: dict | None = None  # driver: the dataset before the one in flight
        self._launched_at = 0.0

    def take(self, step: int) -> tuple[list[Completion] | None, torch.Tensor | None, dict]:
        """Step ``step``'s (completions, rewards, stats) on the driver (``(None, None, {})``
        elsewhere): the held rollout, else one generated now. Rows older than
        ``train.max_staleness`` versions behind the trainer's weights (the engines' synced
        version) are refused: :class:`StaleRollout` on every rank, before any compute."""
        g = self.groups
        # A sync run resumed from a one_step_off checkpoint holds one too.
        if broadcast_object(self.held is not None, g.driver_rank):
            r, self.held = self.held, None
            completions, rewards, stats = (
                (r.completions, r.rewards, r.stats) if g.is_driver else (None, None, {})
            )
        else:
            completions, rewards, stats = self.engines.generation(
                lambda: self.sampler.rollout(step), release=("weights", "kv_cache")
            )
        refusal = None
        if g.is_driver:
            stats = {**stats, **self._staleness(completions)}
            versions = [c.version for c in completions]
            now = self.engines.synced_version
            refusal = staleness_refusal(step, versions, now, self.max_staleness)
        refusal = broadcast_object(refusal, g.driver_rank)
        if refusal is not None:
            raise StaleRollout(refusal)
        return completions, rewards, stats

    def lags(self, completions: list[Completion]) -> torch.Tensor:
        """Each row's lag: versions between the engine that sampled it and the trainer's weights
        (the engines' synced version: every step syncs them). Driver."""
        now = self.engines.synced_version
        return torch.tensor([now - c.version for c in completions], dtype=torch.long)

    def _staleness(self, completions: list[Completion]) -> dict:
        lags = self.lags(completions).to(torch.float64)
        return {
            "rollout/staleness_mean": lags.mean().item(),
            "rollout/staleness_max": lags.max().item(),
            "rollout/policy_version": float(min(c.version for c in completions)),
        }

    def launch(self, step: int) -> None:
        """one_step_off: the driver's thread starts step ``step``'s rollout from the engines'
        current weights (nothing when the run ends before that step, or under ``sync``)."""
        if not self.overlapped or step > self.cfg.train.steps:
            return
        self.launched = True
        if self.groups.is_driver:
            self._position = self.sampler.train_data.state_dict()
            self._launched_at = time.perf_counter()
            self._future = _background(lambda: Rollout(step, *self.sampler.sample(step)))

    def finish(self, metrics: dict | None = None) -> None:
        """Wait for the rollout in flight and hold it for its step (a lost one is dropped, the
        dataset back where it was: its step generates its own). Adds to this step's ``metrics``
        on the driver: to ``perf/rollout_time_s`` the trainer's wait (the phase on its clock),
        and ``perf/pipeline/*``, the rollout's own seconds, its overlap with the trainer and the
        engines' wait for it (docs/logging.md)."""
        if not self.launched:
            return
        self.launched = False
        g = self.groups
        lost, perf = None, {}
        if g.is_driver:
            reached = time.perf_counter()
            future, self._future = self._future, None
            try:
                rollout = future.result()
            except RolloutLost as e:
                lost, rollout = str(e), None
                self.sampler.train_data.load_state_dict(self._position)
            perf = self._times(rollout, reached, time.perf_counter())
            self.held = rollout
        lost = broadcast_object(lost, g.driver_rank)
        if lost is not None:
            print_rank0(f"rollout: the one in flight was lost ({lost}); its step generates anew")
        self.sampler.share_position()
        if metrics is not None:
            for key, seconds in perf.items():  # a first step's own rollout is in it already
                metrics[key] = metrics.get(key, 0.0) + seconds

    def _times(self, rollout: Rollout | None, reached: float, ended: float) -> dict:
        """The trainer reached ``finish`` at ``reached`` and went on at ``ended``; the rollout
        ran from the launch for its own ``perf/rollout_time_s`` (to ``ended`` when lost)."""
        own = rollout.stats if rollout is not None else {}
        perf = {
            "perf/pipeline/" + k.removeprefix(_ROLLOUT_TIMES): v
            for k, v in own.items()
            if k.startswith(_ROLLOUT_TIMES)
        }
        if rollout is not None:
            rollout.stats = {k: v for k, v in own.items() if not k.startswith(_ROLLOUT_TIMES)}
        ran = perf.get("perf/pipeline/rollout_time_s", ended - self._launched_at)
        finished_at = self._launched_at + ran
        perf["perf/rollout_time_s"] = ended - reached  # the trainer's wait
        perf["perf/pipeline/overlap_time_s"] = max(
            0.0, min(finished_at, reached) - self._launched_at
        )
        perf["perf/pipeline/engine_idle_time_s"] = max(0.0, reached - finished_at)
        return perf

    def drop(self) -> None:
        """Wait for the rollout in flight and discard it and the held one (a guard rollback:
        they came from weights it distrusts; the checkpoint it restores brings its own)."""
        self.finish()
        self.held = None

    def state_dict(self) -> dict:
        """The driver's held rollout (empty when none), for its rank state in checkpoints."""
        return {} if self.held is None else {"held": self.held.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        self.held = Rollout.from_state_dict(state["held"]) if state and "held" in state else None
