"""megatron-rl-fp8: full-pipeline FP8 RL post-training (GRPO, DAPO) on Megatron-Core.

Importing the package touches no GPU, Transformer Engine, SGLang or W&B: heavy and optional
dependencies are imported by the modules that use them, at the point of use.
"""

__version__ = "0.1.0"
