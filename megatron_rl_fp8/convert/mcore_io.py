"""Megatron ``dist_checkpointing`` (torch_dist) checkpoints, written and read without a model.

Key scheme (what ``GPTModel.sharded_state_dict()`` produces, for the local and the Transformer
Engine layer specs alike, checked by tests/distributed/test_convert_megatron.py):

* per-layer tensors are *stacked*: key ``decoder.layers.<suffix>`` with global shape
  ``[num_layers, ...]``; layer ``i`` is the slice at offset ``i`` of axis 0. The pre-attention and
  pre-MLP norms use TE's names (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) whatever the spec.
* ``embedding.word_embeddings.weight`` / ``output_layer.weight`` have the padded vocab rows.
* the linears carry ``_extra_state`` objects (``None`` for the local spec; FP8 metadata with TE).
  We write ``None`` for every linear of both specs, which both accept.

Because the stored shapes are global, loading reshards to any TP/PP layout; only the vocab padding
(a multiple of ``make_vocab_size_divisible_by * TP``) is fixed at conversion time.

Writing never materialises a fused tensor: each Megatron tensor is saved as row blocks ("pieces",
``convert.assembly.hf_to_mcore_plan``) that are views of memory-mapped HF tensors; the torch_dist
writer copies one block at a time. Reading loads one layer at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_rl_fp8.checkpoint import save_sharded
from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.parallel import cpu_compat, free_port

# local-spec suffix -> checkpoint suffix (Megatron stores TE names for the fused norms)
CKPT_SUFFIX = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LOCAL_SUFFIX = {v: k for k, v in CKPT_SUFFIX.items()}
# _extra_state objects the local spec and the TE spec look for, per layer.
EXTRA_STATE = (
    "self_attention.linear_qkv._extra_state",
    "self_attention.linear_proj._extra_state",
    "self_attention.core_attention._extra_state",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2._extra_state",
)
_LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
TRAINER_STATE = "trainer_state.json"
CONVERTED_NAME = "iter_0000000"


def checkpoint_key(name: str) -> tuple[str, int | None]:
    """Local-spec Megatron name (global layer numbers) -> (checkpoint key, layer or None)."""
    m = _LOCAL.match(name)
    if m is None:
        return name, None
    suffix = CKPT_SUFFIX.get(m.group(2), m.group(2))
    return f"decoder.layers.{suffix}", int(m.group(1))


def local_name(key: str, layer: int | None) -> str:
    """Inverse of :func:`checkpoint_key`."""
    if layer is None:
        return key
    suffix = key[len("decoder.layers.") :]
    return f"decoder.layers.{layer}." + _LOCAL_SUFFIX.get(suffix, suffix)


@contextlib.contextmanager
def process_group():
    """torch.distributed as the writer needs it: torchrun's group, or a private 1-rank gloo.

    Also turns on the CPU compatibility layer without CUDA (dist_checkpointing's writer calls
    ``torch.cuda.synchronize``), and turns it off again on exit if it was off before, so that
    calling the converter from Python leaves the process as it was.
    """
    compat_was_active = cpu_compat.is_active()
    cpu_compat.enable()
    created = False
    try:
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group(
                    "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
                )
            created = True
        yield dist.get_rank(), dist.get_world_size()
    finally:
        if created:
            dist.destroy_process_group()
        if not compat_was_active:
            cpu_compat.disable()


def refuse_torchrun(command: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConvertError(f"{command} runs in one process; launch it without torchrun")


def resolve_checkpoint(path: str | Path) -> Path:
    """A dist checkpoint directory: ``path`` itself, or what ``path/latest`` names."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "metadata.json").is_file():
        raise ConvertError(
            f"{path} is not a Megatron dist checkpoint (no metadata.json); pass a checkpoint "
            "directory (iter_XXXXXXX) or the checkpoints root holding a 'latest' file"
        )
    return path


