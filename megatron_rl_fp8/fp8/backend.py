"""Which backend runs the FP8 GEMMs on this machine: one decision, made in one place.

Four backends run the same recipes (``FP8Config.recipe``) and differ in what executes them:

* ``te``: Transformer Engine's FP8 linears (Megatron's TE layer spec and ``fp8_autocast``).
* ``torch``: Megatron's local linears with real FP8 GEMMs through ``torch._scaled_mm``
  (``torch_backend.py``); no TE needed, so it runs where TE cannot be installed.
* ``torchao``: the same local linears through torchao's float8 training matmul
  (``torchao_backend.py``; tensorwise and rowwise; ``pip install torchao``). Never chosen by
  ``auto``: pick it to compare with the ``torch`` backend.
* ``emulate``: quantize-dequantize in PyTorch (``emulation.py``); any device, slower than BF16.

The GPU backends need FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell);
TE's MXFP8 needs Blackwell (>= 10.0). The torch backend's blockwise GEMMs are ATen's
DeepSeek-style block-scaled ``scaled_mm`` (``aten/src/ATen/native/cuda/ScaledBlas.cpp``:
``_check_deepseek_support``, ``check_deepseek_recipe``), which runs on Hopper (SM 9.x) only, with
cuBLASLt >= 12.9, and on e4m3 operands only (so not with ``format: hybrid``), in a torch whose
``torch.nn.functional.scaled_mm`` has block scaling. ``backend: auto`` takes the first of te,
torch, emulate that can run the recipe here. An explicit backend that cannot run is an error
naming what is missing, raised at config validation, before any rank starts.
"""

from __future__ import annotations

import torch

from megatron_rl_fp8.fp8 import torchao_backend
from megatron_rl_fp8.fp8.config import HYBRID_BLOCKWISE, FP8Config
from megatron_rl_fp8.fp8.recipes import (
    BACKEND_RECIPES,
    FP8_MIN_CAPABILITY,
    backends_for,
    recipe_spec,
)
from megatron_rl_fp8.fp8.te import INSTALL_HINT, have_te

__all__ = [
    "BLOCKWISE_CUBLAS",
    "BLOCKWISE_SM_MAJOR",
    "FP8_MIN_CAPABILITY",
    "backend_problem",
    "cuda_capability",
    "cuda_toolkit_version",
    "have_blockwise_scaled_mm",
    "resolve_backend",
    "should_emulate",
]


BLOCKWISE_SM_MAJOR = 9
"""ATen's block-scaled (1x128 / 128x128) ``scaled_mm`` runs on this compute-capability major only
(Hopper; ``_check_deepseek_support`` raises NotImplementedError on Ada and Blackwell)."""
BLOCKWISE_CUBLAS = (12, 9)
"""... and needs cuBLASLt >= 12.9, at torch's build (``CUBLAS_VERSION``) and at run time."""


def cuda_toolkit_version() -> tuple[int, int] | None:
    """The CUDA toolkit torch was built with (``torch.version.cuda``), None for a CPU build. Its
    cuBLAS is the ``CUBLAS_VERSION`` ATen checks at build time; the cuBLASLt loaded at run time
    (``cublasLtGetVersion``) is the one torch's wheel pins, normally of the same release."""
    text = torch.version.cuda
    if not text:
        return None
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def have_blockwise_scaled_mm() -> bool:
    """Whether the installed torch has ``torch.nn.functional.scaled_mm`` with 1x128 / 128x128
    block scaling (the torch backend's blockwise GEMMs)."""
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    return (
        hasattr(torch.nn.functional, "scaled_mm")
        and hasattr(scaling, "BlockWise1x128")
        and hasattr(scaling, "BlockWise128x128")
    )


def _capability_problem(capability: tuple[int, int] | None, minimum: tuple[int, int]) -> str | None:
    if capability is None:
        return "no CUDA GPU is visible"
    if tuple(capability) < minimum:
        have = ".".join(map(str, capability))
        need = ".".join(map(str, minimum))
        return (
            f"the GPU (compute capability {have}) has no FP8 tensor cores for it (needs >= {need})"
        )
    return None


def backend_problem(
    backend: str, recipe: str, capability: tuple[int, int] | None, *, fmt: str = "e4m3"
) -> str | None:
    """Why ``backend`` cannot run ``recipe`` in format ``fmt`` on a machine whose GPU has
    ``capability`` (None: no GPU); None when it can. ``emulate`` runs everything everywhere."""
    if backend not in BACKEND_RECIPES:
        raise ValueError(f"backend={backend!r} is not valid; choose one of {list(BACKEND_RECIPES)}")
    if recipe not in BACKEND_RECIPES[backend]:
        can = " or ".join(repr(b) for b in backends_for(recipe))
        return f"it has no {recipe!r} recipe (use backend {can})"
    if backend == "emulate":
        return None
    spec = recipe_spec(recipe)
    problem = _capability_problem(capability, spec.min_capability)
    if problem is not None:
        return problem
    if backend == "te" and not have_te():
        return f"Transformer Engine is not installed (`{INSTALL_HINT}`)"
    if backend == "te" and (spec.te_min_capability or spec.te_min_cuda):
        cuda = cuda_toolkit_version()
        low_cc = spec.te_min_capability and tuple(capability) < spec.te_min_capability
        low_cuda = spec.te_min_cuda and cuda is not None and cuda < spec.te_min_cuda
        if low_cc or low_cuda:
            need = " and ".join(
                f"{what} >= {'.'.join(map(str, v))}"
                for what, v in (
                    ("compute capability", spec.te_min_capability),
                    ("CUDA", spec.te_min_cuda),
                )
                if v
            )
            return (
                f"Transformer Engine's {spec.te_recipe} needs {need} (this GPU: "
                f"{'.'.join(map(str, capability))}, torch's CUDA: {torch.version.cuda}); use "
                "recipe 'tensorwise_current' on this GPU"
            )
    if backend == "torchao":
        if not torchao_backend.have_torchao():
            return f"torchao is not installed (`{torchao_backend.INSTALL_HINT}`)"
    if backend == "torch" and spec.granularity == "block":
        return _blockwise_scaled_mm_problem(capability, fmt)
    return None


