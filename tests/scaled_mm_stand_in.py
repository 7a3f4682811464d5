"""``python tests/scaled_mm_stand_in.py -m megatron_rl_fp8 train CONFIG ...`` (or
``... benchmarks/bench_actor.py ARGS``): run a module or script as ``python`` would, with the FP8 GEMM
backends that need an FP8 GPU (``fp8.backend: torch | torchao``) allowed on this CPU;
:func:`allow_fp8_backends` does the same inside a process (a test's rank).

CPU torch runs ``torch._scaled_mm`` for real: e4m3/e5m2 operands, tensorwise and rowwise float32
scales, the product rounded to the requested output dtype (tests/unit/test_fp8_backend.py checks
it against the emulation). Only the backend selection asks for a GPU, through
``fp8.backend.cuda_capability``; this answers "Hopper" there and changes nothing else, so the
trainer (rollout, calibration, checkpoints) and the benchmarks run those backends' own code
paths. The CUDA kernels' layout rules, which CPU torch does not enforce, are the unit tests'
business.
"""

import runpy
import sys


def allow_fp8_backends() -> None:
    """In this process, answer the backend selection's "which GPU?" with Hopper (9.0), and run
    CPU ``_scaled_mm`` on ATen's own kernel rather than oneDNN's: on CPUs with AMX / AVX512-FP16
    oneDNN's FP8 matmul took ~1 s per 256x512x256 call (2026-12-02), ATen's 2 ms, and the
    trainer makes thousands (test_scaled_mm_run: 17 min instead of 1-2)."""
    import torch

    import megatron_rl_fp8.fp8.backend as backend

    backend.cuda_capability = lambda: (9, 0)
    torch.backends.mkldnn.enabled = False


if __name__ == "__main__":  # spawned workers (the reward pool) import this file as __mp_main__
    allow_fp8_backends()
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
