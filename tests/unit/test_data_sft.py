"""SFT warm-start examples and right-padded batches."""

import pytest
import torch

from megatron_rl_fp8.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SFTExample,
    collate,
    load_tokenizer,
    sft_example,
    sft_examples,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_layout_and_mask(tok):
    ex = sft_example(tok, "12+35=", "47")
    assert ex.input_ids == [BOS_ID, *tok.encode("12+35="), *tok.encode("47"), EOS_ID]
    assert ex.loss_mask == [0.0] * 7 + [1.0] * 3
    assert tok.decode(ex.input_ids) == "<bos>12+35=47<eos>"


def test_length_limits(tok):
    with pytest.raises(ValueError, match="max_response_len=4"):
        sft_example(tok, "604+520=", "1124", max_response_len=4)
    assert (
        len(sft_example(tok, "604+520=", "1124", max_prompt_len=9, max_response_len=5).input_ids)
        == 14
    )
    with pytest.raises(ValueError, match="outside the tokenizer vocabulary"):
        sft_example(tok, "1+1=", "Two")


def test_collate_right_pads(tok):
    examples = sft_examples(
        tok, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "604+520=", "answer": "1124"}]
    )
    batch = collate(examples)
    ids, mask, attn = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    assert ids.dtype == torch.long and mask.dtype == torch.float32 and attn.dtype == torch.long
    assert ids.shape == mask.shape == attn.shape == (2, 14)
    assert ids[0].tolist() == [BOS_ID, *tok.encode("1+2=3"), EOS_ID] + [PAD_ID] * 7
    assert mask[0].tolist() == [0.0] * 5 + [1.0] * 2 + [0.0] * 7
    assert attn[0].tolist() == [1] * 7 + [0] * 7
    assert mask[1].sum().item() == 5 and attn[1].sum().item() == 14
    # Shifted for next-token loss: every supervised target is an answer digit or <eos>.
    targets = ids[:, 1:][mask[:, 1:].bool()].tolist()
    assert tok.decode(targets) == "3<eos>1124<eos>"


def test_collate_errors_and_pad_id():
    with pytest.raises(ValueError, match="no examples"):
        collate([])
    with pytest.raises(ValueError, match="example 0 has 2 ids but 1 mask"):
        collate([SFTExample(input_ids=[1, 2], loss_mask=[1.0])])
    batch = collate([SFTExample([1], [0.0]), SFTExample([1, 5], [0.0, 1.0])], pad_id=-1)
    assert batch["input_ids"][0].tolist() == [1, -1]
