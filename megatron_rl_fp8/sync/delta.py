"""FP8-native delta weight syncs (issue 48): after a full sync, a later sync sends per tensor only
the elements that changed, exploiting FP8's coarse grid (one optimizer step moves few e4m3 codes
across a rounding boundary), and falls back to the full tensor where that is smaller.

Sender and receiver each keep the last synced version of every tensor (the sender: what it sent;
a receiver: what it holds, e.g. a node's relay rank for its engines). A sync is a
:class:`DeltaSync`: the version it makes, the version it applies to (``base``), and per tensor
either its full value or a :class:`TensorDelta` (flat positions of the changed elements, int32,
and their new values in the tensor's dtype: 5 bytes per changed e4m3 code, 8 per float32 scale),
each with a digest of the result. A receiver on another version (relaunched, rejoined, one sync
behind) cannot apply it: :meth:`DeltaReceiver.apply` raises :class:`NeedFullSync` with the
reason, and the sender's next sync to it is full (:meth:`DeltaSender.encode` with ``full``).

Elements are compared by their bytes, so a delta is exact for every dtype (FP8 codes, their
float32 block scales, BF16 norms), and the receiver's tensors after any chain of deltas equal a
full sync's bit for bit; the digests check that at every apply (``verify``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

import torch

_INDEX = torch.int32
_INDEX_BYTES = 4


def digest(t: torch.Tensor) -> str:
    """A tensor's content digest (its dtype, shape and bytes; blake2b, 16 hex digits)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(_bytes(t).numpy().tobytes())
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat unsigned view of the same width: byte-exact comparisons."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width)


@dataclasses.dataclass(frozen=True)
class TensorDelta:
    """The elements of one tensor that changed: flat ``positions`` and their new ``values``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor  # int32 [n]
    values: torch.Tensor  # [n], in ``dtype``

    @property
    def nbytes(self) -> int:
        return (
            self.positions.numel() * _INDEX_BYTES + self.values.numel() * self.values.element_size()
        )

    @property
    def numel(self) -> int:
        """The whole tensor's element count."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass
class DeltaSync:
    """One sync as a chain link: ``version`` made from ``base`` (None: a full sync, which any
    receiver takes). ``tensors``: name -> full tensor or :class:`TensorDelta`; ``digests``: name
    -> the digest of the resulting tensor."""

    version: int
    base: int | None
    tensors: dict[str, torch.Tensor | TensorDelta]
    digests: dict[str, str]
    reason: str = ""  # why a sync that could have been a delta is full

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes if isinstance(t, TensorDelta) else t.numel() * t.element_size()
            for t in self.tensors.values()
        )

    @property
    def full_nbytes(self) -> int:
        """What the same sync sends in full."""
        return sum(
            t.numel * t.values.element_size() if isinstance(t, TensorDelta) else
            t.numel() * t.element_size()
            for t in self.tensors.values()
        )  # fmt: skip


class NeedFullSync(RuntimeError):
    """A receiver cannot apply a delta (another version, a missing tensor, a digest mismatch);
    the message is the one-line reason."""


def delta_of(old: torch.Tensor, new: torch.Tensor) -> TensorDelta:
    """The elements of ``new`` that differ (by bytes) from ``old`` (same shape and dtype)."""
    a, b = _bytes(old), _bytes(new)
    positions = (a != b).nonzero().reshape(-1)
    values = new.detach().contiguous().reshape(-1).cpu()[positions]
    return TensorDelta(tuple(new.shape), new.dtype, positions.to(_INDEX), values)


class DeltaSender:
    """The sending side: the last version it sent of every tensor (host copies)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self._last: dict[str, torch.Tensor] = {}

    def encode(
        self, named: Iterable[tuple[str, torch.Tensor]], *, version: int, full: str = ""
    ) -> DeltaSync:
        """Sync ``version`` of the ``named`` tensors: per tensor a delta against the last
        version sent, where smaller than the tensor; all full when ``full`` gives a reason (a
        receiver on another version) or nothing was sent before."""
        reason = full or ("" if self.version is not None else "the first sync")
        base = None if reason else self.version
        tensors: dict[str, torch.Tensor | TensorDelta] = {}
        digests: dict[str, str] = {}
        last: dict[str, torch.Tensor] = {}
        for name, t in named:
            t = t.detach().contiguous().cpu()
            old = self._last.get(name)
            item: torch.Tensor | TensorDelta = t
            if (
                base is not None
                and old is not None
                and old.shape == t.shape
                and old.dtype == t.dtype
            ):
                delta = delta_of(old, t)
                if delta.nbytes < t.numel() * t.element_size():
                    item = delta
            tensors[name] = item
            digests[name] = digest(t)
            last[name] = t.clone()
        self._last, self.version = last, version
        return DeltaSync(version, base, tensors, digests, reason)


class DeltaReceiver:
    """The receiving side: its current version and tensors. ``verify``: check every tensor's
    digest after applying (the chain's end-to-end check)."""

    def __init__(self, *, verify: bool = True) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.verify = verify

    def apply(self, sync: DeltaSync) -> dict[str, torch.Tensor]:
        """Apply ``sync``; returns the full tensors it changed or sent (what to push on to the
        engines). Raises :class:`NeedFullSync` (and changes nothing) when a delta does not apply
        here."""
        if sync.base is not None and sync.base != self.version:
            raise NeedFullSync(
                f"a delta from version {sync.base} reached a receiver at version {self.version}"
            )
        out: dict[str, torch.Tensor] = {}
        for name, item in sync.tensors.items():
            if not isinstance(item, TensorDelta):
                out[name] = item.clone()
                continue
            old = self.tensors.get(name)
            if old is None or tuple(old.shape) != item.shape or old.dtype != item.dtype:
                raise NeedFullSync(f"a delta for {name}, which this receiver does not hold as is")
            if item.positions.numel() == 0:
                continue
            new = old.clone()
            new.view(-1)[item.positions.long()] = item.values
            out[name] = new
        if self.verify:
            for name, t in out.items():
                if digest(t) != sync.digests[name]:
                    raise NeedFullSync(f"{name} differs from the sender's after the sync")
        self.tensors.update(out)
        self.version = sync.version
        return out
