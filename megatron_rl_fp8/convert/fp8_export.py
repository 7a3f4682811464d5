"""``export-fp8``: a block-FP8 HF checkpoint for serving engines (SGLang, vLLM, transformers).

Format (DeepSeek-V3 style, what ``quant_method: fp8`` with ``weight_block_size`` means to the
engines): every quantized linear ``X.weight`` is ``float8_e4m3fn`` and comes with
``X.weight_scale_inv``, float32 of shape ``[ceil(out/128), ceil(in/128)]``, such that
``weight ~= fp8.float() * scale_inv`` over each 128x128 tile (``fp8.quantize_blockwise``:
``scale_inv = tile_amax / 448``, so nothing saturates). Activations are quantized by the engine at
run time ("dynamic"). Everything that is not a decoder linear stays BF16: embeddings, norms,
biases, ``lm_head`` (always), and the linears of the first / last N layers if asked (the layers
most sensitive to quantization); those are listed in ``modules_to_not_convert``. A Qwen3-MoE
model's experts are quantized one by one (``mlp.experts.<e>.gate_proj.weight`` with its own
``weight_scale_inv``, the per-expert layout SGLang's FP8 MoE loader and Qwen's FP8 releases use);
its router (``mlp.gate``) stays BF16.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.convert.hf_io import OutTensor
from megatron_rl_fp8.convert.mcore_io import refuse_torchrun
from megatron_rl_fp8.convert.mcore_to_hf import parse_size, write_hf
from megatron_rl_fp8.convert.progress import Meter, summary_line
from megatron_rl_fp8.convert.sources import HFSource, McoreSource
from megatron_rl_fp8.convert.staging import check_output, staged_output
from megatron_rl_fp8.fp8.quantize import quantize_blockwise

BLOCK = (128, 128)
# Decoder linears: attention, the dense SwiGLU MLP, and each expert's (Qwen3-MoE; the router,
# ``mlp.gate``, stays BF16 as in Qwen's own FP8 releases, and SGLang builds it unquantized).
_LINEAR = re.compile(
    r"^model\.layers\.(\d+)\.((?:self_attn\.[qkvo]_proj)"
    r"|(?:mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj))\.weight$"
)
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LINEAR_SUFFIXES = _ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# A kept MoE layer names its experts by their module prefix (what SGLang's FusedMoE and
# transformers match against modules_to_not_convert).
_MOE_SUFFIXES = _ATTENTION + ("mlp.experts",)


def kept_layers(num_layers: int, keep_first: int, keep_last: int) -> list[int]:
    if keep_first < 0 or keep_last < 0:
        raise ConvertError("--keep-first-layers / --keep-last-layers must be >= 0")
    if keep_first + keep_last >= num_layers:
        raise ConvertError(
            f"--keep-first-layers {keep_first} + --keep-last-layers {keep_last} keep all "
            f"{num_layers} layers in BF16: nothing would be FP8 under quant_method fp8; keep "
            "fewer layers"
        )
    return sorted(
        set(range(min(keep_first, num_layers)))
        | set(range(max(num_layers - keep_last, 0), num_layers))
    )


def quantization_config(keep: list[int], *, moe: bool = False) -> dict:
    suffixes = _MOE_SUFFIXES if moe else _LINEAR_SUFFIXES
    skip = ["lm_head"] + [f"model.layers.{i}.{s}" for i in keep for s in suffixes]
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": skip,
    }


class _Quantize:
    """HF tensor -> FP8 (weight, weight_scale_inv) for decoder linears, BF16 for the rest."""

    def __init__(self, keep: list[int]):
        self.keep = set(keep)

    def _quantized(self, name: str) -> bool:
        m = _LINEAR.match(name)
        return m is not None and int(m.group(1)) not in self.keep

    def plan(self, t: OutTensor) -> list[OutTensor]:
        if not self._quantized(t.name):
            return [OutTensor(t.name, torch.bfloat16, t.shape)]
        rows, cols = t.shape
        scale_shape = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        return [
            OutTensor(t.name, torch.float8_e4m3fn, t.shape),
            OutTensor(t.name + "_scale_inv", torch.float32, scale_shape),
        ]

    def __call__(self, name: str, tensor: torch.Tensor):
        if not self._quantized(name):
            return [(name, tensor.to(torch.bfloat16))]
        codes, scale_inv = quantize_blockwise(tensor, BLOCK)
        return [(name, codes), (name + "_scale_inv", scale_inv)]


def export_fp8(
    out: str | Path,
    *,
    hf_dir: str | Path | None = None,
    ckpt: str | Path | None = None,
    hf_config_dir: str | Path | None = None,
    keep_first_layers: int = 0,
    keep_last_layers: int = 0,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """From ``hf_dir`` (an HF checkpoint) or ``ckpt`` (+ ``hf_config_dir``, a dist checkpoint)."""
    if (hf_dir is None) == (ckpt is None):
        raise ConvertError("export-fp8 needs exactly one of --hf DIR or --ckpt DIR")
    if ckpt is not None and hf_config_dir is None:
        raise ConvertError("export-fp8 --ckpt needs --hf-config DIR (config.json + tokenizer)")
    out = Path(out)
    check_output(
        out.absolute(),
        overwrite=overwrite,
        inputs={"--hf": hf_dir, "--ckpt": ckpt, "--hf-config": hf_config_dir},
    )
    max_bytes = parse_size(max_shard_size)
    refuse_torchrun("export-fp8")
    source = HFSource(hf_dir) if hf_dir is not None else McoreSource(ckpt, hf_config_dir)
    try:
        model = source.model
        keep = kept_layers(model.num_layers, keep_first_layers, keep_last_layers)
        quant = _Quantize(keep)
        config = dict(source.config)
        config.pop("dtype", None)
        config["torch_dtype"] = "bfloat16"
        config["quantization_config"] = quantization_config(keep, moe=model.num_experts is not None)
        total = sum(o.nbytes for t in source.plan() for o in quant.plan(t))
        meter = Meter("export-fp8", total, show=progress)
        with staged_output(out, overwrite=overwrite) as tmp:
            files = write_hf(
                source, tmp, max_shard_bytes=max_bytes, meter=meter, convert=quant, config=config
            )
        stats = meter.close()
    finally:
        source.close()
    stats.update(
        summary=summary_line("export-fp8", stats, out),
        notes=source.notes,
        files=files,
        kept_layers=keep,
    )
    return stats
