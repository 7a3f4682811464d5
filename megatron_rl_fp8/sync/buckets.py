"""The export path of a weight sync: full Megatron tensors -> HF names -> rollout FP8 -> buckets.

A rollout server takes weights in a few large messages, not one per tensor (each update call has a
fixed cost: an HTTP round trip, a scheduler pause, a process-group broadcast) and not all at once
(that would hold the model twice). So the stream is cut into *buckets* of at most ``bucket_bytes``
(512 MB by default, as slime and verl do), built one at a time: at most one bucket plus the tensor
being converted is alive on the sending side.

Steps, each streaming one tensor at a time::

    iter_full_params (sync/gather: TP all-gather + PP send)   -> (Megatron name, full tensor)
    mcore_state_to_hf (sync/hf_mapping: rename, split qkv/fc1) -> (HF name, tensor)
    quantize_for_rollout (sync/quantize: e4m3 + _scale_inv)    -> what an FP8 server loads
    [dequantize_stream, for servers that cannot run FP8 GEMMs (CPU): the FP8 *values*, in dtype]
    iter_buckets                                               -> lists of (name, tensor)

An FP8 weight and its ``_scale_inv`` always land in the same bucket, so a server never holds new
codes with old scales between two bucket updates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator

import torch

from megatron_rl_fp8.fp8.config import RolloutFP8Config
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import mcore_state_to_hf
from megatron_rl_fp8.sync.quantize import (
    SCALE_SUFFIX,
    dequantize_stream,
    is_fp8_weight,
    quantize_for_rollout,
)

MB = 1 << 20


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass
class Bucket:
    """One message to the rollout engine: named full tensors, in stream order. ``handover``: the
    tensors are views into buffers made to be handed to other processes (``sync/ipc.py``) that
    nothing else holds or changes (the per-node relay's received buckets); the ``tensor``
    transport hands them over as they are instead of copying them first."""

    index: int
    tensors: list[tuple[str, torch.Tensor]]
    handover: bool = False

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for _, t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group a stream into buckets of at most ``bucket_bytes`` (a single larger tensor travels
    alone). A ``<name>_scale_inv`` joins the bucket of ``<name>`` even if that overshoots."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    index = 0
    for name, t in named:
        n = tensor_bytes(t)
        pairs_with_last = (
            name.endswith(SCALE_SUFFIX) and current and current[-1][0] == name[: -len(SCALE_SUFFIX)]
        )
        if current and size + n > bucket_bytes and not pairs_with_last:
            yield Bucket(index, current)
            index += 1
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        yield Bucket(index, current)


@dataclasses.dataclass
class ExportStats:
    """What one export moved (filled in as the stream is consumed)."""

    tensors: int = 0
    buckets: int = 0
    bytes_out: int = 0  # bytes of the exported tensors (after quantization)
    seconds: float = 0.0  # wall time inside the export generators (gather + convert + quantize)


def export_for_rollout(
    full_params: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    fp8: RolloutFP8Config,
    *,
    bucket_mb: float = 512,
    dequantize_to: torch.dtype | None = None,
    stats: ExportStats | None = None,
) -> Iterator[Bucket]:
    """The export path of every weight sync: Megatron-named full tensors -> engine buckets.

    ``full_params`` is the (Megatron name, full tensor) stream of ``sync.gather.iter_full_params``
    (or any full state dict's items). The trainer's ``EngineLink.sync``, ``benchmarks/bench_sync.py`` and
    the tests all call this one function, with the engine's ``export_options`` (its bucket size,
    and ``dequantize_to`` for servers without FP8 kernels).
    """
    return rollout_buckets(
        mcore_state_to_hf(full_params, model),
        fp8,
        bucket_mb=bucket_mb,
        dequantize_to=dequantize_to,
        stats=stats,
    )


def rollout_buckets(
    hf_named: Iterable[tuple[str, torch.Tensor]],
    fp8: RolloutFP8Config,
    *,
    bucket_mb: float = 512,
    dequantize_to: torch.dtype | None = None,
    stats: ExportStats | None = None,
) -> Iterator[Bucket]:
    """Buckets of HF-named tensors as the rollout engine should load them (the second half of
    :func:`export_for_rollout`, for weights that already have HF names).

    With ``fp8.enabled`` the transformer linears arrive as e4m3 codes + ``_scale_inv``;
    ``dequantize_to`` turns them back into that dtype (servers without FP8 kernels still serve the
    FP8-rounded weights), and casts every other tensor to it too.
    """
    stats = stats if stats is not None else ExportStats()
    stream = rollout_stream(hf_named, fp8, dequantize_to=dequantize_to)
    buckets = iter_buckets(_timed(stream, stats), int(bucket_mb * MB))
    while True:
        t0 = time.perf_counter()
        bucket = next(buckets, None)
        stats.seconds += time.perf_counter() - t0
        if bucket is None:
            return
        stats.buckets += 1
        yield bucket


def rollout_stream(
    hf_named: Iterable[tuple[str, torch.Tensor]],
    fp8: RolloutFP8Config,
    *,
    dequantize_to: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in the rollout recipe: FP8-eligible weights that arrive in full precision
    are quantized here (ones already quantized upstream pass through), then optionally turned back
    into ``dequantize_to`` values for servers without FP8 kernels."""
    stream = _quantize_missing(hf_named, fp8)
    if dequantize_to is not None:
        stream = _cast(
            dequantize_stream(stream, block=fp8.weight_block, dtype=dequantize_to), dequantize_to
        )
    return stream


def _quantize_missing(named, fp8: RolloutFP8Config):
    for name, t in named:
        if fp8.enabled and is_fp8_weight(name) and t.is_floating_point() and t.element_size() > 1:
            yield from quantize_for_rollout([(name, t)], fp8)
        else:
            yield name, t


def _cast(named, dtype):
    for name, t in named:
        yield name, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def _timed(named, stats: ExportStats):
    for name, t in named:
        stats.tensors += 1
        stats.bytes_out += tensor_bytes(t)
        yield name, t
