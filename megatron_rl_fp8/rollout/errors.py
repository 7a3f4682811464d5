"""The rollout engines' errors, for every engine and for the trainer that handles them: one to
report, one to recover from inside an engine, two that ask the trainer to sync again.

The trainer (``trainer/engine_link.py``, ``trainer/sampling.py``) catches :class:`SyncFailed` and
:class:`RolloutLost` without knowing which engine raised them; the CLI prints any
:class:`RolloutEngineError` as one line.
"""

from __future__ import annotations


class RolloutEngineError(RuntimeError):
    """A rollout engine failed (an SGLang server that will not start, none left serving), or
    answered something the trainer cannot accept."""


class SyncFailed(RolloutEngineError):
    """A sync did not reach every engine of a fleet; their weights are unknown until the trainer
    runs the sync again (the engines that failed have been relaunched)."""


class RolloutLost(RolloutEngineError):
    """No engine serves the synced weights any more (the ones that died in a rollout have been
    relaunched on placeholder weights): the trainer syncs them and runs the rollout again."""


class ServerGone(RolloutEngineError):
    """An engine's server died, hung or answered for the wrong weights: restart it and retry."""


def first_line(error: Exception | None) -> str:
    """The first line of ``error``'s message, for one-line reports (None: a requested restart)."""
    if error is None:
        return "restart requested"
    return (str(error).splitlines() or [repr(error)])[0]
