"""The frozen reference policy of the KL penalty (``loss.kl_coef > 0``; off by default, as DAPO).

A second GPTModel of the actor's architecture and layout (same TP/PP, same kernel spec, so its
parameters pair one to one with the actor's), with no DDP wrapper, no optimizer and no gradients.
Once per step, in the old-logprob phase, it runs one forward over this rank's rollout rows through
the actor's own pipeline schedule (``schedule.run_schedule``, so PP > 1 needs nothing more) and gives
``ref_logprobs``, a [B, S] tensor aligned with ``labels`` like ``old_logprobs``.

Its weights, set once before step 1 (:meth:`Reference.load_weights`):

* ``model.ref_checkpoint``: an HF folder or a converted / trainer checkpoint folder, read with the
  actor's loaders (``convert/start_weights.py``) at this rank's layout;
* null: the policy RL starts from. A fresh run copies the actor right before step 1 (after the
  start weights and any SFT warm start). When that policy cannot be read again from the start
  checkpoint (a random init, or SFT on top of it), the copy is also saved, weights only, under
  ``<train.output_dir>/reference/``, so a resumed run gets the same reference back; otherwise a
  resume reads ``model.load`` / ``model.hf_checkpoint`` again.

Precision: the reference never runs FP8 (no TE FP8 recipe, no emulated GEMMs; on TE its passes run
in a disabled TE region, as a held step's region is open around them), whatever the actor trains
in: it is the unquantized reference policy, at the actor's parameter dtype. So under FP8
training the KL also contains the FP8-vs-BF16 mismatch of the policy (nonzero at step 1).

Memory: one more copy of the weights in the parameter dtype, sharded like the actor's, and nothing
else persistent (no gradients, no optimizer state): 2 bytes per parameter in bf16, 16 GB for an 8B
model spread over TP * PP GPUs (4 GB per GPU at TP=4), next to the actor's 18 bytes per parameter
(bf16 weights; fp32 main weights, gradients and two Adam moments), so ~11% more; plus one
micro-batch's forward activations at a time, as the actor's logprob pass, freed before the update.
Disk: the snapshot (when one is needed) is one more weights-only copy in the parameter dtype.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from megatron_rl_fp8 import checkpoint
from megatron_rl_fp8.config import RunConfig
from megatron_rl_fp8.convert.start_weights import load_hf_weights
from megatron_rl_fp8.fp8.te import te_fp8_off
from megatron_rl_fp8.metrics.logger import print_rank0
from megatron_rl_fp8.models.gpt import build_gpt_model, transformer_config
from megatron_rl_fp8.models.logprobs import token_logprobs
from megatron_rl_fp8.models.pretrained import check_ref_checkpoint, converted_dir, is_hf_folder
from megatron_rl_fp8.trainer.actor import Actor
from megatron_rl_fp8.trainer.context_parallel import gather_from_cp
from megatron_rl_fp8.trainer.schedule import run_schedule, split_for_model

SNAPSHOT_DIR = "reference"  # under train.output_dir
_SNAPSHOT_NAME = "rl_start"


class Reference:
    def __init__(self, actor: Actor):
        """A frozen twin of ``actor``'s module (its weights are garbage until ``load_weights``)."""
        self.model_cfg = actor.model_cfg
        self.groups = g = actor.groups
        check_ref_checkpoint(self.model_cfg)  # before any weight exists
        on_cpu = g.device.type != "cuda"
        # The actor's kernel choice (Actor.__init__), so parameter names match one to one; but no
        # FP8 recipe and no emulation: the reference runs unquantized.
        use_te = actor.use_te
        # Inside a step whose TE scales are held (fp8.scales_per_step) an enabled TE region is
        # open: the reference's TE modules would run FP8 without a disabled one of their own.
        self.te_fp8 = actor.fp8_backend == "te"
        self.config = transformer_config(
            self.model_cfg,
            tensor_model_parallel_size=g.tp_size,
            pipeline_model_parallel_size=g.pp_size,
            on_cpu=on_cpu,
            use_te=use_te,
            perform_initialization=False,  # every weight is loaded or copied next
            # The actor's sequence and context split: its batches arrive padded for them.
            sequence_parallel=actor.config.sequence_parallel,
            context_parallel_size=g.cp_size,
        )
        self.model = build_gpt_model(self.model_cfg, self.config, use_te=use_te)
        if g.device.type == "cuda":
            self.model.cuda(g.device)
        self.model.eval()
        self.model.requires_grad_(False)

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, cfg: RunConfig, actor: Actor, *, resumed: bool) -> None:
        """Set the reference weights for this run (module docstring). Collective over all ranks;
        call it right before step 1: after the start weights and warm start, or after a resume."""
        m = cfg.model
        snapshot = Path(cfg.train.output_dir) / SNAPSHOT_DIR
        # The RL-start policy is exactly the start checkpoint: no copy needs saving.
        rereadable = m.pretrained and not cfg.sft.steps
        if m.ref_checkpoint is not None:
            source = self.load(m.ref_checkpoint)
        elif not resumed:
            self.copy_from(actor)
            source = "the actor's weights at RL step 0"
            if not rereadable:
                checkpoint.save(
                    snapshot,
                    _SNAPSHOT_NAME,
                    {"model": self.model.sharded_state_dict()},
                    {"reference": source},
                )
                source += f" (saved to {snapshot})"
        elif (snapshot / "latest").is_file():
            source = self.load(snapshot)
        elif rereadable:
            source = self.load(m.load if m.load is not None else m.hf_checkpoint)
        else:
            raise RuntimeError(
                f"resuming with loss.kl_coef={cfg.loss.kl_coef} but {snapshot} holds no reference "
                "weights (the run started without the KL penalty, or the folder was removed): the "
                "policy RL started from is gone. Set model.ref_checkpoint to the weights to use "
                "(e.g. the SFT warm-start cache under train.cache_dir), or start a new run"
            )
        print_rank0(f"reference: {source}")

    def copy_from(self, actor: Actor) -> None:
        """The actor's current weights (same layout, same names), copied shard for shard."""
        src = dict(actor.module.named_parameters())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(src[name])

    def load(self, path: str | Path) -> str:
        """Weights from an HF folder or a converted / trainer checkpoint (any TP/PP it was saved
        at). Collective over all ranks. Returns a description for the run log."""
        t0 = time.perf_counter()
        if is_hf_folder(path):
            g = self.groups
            load_hf_weights(self.model, path, self.model_cfg, tp_rank=g.tp_rank, tp_size=g.tp_size)
            kind = "HF folder"
        else:
            path = converted_dir(path)
            loaded, _ = checkpoint.load(path, {"model": self.model.sharded_state_dict()})
            self.model.load_state_dict(loaded["model"])
            kind = "checkpoint"
        return f"{path} ({kind}, {time.perf_counter() - t0:.1f} s)"

    # -- forward ---------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: dict[str, torch.Tensor],
        micro_batch_size: int,
        *,
        temperature: float = 1.0,
        max_tokens: int | None = None,
    ) -> torch.Tensor | None:
        """Per-token reference logprobs of ``labels`` ([B, S], on the model's device) on the last
        pipeline stage, else None. ``temperature`` must be the actor's, so both score the same
        distribution family; ``max_tokens``: the actor's token budget (``split_micro_batches``)."""
        kwargs = {
            "vocab_size": self.model_cfg.vocab_size,
            "tp_rank": self.groups.tp_rank,
            "tp_group": self.groups.tp,
        }

        g = self.groups

        def loss_fn(mb, logits):
            lp = token_logprobs(logits, mb["labels"], temperature=temperature, **kwargs)
            if g.cp_size > 1:
                lp = gather_from_cp(lp, g.cp, g.cp_size)
            return torch.zeros(()), {"logprobs": lp}

        # The actor's schedule: same micro-batching, positions and pipeline path as its logprobs.
        micro_batches = split_for_model(batch, micro_batch_size, max_tokens, self.config, g)
        with te_fp8_off() if self.te_fp8 else contextlib.nullcontext():
            out = run_schedule(
                self.model, self.groups.device, micro_batches, loss_fn, forward_only=True
            )
        if not self.groups.is_last_stage:
            return None
        return micro_batches.merge([o["logprobs"] for o in out])
