"""Hugging Face checkpoints on disk: a lazy safetensors reader and a streaming sharded writer.

Reading: ``safe_open`` memory-maps each shard, so a tensor costs page cache, not process memory,
until something copies it. Every file the index names is opened (and its header validated) up
front, so a missing or truncated shard is reported before anything is written.

Writing: the safetensors format is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw bytes. Because the converters know every output
tensor's name, dtype and shape before reading any data, the writer plans the shards first, writes
each header, then streams tensors in order: memory stays at one tensor, whatever the shard size.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from megatron_rl_fp8.convert.errors import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files copied through unchanged next to the weights (tokenizer, generation defaults, chat template).
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConvertError(
            f"{path} not found: --hf / --hf-config must be a Hugging Face model "
            "directory with a config.json"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from e


class TensorInfo(NamedTuple):
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class HFCheckpoint:
    """The tensors of an HF model directory, opened lazily. Use as a context manager."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.config = read_config(self.dir)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConvertError(f"{index} is not a valid safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            bins = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = (
                f" (found {bins[:3]}: re-save with save_pretrained(safe_serialization=True))"
                if bins
                else ""
            )
            raise ConvertError(f"{self.dir} has neither {INDEX} nor {SINGLE}{hint}")
        self._handles = {}
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise ConvertError(
                    f"{index} names shard {fname}, which does not exist in {self.dir}"
                )
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ConvertError(
                    f"cannot read shard {path}: {e}. The file is truncated or corrupt "
                    "(re-download or re-save it)"
                ) from e
            self._handles[fname] = handle
            for name in handle.keys():
                sl = handle.get_slice(name)
                dtype = _FROM_ST.get(sl.get_dtype())
                if dtype is None:
                    raise ConvertError(
                        f"{path}: tensor {name} has unsupported dtype {sl.get_dtype()}"
                    )
                self.tensors[name] = TensorInfo(fname, dtype, tuple(sl.get_shape()))
        if weight_map is not None:
            listed_missing = sorted(
                n
                for n, f in weight_map.items()
                if n not in self.tensors or self.tensors[n].file != f
            )
            if listed_missing:
                raise ConvertError(
                    f"{index} lists tensors that are not in the shard it names: "
                    f"{listed_missing[:20]}{' ...' if len(listed_missing) > 20 else ''}"
                )

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped (no copy until it is read)."""
        return self._handles[self.tensors[name].file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def copy_side_files(src: str | Path, dst: str | Path, *, config: dict | None = None) -> list[str]:
    """Copy tokenizer / generation files; write ``config`` (or copy config.json). Returns names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if config is None:
        config = read_config(src)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ["config.json"] + copied


class OutTensor(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsWriter:
    """Stream a planned list of tensors into HF-style shards + ``model.safetensors.index.json``.

    ``plan`` fixes the order: call :meth:`write` with exactly those tensors in that order. Shards
    hold at most ``max_shard_bytes`` (a tensor larger than that gets a shard of its own).
    """

    def __init__(self, out_dir: str | Path, plan: list[OutTensor], *, max_shard_bytes: int):
        self.dir = Path(out_dir)
        self.plan = plan
        shards: list[list[OutTensor]] = [[]]
        size = 0
        for t in plan:
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        n = len(shards)
        self.names = (
            [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.shards = shards
        self._next = 0  # index into plan
        self._shard = -1
        self._left = 0  # tensors left in the open shard
        self._file = None

    def _open_next_shard(self) -> None:
        self._shard += 1
        tensors = self.shards[self._shard]
        header, offset = {}, 0
        for t in tensors:
            header[t.name] = {
                "dtype": _ST_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as safetensors does
        self._file = open(self.dir / self.names[self._shard], "wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._left = len(tensors)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        if self._next >= len(self.plan):
            raise ConvertError(
                f"internal: tensor {name} written after the planned {len(self.plan)}"
            )
        want = self.plan[self._next]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise ConvertError(
                f"internal: expected {want}, got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if self._left == 0:
            self._open_next_shard()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1
        self._left -= 1
        if self._left == 0:
            self._close_file()
        return want.nbytes

    def _close_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def finish(self) -> None:
        """Check everything was written; write the index when there are several shards."""
        if self._next != len(self.plan):
            raise ConvertError(
                f"internal: {len(self.plan) - self._next} planned tensors not written"
            )
        weight_map = {t.name: self.names[i] for i, shard in enumerate(self.shards) for t in shard}
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in self.plan)},
            "weight_map": weight_map,
        }
        if len(self.names) > 1:
            (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