def sharded_state_dict(items, *, num_layers: int, extra_state: bool) -> dict:
    """ShardedTensors for ``items`` = [(local name, [row-block tensors])] (+ extra-state objects)."""
    # lazy: Megatron-Core (~6 s) only to write; mcore-to-hf and export-fp8 read without it
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    sd = {}
    for name, blocks in items:
        key, layer = checkpoint_key(name)
        n = len(blocks)
        for k, block in enumerate(blocks):
            offsets = [] if layer is None else [(0, layer, num_layers)]
            if n > 1:
                offsets.append((len(offsets), k, n))
            sd[f"{key}/{layer}/{k}"] = ShardedTensor.from_rank_offsets(
                key, block, *offsets, replica_id=0, prepend_axis_num=0 if layer is None else 1
            )
    if extra_state:
        for layer in range(num_layers):
            for suffix in EXTRA_STATE:
                key = f"decoder.layers.{suffix}"
                sd[f"{key}/{layer}"] = ShardedObject(
                    key, None, (num_layers,), (layer,), replica_id=0
                )
    return sd


def save(sd: dict, ckpt_dir: Path) -> None:
    save_sharded(sd, ckpt_dir)


def write_trainer_state(ckpt_dir: Path, state: dict) -> None:
    (ckpt_dir / TRAINER_STATE).write_text(json.dumps(state, indent=1) + "\n")


class _Into:
    """The slice of LoadPlanner the storage reader calls: where each read chunk lands."""

    def __init__(self, bufs: dict[str, torch.Tensor]):
        self.bufs = bufs

    def resolve_tensor(self, item):
        t = self.bufs[item.dest_index.fqn]
        for dim, (off, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, item, tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: already in place

    def load_bytes(self, item, value) -> None:
        raise ConvertError(f"internal: unexpected object read {item.dest_index.fqn}")


class DistCheckpointReader:
    """The model tensors of a dist checkpoint (trainer or converted), read a few at a time.

    torch_dist checkpoints are torch.distributed.checkpoint (DCP) directories whose keys are the
    ShardedTensor keys, so we read them with DCP's storage reader directly: any sub-box of a
    stored tensor (one layer of a stacked key) comes back without a process group and without
    reading the rest. (Megatron's own ``load`` assumes other ranks hold the remaining layers,
    which a single process cannot express.)
    """

    def __init__(self, ckpt: str | Path):
        self.dir = resolve_checkpoint(ckpt)
        self._reader = FileSystemReader(str(self.dir))
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - surface the checkpoint path with the cause
            raise ConvertError(
                f"cannot read dist checkpoint metadata in {self.dir}: {e}. The "
                "checkpoint is incomplete or not in torch_dist format"
            ) from e
        self._reader.set_up_storage_reader(metadata, True)
        # Optimizer state and anything that is not a model tensor is skipped.
        self.meta = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")
        }
        state_file = self.dir / TRAINER_STATE
        self.trainer_state = json.loads(state_file.read_text()) if state_file.is_file() else {}

    def _locate(self, name: str) -> tuple[str, int | None]:
        """Local-spec name -> (checkpoint key, layer index into its stacked axis or None)."""
        m = _LOCAL.match(name)
        if m is None:
            return name, None
        suffix = CKPT_SUFFIX.get(m.group(2), m.group(2))
        if f"decoder.layers.{suffix}" in self.meta:
            return f"decoder.layers.{suffix}", int(m.group(1))
        return f"decoder.layers.{m.group(1)}.{suffix}", None  # saved with one key per layer

    def names_and_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Local-spec name (global layers) -> (full shape, dtype), for every model tensor."""
        out = {}
        for key, md in self.meta.items():
            shape, dtype = tuple(md.size), md.properties.dtype
            m = _STACKED.match(key)
            if m and m.group(1) is None:
                for layer in range(shape[0]):
                    out[local_name(key, layer)] = (shape[1:], dtype)
            elif m:  # one key per layer
                suffix = m.group(2)
                out[f"decoder.layers.{m.group(1)}.{_LOCAL_SUFFIX.get(suffix, suffix)}"] = (
                    shape,
                    dtype,
                )
            else:
                out[key] = (shape, dtype)
        return out

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full tensors for local-spec ``names`` (for a stacked key: just that layer's slice)."""
        out = {}
        for name in names:
            key, layer = self._locate(name)
            md = self.meta[key]
            size = tuple(md.size)
            offsets = (0,) * len(size) if layer is None else (layer,) + (0,) * (len(size) - 1)
            box = size if layer is None else (1, *size[1:])
            buf = torch.empty(box, dtype=md.properties.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(box))
            plan = self._reader.prepare_local_plan(
                LoadPlan(create_read_items_for_chunk_list(key, md, [chunk]))
            )
            self._reader.read_data(plan, _Into({key: buf})).wait()
            out[name] = buf if layer is None else buf[0]
        return out
