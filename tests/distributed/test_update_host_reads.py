"""The update's statistics stay on the device: the host reads of one RL step's update (every
``.item()``, ``.tolist()``, ``bool()``/``float()``/``int()`` of a tensor, ``.numpy()``: on a GPU
each is a synchronisation) do not grow with the number of micro-batches. Counted with a torch
function mode around ``PolicyUpdate``, on the real tiny actor (one gloo rank), for the same
rollout batch split into 1, 2 and 8 micro-batches per optimizer step."""

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from tests.dist_utils import run_distributed

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


class CountReads(TorchFunctionMode):
    """Host reads made by the project's code (the frame that calls torch is in the package).
    Megatron's own reads are left out: on this CPU they include its RNG tracker's check of the
    CPU generator state in every local-spec attention (a host tensor on any machine)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            caller = sys._getframe(1).f_code.co_filename
            self.reads += f"{os.sep}megatron_rl_fp8{os.sep}" in caller
        return func(*args, **(kwargs or {}))


def _body(rank, world):
    import tempfile

    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.loss import grpo_advantages
    from megatron_rl_fp8.trainer.batch import build_rl_batch, order_for_updates
    from megatron_rl_fp8.trainer.collectives import scatter_rows
    from megatron_rl_fp8.trainer.loop import Trainer

    out = tempfile.mkdtemp()
    cfg = load_config(
        "examples/tiny_cpu.yaml",
        [
            "sft.steps=0",
            "train.prompts_per_step=4",
            "train.micro_batch_size=8",
            "rollout.n_samples_per_prompt=4",
            "reward.format_weight=0.5",  # reward variance in every group: non-zero advantages
            f"train.output_dir={out}",
        ],
    )
    trainer = Trainer(cfg)
    try:
        trainer.engines.sync(version=0)
        completions, rewards, _ = trainer.sampler.rollout(1)
        adv = grpo_advantages(rewards, cfg.rollout.n_samples_per_prompt, norm_std=True)
        rows = build_rl_batch(completions, adv, pad_id=trainer.tokenizer.pad_token_id)
        batch = order_for_updates(rows, 1, cfg.train.updates_per_step)
        n_rows = batch["input_ids"].shape[0] // cfg.train.updates_per_step  # per mini-batch
        counts = {}
        for micro in (1, 2, 8):
            cfg.train.micro_batch_size = n_rows // micro
            local = scatter_rows(batch, trainer.groups)
            with CountReads() as mode:
                metrics = trainer.policy_update(local, 1)
            counts[micro] = (mode.reads, metrics["train/response_tokens"])
        return counts
    finally:
        trainer.close()


def test_host_reads_per_update_do_not_grow_with_micro_batches():
    (counts,) = run_distributed(_body, world_size=1)
    reads = {micro: n for micro, (n, _) in counts.items()}
    # The same tokens in every split, so the same statistics are accounted.
    assert len({tokens for _, tokens in counts.values()}) == 1
    assert reads[1] == reads[2] == reads[8], reads
