"""GPU parameter sets for the step-time model (``plan/time.py``): datasheet peaks, one GPU each.

Numbers are the vendor's public datasheets, dense (no 2:4 sparsity), SXM parts, per GPU, in
bytes and FLOP per second (10^12 = T). The efficiencies that turn a peak into a prediction are
measurements, kept in ``plan/efficiency.py:Efficiency``, not here.
"""

from __future__ import annotations

import dataclasses

from megatron_rl_fp8.config_utils import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU's peaks."""

    name: str
    bf16_flops: float  # dense BF16 tensor-core FLOP/s
    fp8_flops: float  # dense FP8 tensor-core FLOP/s
    hbm_bytes_s: float  # HBM bandwidth, bytes/s
    memory_gb: float  # HBM capacity, GB of 10^9 bytes (the planner's --gpu-memory-gb)
    nvlink_bytes_s: float  # NVLink, one direction, bytes/s per GPU
    ib_bytes_s: float  # scale-out network, one NIC per GPU, bytes/s


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): BF16 1,979 TFLOPS and FP8 3,958
    # TFLOPS *with sparsity* (dense: half), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
    # (bidirectional: 450 GB/s each way). DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s).
    "H100": GPU(
        name="H100",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes_s=3.35e12,
        memory_gb=80.0,
        nvlink_bytes_s=450e9,
        ib_bytes_s=50e9,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the same tensor cores as H100 SXM
    # (BF16 1,979 / FP8 3,958 TFLOPS with sparsity), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s;
    # HGX H200 / DGX H200: one 400 Gb/s ConnectX-7 per GPU.
    "H200": GPU(
        name="H200",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes_s=4.8e12,
        memory_gb=141.0,
        nvlink_bytes_s=450e9,
        ib_bytes_s=50e9,
    ),
    # NVIDIA DGX B200 / HGX B200 datasheets, per GPU: FP8 9 PFLOPS and BF16 4.5 PFLOPS with
    # sparsity (dense: 4.5 / 2.25), 180 GB HBM3e (1,440 GB per 8) at 8 TB/s (64 TB/s per 8),
    # NVLink 5 1.8 TB/s (900 GB/s each way); DGX B200: one 400 Gb/s ConnectX-7 per GPU.
    "B200": GPU(
        name="B200",
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        hbm_bytes_s=8.0e12,
        memory_gb=180.0,
        nvlink_bytes_s=900e9,
        ib_bytes_s=50e9,
    ),
}


def get_gpu(name: str) -> GPU:
    """The parameter set named ``name`` (case-insensitive); ConfigError naming the choices."""
    gpu = GPUS.get(name.upper())
    if gpu is None:
        raise ConfigError(f"--gpu={name!r} is not known; choose one of {', '.join(GPUS)}")
    return gpu
