"""The actor: a Megatron GPTModel wrapped in Megatron DDP with Megatron's optimizer.

Every forward/backward goes through ``get_forward_backward_func`` so PP=1 and PP>1 share one path
(``trainer/schedule.py``: the micro-batch split and ``run_schedule``).
Loss scaling, written down once: the schedule divides each micro-batch loss by the number of
micro-batches and Megatron DDP averages gradients over data-parallel ranks. Our losses are already
normalised by the *global* token count of the mini-batch (so summing them over micro-batches and
ranks gives the token mean); we multiply by ``num_microbatches * dp_size`` to cancel both, with this
rank's own ``num_microbatches`` (under ``train.max_tokens_per_gpu`` DP ranks may run different
counts: each divides by its own, and DDP averages over DP with a plain 1 / dp_size).

The learning rate follows Megatron's ``OptimizerParamScheduler`` (``optim.lr_*``), owned here next
to the optimizer: one scheduler step per *applied* optimizer step, as Megatron's training loop
(``trainer/optimizer.py`` builds it, and repairs a distributed optimizer's checkpoint load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import get_megatron_optimizer

from megatron_rl_fp8.fp8.backend import resolve_backend
from megatron_rl_fp8.fp8.config import FP8Config
from megatron_rl_fp8.fp8.te import have_te, megatron_fp8_kwargs
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.models.config import ModelConfig
from megatron_rl_fp8.models.expert_load import ExpertLoad
from megatron_rl_fp8.models.fp8 import (
    fp8_scaling_state,
    fp8_weight_cache,
    frozen_fp8_scaling,
    full_precision,
    install_fp8_linears,
    load_fp8_scaling_state,
)
from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
from megatron_rl_fp8.models.logprobs import token_logprobs, token_logprobs_and_entropy
from megatron_rl_fp8.models.memory import MemoryConfig
from megatron_rl_fp8.models.routing_replay import ROUTES, RoutingReplay
from megatron_rl_fp8.parallel import Groups, ParallelConfig, check_context_parallel
from megatron_rl_fp8.trainer.config import OptimConfig
from megatron_rl_fp8.trainer.context_parallel import gather_from_cp
from megatron_rl_fp8.trainer.optimizer import (
    allocate_distributed_optimizer_state,
    build_opt_param_scheduler,
    megatron_optimizer_config,
    restore_adam_step,
)
from megatron_rl_fp8.trainer.schedule import MicroBatches, run_schedule, split_for_model

_BACKEND_WORDS = {
    "te": "Transformer Engine",
    "torch": "torch._scaled_mm",
    "torchao": "torchao float8",
    "emulate": "emulated",
}
"""How ``describe`` names each FP8 backend."""


_SIZES = ("tp_size", "pp_size", "dp_size", "cp_size")  # a layout, in log order


def _layout_text(layout: dict) -> str:
    """'TP=2 PP=1 DP=4' (CP only when > 1) from :meth:`Actor._layout`'s sizes."""
    return " ".join(
        f"{k[:2].upper()}={layout[k]}" for k in _SIZES if k != "cp_size" or layout[k] > 1
    )


