"""Where a step's time goes: the trainer's phase timers as ``perf/`` keys that add up.

Every timer is ``time.perf_counter`` on the driver (global rank 0), read where a phase's work is
done on the host: no timer adds a device synchronization of its own, except the weight sync's
split on GPU (``sync/timing.py``). The phases of one step window are disjoint, so

    perf/step_time_s = sum of the PHASES present + perf/other_time_s

(``other``: advantages, the batch scatter, the guard, logging, the progress bar; never below 0).
A step's window runs from the end of the previous metrics line to this one: it holds the
checkpoint written after the previous line (``perf/checkpoint_time_s`` is on the line *after*
the save, since a step's line is written before its checkpoint), this step's phases and its
evaluation. A guard rollback's discarded step falls into the next line's ``other``. So the step
times of one process add up to its wall time from the first RL step to the last line.

``PARTS`` are nested splits of a phase (generation inside the rollout, the sync's gather /
quantize / transfer / engine load); they need not fill their phase. ``perf/amortised/<name>``:
the running mean over this process's logged steps, a step without the phase counting 0 (so a
checkpoint every 50 steps shows its per-step cost), from the first line that has the phase. Definitions of every key: docs/logging.md.
"""

from __future__ import annotations

import collections
import time

STEP = "perf/step_time_s"
OTHER = "perf/other_time_s"
AMORTISED = "perf/amortised/"

# (label, key): the disjoint phases of a step window, in pipeline order.
PHASES: tuple[tuple[str, str], ...] = (
    ("rollout", "perf/rollout_time_s"),
    ("offload (colocated)", "perf/offload_time_s"),
    ("reload (colocated)", "perf/reload_time_s"),
    ("old logprobs", "perf/logprob_time_s"),
    ("BF16 shadow", "perf/shadow_time_s"),
    ("update", "perf/update_time_s"),
    ("weight sync", "perf/sync_time_s"),
    ("evaluation", "perf/eval_time_s"),
    ("checkpoint", "perf/checkpoint_time_s"),
)

# key -> its nested parts (label, key), shown under it in the run report.
PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "perf/rollout_time_s": (
        ("generation", "perf/rollout_generate_time_s"),
        ("reward", "perf/reward_time_s"),
    ),
    "perf/rollout_generate_time_s": (("waiting on engines", "perf/rollout_wait_time_s"),),
    "perf/sync_time_s": (
        ("gather", "perf/sync_gather_time_s"),
        ("quantize", "perf/sync_quantize_time_s"),
        ("transfer", "perf/sync_transfer_time_s"),
        ("engine load", "perf/sync_load_time_s"),
        ("relay to other nodes", "perf/sync_relay_time_s"),
    ),
}

# Pipelined steps (train.pipeline=one_step_off): the next step's rollout in a driver thread,
# beside the phases above, not one of them (under it perf/rollout_time_s is the trainer's wait).
BESIDE: tuple[tuple[str, str], ...] = (
    ("rollout beside the trainer (pipelined)", "perf/pipeline/rollout_time_s"),
    ("of it, overlapping the trainer's work", "perf/pipeline/overlap_time_s"),
    ("engines waiting for the trainer", "perf/pipeline/engine_idle_time_s"),
)

AMORTISED_KEYS = (STEP, *(key for _, key in PHASES), OTHER)


def other_time(metrics: dict) -> float:
    """``perf/step_time_s`` minus the phases present in ``metrics`` (float rounding clamped to 0)."""
    return max(0.0, metrics[STEP] - sum(metrics.get(key, 0.0) for _, key in PHASES))


def amortised_key(key: str) -> str:
    return AMORTISED + key.removeprefix("perf/")


class StepClock:
    """The driver's step windows: :meth:`add` time spent between two lines (it belongs to the next
    one), :meth:`finish` a step's metrics (step time, other, running means) and open the next
    window."""

    def __init__(self):
        self.start = time.perf_counter()
        self.pending: collections.Counter = collections.Counter()
        self.totals: collections.Counter = collections.Counter()
        self.steps = 0

    def add(self, key: str, seconds: float) -> None:
        self.pending[key] += seconds

    def finish(self, metrics: dict) -> None:
        """Add ``perf/step_time_s``, ``perf/other_time_s`` and ``perf/amortised/*`` to ``metrics``
        (and the pending times); the next window starts now."""
        now = time.perf_counter()
        for key, seconds in self.pending.items():
            metrics[key] = metrics.get(key, 0.0) + seconds
        self.pending.clear()
        metrics[STEP] = now - self.start
        metrics[OTHER] = other_time(metrics)
        self.start = now
        self.steps += 1
        for key in AMORTISED_KEYS:
            if key in metrics or key in self.totals:  # from the first step that has the phase
                self.totals[key] += metrics.get(key, 0.0)
                metrics[amortised_key(key)] = self.totals[key] / self.steps


class Throughput:
    """Tokens that carried gradient per second: of one step's training phases (rollout to sync:
    evaluations and checkpoints excluded), and of this process's run (time lost to rolled-back
    steps and dynamic-sampling refills counts against it). The run's clock starts here."""

    def __init__(self):
        self.tokens = 0.0
        self.started = time.perf_counter()

    def add(self, metrics: dict, step_started: float) -> None:
        """``perf/useful_tokens_per_s`` and ``perf/useful_tokens_per_s_run`` into ``metrics``."""
        tokens = metrics["perf/useful_tokens"]
        self.tokens += tokens
        now = time.perf_counter()
        metrics["perf/useful_tokens_per_s"] = tokens / (now - step_started)
        metrics["perf/useful_tokens_per_s_run"] = self.tokens / (now - self.started)
