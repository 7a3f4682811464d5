"""Install megatron-rl-fp8.

CPU boxes: install ``torch==2.13.0`` first (the Makefile does), so the requirement below is already
met and pip does not fetch a multi-GB CUDA build. GPU clusters keep their own CUDA torch; nothing
here pins torch to a CPU build.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-rl-fp8",
    version="0.1.0",
    description="Full-pipeline FP8 RL post-training (GRPO, DAPO) on Megatron-Core with calibrated clipping",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl_fp8", "megatron_rl_fp8.*"]),
    package_data={"megatron_rl_fp8": ["data/assets/**/*", "data/assets/*", "examples/*.yaml"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "nvidia-modelopt>=0.47",
        # urllib3: the engines' HTTP client (rollout/sglang/http.py); requests: modelopt imports it.
        "urllib3>=2",
        "requests",
        # modelopt imports this without declaring it (docs/platform.md).
        "huggingface_hub",
        # dist_checkpointing.save needs psutil but megatron-core does not declare it.
        "psutil",
        "transformers>=4.51",
        "tokenizers",
        "safetensors",
        "pyyaml",
        "tqdm",
        "math-verify>=0.9",
        # Parquet prompt files (verl-style datasets).
        "pyarrow",
        # `megatron-rl-fp8 report`: PNG figures of runs.
        "matplotlib",
        # The study report's Student-t intervals (study/report.py).
        "scipy",
    ],
    extras_require={
        # torchao: fp8.backend=torchao (its float8 training matmul), on GPUs without TE too.
        # Pinned to what docs/gpu_contracts.md read: torchao 0.18.0, SGLang 0.5.23. TE was read
        # at main @ d0067d0 (2.20.0.dev0, no release yet); Megatron's blockwise FP8 needs >= 2.3.
        "gpu": ["transformer-engine[pytorch]>=2.3,<2.21", "torchao==0.18.0"],
        "sglang": ["sglang==0.5.23"],
        # accelerate: transformers needs it to read FP8 checkpoints (a conversion test does).
        # tensorboard, wandb: the logger tests write real event files and offline W&B runs.
        # torchao: the torchao backend's CPU tests (its float8 matmul runs on CPU _scaled_mm).
        "dev": [
            "pytest",
            "pytest-timeout",
            # make test runs on two workers; make coverage measures ranks and CLI runs too
            # (coverage's patch = fork / subprocess).
            "pytest-xdist>=3.6",
            "pytest-cov>=7",
            "coverage>=7.18",
            "accelerate",
            "ruff==0.17.6",
            "tensorboard",
            "wandb",
            "torchao==0.18.0",
        ],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["megatron-rl-fp8=megatron_rl_fp8.cli:main"]},
)
