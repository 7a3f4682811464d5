"""FP8 in the actor: TE autocast, real FP8 GEMMs via torch, or emulated FP8 linears; one switch.

Which of the four backends runs is ``fp8.backend`` (``fp8/backend.py: resolve_backend``). Under ``te``
(GPU, TE spec), FP8 is Megatron-Core's own: ``TransformerConfig.fp8`` and ``fp8_recipe``
(``fp8.te.megatron_fp8_kwargs``) make every TE linear run FP8 GEMMs.

Under ``torch`` and ``emulate`` the local spec's ``ColumnParallelLinear`` / ``RowParallelLinear``
compute their GEMMs through :class:`megatron_rl_fp8.fp8.torch_backend.FP8LinearTorch` (real FP8
codes into ``torch._scaled_mm``) or :class:`megatron_rl_fp8.fp8.FP8LinearEmulator`
(quantize-dequantize) instead: same layer classes, same parameters and sharding, but the three
GEMMs of each linear (fprop, dgrad, wgrad) read FP8 operands with the recipe's granularity. Layers
kept in BF16 (first/last N, the LM head) keep Megatron's GEMM. Each such linear owns its
delayed-scaling amax histories, as TE modules do.

:func:`full_precision` switches FP8 off for a block of code (the BF16 shadow pass of calibrated
clipping): the same weights, the same layers, unquantized GEMMs, no amax-history updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.emulation import FP8LinearEmulator, quantization_error
from megatron_rl_fp8.fp8.te import te_fp8_off, te_step_scales
from megatron_rl_fp8.fp8.torch_backend import FP8LinearTorch
from megatron_rl_fp8.fp8.torchao_backend import FP8LinearTorchAO

_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _make_linear(fp8: FP8Config, backend: str):
    if backend == "emulate":
        return FP8LinearEmulator(fp8)
    if backend == "torch":
        return FP8LinearTorch(fp8)
    if backend == "torchao":
        return FP8LinearTorchAO(fp8)
    raise ValueError(
        f"backend={backend!r} has no FP8 linears to install (Transformer Engine's come with its "
        "layer spec); use 'torch' or 'emulate'"
    )


class _EmulatedGemm:
    """Replaces a Megatron linear's ``_forward_impl`` (the GEMM call) with an FP8 linear of the
    torch backend or the emulation (``emulator``: either, same call).

    Megatron passes the communication duties of the GEMM along with it, and they are kept: the
    column-parallel dgrad all-reduce (``copy_to_tensor_model_parallel_region``: identity forward,
    all-reduce backward) and, under sequence parallelism, the all-gather of the sequence-split
    input (``gather_from_sequence_parallel_region``: all-gather forward, reduce-scatter of the
    input gradient backward). The FP8 linear then sees the whole sequence, as it does without
    sequence parallelism: the same operands, so the same codes and scales (a tensorwise amax is
    over the gathered tensor, as TE's is over its all-gathered input).

    Memory under sequence parallelism: the torch backend gathers the input itself and keeps only
    this rank's part for its backward (``gathers_sequence``), as Megatron's own GEMM does; the
    emulation keeps the gathered input (it is for numerics, not memory).
    """

    def __init__(self, module: torch.nn.Module, emulator):
        self.original = module._forward_impl
        self.emulator = emulator
        self.enabled = True

    def __call__(
        self,
        input,
        weight,
        *args,
        bias=None,
        allreduce_dgrad=False,
        sequence_parallel=False,
        tp_group=None,
        **kwargs,
    ):
        # An expert that received no tokens multiplies an empty input: nothing to quantize (a
        # tensorwise or rowwise amax of no values is undefined), so Megatron's own GEMM runs it.
        if not self.enabled or (input.numel() == 0 and not sequence_parallel):
            return self.original(
                input,
                weight,
                *args,
                bias=bias,
                allreduce_dgrad=allreduce_dgrad,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                **kwargs,
            )
        if sequence_parallel:  # Megatron never sets allreduce_dgrad with it
            group = get_tensor_model_parallel_group_if_none(tp_group)
            if self.emulator.gathers_sequence:  # keeps only this rank's part for the backward
                return self.emulator(input, weight, bias, sp_group=group)
            input = mappings.gather_from_sequence_parallel_region(input, group=group)
        elif allreduce_dgrad:
            input = mappings.copy_to_tensor_model_parallel_region(input, group=tp_group)
        return self.emulator(input, weight, bias)


def emulated_linears(model) -> Iterator[tuple[str, torch.nn.Module, _EmulatedGemm]]:
    """(name, module, GEMM) for every linear of ``model`` whose FP8 this project runs (backend
    'emulate', 'torch' or 'torchao'; ``gemm.emulator`` tells which)."""
    for name, module in model.named_modules():
        gemm = module.__dict__.get("_forward_impl")
        if isinstance(gemm, _EmulatedGemm):
            yield name, module, gemm


def install_fp8_linears(model, fp8: FP8Config, num_layers: int, backend: str = "emulate") -> int:
    """Route the FP8 linears of this pipeline stage through ``backend`` ('emulate', 'torch' or 'torchao');
    returns how many.

    ``num_layers`` is the model's total depth (BF16 first/last layers are global positions).
    """
    if not fp8.enabled:
        return 0
    _make_linear(fp8, backend)  # an unknown backend fails before any module changes
    count = 0
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        if not fp8.layer_uses_fp8(layer.layer_number, num_layers):
            continue
        for name, module in layer.named_modules():
            if name.split(".")[-1] in _LINEARS:
                module._forward_impl = _EmulatedGemm(module, _make_linear(fp8, backend))
                count += 1
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and not fp8.keep_lm_head_bf16:
        output_layer._forward_impl = _EmulatedGemm(output_layer, _make_linear(fp8, backend))
        count += 1
    return count


@contextlib.contextmanager
def fp8_weight_cache(model) -> Iterator[None]:
    """Inside the block, torch-backend linears quantize each weight once and reuse it for every
    micro-batch (the caller guarantees the weights do not change there: one forward/backward
    schedule). No effect on the emulation or TE."""
    with contextlib.ExitStack() as stack:
        for _, _, gemm in emulated_linears(model):
            cache = getattr(gemm.emulator, "weight_cache", None)
            if cache is not None:
                stack.enter_context(cache())
        yield


@contextlib.contextmanager
def full_precision(model, config=None):
    """Run ``model`` without FP8 inside the block: emulated linears use Megatron's GEMM; on the TE
    path ``config.fp8`` is cleared so Megatron opens no FP8 autocast, and a disabled TE region
    keeps a step's held-scales region (:func:`step_fp8_scaling`) from applying (same weights)."""
    gemms = [g for _, _, g in emulated_linears(model)]
    # Restore what was there, not "on": the blocks nest (the stability guard's BF16 steps
    # contain the BF16 shadow passes).
    saved_enabled = [g.enabled for g in gemms]
    saved_fp8 = getattr(config, "fp8", None) if config is not None else None
    for g in gemms:
        g.enabled = False
    if saved_fp8 is not None:
        config.fp8 = None
    try:
        with te_fp8_off() if saved_fp8 is not None else contextlib.nullcontext():
            yield
    finally:
        for g, enabled in zip(gemms, saved_enabled):
            g.enabled = enabled
        if saved_fp8 is not None:
            config.fp8 = saved_fp8


def _scaling_states(model) -> Iterator[tuple[str, object]]:
    """(operand role, delayed-scaling state) of every FP8 linear this project runs."""
    for _, _, gemm in emulated_linears(model):
        yield from gemm.emulator.scaling_states().items()


@contextlib.contextmanager
def frozen_fp8_scaling(model) -> Iterator[None]:
    """Forward passes inside the block leave the delayed-scaling amax histories of ``model``'s
    FP8 linears as they found them: the calibration's FP8 pass then sees the scales the update's
    forward will use, and does not shift them (each pass would otherwise record its amaxes and
    move the next pass's scales). No effect without history (current scaling, blockwise) or on
    TE, whose modules keep their own: there the step's held region (:func:`step_fp8_scaling`)
    keeps the pass's scales the update's (docs/gpu_contracts.md, TE-7)."""
    saved = [
        (s, None if s.history is None else s.history.clone(), s.num_updates)
        for _, s in _scaling_states(model)
    ]
    try:
        yield
    finally:
        for s, history, num_updates in saved:
            s.history, s.num_updates = history, num_updates


@contextlib.contextmanager
def step_fp8_scaling(model, config=None) -> Iterator[None]:
    """Forward passes inside the block (one RL step's: old logprobs, calibration, updates)
    quantize activations and weights with the delayed scales the block began with; their amaxes
    still enter the histories, and the scales move once the block ends (``fp8.scales_per_step``).
    So a token's old and new log-probs compare two policies under one set of scales: without it,
    a micro-batch's update forward takes the scales other micro-batches left in the history, and
    its ratios shift together. Gradient scales move as before. On the TE path (``config.fp8``
    set) one TE region around the block holds TE's own histories' forward scales, and TE moves
    the gradient scales once, after the block's first backward (``fp8/te.py: te_step_scales``;
    docs/gpu_contracts.md, TE-7). No effect without history."""
    states = [s for role, s in _scaling_states(model) if role != "grad_output"]
    te_fp8 = getattr(config, "fp8", None) is not None
    for s in states:
        s.pin()
    try:
        with te_step_scales(config) if te_fp8 else contextlib.nullcontext():
            yield
    finally:
        for s in states:
            s.unpin()


def weight_quantization_errors(model, fp8: FP8Config) -> dict[str, float]:
    """Relative quantization error (||q(W) - W|| / ||W||) of each FP8 linear's weight shard under
    the trainer's recipe, keyed ``L<layer>.<linear>`` (``lm_head`` for the output layer)."""
    out = {}
    for name, module, _ in emulated_linears(model):
        parts = name.split(".")
        if "layers" in parts:
            layer = model.decoder.layers[int(parts[parts.index("layers") + 1])]
            key = f"L{layer.layer_number}.{parts[-1]}"
        else:
            key = "lm_head"
        out[key] = quantization_error(module.weight, fp8.recipe, role="weight")["rel_error"]
    return out


def fp8_scaling_state(model) -> dict[str, dict]:
    """The delayed-scaling amax histories of ``model``'s FP8 linears, by module name and operand
    role (``tensorwise_delayed``; empty for recipes without history). This rank's own: each
    linear scales its local shard from what it saw. TE keeps its own in its modules' extra state."""
    state = {}
    for name, _, gemm in emulated_linears(model):
        roles = {r: s.state_dict() for r, s in gemm.emulator.scaling_states().items()}
        if any(s["num_updates"] for s in roles.values()):
            state[name] = roles
    return state


def load_fp8_scaling_state(model, state: dict[str, dict], device) -> None:
    """Restore :func:`fp8_scaling_state` into the same model layout (the histories on
    ``device``). A non-empty ``state`` whose linears are not the model's is a ValueError."""
    gemms = {name: gemm for name, _, gemm in emulated_linears(model)}
    if state and set(state) != set(gemms):
        odd = sorted(set(gemms) ^ set(state))[0]
        raise ValueError(f"FP8 scaling state does not match the model's FP8 linears ({odd})")
    for name, roles in state.items():
        for role, scaling in gemms[name].emulator.scaling_states().items():
            scaling.load_state_dict(roles[role], device)


def gather_weight_quantization_errors(model, fp8: FP8Config, groups) -> dict[str, float]:
    """:func:`weight_quantization_errors` of every pipeline stage's layers on the driver, as
    ``fp8/weight_qerr/<layer>`` plus their mean (``{}`` on the other ranks). Tensor-parallel
    rank 0's shards stand for the layer. Collective over all ranks; ``{}`` without FP8 training
    (and no collective)."""
    if not fp8.enabled:
        return {}
    g = groups
    mine = {}
    if g.dp_rank == 0 and g.cp_rank == 0 and g.tp_rank == 0:
        mine = weight_quantization_errors(model, fp8)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {f"fp8/weight_qerr/{k}": v for d in everyone for k, v in d.items()}
    if merged:
        merged["fp8/weight_qerr_mean"] = sum(merged.values()) / len(merged)
    return merged if g.is_driver else {}
