"""The SGLang engine's two errors: one to report, one to recover from."""

from __future__ import annotations


class SGLangServerError(RuntimeError):
    """The SGLang server failed, or answered something the engine cannot accept."""


class _ServerGone(SGLangServerError):
    """The server died, hung or answered for the wrong weights: restart it and retry."""


def _first_line(error: Exception | None) -> str:
    if error is None:
        return "restart requested"
    return (str(error).splitlines() or [repr(error)])[0]
