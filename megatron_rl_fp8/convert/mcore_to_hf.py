"""``mcore-to-hf``: a Megatron dist checkpoint -> sharded safetensors + index + config + tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.convert.hf_io import OutTensor, SafetensorsWriter, copy_side_files
from megatron_rl_fp8.convert.mcore_io import refuse_torchrun
from megatron_rl_fp8.convert.progress import Meter, summary_line
from megatron_rl_fp8.convert.sources import McoreSource
from megatron_rl_fp8.convert.staging import check_output, staged_output

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / 1000 -> bytes."""
    if isinstance(text, int):
        return text
    units = {
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "B": 1,
    }
    s = text.strip().upper()
    size = None
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            try:
                number = float(s[: -len(u)])
                size = int(number * units[u]) if math.isfinite(number) else None
            except ValueError:
                pass  # not a number before the unit: size stays None, refused below
            break
    else:
        try:
            size = int(s)
        except ValueError:
            pass  # neither a unit nor a byte count: refused below
    if size is None:
        raise ConvertError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB or a byte count")
    if size < 1:
        raise ConvertError(
            f"--max-shard-size {text!r}: give a positive size (e.g. 5GB or 500MB); at 0 every "
            "tensor would get a shard of its own"
        )
    return size


def write_hf(
    source,
    out_tmp: Path,
    *,
    max_shard_bytes: int,
    meter: Meter,
    convert=None,
    config: dict | None = None,
) -> list[str]:
    """Stream ``source`` through ``convert(name, tensor) -> [(name, tensor)]`` into ``out_tmp``."""
    plan = source.plan()
    if convert is not None:
        plan = [o for t in plan for o in convert.plan(t)]
    writer = SafetensorsWriter(out_tmp, plan, max_shard_bytes=max_shard_bytes)
    try:
        for name, tensor in source:
            outs = [(name, tensor)] if convert is None else convert(name, tensor)
            for out_name, t in outs:
                meter.update(writer.write(out_name, t))
        writer.finish()
    finally:
        writer.abort()
    return copy_side_files(
        source.dir, out_tmp, config=config if config is not None else source.config
    )


class _Cast:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def plan(self, t: OutTensor) -> list[OutTensor]:
        return [OutTensor(t.name, self.dtype, t.shape)]

    def __call__(self, name, tensor):
        return [(name, tensor.to(self.dtype))]


def mcore_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    hf_config_dir: str | Path,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    out = Path(out)
    check_output(
        out.absolute(),
        overwrite=overwrite,
        inputs={"--ckpt": ckpt, "--hf-config": hf_config_dir},
    )
    max_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    refuse_torchrun("mcore-to-hf")
    source = McoreSource(ckpt, hf_config_dir)
    config = dict(source.config)
    cast = None
    if dtype is not None:
        cast = _Cast(DTYPES[dtype])
        config["torch_dtype"] = dtype
        config.pop("dtype", None)
    total = sum(
        t.nbytes
        for t in (
            source.plan() if cast is None else [o for t in source.plan() for o in cast.plan(t)]
        )
    )
    meter = Meter("mcore-to-hf", total, show=progress)
    with staged_output(out, overwrite=overwrite) as tmp:
        files = write_hf(
            source, tmp, max_shard_bytes=max_bytes, meter=meter, convert=cast, config=config
        )
    stats = meter.close()
    stats.update(summary=summary_line("mcore-to-hf", stats, out), notes=source.notes, files=files)
    return stats
