"""A batch through Megatron's pipeline schedule: split into micro-batches, run forward (and
backward) with ``get_forward_backward_func`` so PP=1 and PP>1 share one path, and merged back.

The actor and the frozen KL reference (``trainer/reference.py``) both split with
:func:`split_for_model` and run with :func:`run_schedule`. Sequence lengths are padded to what
sequence / context parallelism and Transformer Engine's FP8 GEMMs need (:func:`seq_multiple`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_rl_fp8.fp8.te import te_fp8_align
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.trainer.batch import merge_rows, pack_by_tokens, row_lengths, take_rows
from megatron_rl_fp8.trainer.context_parallel import split_for_cp


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """A batch's rows split into micro-batches, and the way back to the batch's row order."""

    batches: list[dict]
    # Batch rows of each micro-batch under a token budget; None: consecutive rows, in order.
    groups: list[list[int]] | None = None
    width: int | None = None  # the batch's S, which merged per-token outputs get back

    @property
    def variable_shapes(self) -> bool:
        return self.groups is not None

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-micro-batch per-token outputs as one [B, S] tensor in the batch's row order (the
        positions padded for ``seq_multiple`` cut off again)."""
        if self.groups is None:
            merged = torch.cat(parts)
            return merged if self.width is None else merged[:, : self.width]
        return merge_rows(parts, self.groups, self.width)


def seq_multiple(config) -> int:
    """What every micro-batch's sequence length must be a multiple of under this Megatron config:
    context parallelism cuts sequences into 2 * CP chunks, sequence parallelism splits each CP
    rank's share over the TP ranks. Under Transformer Engine FP8 (``config.fp8`` set) each rank's
    share of a sequence is also a multiple of what TE's FP8 GEMMs need of their rows (8; 32 under
    MXFP8), so that a linear's input rows (that share x the micro-batch's rows, any row count)
    meet TE's rule (``fp8/te.py: te_fp8_align``)."""
    cp = config.context_parallel_size
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if config.fp8:
        rows = te_fp8_align(getattr(config, "fp8_recipe", None))[0]
        return rows * cp * tp  # a multiple of 2 * CP too
    return (2 * cp if cp > 1 else 1) * tp


def _pad_positions(v: torch.Tensor, extra: int) -> torch.Tensor:
    """A per-token tensor ([B, S, ...]) with ``extra`` zero positions appended along S."""
    return torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, extra))


def split_micro_batches(
    batch: dict[str, torch.Tensor],
    micro_batch_size: int,
    max_tokens: int | None = None,
    *,
    multiple: int = 1,
) -> MicroBatches:
    """``micro_batch_size`` consecutive rows at a time, each padded to the batch's S; or, with a
    token budget ``max_tokens``, rows grouped by ``pack_by_tokens`` over their real lengths
    (``row_lengths`` of ``loss_mask``, rounded up to ``multiple``), each micro-batch cut to its
    own longest row (``micro_batch_size`` unused). Sequence lengths are padded up to a multiple
    of ``multiple`` (``seq_multiple``: sequence / context parallelism split them)."""
    n, width = batch["input_ids"].shape
    padded = math.ceil(width / multiple) * multiple
    if padded != width:
        # Right padding (token 0, no loss): causal attention keeps it from the real positions.
        batch = {
            k: _pad_positions(v, padded - width) if v.dim() >= 2 else v for k, v in batch.items()
        }
    if max_tokens is None:
        return MicroBatches(
            [
                {k: v[i : i + micro_batch_size] for k, v in batch.items()}
                for i in range(0, n, micro_batch_size)
            ],
            width=width,
        )
    lengths = [
        min(math.ceil(length / multiple) * multiple, padded)
        for length in row_lengths(batch["loss_mask"])
    ]
    groups = pack_by_tokens(lengths, max_tokens)
    # Rows come longest first: a micro-batch's first row is its longest.
    batches = [take_rows(batch, rows, lengths[rows[0]]) for rows in groups]
    return MicroBatches(batches, groups, width)


def split_for_model(
    batch: dict, micro_batch_size: int, max_tokens: int | None, config, groups: Groups
) -> MicroBatches:
    """``split_micro_batches`` for a model built with Megatron ``config`` on ``groups``: lengths
    padded for its sequence / context split, and the token budget per GPU (a CP rank holds
    1 / CP of each sequence's tokens). The actor and the KL reference split alike."""
    return split_micro_batches(
        batch,
        micro_batch_size,
        max_tokens * groups.cp_size if max_tokens is not None else None,
        multiple=seq_multiple(config),
    )


def run_schedule(
    model,
    device,
    micro_batches: MicroBatches,
    loss_fn: Callable,
    *,
    forward_only: bool,
    before_forward: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Megatron's forward(/backward) schedule over ``micro_batches`` (PP=1 and PP>1 alike);
    returns the per-micro-batch dicts of ``loss_fn`` (last pipeline stage only). The actor and
    the frozen KL reference both run their passes through it. ``before_forward(mb)``: called
    with each micro-batch as the model will see it (on its device, this CP rank's share), just
    before its forward (the actor's routing replay)."""
    if micro_batches.variable_shapes:
        # Micro-batches differ in rows and length (token budget): the pipeline's p2p then sends
        # each activation's [S, rows, hidden] shape ahead of it (both dims may vary), and the
        # seq_length / micro_batch_size below are only the schedule's unused shape hints. Only
        # the p2p reads this flag (PP=1 has none); every stage of a pipeline sees the same
        # micro-batches, so all set it in the same call.
        get_model_config(model).variable_seq_lengths = True
    micro_batches = micro_batches.batches
    cp_size = get_model_config(model).context_parallel_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_size > 1 else 0

    def forward_step(data_iterator, model):
        # Batches are built on the host; the model's device is CUDA on GPU clusters.
        mb = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
        if cp_size > 1:
            # This CP rank's tokens of every sequence; loss_fn sees the same share.
            mb = split_for_cp(mb, cp_size, cp_rank)
            pos = mb.pop("position_ids")
        else:
            ids = mb["input_ids"]
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        if before_forward is not None:
            before_forward(mb)
        # attention_mask=None: the local spec applies a causal mask; right padding never
        # influences earlier (real) positions under a causal mask.
        output = model(mb["input_ids"], pos, None)
        return output, functools.partial(loss_fn, mb)

    fwd_bwd = get_forward_backward_func()
    seq_len = micro_batches[0]["input_ids"].shape[1]
    return fwd_bwd(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_len,
        micro_batch_size=micro_batches[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )
