"""``python tests/integration/scaled_mm_cli.py train CONFIG ...``: the CLI with the FP8 GEMM
backends that need an FP8 GPU (``fp8.backend: torch | torchao``) allowed on this CPU.

CPU torch runs ``torch._scaled_mm`` for real: e4m3/e5m2 operands, tensorwise and rowwise float32
scales, the product rounded to the requested output dtype (tests/unit/test_fp8_backend.py checks
it against the emulation). Only the backend selection asks for a GPU, through
``fp8.backend.cuda_capability``; this script answers "Hopper" there and changes nothing else, so
the whole trainer (rollout, calibration, checkpoints) runs those backends' own code paths. The
CUDA kernels' layout rules, which CPU torch does not enforce, are the unit tests' business.
"""

import sys

if __name__ == "__main__":  # spawned reward workers import this file as __mp_main__
    import megatron_rl_fp8.fp8.backend as backend

    backend.cuda_capability = lambda: (9, 0)

    from megatron_rl_fp8.cli import main

    sys.exit(main(sys.argv[1:]))
