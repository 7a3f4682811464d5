"""Convert checkpoints: HF <-> Megatron dist checkpoints, and FP8 export. See docs/convert.md.

python tools/convert_checkpoint.py hf-to-mcore --hf Qwen3-8B --out ckpt/qwen3-8b --tp 2
python tools/convert_checkpoint.py mcore-to-hf --ckpt runs/x/checkpoints --hf-config Qwen3-8B --out hf-out
python tools/convert_checkpoint.py export-fp8 --hf Qwen3-8B --out Qwen3-8B-FP8
"""

import sys

from megatron_rl_fp8.convert.cli import main

if __name__ == "__main__":  # the guard dist_checkpointing's multiprocessing needs
    sys.exit(main())
