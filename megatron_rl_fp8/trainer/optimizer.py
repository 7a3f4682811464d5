"""Megatron's optimizer as the actor runs it: its config, the learning-rate schedule, and two
repairs to loading a distributed optimizer's checkpoint.

The learning rate follows Megatron's ``OptimizerParamScheduler`` (``optim.lr_*``): one scheduler
step per *applied* optimizer step, as Megatron's training loop. The run's config decides the
schedule and a checkpoint only its position (``Actor.load_lr_schedule_state_dict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl_fp8.trainer.config import OptimConfig

if TYPE_CHECKING:
    from megatron_rl_fp8.models.memory import MemoryConfig
    from megatron_rl_fp8.parallel import ParallelConfig


def megatron_optimizer_config(
    optim_cfg: OptimConfig, config, parallel: ParallelConfig, memory: MemoryConfig
):
    """Megatron's ``OptimizerConfig``: Adam with ``optim_cfg``'s settings, for a model built with
    the Megatron ``config`` (its bf16 flag and parameter dtype), with ``parallel``'s distributed
    optimizer and ``memory``'s optimizer offload."""
    return OptimizerConfig(
        optimizer="adam",
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,  # each param group's max_lr / min_lr come from these two
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        overlap_param_gather=parallel.overlap_param_gather,
        **memory.optimizer_kwargs(),
    )


def build_opt_param_scheduler(optimizer, optim_cfg: OptimConfig, lr_decay_steps: int):
    """Megatron's scheduler for ``optim_cfg`` at its step 0 (it sets every param group's lr now).

    ``optimizer`` is anything with ``param_groups``; a group's own ``max_lr`` / ``min_lr`` (Megatron's
    param groups carry them) take precedence over the scheduler's.
    """
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,  # Megatron's warmup starts at 0
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        lr_warmup_steps=optim_cfg.lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=optim_cfg.lr_decay_style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=0,
        wd_incr_style="constant",
        # On resume the run's config decides the schedule and the checkpoint only its position
        # (so a resumed run may extend train.steps); load_state_dict then just replays num_steps.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed ``optimizer`` its Adam state before a load fills it. Without
    Apex / TE, Megatron's wrapper reads the torch Adam's ``step`` even when loading, which a
    torch optimizer creates only at its first step; Megatron's own loader (Megatron-FSDP
    path) allocates it by a step with zero gradients, and so does this. The loaded values
    then replace every tensor it touched (weights, fp32 main weights, moments, step)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def restore_adam_step(optimizer, loaded: dict) -> None:
    """Give a torch Adam's per-parameter state the step of ``loaded``, the distributed
    ``optimizer``'s checkpointed state dict, one tensor each.
    Megatron 0.16's distributed optimizer (without Apex / TE) loads the step from the param
    groups as *one* tensor shared by every parameter, which torch's Adam then increments once
    per parameter at the next step (bias correction as if thousands of steps had passed),
    and its bucket-space format copies this process's own step (the zero-gradient
    allocation's 1) over it. TE's and apex's Adam keep the step in the param groups."""
    (opt,) = getattr(optimizer, "chained_optimizers", [optimizer])
    (step,) = {group["step"] for group in loaded["optimizer"]["param_groups"]}
    for state in opt.optimizer.state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.full_like(old, step)
