"""The shipped character tokenizer: ids, exact round trips, offline loading."""

import json

import pytest

from megatron_rl_fp8.data import (
    BOS_ID,
    DEFAULT_TOKENIZER_DIR,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB,
    VOCAB_SIZE,
    TaskConfig,
    TokenizerConfig,
    build_datasets,
    encode_text,
    load_prompt_encoder,
    load_tokenizer,
    prompt_token_ids,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_special_ids_and_vocab_size(tok):
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tok.pad_token_id == PAD_ID and tok.bos_token_id == BOS_ID
    assert tok.eos_token_id == EOS_ID and tok.unk_token_id == UNK_ID
    assert len(tok) == VOCAB_SIZE == len(VOCAB) < 64
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert tok.convert_tokens_to_ids(list("0123456789")) == list(range(4, 14))


def test_loads_offline_with_autotokenizer(monkeypatch):
    # No hub: offline mode on, and the folder is all transformers gets.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.decode(tok.encode("12+35=47")) == "12+35=47"
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>" and tok.bos_token == "<bos>"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        json.loads((DEFAULT_TOKENIZER_DIR / name).read_text())


def test_one_token_per_character_and_no_implicit_specials(tok):
    ids = tok.encode("12+35=47")
    assert len(ids) == 8 and BOS_ID not in ids and EOS_ID not in ids
    assert tok.decode(ids) == "12+35=47"
    text = "what is 3 * (4 - 5), x?\n: 1.5/2"
    assert tok.decode(tok.encode(text)) == text  # spaces and newlines kept, none inserted


def test_special_tokens_decode_and_skip(tok):
    ids = [BOS_ID, *tok.encode("7+8="), *tok.encode("15"), EOS_ID, PAD_ID, PAD_ID]
    assert tok.decode(ids, skip_special_tokens=True) == "7+8=15"
    assert tok.decode(ids) == "<bos>7+8=15<eos><pad><pad>"
    # A literal "<eos>" in text is the special token, not five characters.
    assert tok.encode("3<eos>") == [tok.convert_tokens_to_ids("3"), EOS_ID]


def test_round_trip_on_all_shipped_prompts(tok):
    encoder = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)
    train, val, _ = build_datasets(TaskConfig(), encoder)
    texts = [r["prompt"] + r["answer"] for r in train.records + val.records]
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, encoded):
        assert len(ids) == len(text) and UNK_ID not in ids
    assert tok.batch_decode(encoded) == texts


def test_prompt_token_ids_and_length_limit(tok):
    assert prompt_token_ids(tok, "1+2=") == [BOS_ID, *tok.encode("1+2=")]
    assert len(prompt_token_ids(tok, "123+456=", max_prompt_len=9)) == 9
    with pytest.raises(ValueError, match="max_prompt_len=8"):
        prompt_token_ids(tok, "123+456=", max_prompt_len=8)


def test_unknown_characters_are_refused(tok):
    with pytest.raises(ValueError, match=r"outside the tokenizer vocabulary: \['A', 'é'\]"):
        encode_text(tok, "Aé+1=")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
