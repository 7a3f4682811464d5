"""``hf-to-mcore``: a Hugging Face checkpoint -> a Megatron dist checkpoint the trainer loads.

Output layout (the trainer's checkpoint layout, ``megatron_rl_fp8/checkpoint/``)::

    <out>/iter_0000000/        dist_checkpointing files + trainer_state.json (conversion record)
    <out>/latest               "iter_0000000"

``megatron_rl_fp8.checkpoint.load(<out>/iter_0000000, actor.sharded_state_dict(with_optimizer=False))``
loads it at any TP/PP whose padded vocab equals the one chosen here (``--tp``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl_fp8.convert import mcore_io
from megatron_rl_fp8.convert.assembly import hf_to_mcore_plan
from megatron_rl_fp8.convert.errors import ConvertError
from megatron_rl_fp8.convert.hf_io import HFCheckpoint
from megatron_rl_fp8.convert.progress import Meter, summary_line
from megatron_rl_fp8.convert.staging import check_output, staged_output
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.hf_mapping import (
    MappingError,
    expected_hf_shapes,
    model_config_from_hf,
)


def check_hf_tensors(ckpt: HFCheckpoint, model: ModelConfig) -> None:
    """Raise one error listing every missing, unexpected and misshapen tensor."""
    expected = expected_hf_shapes(model)
    present = {n: t.shape for n, t in ckpt.tensors.items() if not n.endswith("rotary_emb.inv_freq")}
    if model.tie_word_embeddings:
        present.pop("lm_head.weight", None)  # some tied checkpoints store the copy; it is unused
    missing = sorted(set(expected) - set(present))
    extra = sorted(set(present) - set(expected))
    wrong = sorted(
        f"{n} {present[n]} (expected {expected[n]})"
        for n in set(expected) & set(present)
        if tuple(present[n]) != tuple(expected[n])
    )
    if missing or extra or wrong:

        def show(xs):
            return f"{xs[:20]}{f' ... ({len(xs)} in all)' if len(xs) > 20 else ''}"

        parts = [
            f"missing {show(missing)}" if missing else "",
            f"unexpected {show(extra)}" if extra else "",
            f"wrong shape {show(wrong)}" if wrong else "",
        ]
        raise ConvertError(
            f"{ckpt.dir} does not match its config.json ({model.arch}, {model.num_layers} layers, "
            f"hidden {model.hidden_size}): "
            + "; ".join(p for p in parts if p)
            + ". Nothing was written; fix the checkpoint or its config.json."
        )


def _piece_bytes(ckpt: HFCheckpoint, piece) -> int:
    info = ckpt.tensors[piece.hf_name]
    if piece.rows is None:
        return info.nbytes
    return (piece.rows[1] - piece.rows[0]) * info.nbytes // info.shape[0]


def _assign(sizes: list[int], world: int) -> list[int]:
    """Owner rank per tensor: biggest first onto the least-loaded rank (balanced write bytes)."""
    owner, load = [0] * len(sizes), [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda r: load[r])
        owner[i] = r
        load[r] += sizes[i]
    return owner


def hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert; returns the summary stats (also printed by the CLI). Collective under torchrun."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    out = Path(out)
    check_output(out.absolute(), overwrite=overwrite, inputs={"--hf": hf_dir})
    with HFCheckpoint(hf_dir) as ckpt, mcore_io.process_group() as (rank, world):
        try:
            model, notes = model_config_from_hf(ckpt.config)
        except MappingError as e:
            raise ConvertError(f"{ckpt.dir / 'config.json'}: {e}") from e
        _check_layout(model, tp, pp)
        check_hf_tensors(ckpt, model)
        padded = model.padded_vocab_size(tp)
        plan = hf_to_mcore_plan(model)
        sizes = [sum(_piece_bytes(ckpt, p) for p in pieces) for _, pieces in plan]
        owner = _assign(sizes, world)
        meter = Meter(
            "hf-to-mcore",
            sum(s for s, o in zip(sizes, owner) if o == rank),
            show=progress and rank == 0,
        )
        items = []
        for (name, pieces), size, o in zip(plan, sizes, owner):
            if o != rank:
                continue
            blocks = []
            for p in pieces:
                t = ckpt.get(p.hf_name)
                blocks.append(t if p.rows is None else t[p.rows[0] : p.rows[1]])
            vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            if vocab and padded > model.vocab_size:
                # Padding rows are zeros (logprobs mask them). The only tensors materialised.
                t = blocks[0]
                blocks = [torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])]
            items.append((name, blocks))
            meter.update(size)
        sd = mcore_io.sharded_state_dict(
            items,
            num_layers=model.num_layers,
            extra_state=rank == 0,
            num_experts=model.num_experts,
        )
        with staged_output(out, overwrite=overwrite, rank=rank, world=world) as tmp:
            ckpt_dir = tmp / mcore_io.CONVERTED_NAME
            if rank == 0:
                ckpt_dir.mkdir()
            if world > 1:
                dist.barrier()
            if progress and rank == 0:
                # The bar above covers mapping; the write itself is one collective save call.
                meter.bar.close()
                print(
                    f"hf-to-mcore: writing {sum(sizes) / 1e9:.2f} GB with dist_checkpointing "
                    f"({world} rank{'s' if world > 1 else ''}) ...",
                    flush=True,
                )
            mcore_io.save(sd, ckpt_dir)
            if rank == 0:
                mcore_io.write_trainer_state(
                    ckpt_dir,
                    {
                        "step": 0,
                        "converted_from": str(Path(hf_dir).absolute()),
                        "model": dataclasses.asdict(model),
                        "padded_vocab_size": padded,
                        "tensor_model_parallel_size": tp,
                        "pipeline_model_parallel_size": pp,
                        "notes": notes,
                    },
                )
                (tmp / "latest").write_text(mcore_io.CONVERTED_NAME + "\n")
        stats = meter.close()
    if world > 1:  # every rank wrote its share; report the whole
        stats["tensors"], stats["bytes"] = len(plan), sum(sizes)
        stats["gb_per_s"] = stats["bytes"] / 1e9 / max(stats["seconds"], 1e-9)
    stats.update(summary=summary_line("hf-to-mcore", stats, out), notes=notes, rank=rank)
    return stats


def _check_layout(model: ModelConfig, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConvertError(f"--tp and --pp must be >= 1, got {tp}, {pp}")
    if model.num_query_groups % tp or model.num_attention_heads % tp:
        raise ConvertError(
            f"--tp {tp} must divide num_key_value_heads={model.num_query_groups} "
            f"and num_attention_heads={model.num_attention_heads}"
        )
    if model.num_experts is None and model.ffn_hidden_size % tp:
        raise ConvertError(f"--tp {tp} must divide intermediate_size={model.ffn_hidden_size}")
    if model.num_experts is not None and model.expert_ffn_hidden_size % tp:
        raise ConvertError(
            f"--tp {tp} must divide moe_intermediate_size={model.expert_ffn_hidden_size} (the experts are "
            "split over the tensor-parallel ranks)"
        )
    if model.num_layers % pp:
        raise ConvertError(f"--pp {pp} must divide num_hidden_layers={model.num_layers}")
