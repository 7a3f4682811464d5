import pytest
import torch

from megatron_rl_fp8.rollout.base import Completion
from megatron_rl_fp8.trainer.batch import build_rl_batch, build_sft_batch, rows_for_rank


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
