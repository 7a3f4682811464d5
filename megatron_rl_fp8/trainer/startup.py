"""Start-up, before the first RL step: the prompts (checked before any weight exists), the
rollout engine (driver), and a fresh run's start weights. The run directory is ``run_dir.py``'s,
the SFT warm start ``warm_start.py``'s, a resume the checkpointer's (``checkpointer.py``)."""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.config_utils import to_dict
from megatron_rl_fp8.convert.start_weights import load_converted, load_hf_weights
from megatron_rl_fp8.data import build_datasets, load_prompt_encoder
from megatron_rl_fp8.data.prompts import check_vocab
from megatron_rl_fp8.fp8.backend import moving_scales_note
from megatron_rl_fp8.metrics.console import print_step
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.models.hf_mapping import hf_config_with_tokens
from megatron_rl_fp8.parallel import Groups
from megatron_rl_fp8.rollout import build_engine
from megatron_rl_fp8.rollout.environment import tool_schemas
from megatron_rl_fp8.trainer import run_dir
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.warm_start import warm_start


def load_prompts(cfg: RunConfig):
    """(prompt encoder, train prompts, held-out prompts); one-line errors for a tokenizer that
    does not fit the model and for unreadable data."""
    tools = tool_schemas(cfg.env) if cfg.env.tools else None
    tokenizer = load_prompt_encoder(
        cfg.tokenizer, hf_checkpoint=cfg.model.hf_checkpoint, tools=tools
    )
    check_vocab(tokenizer, cfg.model.vocab_size)
    train, val, dropped = build_datasets(cfg.task, tokenizer)
    if any(dropped.values()):
        print_rank0(
            f"data: dropped {dropped['train']} train and {dropped['val']} val prompts longer "
            f"than task.max_prompt_len={cfg.task.max_prompt_len} tokens"
        )
    return tokenizer, train, val


def describe_actor(cfg: RunConfig, actor: Actor) -> None:
    """The actor's line in the run log, and a note where calibrated clipping runs with delayed
    scales that move within a step (``fp8/backend.py: moving_scales_note``)."""
    print_rank0(f"actor: {actor.describe()}")
    note = moving_scales_note(cfg.fp8, actor.fp8_backend)
    if note and cfg.loss.calib.enabled:
        print_rank0(f"note: {note}")


def rollout_engine(cfg: RunConfig, tokenizer, actor: Actor, groups: Groups, out_dir: str):
    """The driver's rollout engine (None on the other ranks)."""
    if not groups.is_driver:
        return None
    return build_engine(
        cfg.rollout,
        hf_config_with_tokens(cfg.model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_ids,
        output_dir=out_dir,
        device=groups.device,
        dtype=actor.config.params_dtype,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
    )


def load_start_weights(cfg: RunConfig, actor: Actor, groups: Groups) -> None:
    """A fresh run's weights: ``model.load`` (converted) or ``model.hf_checkpoint``, else the
    random init already there. Collective over all ranks."""
    m, g = cfg.model, groups
    if m.load is not None:
        path = load_converted(actor, m.load)
        print_rank0(f"start weights: {path} (converted checkpoint)")
    elif m.hf_checkpoint is not None:
        t0 = time.perf_counter()
        n = load_hf_weights(actor.module, m.hf_checkpoint, m, tp_rank=g.tp_rank, tp_size=g.tp_size)
        actor.params_changed()
        dist.barrier()
        print_rank0(
            f"start weights: {m.hf_checkpoint} ({n} tensors on rank 0, "
            f"{time.perf_counter() - t0:.1f} s)"
        )


def resume_or_start(tr) -> bool:
    """The trainer ``tr`` (trainer/loop.py) resumed from its newest intact checkpoint, or
    started fresh: start weights, warm start, the first sync and the step-0 evaluation; then
    the KL reference's weights. Returns whether it resumed. Collective."""
    cfg = tr.cfg
    if tr.is_driver:
        run_dir.report_changed_settings(tr.out_dir, to_dict(cfg))
    restored = tr.checkpointer.restore()  # a refused resume keeps the old config.yaml
    if tr.is_driver:
        run_dir.save_config(tr.out_dir, cfg.to_yaml())
    if restored is not None:
        tr.step = restored[1]["step"]
        if "guard" in restored[1]:
            tr.actor.set_lr_scale(tr.guard.lr_scale)
        tr.guard.saved(tr.step)  # vouched for once the next step passes the guard
        tr.guard.loaded_from(tr.step)
        print_rank0(f"resumed from {restored[0]} at step {tr.step}")
    # Lines past the restored step are replayed by this run; drop them so none is duplicated.
    tr.logger.truncate_after(tr.step if restored else -1)
    if restored is None:
        load_start_weights(cfg, tr.actor, tr.groups)
        first = warm_start(cfg, tr.actor, tr.groups, tr.tokenizer, tr.train_data.records)
        tr.engines.sync(version=0)
        first.update(tr.evaluate())
        tr.logger.log(0, first)
        if tr.is_driver:
            print_step(0, first)
    else:
        tr.engines.sync(version=tr.step)
    if tr.reference is not None:  # the RL-start policy, known only now
        tr.reference.load_weights(cfg, tr.actor, resumed=restored is not None)
    return restored is not None