class Actor:
    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        groups: Groups,
        fp8: FP8Config | None = None,
        *,
        memory: MemoryConfig | None = None,
        parallel: ParallelConfig | None = None,
        init_weights: bool = True,
        total_steps: int | None = None,
        routing_replay: str = "none",
    ):
        """``init_weights=False`` skips Megatron's random init (minutes of host time at 8B) for
        a model whose every weight is loaded next (``convert/start_weights.py``).
        ``total_steps``: optimizer steps of the whole run (``train.steps *
        train.updates_per_step``), the decay horizon when ``optim.lr_decay_steps`` is null.
        ``parallel``: the scale features (sequence parallelism, the distributed optimizer,
        overlapped communication); TP / PP / CP sizes come from ``groups``.
        ``routing_replay``: ``rollout.routing_replay`` (MoE: a batch's engine routes replayed,
        ``replay``, or only compared, ``measure``; ``models/routing_replay.py``)."""
        self.model_cfg = model_cfg
        self.optim_cfg = self.base_optim_cfg = optim_cfg
        self.lr_decay_steps = optim_cfg.resolved_lr_decay_steps(total_steps)
        self.groups = groups
        self.fp8 = fp8 or FP8Config()
        # fp8.backend (resolved for this machine): 'te' is Megatron's own fp8 config on the TE
        # spec; 'torch' (real FP8 GEMMs) and 'emulate' are the local spec with FP8 linears
        # installed after build. None: FP8 is off.
        self.fp8_backend = resolve_backend(self.fp8)
        self.fp8_emulated = self.fp8_backend == "emulate"
        te_fp8 = megatron_fp8_kwargs(self.fp8) if self.fp8_backend == "te" else {}
        on_cpu = groups.device.type != "cuda"
        use_te = self.use_te = not on_cpu and self.fp8_backend in (None, "te") and have_te()
        memory = memory or MemoryConfig()
        memory.check_backend(use_te=use_te)
        parallel = self.parallel = parallel or ParallelConfig()
        check_context_parallel(groups.cp_size, use_te=use_te)
        self.config = transformer_config(
            model_cfg,
            tensor_model_parallel_size=groups.tp_size,
            pipeline_model_parallel_size=groups.pp_size,
            on_cpu=on_cpu,
            use_te=use_te,
            perform_initialization=init_weights,
            sequence_parallel=parallel.sequence_parallel,
            context_parallel_size=groups.cp_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            **te_fp8,
            **memory.megatron_kwargs(),
        )
        module = build_gpt_model(model_cfg, self.config, use_te=use_te)
        # MoE: the routers' token counts per expert, for the step's moe/ metrics.
        self.expert_load = self.routing = None
        self.routing_replay = routing_replay
        if model_cfg.num_experts is not None:
            self.expert_load = ExpertLoad(module, model_cfg.num_layers, model_cfg.num_experts)
            self.routing = RoutingReplay(
                module,
                sequence_parallel=parallel.sequence_parallel,
                tp_rank=groups.tp_rank,
                tp_size=groups.tp_size,
            )
        if self.fp8_backend in ("torch", "torchao", "emulate"):
            install_fp8_linears(module, self.fp8, model_cfg.num_layers, self.fp8_backend)
        if groups.device.type == "cuda":
            # As Megatron's get_model: weights are initialised on the host (so every TP layout
            # draws the same full matrices), then the module moves to this rank's GPU *before*
            # the DDP wrap, which allocates its gradient buffers on the parameters' device.
            module.cuda(groups.device)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            overlap_param_gather=parallel.overlap_param_gather,
        )
        self.model = DistributedDataParallel(
            config=self.config, ddp_config=ddp_config, module=module
        )
        self.optimizer_config = megatron_optimizer_config(optim_cfg, self.config, parallel, memory)
        self.reset_optimizer()
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync

    def describe(self) -> str:
        """One line for the run log: size, dtype, device, layout and FP8 path of this rank."""
        n = sum(p.numel() for p in self.module.parameters())
        fp8 = "off"
        if self.fp8.enabled:
            words = _BACKEND_WORDS[self.fp8_backend]
            if self.fp8.compile_casts:  # only torch / torchao have casts of their own to compile
                on = self.fp8_backend in ("torch", "torchao")
                words += ", casts compiled" if on else ", fp8.compile_casts unused"
            fp8 = f"{self.fp8.recipe} ({words})"
        g, p = self.groups, self.parallel
        cpu = g.device.type == "cpu"
        dtype = str(self.config.params_dtype).removeprefix("torch.")
        layout = _layout_text(self._layout())
        features = [
            name
            for name, on in (
                ("SDPA attention", not self.use_te and self.model_cfg.uses_sdpa(on_cpu=cpu)),
                ("sequence parallel", p.sequence_parallel),
                ("distributed optimizer", p.use_distributed_optimizer),
                ("overlapped grad reduce", p.overlap_grad_reduce),
                ("overlapped param gather", p.overlap_param_gather),
                (
                    f"recompute {self.config.recompute_granularity}",
                    self.config.recompute_granularity,
                ),
            )
            if on
        ]
        return (
            f"{n / 1e6:.2f}M parameters on this rank, {dtype} on {g.device} ({layout}"
            f"{''.join(', ' + f for f in features)}), FP8 {fp8}"
        )

    def reset_optimizer(self) -> None:
        """Fresh Adam state and the lr schedule at its step 0 (after the SFT warm start, so
        fresh, cached and skipped warm starts all begin RL alike)."""
        if hasattr(self, "optimizer"):
            self.finish_param_gather()  # the new optimizer's main weights copy these
        self.optimizer = get_megatron_optimizer(self.optimizer_config, [self.model])
        self.opt_param_scheduler = build_opt_param_scheduler(
            self.optimizer, self.optim_cfg, self.lr_decay_steps
        )

    @property
    def module(self):
        return self.model.module

    def full_precision(self):
        """Context: forward passes inside run without FP8 (the BF16 shadow), same weights."""
        return full_precision(self.module, self.config)

    def frozen_fp8_scaling(self):
        """Context: FP8 forward passes inside leave the delayed-scaling histories unchanged."""
        return frozen_fp8_scaling(self.module)

    def set_lr(self, lr: float) -> None:
        """Pin a constant lr (the SFT warm start): the schedule is detached until
        ``reset_optimizer``, which restarts it at step 0."""
        self.opt_param_scheduler = None
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step (every param group shares it)."""
        return self.optimizer.param_groups[0]["lr"]

    # -- forward / backward ----------------------------------------------------------------------
    def _run(
        self,
        micro_batches: MicroBatches,
        loss_fn: Callable,
        *,
        forward_only: bool,
        count_routes: bool = False,
    ) -> list[dict]:
        """One schedule; a batch that carries the engine's routes (MoE) replays them or compares
        them, as ``rollout.routing_replay`` says (``count_routes``: into the mismatch metric)."""
        routing, feed = contextlib.nullcontext(), None
        if self.routing is not None and self.routing_replay != "none":
            if ROUTES in micro_batches.batches[0]:
                routing = self.routing.passing(self.routing_replay, count=count_routes)
                feed = self.routing.feed
        # The weights are fixed for one schedule: the torch backend quantizes each once.
        with fp8_weight_cache(self.module), routing:
            return run_schedule(
                self.model,
                self.groups.device,
                micro_batches,
                loss_fn,
                forward_only=forward_only,
                before_forward=feed,
            )

    def _logits_kwargs(self) -> dict:
        return {
            "vocab_size": self.model_cfg.vocab_size,
            "tp_rank": self.groups.tp_rank,
            "tp_group": self.groups.tp,
        }

    def _split(self, batch: dict, micro_batch_size: int, max_tokens: int | None) -> MicroBatches:
        return split_for_model(batch, micro_batch_size, max_tokens, self.config, self.groups)

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        """A per-token output of this CP rank's positions as the whole [B, S] (``gather_from_cp``);
        itself without context parallelism."""
        g = self.groups
        return gather_from_cp(local, g.cp, g.cp_size) if g.cp_size > 1 else local

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        *,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        entropy: bool = True,
        count_routes: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """Per-token logprobs of ``labels`` and (with ``entropy``) entropy; [B, S] tensors on the
        last stage, else None. ``max_tokens``: micro-batches by token budget
        (``split_micro_batches``); positions past a micro-batch's longest row come back as 0 (no
        loss or metric reads them). Entropy costs one more pass over each logits chunk: only the
        pass whose entropy is reported asks for it. ``count_routes``: a MoE batch's routes
        compared with this pass's own routing count into ``moe/routing_mismatch``."""
        self.model.eval()
        keys = ("logprobs", "entropy") if entropy else ("logprobs",)

        def loss_fn(mb, logits):
            kwargs = {"temperature": temperature, **self._logits_kwargs()}
            if not entropy:
                lp = token_logprobs(logits, mb["labels"], **kwargs)
                return torch.zeros(()), {"logprobs": self._whole(lp)}
            lp, ent = token_logprobs_and_entropy(logits, mb["labels"], **kwargs)
            return torch.zeros(()), {"logprobs": self._whole(lp), "entropy": self._whole(ent)}

        micro_batches = self._split(batch, micro_batch_size, max_tokens)
        out = self._run(micro_batches, loss_fn, forward_only=True, count_routes=count_routes)
        self.model.train()
        if not self.groups.is_last_stage:
            return None
        # Left on the model's device: the loss, the calibration histograms (all-reduced over
        # NCCL on GPU) and the metrics all consume them there.
        return {k: micro_batches.merge([o[k] for o in out]) for k in keys}

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        token_loss_fn: Callable,
        *,
        temperature: float = 1.0,
        max_tokens: int | None = None,
    ) -> tuple[list[dict], float, bool]:
        """One optimizer step over ``batch`` (this rank's rows).

        ``token_loss_fn(mb, logprobs) -> (loss, metrics)`` returns a loss normalised by the global
        token count (so it sums across micro-batches and ranks) and a dict of metrics.
        ``max_tokens``: micro-batches by token budget (``split_micro_batches``).
        Returns (per-micro-batch metric dicts [last stage only], grad norm, update applied).
        """
        micro_batches = self._split(batch, micro_batch_size, max_tokens)
        # This rank's own micro-batch count, as the schedule divides by it: under a token budget
        # it differs between DP ranks.
        # Megatron averages gradients over DP x CP; each CP rank's loss covers its own tokens.
        scale = len(micro_batches.batches) * self.groups.dp_size * self.groups.cp_size

        def loss_fn(mb, logits):
            lp = token_logprobs(
                logits, mb["labels"], temperature=temperature, **self._logits_kwargs()
            )
            loss, metrics = token_loss_fn(mb, lp)
            return loss * scale, {"loss": loss.detach(), **metrics}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(micro_batches, loss_fn, forward_only=False)
        if not self._finite(out):
            # Never apply a NaN/inf update (Megatron's fp32 and bf16 optimizers would: only fp16
            # loss scaling looks for them). The stability guard decides what happens next.
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            return out, float("nan"), False
        ok, grad_norm, _ = self.optimizer.step()
        if ok and self.opt_param_scheduler is not None:
            self.opt_param_scheduler.step(increment=1)
        return out, float(grad_norm if grad_norm is not None else float("nan")), bool(ok)

    def _finite(self, out: list[dict]) -> bool:
        """Whether every rank's losses and gradients are finite (collective over all ranks: TP and
        PP ranks hold different gradient shards, so all must agree before anyone steps). One
        reduction over this rank's gradient buffer (its sum is NaN/inf when any element is, or
        when the gradients are so large that their norm would overflow too; no buffer-sized
        temporary) and one one-element all-reduce; one host read, however many micro-batches."""
        checks = [torch.isfinite(o["loss"]).all() for o in out]
        checks += [torch.isfinite(buffer.grad_data.sum()) for buffer in self.model.buffers]
        finite = torch.stack(checks).all() if checks else torch.tensor(True)
        flag = (~finite).to(self.groups.device, torch.float32).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag.item() == 0.0

    def counting_experts(self) -> contextlib.AbstractContextManager:
        """MoE: count the tokens each router sends to each expert in the forward passes inside
        (the RL update's; the warm start's are not the policy's load); nothing for a dense
        model."""
        return self.expert_load.counting() if self.expert_load else contextlib.nullcontext()

    def moe_metrics(self) -> dict[str, float]:
        """MoE: the ``moe/`` metrics since the last call, of the forward passes counted: the
        expert load (``models/expert_load.py``) and the routing mismatch with the engine
        (``models/routing_replay.py``, when a pass compared routes). Collective over all ranks;
        {} for a dense model."""
        if self.expert_load is None:
            return {}
        kw = dict(device=self.groups.device)
        kw["counts_here"] = self.groups.tp_rank == 0 or self.parallel.sequence_parallel
        return {**self.expert_load.metrics(**kw), **self.routing.metrics(**kw)}

    def finish_param_gather(self) -> None:
        """Make every rank's module hold the updated weights. With
        ``parallel.overlap_param_gather`` the distributed optimizer leaves its all-gather of the
        new weights to the next forward pass; what reads the weights outside one (the weight
        norm, the rollout sync, checkpoints) calls this first. A no-op otherwise."""
        if self.parallel.overlap_param_gather:
            self.model.start_param_sync(force_sync=True)

    @torch.no_grad()
    def param_norm(self) -> float:
        """Global L2 norm of the weights (collective over all ranks), summed in float32 on purpose:
        weights whose norm overflows float32 make activations overflow too, so this returns inf
        for them and the stability guard treats it as non-finite. Tensor-parallel duplicates
        (norms, biases) count on TP rank 0 only, a tied embedding on the first stage only."""
        g = self.groups
        total = torch.zeros(1, device=g.device)
        for p in self.module.parameters():
            duplicate = not getattr(p, "tensor_model_parallel", False) and g.tp_rank != 0
            tied_copy = getattr(p, "shared", False) and not g.is_first_stage
            if not (duplicate or tied_copy):
                total += p.detach().float().pow(2).sum()
        torch.distributed.all_reduce(total)
        copies = g.dp_size * g.cp_size  # replicas holding the same weights
        return math.sqrt(total.item() / copies) if math.isfinite(total.item()) else float("inf")

    # -- checkpoints -----------------------------------------------------------------------------
    def sharded_state_dict(self, *, with_optimizer: bool, is_loading: bool = False) -> dict:
        model_sd = self.module.sharded_state_dict()
        sd = {"model": model_sd}
        if with_optimizer:
            # is_loading makes Megatron allocate the (still empty) Adam state first, so the loaded
            # exp_avg / exp_avg_sq have somewhere to go; without it they are silently dropped.
            kwargs = {}
            if self.parallel.use_distributed_optimizer:
                # Its state in bucket space without the DP padding, so a checkpoint loads at
                # another DP size (same TP x PP).
                kwargs = {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}
                if is_loading:
                    allocate_distributed_optimizer_state(self.optimizer)
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, **kwargs
            )
        return sd

    @torch.no_grad()
    def load_sharded(self, loaded: dict) -> None:
        # no_grad: the distributed optimizer copies its loaded fp32 shards in place into views
        # of the weights themselves when they are fp32 (CPU), leaves that require grad.
        self.module.load_state_dict(loaded["model"])
        if "optimizer" in loaded:
            self.optimizer.load_state_dict(loaded["optimizer"])
            if self.parallel.use_distributed_optimizer:
                restore_adam_step(self.optimizer, loaded["optimizer"])
        else:
            self.params_changed()

    def _layout(self) -> dict:
        keys = ("rank", *_SIZES, *(k.replace("size", "rank") for k in _SIZES))
        return {k: getattr(self.groups, k) for k in keys}

    def rank_state(self) -> dict:
        """What this rank alone holds, for its checkpoint file: the FP8 delayed-scaling amax
        histories of its linears (empty for the other recipes and TE, whose modules keep their
        own). Empty when there is nothing."""
        scaling = fp8_scaling_state(self.module)
        return {"layout": self._layout(), "fp8_scaling": scaling} if scaling else {}

    def load_rank_state(self, state: dict | None) -> None:
        """Restore :meth:`rank_state` from a checkpoint written at the same layout. From another
        layout (or none) the histories start afresh, as they did before they were checkpointed,
        and rank 0 says so."""
        if not state:
            return
        if state["layout"] != self._layout():
            was, now = _layout_text(state["layout"]), _layout_text(self._layout())
            print_rank0(
                f"checkpoint: FP8 delayed-scaling amax histories start afresh (written at {was}, "
                f"this run is {now})"
            )
            return
        load_fp8_scaling_state(self.module, state["fp8_scaling"], self.groups.device)

    def params_changed(self) -> None:
        """The weights were written outside the optimizer (a pretrained start, a cached warm
        start). Megatron's bf16 optimizer keeps fp32 main copies taken when it was built; they
        are refreshed here, or its first step would write the old weights back."""
        self.optimizer.reload_model_params()

    def set_lr_scale(self, scale: float) -> None:
        """Run the configured schedule with ``optim.lr`` and ``optim.min_lr`` times ``scale``
        from the current position on (the stability guard lowers it after a rollback)."""
        base = self.base_optim_cfg
        position = self.lr_schedule_state_dict()
        self.optim_cfg = dataclasses.replace(base, lr=base.lr * scale, min_lr=base.min_lr * scale)
        self.load_lr_schedule_state_dict(position)

    def lr_schedule_state_dict(self) -> dict:
        """The schedule's position and settings (plain numbers and strings: JSON-able)."""
        return self.opt_param_scheduler.state_dict()

    def load_lr_schedule_state_dict(self, state: dict) -> None:
        """Continue the schedule at the position in ``state`` (after ``load_sharded``).

        The run's config decides the schedule, the checkpoint only its position: Megatron's
        optimizer load brought back the checkpoint's ``max_lr`` / ``min_lr`` in every param group
        (they override the scheduler's), so the config's are put back before replaying the steps.
        """
        for group in self.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = self.optim_cfg.lr, self.optim_cfg.min_lr
        self.opt_param_scheduler = build_opt_param_scheduler(
            self.optimizer, self.optim_cfg, self.lr_decay_steps
        )
        self.opt_param_scheduler.load_state_dict(state)
