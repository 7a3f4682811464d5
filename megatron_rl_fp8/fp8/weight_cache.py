"""FP8 copies of a linear's weight, reused while the weight cannot change.

The actor opens :meth:`WeightCache.scope` around each forward / backward schedule (every
micro-batch of one mini-batch sees the same weights; the optimizer steps after it). Inside, a
backend quantizes each weight once per layout (``"fprop"``, ``"dgrad"``) and every later
micro-batch reuses it; outside, nothing is kept. A key of the weight's storage, version and shape
guards the caller's promise: another tensor, or an in-place update through autograd-visible ops,
misses. (Megatron's optimizer writes ``.data``, which does not bump the version: hence the
explicit scope.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class WeightCache:
    """One linear's cached weight operands by layout; ``enabled=False`` never keeps any (a recipe
    whose weight scale changes per call: delayed scaling)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.entries: dict[str, tuple[tuple, Any]] | None = None  # layout -> (key, operand)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Reuse inside the block (nests: the outermost scope clears it on exit)."""
        if self.entries is not None:
            yield
            return
        self.entries = {}
        try:
            yield
        finally:
            self.entries = None

    @property
    def active(self) -> bool:
        """Inside a scope, and caching is on."""
        return self.enabled and self.entries is not None

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        return (weight.data_ptr(), weight._version, tuple(weight.shape))

    def get(self, weight: torch.Tensor, layout: str) -> Any | None:
        """The cached ``layout`` operand of ``weight``, or None."""
        if not self.active:
            return None
        hit = self.entries.get(layout)
        return hit[1] if hit is not None and hit[0] == self._key(weight) else None

    def fetch(self, weight: torch.Tensor, layout: str, make: Callable[[], Any]) -> Any:
        """``weight``'s cached ``layout`` operand, else ``make()``, kept where caching is on."""
        hit = self.get(weight, layout)
        if hit is not None:
            return hit
        operand = make()
        if self.active:
            self.entries[layout] = (self._key(weight), operand)
        return operand
