import dataclasses

import pytest
import torch

from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.trainer.batch import build_rl_batch, build_sft_batch, rows_for_rank

# Turn 1 sampled [7, 8], the environment inserted [30, 31], turn 2 sampled [9, 2].
TWO_TURNS = Completion(
    prompt_ids=[1, 5],
    response_ids=[7, 8, 30, 31, 9, 2],
    response_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
    response_mask=[1, 1, 0, 0, 1, 1],
    finished=True,
)


def test_rl_batch_aligns_labels_masks_and_logprobs():
    comps = [
        Completion(
            prompt_ids=[1, 5, 6], response_ids=[7, 2], response_logprobs=[-0.1, -0.2], finished=True
        ),
        Completion(
            prompt_ids=[1, 5],
            response_ids=[8, 9, 10],
            response_logprobs=[-1.0, -2.0, -3.0],
            finished=False,
        ),
    ]
    b = build_rl_batch(comps, torch.tensor([0.5, -0.5]), pad_id=0)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 10]]
    assert b["labels"].tolist() == [[5, 6, 7, 2, 0], [5, 8, 9, 10, 0]]
    # The mask marks positions whose *label* is a response token.
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    assert torch.allclose(b["rollout_logprobs"][0, 2:4], torch.tensor([-0.1, -0.2]))
    assert torch.allclose(b["rollout_logprobs"][1, 1:4], torch.tensor([-1.0, -2.0, -3.0]))
    masked_labels = b["labels"][b["loss_mask"].bool()].tolist()
    assert masked_labels == [7, 2, 8, 9, 10]


def test_observation_tokens_between_turns_are_out_of_the_loss_mask():
    c = TWO_TURNS
    b = build_rl_batch([c], torch.tensor([1.0]), pad_id=0)
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 1, 1, 0]]
    assert b["labels"][b["loss_mask"].bool()].tolist() == [7, 8, 9, 2]
    one_turn = dataclasses.replace(c, response_mask=None)
    assert build_rl_batch([one_turn], torch.tensor([1.0]), pad_id=0)["loss_mask"].sum() == 6


def test_a_pipelined_rollout_keeps_its_observation_mask_across_a_checkpoint():
    from megatron_rl_fp8.trainer.pipeline import Rollout

    multi = Completion(
        prompt_ids=[1],
        response_ids=[7, 30, 2],
        response_logprobs=[-0.5, 0.0, -0.25],  # float32-exact: the state holds float32
        response_mask=[1, 0, 1],
        finished=True,
    )
    single = Completion(prompt_ids=[1], response_ids=[8], response_logprobs=[-1.0], finished=False)
    back = Rollout.from_state_dict(Rollout(3, [multi, single], torch.zeros(2), {}).state_dict())
    assert back.completions == [multi, single]
    old = Rollout(3, [single], torch.zeros(1), {}).state_dict()
    del old["response_mask"]  # saved before multi-turn rollouts
    assert Rollout.from_state_dict(old).completions == [single]


