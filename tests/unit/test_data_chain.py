"""The long-answer task (``task.name: chain``): worked solutions, the shipped files, their limits,
the verifier and the format check."""

import pytest

from megatron_rl_fp8.data import (
    TaskConfig,
    TokenizerConfig,
    build_datasets,
    load_prompt_encoder,
    load_tokenizer,
    sft_examples,
)
from megatron_rl_fp8.data.chain import (
    CHAIN_MAX_PROMPT_LEN,
    CHAIN_MAX_RESPONSE_LEN,
    CHAIN_TRAIN_PATH,
    CHAIN_VAL_PATH,
    solution,
    write_chain_files,
)
from megatron_rl_fp8.reward.verifiers import FORMAT_CHECKS, VERIFIERS, chain_exact, chain_format


def test_solution_by_hand():
    assert solution("12+35-7+40+3=") == "12+35=47,47-7=40,40+40=80,80+3=83"
    assert solution("3-15-2=") == "3-15=-12,-12-2=-14"
    assert solution("0+0=") == "0+0=0"


def _datasets():
    encoder = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)
    cfg = TaskConfig(
        name="chain", max_prompt_len=CHAIN_MAX_PROMPT_LEN, max_response_len=CHAIN_MAX_RESPONSE_LEN
    )
    train, val, dropped = build_datasets(cfg, encoder)
    assert dropped == {"train": 0, "val": 0}
    return train, val


def test_task_name_picks_the_shipped_chain_files():
    cfg = TaskConfig(name="chain")
    assert (cfg.resolved_train_path, cfg.resolved_val_path) == (CHAIN_TRAIN_PATH, CHAIN_VAL_PATH)
    assert TaskConfig(name="chain", train_path="x.jsonl").resolved_train_path.name == "x.jsonl"


def test_shipped_files_are_worked_chains_within_the_limits():
    assert CHAIN_TRAIN_PATH.stat().st_size + CHAIN_VAL_PATH.stat().st_size < 1_000_000
    train, val = _datasets()
    assert len(train) == 8_000 and len(val) == 256
    val_prompts = [r["prompt"] for r in val.records]
    assert len(set(val_prompts)) == len(val_prompts)
    assert not {r["prompt"] for r in train.records} & set(val_prompts)
    records = train.records + val.records
    for r in records:
        assert r["answer"] == solution(r["prompt"])
        assert chain_exact(r["answer"] + "<eos>", r["answer"]) == 1.0
        assert chain_format(r["answer"]) == 1.0
        assert r["answer"].count(",") + 2 in (5, 6)  # steps = operands - 1
    examples = sft_examples(
        load_tokenizer(),
        records,
        max_prompt_len=CHAIN_MAX_PROMPT_LEN,
        max_response_len=CHAIN_MAX_RESPONSE_LEN,
    )  # raises on any over-long example
    responses = sorted(sum(e.loss_mask) for e in examples)
    # The point of the task: answers of 32-64 tokens for most problems, never over the limit.
    assert responses[len(responses) // 10] >= 30 and responses[-1] <= CHAIN_MAX_RESPONSE_LEN
    assert 36 <= responses[len(responses) // 2] <= 44


def test_regeneration_is_byte_exact(tmp_path):
    train, val = write_chain_files(tmp_path)
    assert train.read_bytes() == CHAIN_TRAIN_PATH.read_bytes()
    assert val.read_bytes() == CHAIN_VAL_PATH.read_bytes()


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("12+35=47,47-7=40<eos>", 1.0),
        ("12+35=47,47-7=40", 1.0),  # no <eos>: read to the end
        ("12+35=47,47-7=41<eos>", 0.0),
        ("12+35=47,47-7=39,39+1=40<eos>", 1.0),  # the final total is what is scored
        ("12+35=47,47-7=40,40+<eos>", 0.0),  # cut off mid-step
        ("40<eos>", 0.0),  # no '=': no final total
        ("=40<eos>", 1.0),
        ("=40.5<eos>", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_chain_exact(response, reward):
    assert VERIFIERS["chain"] is chain_exact
    assert chain_exact(response, "12+35=47,47-7=40") == reward
    assert chain_exact(response, "40") == reward
    assert chain_exact(response, 40) == reward


def test_chain_exact_reads_negative_totals_and_refuses_a_malformed_reference():
    assert chain_exact("3-15=-12<eos>", "3-15=-12") == 1.0
    assert chain_exact("3-15=12<eos>", "3-15=-12") == 0.0
    with pytest.raises(ValueError, match="worked chain"):
        chain_exact("1", "forty")
    with pytest.raises(ValueError, match="worked chain"):
        chain_exact("1", "12+35=47,")


def test_chain_format():
    assert FORMAT_CHECKS["chain"] is chain_format
    assert chain_format("12+35=47,47-7=40<eos>") == 1.0
    assert chain_format("-3+5=2") == 1.0
    for bad in ("40", "12+35=47,", "12+35=47,47-7", "12+35=47 47-7=40", None):
        assert chain_format(bad) == 0.0
