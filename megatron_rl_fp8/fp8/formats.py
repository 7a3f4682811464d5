"""FP8 element formats: the two encodings, their ranges, and the torch dtypes that hold them.

* **e4m3** (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, max finite 448, no inf.
  Relative rounding error of a normal value is at most 2^-4 (half of the 2^-3 mantissa step).
  Used for weights and activations, which need precision more than range.
* **e5m2** (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, max finite 57344, has inf.
  Relative rounding error at most 2^-3. Used for gradients under the "hybrid" format, because
  gradients span more orders of magnitude than activations and tolerate coarser steps.

Neither format can hold a typical tensor directly (its values are far from [-448, 448] and from
the normal range), so every FP8 tensor travels with a *scale*: ``x ~= fp8 * scale_inv``. The
recipes differ only in how many elements share one scale (see ``quantize.py``).
"""

from __future__ import annotations

from typing import Literal

import torch

ElementFormat = Literal["e4m3", "e5m2"]

E4M3_MAX = 448.0
"""Largest finite e4m3fn value (0b0_1111_110 = 1.75 * 2^8)."""
E5M2_MAX = 57344.0
"""Largest finite e5m2 value (0b0_11110_11 = 1.75 * 2^15)."""

E4M3_EMAX = 8
"""Exponent of the largest e4m3 power of two (256); the OCP MX spec's ``emax_elem`` for e4m3."""
E5M2_EMAX = 15
"""Exponent of the largest e5m2 power of two (32768); ``emax_elem`` for e5m2."""

E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal e4m3 value; below it, subnormals lose relative precision."""
E5M2_MIN_NORMAL = 2.0**-14
"""Smallest normal e5m2 value."""

FP8_DTYPES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
FP8_MAX: dict[str, float] = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
FP8_EMAX: dict[str, int] = {"e4m3": E4M3_EMAX, "e5m2": E5M2_EMAX}
FP8_MIN_NORMAL: dict[str, float] = {"e4m3": E4M3_MIN_NORMAL, "e5m2": E5M2_MIN_NORMAL}
FP8_REL_ERROR: dict[str, float] = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
"""Worst-case relative rounding error for a value in the normal range (round to nearest even)."""


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it names an FP8 element format, else raise a ValueError naming the fix."""
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 element format must be 'e4m3' or 'e5m2', got {fmt!r}")
    return fmt
