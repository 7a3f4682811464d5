"""The step-time model's efficiencies (``plan/time.py``): fractions of a datasheet peak and rates,
each with the measurement it comes from or marked ASSUMPTION; docs/scaling.md lists them."""

from __future__ import annotations

import dataclasses

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.fp8.recipes import RECIPES
from megatron_rl_fp8.plan.hardware import GPUS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of a datasheet peak, and rates, that the model applies. Defaults are the
    project's measurements (docs/gpu.md, docs/benchmarks.md, PLATFORM_NOTES) unless marked
    ASSUMPTION (no measurement yet: the doc lists these)."""

    gemm_bf16: float = 0.709
    """BF16 GEMM / dense peak: mean of ``bench_gemm``'s 8 Qwen3-8B/32B linear shapes at M=8192
    on the lent H200 (660-770 TFLOP/s of 989; docs/gpu.md, gpu_check run of 2026-11-30)."""

    actor_step_s: float = 1.00
    """The measured trainer step the non-GEMM cost is fitted to: ``benchmarks/bench_actor.py``, 2.03B
    Qwen3 shape, local spec (no TE), bf16, 8 x 2048 tokens, micro-batch 2, one H200: 1.00 s/step,
    19.4% MFU (docs/gpu.md, gpu_check run of 2026-11-30). Local spec with Megatron's unfused
    attention (torch's SDPA, the local spec's GPU default since 2026-12-01, and Transformer
    Engine should shrink the non-GEMM share; not measured yet: gpu_check's ``attention`` step)."""

    fp8_linear_speedup: tuple[tuple[str, float], ...] = tuple(
        (name, spec.plan_speedup) for name, spec in RECIPES.items() if spec.plan_speedup
    )
    """FP8 / BF16 time of the linear layers' forward + backward, quantization included, by
    ``fp8.recipe``: each recipe's ``plan_speedup`` in ``fp8/recipes.py``, with its source
    (tensorwise 1.44x and rowwise 1.10x measured on an H200; blockwise and mxfp8 1.15x
    ASSUMPTIONS)."""

    rollout_fp8_gemm: float = 1.59
    """FP8 W8A8 blockwise (1x128 x 128x128) / BF16 GEMM rate for the rollout engine's linears:
    mean of ``bench_gemm``'s blockwise column, H200 (1.37-1.75x; docs/gpu.md)."""

    prefill_mfu: float = 0.5
    """ASSUMPTION: SGLang prefill, model FLOPs / dense peak (no SGLang on the lent GPU)."""

    decode_hbm: float = 0.7
    """ASSUMPTION: SGLang decode, bytes read (weights + KV) / HBM peak."""

    decode_mfu: float = 0.5
    """ASSUMPTION: SGLang decode's compute bound at large batches, model FLOPs / dense peak."""

    tp_collective_latency_s: float = 10e-6
    """ASSUMPTION: latency of one small NCCL all-reduce within a node (decode: 2 per layer)."""

    nvlink: float = 300 / 450
    """ASSUMPTION: NCCL bus bandwidth / NVLink one-way peak: the ~300 GB/s of bench_sync's GPU
    projection (docs/benchmarks.md)."""

    ib: float = 40 / 50
    """ASSUMPTION: the ~40 GB/s of one 400 Gb/s NIC that bench_sync's projection uses."""

    quantize_bytes_s: float = 82e9
    """FP8 blockwise quantization of the synced linears, bf16 bytes in per second on one H200:
    modelopt ``FP8QTensor`` on Qwen3-8B's linears, ~0.17 s for 13.9 GB (``bench_sync.py
    --quantizers``, docs/benchmarks.md). Scaled by the GPU's HBM bandwidth."""

    engine_load_s: float = 0.15
    """ASSUMPTION: per-sync HTTP calls and engine-side loading (bench_sync's projection: 0.1-0.2
    s)."""

    delta_fraction: float = 0.2
    """A delta sync's bytes / a full sync's (``rollout.delta_sync``): 0.17-0.29 measured on a 100M
    Qwen3 at lr 1e-5, 0.03-0.05 at lr 1e-6 (``bench_delta_sync.py``, docs/delta_sync.md); the
    larger is kept. ``plan --delta-fraction`` takes a run's own ``perf/sync_relay_mb /
    perf/sync_relay_full_mb``."""

    delta_encode_bytes_s: float = 1e9
    """Bytes per second a sender delta-encodes (compare with its last sync's copy, CRC-32s) and a
    receiver applies, each: 0.2-1.2 and 0.6-1.7 GB/s measured on this 2-core box
    (``bench_delta_sync.py``); ASSUMPTION that a cluster host does no worse (both are
    memory-bound torch ops on the host)."""

    turn_request_s: float = 0.02
    """ASSUMPTION: a multi-turn trajectory's later turn as a new engine request, less its
    tokens: the HTTP round trip and the scheduler taking the request in, once per turn (the
    turns of a step's trajectories go out together)."""

    reward_s_per_row: float = 0.01
    """ASSUMPTION: CPU seconds to score one completion (math-verify parse and compare)."""

    checkpoint_bytes_s_per_node: float = 2e9
    """ASSUMPTION: parallel file system write rate per node."""

    optimizer_hbm: float = 0.7
    """ASSUMPTION: Adam's step, bytes moved / HBM peak (a memory-bound elementwise kernel)."""

    rest_s_per_flop: float | None = None
    """The trainer's non-GEMM seconds per model FLOP *on the device in use*, when fitted there
    (``scripts/validate_step_model.py`` fits it on a measured CPU run). ``None``: the fit to
    ``actor_step_s`` on the reference GPU, scaled by HBM bandwidth."""

    def fp8_speedup(self, recipe: str) -> float:
        table = dict(self.fp8_linear_speedup)
        if recipe not in table:
            raise ConfigError(f"fp8.recipe={recipe!r} has no FP8 speed in the step-time model")
        return table[recipe]


EFFICIENCY = Efficiency()
REFERENCE_GPU = GPUS["H200"]  # where the efficiencies were measured