def _blockwise_scaled_mm_problem(capability: tuple[int, int], fmt: str) -> str | None:
    """What stops ATen's block-scaled ``scaled_mm`` here (``BLOCKWISE_*``, ``HYBRID_BLOCKWISE``)."""
    if fmt == "hybrid":
        return HYBRID_BLOCKWISE
    if capability[0] != BLOCKWISE_SM_MAJOR:
        have = ".".join(map(str, capability))
        return (
            f"ATen's block-scaled scaled_mm runs on Hopper (compute capability 9.x) only, and "
            f"this GPU is {have} (ScaledBlas.cpp: _check_deepseek_support); use backend 'te' "
            "(Transformer Engine's blockwise runs on Blackwell too) or another recipe"
        )
    if not have_blockwise_scaled_mm():
        return (
            f"torch {torch.__version__} has no block-scaled torch.nn.functional.scaled_mm "
            "(upgrade torch; 2.11 has it)"
        )
    cuda = cuda_toolkit_version()
    if cuda is not None and cuda < BLOCKWISE_CUBLAS:
        return (
            f"ATen's block-scaled scaled_mm needs cuBLASLt >= 12.9 and torch {torch.__version__} "
            f"is built with CUDA {torch.version.cuda}; install a torch built with CUDA >= 12.9"
        )
    return None


def resolve_backend(config: FP8Config, *, capability=...) -> str | None:
    """The backend that runs ``config``'s FP8 GEMMs here: 'te', 'torch', 'torchao' or 'emulate'; None when
    FP8 is off (recipe 'bf16').

    ``capability``: the GPU's compute capability (None: no GPU); probed when not given. Raises a
    one-line ValueError when an explicitly chosen backend cannot run here.
    """
    if not config.enabled:
        return None
    if capability is ...:
        capability = cuda_capability()
    if config.backend != "auto":
        problem = backend_problem(config.backend, config.recipe, capability, fmt=config.format)
        if problem is not None:
            raise ValueError(
                f"FP8Config.backend={config.backend!r} cannot run recipe={config.recipe!r} here: "
                f"{problem}; use backend 'emulate', or 'auto' to pick what can run"
            )
        return config.backend
    for backend in ("te", "torch"):
        if backend == "te" and not config.keep_lm_head_bf16:
            continue  # Megatron's output layer is no TE module: TE cannot run it in FP8
        if backend_problem(backend, config.recipe, capability, fmt=config.format) is None:
            return backend
    return "emulate"


def should_emulate(config: FP8Config) -> bool:
    """True when FP8 runs through the PyTorch emulation here (``fp8.backend``, resolved by
    :func:`resolve_backend`: asked for, or neither TE nor the torch backend can run)."""
    return resolve_backend(config) == "emulate"


def holds_step_scales(config: FP8Config, backend: str | None) -> bool:
    """Whether an RL step quantizes all its forwards with the delayed scales it began with
    (``fp8.scales_per_step``) when ``backend`` (:func:`resolve_backend`'s answer) runs ``config``.
    'auto' holds them on every backend that runs a delayed recipe: the emulation and the torch
    backend pin the histories they own; on TE one autocast region spans the step
    (docs/gpu_contracts.md, TE-7)."""
    if backend is None or not config.spec.delayed:
        return False
    if config.scales_per_step == "auto":
        return backend in ("emulate", "torch", "te")
    return config.scales_per_step


def moving_scales_note(config: FP8Config, backend: str | None) -> str | None:
    """A line for the run log where delayed scales move inside an RL step (a delayed recipe run
    with ``fp8.scales_per_step: false``), None elsewhere: calibrated clipping's default did not
    bring the clip shares to BF16's there, the oracle mode did (docs/reproduction.md)."""
    if backend is None or not config.spec.delayed or holds_step_scales(config, backend):
        return None
    return (
        "fp8: delayed scales move within each RL step here (fp8.scales_per_step=false); "
        "calibrated clipping's default did not match BF16's clip shares with moving scales, "
        "loss.calib.mode=oracle did at a BF16 forward per mini-batch (docs/reproduction.md); "
        "fp8.scales_per_step 'auto' holds them, blockwise and current scaling need neither"
    )