def test_sft_batch_moves_mask_to_label_positions():
    collated = {
        "input_ids": torch.tensor([[1, 4, 5, 2]]),
        "loss_mask": torch.tensor([[0.0, 0.0, 1.0, 1.0]]),
    }
    b = build_sft_batch(collated, pad_id=0)
    assert b["labels"].tolist() == [[4, 5, 2, 0]]
    assert b["loss_mask"].tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_rows_for_rank_partitions_rows():
    batch = {"x": torch.arange(8)}
    parts = [rows_for_rank(batch, r, 2)["x"].tolist() for r in range(2)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_order_for_updates_gives_every_layout_the_same_mini_batches():
    from megatron_rl_fp8.trainer.batch import order_for_updates, rows_for_rank

    batch = {"x": torch.arange(24)}
    for dp in (1, 2, 3):
        ordered = order_for_updates(batch, dp, updates=2)
        minis = [[] for _ in range(2)]
        for r in range(dp):
            local = rows_for_rank(ordered, r, dp)["x"]
            for u, chunk in enumerate(local.chunk(2)):
                minis[u] += chunk.tolist()
        assert minis == [list(range(12)), list(range(12, 24))], dp
    with pytest.raises(ValueError, match="mini-batches"):
        order_for_updates(batch, 5, updates=2)


# -- micro-batches by token budget (train.max_tokens_per_gpu) ------------------------------------


def _padded_size(rows, lengths):
    return len(rows) * max(lengths[i] for i in rows)


@pytest.mark.parametrize("seed", range(20))
def test_pack_by_tokens_places_every_row_once_within_the_budget(seed):
    from megatron_rl_fp8.trainer.batch import pack_by_tokens

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
    lengths = lengths.tolist()
    budget = int(torch.randint(20, 200, (1,), generator=g))
    groups = pack_by_tokens(lengths, budget)
    assert sorted(i for rows in groups for i in rows) == list(range(len(lengths)))
    for rows in groups:
        # Over budget only as a single row longer than the budget.
        assert _padded_size(rows, lengths) <= budget or (
            len(rows) == 1 and lengths[rows[0]] > budget
        )
        # Longest first inside each micro-batch, so the first row is its padded width.
        assert [lengths[i] for i in rows] == sorted((lengths[i] for i in rows), reverse=True)
    # Deterministic: the same lengths give the same plan.
    assert pack_by_tokens(lengths, budget) == groups
    # Greedy is tight: every micro-batch but the last was full (one more row of at most its
    # longest row's length would not have fit).
    for rows in groups[:-1]:
        assert (len(rows) + 1) * lengths[rows[0]] > budget


def test_pack_by_tokens_hand_example():
    from megatron_rl_fp8.trainer.batch import pack_by_tokens

    lengths = [3, 9, 2, 3, 12, 5]
    # Longest first, ties by index: 12 alone (over the budget), 9 alone (2 x 9 > 10),
    # then 5 + 3 (2 x 5 = 10; a third row: 3 x 5 > 10), then 3 + 2 (2 x 3).
    assert pack_by_tokens(lengths, 10) == [[4], [1], [5, 0], [3, 2]]
    assert pack_by_tokens(lengths, 1000) == [[4, 1, 5, 0, 3, 2]]
    with pytest.raises(ValueError, match="max_tokens"):
        pack_by_tokens(lengths, 0)


def test_row_lengths_end_at_the_last_loss_position():
    from megatron_rl_fp8.trainer.batch import row_lengths

    comps = [
        Completion(
            prompt_ids=[1, 5, 6], response_ids=[7, 2], response_logprobs=[0, 0], finished=True
        ),
        Completion(
            prompt_ids=[1], response_ids=[8, 9, 10, 11], response_logprobs=[0] * 4, finished=False
        ),
    ]
    b = build_rl_batch(comps, torch.zeros(2), pad_id=0)
    # prompt + response - 1: the last input token's prediction (label pad) is never read.
    assert row_lengths(b["loss_mask"]) == [4, 4]
    assert row_lengths(torch.zeros(2, 5)) == [1, 1]  # no loss position: one position, not zero


def test_take_and_merge_rows_restore_the_batch_order():
    from megatron_rl_fp8.trainer.batch import merge_rows, pack_by_tokens, row_lengths, take_rows

    mask = torch.zeros(5, 8)
    for i, n in enumerate([3, 8, 1, 6, 4]):
        mask[i, :n] = 1
    batch = {"loss_mask": mask, "x": torch.arange(40.0).reshape(5, 8), "adv": torch.arange(5.0)}
    lengths = row_lengths(mask)
    groups = pack_by_tokens(lengths, 12)
    parts = [take_rows(batch, rows, lengths[rows[0]]) for rows in groups]
    for rows, part in zip(groups, parts):
        assert part["x"].shape == (len(rows), lengths[rows[0]])  # cut to its own longest row
        assert part["adv"].tolist() == [float(i) for i in rows]  # per-row tensors: rows only
    merged = merge_rows([p["x"] for p in parts], groups, 8)
    # Every row back in place, real positions exact, positions past its micro-batch's width 0.
    assert torch.equal(merged * mask, batch["x"] * mask)
    for rows, part in zip(groups, parts):
        assert merged[rows, part["x"].shape[1] :].eq(0).all()


def test_split_micro_batches_fixed_and_by_tokens():
    from megatron_rl_fp8.trainer.schedule import split_micro_batches

    mask = torch.zeros(6, 10)
    for i, n in enumerate([2, 9, 3, 9, 1, 4]):
        mask[i, :n] = 1
    batch = {"input_ids": torch.arange(60).reshape(6, 10), "loss_mask": mask}
    fixed = split_micro_batches(batch, 4)
    assert not fixed.variable_shapes
    assert [mb["input_ids"].shape for mb in fixed.batches] == [(4, 10), (2, 10)]
    assert torch.equal(fixed.merge([mb["input_ids"] for mb in fixed.batches]), batch["input_ids"])

    packed = split_micro_batches(batch, 4, max_tokens=20)
    assert packed.variable_shapes
    assert [tuple(mb["input_ids"].shape) for mb in packed.batches] == [(2, 9), (4, 4)]
    merged = packed.merge([mb["input_ids"] for mb in packed.batches])
    assert torch.equal(merged * mask.long(), batch["input_ids"] * mask.long())
    # Sequence lengths rounded up to a multiple (sequence / context parallelism): S = 10 is
    # padded to 12 (token 0, no loss), and the merged outputs are cut back to S.
    aligned = split_micro_batches(batch, 4, max_tokens=20, multiple=4)
    # (the two 9-token rows become 12 long: 24 tokens no longer fit the budget together)
    assert [tuple(mb["input_ids"].shape) for mb in aligned.batches] == [(1, 12), (1, 12), (4, 4)]
    assert aligned.batches[0]["loss_mask"][:, 10:].sum() == 0
    merged = aligned.merge([mb["input_ids"] for mb in aligned.batches])
    assert torch.equal(merged * mask.long(), batch["input_ids"] * mask.long())
    fixed = split_micro_batches(batch, 4, multiple=4)
    assert [mb["input_ids"].shape for mb in fixed.batches] == [(4, 12), (2, 12)]
    assert torch.equal(fixed.merge([mb["input_ids"] for mb in fixed.batches]), batch["input_ids"])


def test_metrics_do_not_depend_on_how_rows_are_grouped():
    """update_metrics.account: token-weighted sums and extremes; a micro-batch without response
    tokens (a token budget puts such rows together) adds nothing, not a ratio_min of 0."""
    from megatron_rl_fp8.metrics.accumulator import MetricAccumulator
    from megatron_rl_fp8.trainer.update_metrics import TokenStats, account

    def out(ntok, clipfrac, ratio_min, ratio_max, loss, nneg, neg_lower):
        t = torch.tensor
        stats = TokenStats(
            pg_loss=t(loss),
            tokens=t(float(ntok)),
            neg_tokens=t(float(nneg)),
            pos_tokens=t(float(ntok - nneg)),
            useful=t(float(ntok)),
            ratio_hist=torch.zeros(4),
            weighted={
                # a share of the negative-advantage tokens, weighted by their count
                "pg_clipfrac_neg_lower": t(neg_lower * nneg),
                # policy_loss's per-micro-batch means, weighted by the micro-batch's tokens
                "pg_clipfrac": t(clipfrac * ntok),
                "ratio_min": t(ratio_min * ntok),
                "ratio_max": t(ratio_max * ntok),
            },
        )
        return {"loss": t(loss), "stats": stats}

    # The same 6 response tokens: 2 + 4 in two micro-batches, or 6 plus an empty one.
    # Negative-advantage tokens: 1 (clipped) + 3 (none clipped), or all 4 together (1/4).
    two = [out(2, 0.5, 0.9, 1.1, 0.25, 1, 1.0), out(4, 0.25, 0.8, 1.3, 0.5, 3, 0.0)]
    empty = [out(6, 1 / 3, 0.8, 1.3, 0.75, 4, 0.25), out(0, 0.0, 1.0, 1.0, 0.0, 0, 0.0)]
    totals = []
    for outs in (two, empty):
        acc = MetricAccumulator()
        account(outs, acc, applied=True)
        totals.append(acc.reduce())
    a, b = totals
    for tot in (a, b):
        assert tot.maxima == {"ratio_max": pytest.approx(1.3)}
        assert tot.minima == {"ratio_min": pytest.approx(0.8)}
    assert a.sums == pytest.approx(b.sums)
    assert a.sums["pg/pg_clipfrac"] / a.sums["pg_tokens"] == pytest.approx(2 / 6)
    share = a.sums["pg/pg_clipfrac_neg_lower"] / a.sums["pg_tokens_neg"]
    assert share == pytest.approx(1 / 4)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_inserted_tokens_carry_no_gradient_and_no_statistic(level):
    """A multi-turn row's inserted tokens, through the batch and the clipped loss with TIS:
    whatever log-probs sit at their positions (the rollout's 0.0 placeholders, the trainer's,
    pi_old's), the loss, every metric and every other token's gradient are the same, and their
    own gradient is 0."""
    from megatron_rl_fp8.loss.importance import ISCorrectionConfig
    from megatron_rl_fp8.loss.ppo import policy_loss

    c = TWO_TURNS
    b = build_rl_batch([c, c], torch.tensor([1.0, -1.0]), pad_id=0)
    mask = b["loss_mask"]
    inserted = torch.zeros_like(mask, dtype=torch.bool)
    inserted[:, 3:5] = True  # label positions of 30, 31
    gen = torch.Generator().manual_seed(0)
    trainer = b["rollout_logprobs"] + 0.3 * torch.randn(mask.shape, generator=gen)
    old = b["rollout_logprobs"] + 0.1 * torch.randn(mask.shape, generator=gen)

    def run(shift: float):
        lp = torch.where(inserted, trainer - 7.0 * shift, trainer).requires_grad_()
        loss, metrics = policy_loss(
            lp,
            torch.where(inserted, old + 5.0 * shift, old),
            b["advantages"],
            mask,
            clip_low=0.8,
            clip_high=1.28,
            rollout_log_prob=torch.where(
                inserted, b["rollout_logprobs"] - 3.0 * shift, b["rollout_logprobs"]
            ),
            is_correction=ISCorrectionConfig(level=level, mode="truncate", cap=2.0),
        )
        loss.backward()
        return loss.detach(), {k: v.item() for k, v in metrics.items()}, lp.grad

    loss0, metrics0, grad0 = run(0.0)
    loss1, metrics1, grad1 = run(1.0)
    assert torch.equal(loss0, loss1) and metrics0 == metrics1
    assert torch.equal(grad0, grad1) and not grad0[inserted].any() and grad0[mask.bool()].any()
