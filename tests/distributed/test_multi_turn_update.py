"""Inserted tokens through a whole actor update (issue 46): the real tiny actor (one gloo rank),
full FP8 (blockwise emulation), calibrating this step, token-level TIS. A multi-turn row's
inserted tokens (``Completion.response_mask`` 0, the 0.0 placeholder log-prob the turn loop
gives them) are perturbed where only a leak could see them: their targets (the label ids at
their positions; the inputs stay, so every forward is the same) and their rollout log-probs.
The weights after the update are bitwise those of the unperturbed update, every metric is the
same, and the gradient reaching the logits is exactly 0 at every position the mask leaves out,
token by token."""

import torch

from tests.dist_utils import run_distributed

OVERRIDES = [
    "sft.steps=0",
    "train.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=8",  # one micro-batch per mini-batch: rows 0-7, then 8-15
    "train.updates_per_step=2",
    "loss.calib.interval=1",  # calibrating at step 1
    "loss.calib.ema_decay=0",  # the bounds are this batch's alone, for both updates
    "loss.is_correction.level=token",
]


def _with_inserted_spans(completions):
    """Turn each response of 4+ tokens into turn | inserted answer (its tokens 1-2) | turn."""
    for c in completions:
        if len(c.response_ids) >= 4:
            c.response_mask = [1, 0, 0] + [1] * (len(c.response_ids) - 3)
            c.response_logprobs = [
                v if m else 0.0 for v, m in zip(c.response_logprobs, c.response_mask)
            ]
    return completions


def _body(rank, world):
    import tempfile

    from megatron_rl_fp8.config import load_config
    from megatron_rl_fp8.loss import grpo_advantages
    from megatron_rl_fp8.trainer.batch import build_rl_batch, order_for_updates
    from megatron_rl_fp8.trainer.collectives import scatter_rows
    from megatron_rl_fp8.trainer.loop import Trainer

    cfg = load_config(
        "examples/tiny_cpu_fp8.yaml", [*OVERRIDES, f"train.output_dir={tempfile.mkdtemp()}"]
    )
    trainer = Trainer(cfg)
    try:
        actor = trainer.actor
        trainer.engines.sync(version=0)
        completions, _, _ = trainer.sampler.rollout(1)
        completions = _with_inserted_spans(completions)
        # The random policy is never right: rewards of its own, so every group has a signal.
        rewards = torch.randn(len(completions), generator=torch.Generator().manual_seed(1))
        adv = grpo_advantages(rewards, cfg.rollout.n_samples_per_prompt, norm_std=True)
        rows = build_rl_batch(completions, adv, pad_id=trainer.tokenizer.pad_token_id)
        batch = scatter_rows(order_for_updates(rows, 1, 2), trainer.groups)
        response = batch["rollout_logprobs"] != 0  # sampled tokens (a log-prob is never 0.0)
        inserted = torch.zeros_like(response)
        for i, c in enumerate(completions):  # one rank: order_for_updates keeps the rows
            start = len(c.prompt_ids) - 1
            for j, m in enumerate(c.sampled()):
                inserted[i, start + j] = m == 0
        assert torch.equal(batch["loss_mask"].bool(), response & ~inserted)
        assert inserted.sum() >= 8

        start = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
        grads = []

        def keep_grad(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            if logits.requires_grad:  # the update's forward, not the no-grad log-prob passes
                logits.register_hook(lambda g: grads.append(g.detach().clone()))

        actor.module.output_layer.register_forward_hook(keep_grad)

        def update(b):
            with torch.no_grad():
                for n, p in actor.module.named_parameters():
                    p.copy_(start[n])
            actor.params_changed()
            actor.reset_optimizer()
            grads.clear()
            metrics = trainer.policy_update(b, 1)
            after = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
            return after, metrics, list(grads)

        plain, plain_metrics, plain_grads = update(batch)
        g = torch.Generator().manual_seed(0)
        perturbed = dict(batch)
        labels, logprobs = batch["labels"].clone(), batch["rollout_logprobs"].clone()
        vocab = cfg.model.vocab_size
        labels[inserted] = (
            labels[inserted] + torch.randint(1, vocab, labels[inserted].shape, generator=g)
        ) % vocab
        logprobs[inserted] = -5 * torch.rand(int(inserted.sum()), generator=g)
        perturbed["labels"], perturbed["rollout_logprobs"] = labels, logprobs
        other, other_metrics, _ = update(perturbed)

        moved = max((plain[n] - start[n]).abs().max().item() for n in start)
        same = all(torch.equal(plain[n], other[n]) for n in start)
        timing = {k for k in plain_metrics if k.startswith("perf/")}
        metrics_same = {k: v for k, v in plain_metrics.items() if k not in timing} == {
            k: v for k, v in other_metrics.items() if k not in timing
        }
        leaked, used = [], []
        for k, grad in enumerate(plain_grads):  # [sequence, rows, vocab] of micro-batch k
            per_token = grad.abs().amax(dim=-1).transpose(0, 1)  # [rows, sequence]
            mask = batch["loss_mask"][8 * k : 8 * k + 8, : per_token.shape[1]].bool()
            assert mask.sum() == batch["loss_mask"][8 * k : 8 * k + 8].sum()
            leaked.append(per_token[~mask].max().item())
            used.append((per_token[mask] > 0).float().mean().item())
        return {
            "moved": moved,
            "same": same,
            "metrics_same": metrics_same,
            "calibrated": "calib/lower" in " ".join(plain_metrics),
            "micro_batches": len(plain_grads),
            "leaked": max(leaked),
            "used": min(used),
            "inserted": int(inserted.sum()),
        }
    finally:
        trainer.close()


def test_inserted_tokens_change_nothing_in_a_whole_fp8_update():
    (r,) = run_distributed(_body, world_size=1, timeout=600)
    assert r["moved"] > 0 and r["calibrated"] and r["micro_batches"] == 2
    assert r["same"], "perturbing inserted tokens' targets and log-probs changed the weights"
    assert r["metrics_same"]
    assert r["leaked"] == 0.0  # not a single masked position's logits got a gradient
    assert r["used"] > 0.9  # while the sampled tokens' did
