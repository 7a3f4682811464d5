"""FP8 delta syncs (issue 48, ``sync/delta.py``): a chain of delta syncs leaves a receiver's
tensors bit-equal to a full sync's of the same weights, over 20 optimizer-sized steps of block-FP8
weights (codes, float32 block scales, a BF16 norm); a receiver relaunched or one sync behind is
refused the delta with its reason and takes a full sync; a corrupted delta is caught by its
digest."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_fp8.fp8.quantize import quantize_blockwise
from megatron_rl_fp8.sync.delta import (
    DeltaReceiver,
    DeltaSender,
    DeltaSync,
    NeedFullSync,
    TensorDelta,
)


class _Weights:
    """A 256 x 384 Gaussian weight (std 0.02) and a norm, moved each step by an Adam-sized
    update (each element by about ``lr``, random signs), exported as block FP8 (128 x 128)."""

    def __init__(self, seed: int = 0, pow2: bool = False):
        self.gen = torch.Generator().manual_seed(seed)
        self.w = 0.02 * torch.randn(256, 384, generator=self.gen)
        self.norm = 1 + 0.1 * torch.randn(384, generator=self.gen)
        self.pow2 = pow2

    def step(self, lr: float) -> None:
        self.w += lr * torch.randn(self.w.shape, generator=self.gen).sign()
        self.norm += lr * torch.randn(self.norm.shape, generator=self.gen).sign()

    def export(self) -> list[tuple[str, torch.Tensor]]:
        codes, scale_inv = quantize_blockwise(self.w, (128, 128), pow2_scale=self.pow2)
        return [
            ("layers.0.mlp.down_proj.weight", codes),
            ("layers.0.mlp.down_proj.weight_scale_inv", scale_inv),
            ("layers.0.post_attention_layernorm.weight", self.norm.to(torch.bfloat16)),
        ]


def _equal(a: dict, b: list) -> bool:
    return sorted(a) == sorted(n for n, _ in b) and all(
        a[n].dtype == t.dtype and torch.equal(a[n].view(torch.uint8), t.view(torch.uint8))
        for n, t in b
    )


def test_twenty_delta_syncs_equal_a_full_sync_bit_for_bit():
    weights, sender, receiver = _Weights(), DeltaSender(), DeltaReceiver()
    first = sender.encode(weights.export(), version=0)
    assert first.base is None and first.reason == "the first sync"
    receiver.apply(first)
    ratios = []
    for version in range(1, 21):
        weights.step(lr=1e-5)
        sync = sender.encode(weights.export(), version=version)
        assert sync.base == version - 1
        receiver.apply(sync)
        assert receiver.version == version
        assert _equal(receiver.tensors, weights.export())  # what a full sync would hold
        codes = sync.tensors["layers.0.mlp.down_proj.weight"]
        assert isinstance(codes, TensorDelta)  # few codes change: the delta is smaller
        ratios.append(sync.nbytes / sync.full_nbytes)
    assert max(ratios) < 0.5, ratios


def test_pow2_scales_stay_still_between_steps():
    """UE8M0 (power-of-two) block scales change only where a block's amax crosses a power of
    two: after a small step, no scale element travels."""
    weights, sender = _Weights(pow2=True), DeltaSender()
    sender.encode(weights.export(), version=0)
    weights.step(lr=1e-6)
    scales = sender.encode(weights.export(), version=1).tensors[
        "layers.0.mlp.down_proj.weight_scale_inv"
    ]
    assert isinstance(scales, TensorDelta) and scales.positions.numel() == 0


def test_a_relaunched_or_lagging_receiver_takes_a_full_sync():
    weights, sender = _Weights(), DeltaSender()
    behind, fresh = DeltaReceiver(), DeltaReceiver()
    behind.apply(sender.encode(weights.export(), version=0))
    weights.step(lr=1e-5)
    sender.encode(weights.export(), version=1)  # `behind` missed this one
    weights.step(lr=1e-5)
    delta = sender.encode(weights.export(), version=2)
    for receiver, why in ((behind, "at version 0"), (fresh, "at version None")):
        with pytest.raises(NeedFullSync, match=f"from version 1 reached a receiver {why}"):
            receiver.apply(delta)
    assert behind.version == 0  # a refused delta changes nothing
    weights.step(lr=1e-5)
    full = sender.encode(weights.export(), version=3, full="a receiver is at another version")
    assert full.base is None and full.reason == "a receiver is at another version"
    for receiver in (behind, fresh):
        receiver.apply(full)
        assert receiver.version == 3 and _equal(receiver.tensors, weights.export())


def test_a_corrupted_delta_fails_its_digest():
    weights, sender, receiver = _Weights(), DeltaSender(), DeltaReceiver()
    receiver.apply(sender.encode(weights.export(), version=0))
    weights.step(lr=1e-5)
    sync = sender.encode(weights.export(), version=1)
    codes = sync.tensors["layers.0.mlp.down_proj.weight"]
    flipped = codes.values.view(torch.uint8) ^ 1
    bad = dict(sync.tensors)
    bad["layers.0.mlp.down_proj.weight"] = TensorDelta(
        codes.shape, codes.dtype, codes.positions, flipped.view(codes.dtype)
    )
    with pytest.raises(NeedFullSync, match="differs from the sender's"):
        receiver.apply(DeltaSync(sync.version, sync.base, bad, sync.digests))
    assert receiver.version is None  # its copy is now unknown: only a full sync applies
    with pytest.raises(NeedFullSync, match="at version None"):
        receiver.apply(sync)
    receiver.apply(sender.encode(weights.export(), version=2, full="the receiver failed"))
    assert receiver.version == 2 and _equal(receiver.tensors, weights.export())


def test_a_sync_that_does_not_finish_makes_the_next_one_full():
    weights, sender = _Weights(), DeltaSender()
    sender.encode(weights.export(), version=0)
    sender.begin(1)
    sender.encode_tensor(*weights.export()[0])  # the stream broke here
    assert sender.version is None
    assert sender.begin(2) == (None, "the last sync did not finish")
