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
* MoE experts (``SequentialMLP`` and TE's grouped MLP store the same keys) are stacked over layers
  *and* experts: key ``decoder.layers.mlp.experts.experts.linear_fc1.weight``, global shape
  ``[num_layers, num_experts, ...]``, expert ``e`` of layer ``i`` at offset ``(i, e)``; their
  ``_extra_state`` objects have shape ``(num_layers, num_experts)``. Local names number experts
  globally: ``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1.weight``.

Because the stored shapes are global, loading reshards to any TP/PP layout; only the vocab padding
(a multiple of ``make_vocab_size_divisible_by * TP``) is fixed at conversion time.

Writing never materialises a fused tensor: each Megatron tensor is saved as row blocks ("pieces",
``convert.assembly.hf_to_mcore_plan``) that are views of memory-mapped HF tensors; the torch_dist
writer copies one block at a time. Reading loads one layer at a time.
"""

from __future__ import annotations

import contextlib
import itertools
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
# MoE: local name suffix <-> checkpoint suffix (one more stacked axis: the global expert index).
_EXPERT_LOCAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
EXPERT_PREFIX = "mlp.experts.experts."
EXPERT_EXTRA_STATE = ("linear_fc1._extra_state", "linear_fc2._extra_state")
_LOCAL = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
TRAINER_STATE = "trainer_state.json"
CONVERTED_NAME = "iter_0000000"


def checkpoint_key(name: str) -> tuple[str, tuple[int, ...]]:
    """Local-spec Megatron name (global layer and expert numbers) -> (checkpoint key, its indices
    on the stacked axes: ``()``, ``(layer,)`` or, for an expert's tensor, ``(layer, expert)``)."""
    m = _LOCAL.match(name)
    if m is None:
        return name, ()
    layer, suffix = int(m.group(1)), m.group(2)
    e = _EXPERT_LOCAL.match(suffix)
    if e is not None:
        return f"decoder.layers.{EXPERT_PREFIX}{e.group(2)}", (layer, int(e.group(1)))
    return f"decoder.layers.{CKPT_SUFFIX.get(suffix, suffix)}", (layer,)


def local_name(key: str, at: tuple[int, ...]) -> str:
    """Inverse of :func:`checkpoint_key`."""
    if not at:
        return key
    suffix = key[len("decoder.layers.") :]
    if len(at) == 2:
        local = f"mlp.experts.local_experts.{at[1]}.{suffix[len(EXPERT_PREFIX) :]}"
        return f"decoder.layers.{at[0]}.{local}"
    return f"decoder.layers.{at[0]}." + _LOCAL_SUFFIX.get(suffix, suffix)


def stacked_axes(key: str) -> int:
    """How many leading axes of a stored tensor index layers (1) and experts (2), 0 if none."""
    if not key.startswith("decoder.layers.") or _STACKED.match(key).group(1) is not None:
        return 0
    return 2 if key.startswith(f"decoder.layers.{EXPERT_PREFIX}") else 1


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


def sharded_state_dict(
    items, *, num_layers: int, extra_state: bool, num_experts: int | None = None
) -> dict:
    """ShardedTensors for ``items`` = [(local name, [row-block tensors])] (+ extra-state objects;
    ``num_experts`` for a mixture-of-experts model, whose dense MLP objects become the experts')."""
    # lazy: Megatron-Core (~6 s) only to write; mcore-to-hf and export-fp8 read without it
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    sd = {}
    for name, blocks in items:
        key, at = checkpoint_key(name)
        sizes = (num_layers, num_experts)[: len(at)]
        n = len(blocks)
        for k, block in enumerate(blocks):
            offsets = [(axis, i, size) for axis, (i, size) in enumerate(zip(at, sizes))]
            if n > 1:
                offsets.append((len(offsets), k, n))
            sd[f"{key}/{at}/{k}"] = ShardedTensor.from_rank_offsets(
                key, block, *offsets, replica_id=0, prepend_axis_num=len(at)
            )
    if extra_state:
        for layer in range(num_layers):
            for suffix in EXTRA_STATE:
                if num_experts is not None and suffix.startswith("mlp."):
                    continue
                key = f"decoder.layers.{suffix}"
                sd[f"{key}/{layer}"] = ShardedObject(
                    key, None, (num_layers,), (layer,), replica_id=0
                )
            for e in range(num_experts or 0):
                for suffix in EXPERT_EXTRA_STATE:
                    key = f"decoder.layers.{EXPERT_PREFIX}{suffix}"
                    sd[f"{key}/{layer}/{e}"] = ShardedObject(
                        key, None, (num_layers, num_experts), (layer, e), replica_id=0
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

    def _locate(self, name: str) -> tuple[str, tuple[int, ...]]:
        """Local-spec name -> (checkpoint key, its indices on the key's stacked axes)."""
        key, at = checkpoint_key(name)
        if key in self.meta or not at:
            return key, at
        m = _LOCAL.match(name)  # saved with one key per layer
        return f"decoder.layers.{m.group(1)}.{CKPT_SUFFIX.get(m.group(2), m.group(2))}", ()

    def names_and_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Local-spec name (global layers and experts) -> (full shape, dtype), for every model
        tensor."""
        out = {}
        for key, md in self.meta.items():
            shape, dtype = tuple(md.size), md.properties.dtype
            m = _STACKED.match(key)
            axes = stacked_axes(key)
            if axes:
                for at in itertools.product(*(range(n) for n in shape[:axes])):
                    out[local_name(key, at)] = (shape[axes:], dtype)
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
            key, at = self._locate(name)
            md = self.meta[key]
            size = tuple(md.size)
            offsets = (*at, *(0,) * (len(size) - len(at)))
            box = (*(1,) * len(at), *size[len(at) :])
            buf = torch.empty(box, dtype=md.properties.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(box))
            plan = self._reader.prepare_local_plan(
                LoadPlan(create_read_items_for_chunk_list(key, md, [chunk]))
            )
            self._reader.read_data(plan, _Into({key: buf})).wait()
            out[name] = buf.reshape(size[len(at) :])
        return out
