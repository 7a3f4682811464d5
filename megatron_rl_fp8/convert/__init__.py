"""Checkpoint conversion: Hugging Face <-> Megatron dist checkpoints, and FP8 export for serving.

Three commands (``megatron-rl-fp8 convert``), one mapping
(``models.hf_mapping``, shared with weight sync):

* ``hf_to_mcore``: safetensors (memory-mapped) -> ``dist_checkpointing`` torch_dist checkpoint in
  the trainer's layout. Fused tensors (QKV, gate/up) are written as row blocks straight from the
  mapped files, so memory stays near the largest single tensor. One process or torchrun ranks.
* ``mcore_to_hf``: dist checkpoint (converted or trained) -> HF shards + index + config +
  tokenizer, one layer in memory at a time.
* ``export_fp8``: HF or dist checkpoint -> block-FP8 (128x128 E4M3 + ``weight_scale_inv``) HF
  checkpoint with the ``quantization_config`` serving engines read.

Every command validates the whole input first (names, shapes, truncated shards) and writes into a
staging directory next to ``--out`` that is renamed only on success.
"""

from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.convert.fp8_export import export_fp8
from megatron_rl_fp8.convert.hf_to_mcore import hf_to_mcore
from megatron_rl_fp8.convert.mcore_to_hf import mcore_to_hf

__all__ = ["ConvertError", "export_fp8", "hf_to_mcore", "mcore_to_hf"]
