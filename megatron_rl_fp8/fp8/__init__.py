"""FP8 numerics for training and rollout: why, and how this package does it.

FP8 halves the bytes of BF16 and doubles tensor-core throughput, but an 8-bit float has very
little of either precision or range, and the two encodings split them differently:

* **e4m3** (max 448, 3 mantissa bits, <= 2^-4 relative rounding error): weights and activations.
* **e5m2** (max 57344, 2 mantissa bits, <= 2^-3 relative error): gradients, under the "hybrid"
  format, because gradients span more decades than they need digits.

Since no real tensor fits [-448, 448] at useful precision, every FP8 tensor carries **scales**:
``x ~= fp8 * scale_inv``, with ``scale_inv = amax / fp8_max`` over the elements sharing it. The
*recipe* is the choice of which elements share a scale and when amax is measured:

* ``tensorwise_delayed``: one scale per tensor from a history of past amaxes (no extra pass over
  the tensor; a spike saturates until the history catches up).
* ``tensorwise_current``: one scale per tensor from its own amax (robust; one extra reduction).
* ``rowwise``: one scale per row along the GEMM's contraction dim (per token / per channel).
* ``blockwise``: 1x128 groups for activations and gradients, 128x128 tiles for weights
  (DeepSeek-V3; what FP8 rollout engines load as ``weight_scale_inv``).
* ``mxfp8``: 32-element blocks with power-of-two (E8M0) scales (OCP MX; Blackwell).

Finer scales contain outliers (one large value only coarsens its own group) at the cost of more
scale bookkeeping. For RL the noise matters beyond loss curves: it enters the importance ratio
pi_theta / pi_old directly, which is why the loss side calibrates its clip bounds (see ``loss/``).

Where things live: ``recipes`` (one description per recipe, read by everything that depends on
it), ``config`` (FP8Config, RolloutFP8Config), ``formats`` (constants),
``quantize`` (fake quant per granularity; real FP8 blockwise weights for rollout),
``emulation`` (the quantize-dequantize FP8 linear layer, any device), ``torch_backend`` (real FP8
GEMMs through ``torch._scaled_mm``), ``torchao_backend`` (torchao's float8 matmul), ``te``
(mapping to Transformer Engine / Megatron) and ``backend`` (which of the four runs,
``fp8.backend``).
Nothing here imports Transformer Engine or Megatron at import time. This file re-exports nothing:
import from the modules, so that ``recipes`` and ``config`` load without torch (the planner and
the report read them).
"""
