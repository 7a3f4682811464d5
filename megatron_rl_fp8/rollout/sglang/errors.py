"""The SGLang engines' errors: one to report, one to recover from, two that ask the trainer
to sync again."""

from __future__ import annotations


class SGLangServerError(RuntimeError):
    """The SGLang server failed, or answered something the engine cannot accept."""


class SyncFailed(SGLangServerError):
    """A sync did not reach every engine of a fleet; their weights are unknown until the trainer
    runs the sync again (the engines that failed have been relaunched)."""


class RolloutLost(SGLangServerError):
    """No engine serves the synced weights any more (the ones that died in a rollout have been
    relaunched on placeholder weights): the trainer syncs them and runs the rollout again."""


class _ServerGone(SGLangServerError):
    """The server died, hung or answered for the wrong weights: restart it and retry."""


def _first_line(error: Exception | None) -> str:
    if error is None:
        return "restart requested"
    return (str(error).splitlines() or [repr(error)])[0]
