"""The one error type of the conversion tools: what is wrong, with which file or tensor, and what to do."""

from __future__ import annotations


class ConvertError(RuntimeError):
    """A checkpoint cannot be converted; nothing was written to the output directory."""
