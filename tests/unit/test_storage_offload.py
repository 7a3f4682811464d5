"""``StorageOffload``, the core of the trainer's offload (``trainer/offload.py``), on hand-made
tensors: each storage once however many views and names reach it, and the tensors it must leave
alone (no storage, zero-size, not resizable, not on the device). The real actor is in
``tests/distributed/test_offload.py``."""

import numpy as np
import pytest
import torch

from megatron_rl_fp8.trainer.offload import StorageOffload


def _bits(t):
    return t.detach().clone().reshape(-1).view(torch.uint8)


class _Tensors:
    """A Megatron-like layout: weights that are views into one flat buffer, a tied weight reached
    under two names, a separate Adam moment, a gradient buffer (and a view of it reached as a
    weight's gradient), and the tensors the offload must skip."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.flat = torch.randn(10, generator=g)
        self.w1, self.w2 = self.flat[:4].view(2, 2), self.flat[4:]
        self.moment = torch.randn(3, generator=g, dtype=torch.float64)
        self.grads = torch.randn(6, generator=g)
        self.grad_view = self.grads[2:]
        self.mixed = torch.randn(2, generator=g)  # reached both as a gradient and not
        self.empty = torch.empty(0)
        self.meta = torch.empty(5, device="meta")
        self.foreign = torch.from_numpy(np.arange(4, dtype=np.float32))  # not resizable

    def __call__(self):
        yield self.w1, False
        yield self.w2, False
        yield self.w1, False  # the tied weight, under its second name
        yield self.moment, False
        yield self.grads, True
        yield self.grad_view, True
        yield self.mixed, True
        yield self.mixed, False
        yield None, True  # a weight without a gradient
        yield self.empty, False
        yield self.meta, False
        yield self.foreign, False

    def kept(self):
        """The tensors whose bytes come back, by name."""
        return {"flat": self.flat, "moment": self.moment, "grads": self.grads, "mixed": self.mixed}


MOVED = 10 * 4 + 3 * 8 + 6 * 4 + 2 * 4  # flat, moment, grads, mixed: each storage once


def test_offload_moves_each_storage_once_and_reload_restores_it():
    ts = _Tensors()
    before = {k: _bits(v) for k, v in ts.kept().items()}
    off = StorageOffload(ts, torch.device("cpu"))
    assert off.offload() == MOVED
    assert off.is_offloaded and off.offloaded_bytes == MOVED
    assert all(v.untyped_storage().nbytes() == 0 for v in ts.kept().values())
    assert off.skipped_bytes == 16  # the numpy-backed tensor stays, untouched
    assert ts.foreign.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert off.offload() == 0  # called twice: nothing more to move
    off.reload()
    assert not off.is_offloaded and off.offloaded_bytes == 0
    for k, v in ts.kept().items():
        assert torch.equal(_bits(v), before[k]), k
    # Views see the same storage again: the layout survived.
    assert torch.equal(ts.w2, ts.flat[4:]) and ts.w1.data_ptr() == ts.flat.data_ptr()
    off.reload()  # nothing offloaded: a no-op
    assert off.metrics()["perf/offloaded_gb"] == MOVED / 1e9


def test_dropped_gradients_come_back_zeroed():
    ts = _Tensors()
    before = {k: _bits(v) for k, v in ts.kept().items()}
    off = StorageOffload(ts, torch.device("cpu"), keep_grads=False)
    assert off.offload() == MOVED  # freed all the same
    off.reload()
    assert not ts.grads.any()
    # Reached as something other than a gradient too: copied.
    for k in ("flat", "moment", "mixed"):
        assert torch.equal(_bits(ts.kept()[k]), before[k]), k


def test_host_buffers_are_reused_between_cycles():
    ts = _Tensors()
    off = StorageOffload(ts, torch.device("cpu"))
    off.offload()
    first = sorted(e.host.data_ptr() for e in off._entries)
    off.reload()
    off.offload()
    assert sorted(e.host.data_ptr() for e in off._entries) == first
    off.reload()
    uncached = StorageOffload(ts, torch.device("cpu"), cache_host_buffers=False)
    uncached.offload()
    uncached.reload()
    assert uncached._pool == {}


def test_only_storages_on_the_device_move():
    ts = _Tensors()
    off = StorageOffload(ts, torch.device("cuda", 0))  # nothing here lives there
    assert off.offload() == 0
    assert ts.flat.untyped_storage().nbytes() == 40
    off.reload()


def test_wrapper_tensors_move_through_their_inner_tensors():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    a, b = torch.arange(3.0), torch.arange(3.0, 6.0)
    wrapped = two_tensor.TwoTensor(a, b)
    off = StorageOffload(lambda: [(wrapped, False)], torch.device("cpu"))
    assert off.offload() == 24
    assert a.untyped_storage().nbytes() == 0
    off.reload()
    assert a.tolist() == [0.0, 1.0, 2.0] and b.tolist() == [3.0, 4.0, 5.0]


def test_offloaded_context_reloads_on_error():
    ts = _Tensors()
    off = StorageOffload(ts, torch.device("cpu"))
    with pytest.raises(KeyError), off.offloaded():
        assert ts.flat.untyped_storage().nbytes() == 0
        raise KeyError("the rollout failed")
    assert not off.is_offloaded and ts.flat.untyped_storage().nbytes() == 40
