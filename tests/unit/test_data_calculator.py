"""The tool-use task (``task.name: calculator``): the shipped files, their limits, the SFT traces
(policy turns trained on, inserted answers read but not trained on) and the verifier."""

import pytest

from megatron_rl_fp8.data import TaskConfig, TokenizerConfig, build_datasets, load_prompt_encoder
from megatron_rl_fp8.data.calculator import (
    CALC_MAX_PROMPT_LEN,
    CALC_MAX_RESPONSE_LEN,
    CALC_TRAIN_PATH,
    CALC_VAL_PATH,
    tool_turns,
    write_calculator_files,
)
from megatron_rl_fp8.data.sft import sft_examples_from_records
from megatron_rl_fp8.reward.verifiers import FORMAT_CHECKS, VERIFIERS, arithmetic_exact
from megatron_rl_fp8.rollout.environment import calculator
from megatron_rl_fp8.rollout.tools import tool_format

ENCODER = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)


def _datasets():
    cfg = TaskConfig(
        name="calculator",
        max_prompt_len=CALC_MAX_PROMPT_LEN,
        max_response_len=CALC_MAX_RESPONSE_LEN,
    )
    assert (cfg.resolved_train_path, cfg.resolved_val_path) == (CALC_TRAIN_PATH, CALC_VAL_PATH)
    train, val, dropped = build_datasets(cfg, ENCODER)
    assert dropped == {"train": 0, "val": 0}
    return train, val


def test_shipped_files_are_products_with_traces_on_about_half():
    train, val = _datasets()
    assert len(train) == 8_000 and len(val) == 256
    assert not {r["prompt"] for r in train.records} & {r["prompt"] for r in val.records}
    for r in train.records + val.records:
        a, b = r["prompt"].removesuffix("=").split("*")
        assert len(a) == 3 and len(b) == 2 and int(r["answer"]) == int(a) * int(b)
    traced = [r for r in train.records if "sft_turns" in r["record"]]
    assert 0.45 < len(traced) / len(train) < 0.55
    assert all(r["record"]["sft_turns"] == tool_turns(r["prompt"], r["answer"]) for r in traced)
    assert not any("sft_turns" in r["record"] for r in val.records)


def test_a_trace_is_what_the_turn_loop_makes_of_the_same_trajectory():
    """The SFT trace's turns, parsed and answered by the calc format and the calculator, give
    back its inserted text: the warm start teaches exactly the rollout's layout."""
    fmt = tool_format("calc")
    policy, inserted, final = tool_turns("437*86=", "37582")
    turn = fmt.parse(policy)
    assert fmt.answer([calculator(c.name, c.arguments, {}) for c in turn.calls]) == inserted
    assert arithmetic_exact(final, "37582") == 1.0


def test_sft_trains_on_the_policy_turns_only():
    train, _ = _datasets()
    record = next(r for r in train.records if "sft_turns" in r["record"])
    [ex] = sft_examples_from_records(ENCODER, [record])
    policy, inserted, final = record["record"]["sft_turns"]
    eos = ENCODER.eos_token_id
    n_prompt = len(record["prompt_ids"])
    parts = [
        (ENCODER.tokenizer.encode(policy) + [eos], 1.0),
        (ENCODER.tokenizer.encode(inserted), 0.0),
        (ENCODER.tokenizer.encode(final) + [eos], 1.0),
    ]
    assert ex.input_ids == record["prompt_ids"] + [t for ids, _ in parts for t in ids]
    assert ex.loss_mask == [0.0] * n_prompt + [m for ids, m in parts for _ in ids]
    assert len(ex.input_ids) - n_prompt <= CALC_MAX_RESPONSE_LEN
    plain = next(r for r in train.records if "sft_turns" not in r["record"])
    [ex] = sft_examples_from_records(ENCODER, [plain])
    assert sum(ex.loss_mask) == len(plain["answer"]) + 1


@pytest.mark.parametrize("turns", [["a", "b"], "calc(1)", [1, 2, 3]])
def test_a_malformed_trace_names_its_record(turns):
    record = {
        "prompt_ids": [1],
        "answer": "1",
        "where": "t.jsonl:3",
        "record": {"sft_turns": turns},
    }
    with pytest.raises(ValueError, match=r"t.jsonl:3: sft_turns must be a list of strings"):
        sft_examples_from_records(ENCODER, [record])


def test_the_verifier_scores_the_last_turn():
    assert VERIFIERS["calculator"] is arithmetic_exact
    assert FORMAT_CHECKS["calculator"]("37582") == 1.0


def test_regeneration_is_byte_exact(tmp_path):
    train, val = write_calculator_files(tmp_path)
    assert train.read_bytes() == CALC_TRAIN_PATH.read_bytes()
    assert val.read_bytes() == CALC_VAL_PATH.read_bytes()
