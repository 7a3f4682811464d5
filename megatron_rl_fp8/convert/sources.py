"""Streams of HF-named tensors, from an HF directory or from a Megatron dist checkpoint.

Both know every output tensor's name, dtype and shape before reading data (so writers can plan
shards), and yield tensors one at a time (HF: memory-mapped; Megatron: one layer loaded at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_rl_fp8.convert.assembly import hf_to_mcore_plan
from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.convert.hf_io import HFCheckpoint, OutTensor, read_config
from megatron_rl_fp8.convert.hf_to_mcore import check_hf_tensors
from megatron_rl_fp8.convert.mcore_io import DistCheckpointReader
from megatron_rl_fp8.models.hf_mapping import (
    MappingError,
    expected_hf_names,
    expected_hf_shapes,
    mcore_to_hf,
    model_config_from_hf,
)


def _model(config: dict, where: Path):
    try:
        return model_config_from_hf(config)
    except MappingError as e:
        raise ConvertError(f"{where / 'config.json'}: {e}") from e


class HFSource:
    """Tensors of an HF checkpoint directory, validated against its config.json."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.ckpt = HFCheckpoint(hf_dir)
        self.config = self.ckpt.config
        self.model, self.notes = _model(self.config, self.dir)
        check_hf_tensors(self.ckpt, self.model)

    def plan(self) -> list[OutTensor]:
        return [
            OutTensor(n, self.ckpt.tensors[n].dtype, tuple(self.ckpt.tensors[n].shape))
            for n in expected_hf_names(self.model)
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for t in self.plan():
            yield t.name, self.ckpt.get(t.name)

    def close(self) -> None:
        self.ckpt.close()


class McoreSource:
    """HF tensors of a Megatron dist checkpoint; the model shape comes from ``hf_config_dir``."""

    def __init__(self, ckpt: str | Path, hf_config_dir: str | Path):
        self.dir = Path(hf_config_dir)
        self.config = read_config(hf_config_dir)
        self.model, self.notes = _model(self.config, self.dir)
        self.reader = DistCheckpointReader(ckpt)
        self._check()

    def _check(self) -> None:
        model, hf_shapes = self.model, expected_hf_shapes(self.model)
        expected = {}
        for name, pieces in hf_to_mcore_plan(model):
            first = hf_shapes[pieces[0].hf_name]
            rows = sum(
                hf_shapes[p.hf_name][0] if p.rows is None else p.rows[1] - p.rows[0] for p in pieces
            )
            expected[name] = (rows, *first[1:])
        have = {n: s for n, (s, _) in self.reader.names_and_shapes().items()}
        missing = sorted(set(expected) - set(have))
        extra = sorted(set(have) - set(expected))
        wrong = []
        for n in sorted(set(expected) & set(have)):
            e, h = expected[n], have[n]
            vocab = n in ("embedding.word_embeddings.weight", "output_layer.weight")
            ok = (h[1:] == e[1:] and h[0] >= e[0]) if vocab else h == e
            if not ok:
                wrong.append(f"{n} {h} (expected {e}{' or more vocab rows' if vocab else ''})")
        if missing or extra or wrong:
            raise ConvertError(
                f"dist checkpoint {self.reader.dir} does not match {self.dir / 'config.json'}: "
                f"missing {missing[:20]}, unexpected {extra[:20]}, wrong shape {wrong[:20]}. "
                "Pass the --hf-config of the model this checkpoint was trained from."
            )
        self._groups = [
            [n] for n, _ in hf_to_mcore_plan(model) if not n.startswith("decoder.layers.")
        ]
        per_layer: dict[int, list[str]] = {}
        for n, _ in hf_to_mcore_plan(model):
            if n.startswith("decoder.layers."):
                per_layer.setdefault(int(n.split(".")[2]), []).append(n)
        self._groups[1:1] = [per_layer[i] for i in sorted(per_layer)]  # embedding, layers, rest
        self._shapes = self.reader.names_and_shapes()

    def plan(self) -> list[OutTensor]:
        out = []
        for group in self._groups:
            for name in group:
                shape, dtype = self._shapes[name]
                for hf_name, t in mcore_to_hf(name, torch.empty(shape, device="meta"), self.model):
                    out.append(OutTensor(hf_name, dtype, tuple(t.shape)))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self._groups:
            loaded = self.reader.load(group)
            for name in group:
                yield from mcore_to_hf(name, loaded.pop(name), self.model)

    def close(self) -> None:
        """Nothing to release: the reader opens and closes the checkpoint per layer group."""
