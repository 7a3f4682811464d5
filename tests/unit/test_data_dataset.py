"""PromptDataset: loading, error messages, deterministic shuffling and resume; TaskConfig."""

import json
import sys

import pytest

from megatron_rl_fp8.data import (
    DataError,
    PromptDataset,
    TaskConfig,
    TokenizerConfig,
    build_datasets,
    load_prompt_encoder,
    load_records,
)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _core(records):
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in records]


def _records(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


def test_loads_jsonl_with_custom_fields_and_int_answers(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"question": "1+2=", "target": 3, "extra": "ignored"}),
            "",
            json.dumps({"question": "5-7=", "target": "-2"}),
        ],
    )
    recs = load_records(path, prompt_field="question", answer_field="target")
    assert _core(recs) == [{"prompt": "1+2=", "answer": "3"}, {"prompt": "5-7=", "answer": "-2"}]
    assert recs[1]["where"] == f"{path}:3"  # the file line (blank lines count)
    assert recs[0]["record"] == {"question": "1+2=", "target": 3, "extra": "ignored"}
    ds = PromptDataset.from_file(path, prompt_field="question", answer_field="target")
    assert len(ds) == 2 and ds[1]["index"] == 1 and _core([ds[1]]) == _core(recs[1:])


@pytest.mark.parametrize(
    "line, pattern",
    [
        ('{"prompt": "1+2=", "answer": "3"', r"p\.jsonl:2: invalid JSON"),
        ('["1+2=", "3"]', r"p\.jsonl:2: expected a JSON object.*got list"),
        ('{"prompt": "1+2="}', r"p\.jsonl:2: missing field 'answer' \(record has \['prompt'\]\)"),
        ('{"prompt": "", "answer": "3"}', r"p\.jsonl:2: field 'prompt' must be a non-empty"),
        ('{"prompt": "1+2=", "answer": null}', r"p\.jsonl:2: field 'answer' must be a string"),
        ('{"prompt": "1+2=", "answer": true}', r"p\.jsonl:2: field 'answer' must be a string"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, pattern):
    path = _write(tmp_path / "p.jsonl", ['{"prompt": "0+0=", "answer": "0"}', line])
    with pytest.raises(ValueError, match=pattern):
        load_records(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="suffix '.csv'"):
        load_records(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="holds no records"):
        load_records(_write(tmp_path / "empty.jsonl", ["", "  "]))


def test_parquet_without_pyarrow_gives_install_hint(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    for mod in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import mod` raise ImportError
    with pytest.raises(DataError, match="pip install pyarrow"):
        load_records(path)


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["1+2=", "3+4="], "a": [3, 7]}), path)
    assert _core(load_records(path, prompt_field="q", answer_field="a")) == [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": "3+4=", "answer": "7"},
    ]
    pq.write_table(pa.table({"q": ["1+2="]}), path)
    with pytest.raises(ValueError, match=r"row 0: missing field 'a'"):
        load_records(path, prompt_field="q", answer_field="a")


def test_epochs_visit_every_record_once_in_a_seeded_order():
    ds = PromptDataset(_records(10), seed=7)
    first = [r["index"] for r in ds.next_batch(10)]
    second = [r["index"] for r in ds.next_batch(10)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # reshuffled per epoch
    again = PromptDataset(_records(10), seed=7)
    assert [r["index"] for r in again.next_batch(20)] == first + second
    other = PromptDataset(_records(10), seed=8)
    assert [r["index"] for r in other.next_batch(10)] != first
    plain = PromptDataset(_records(4), shuffle=False)
    assert [r["index"] for r in plain.next_batch(6)] == [0, 1, 2, 3, 0, 1]


def test_batches_cross_epoch_boundaries():
    ds = PromptDataset(_records(5), seed=1)
    batch = ds.next_batch(7)
    assert len(batch) == 7 and ds.epoch == 1 and ds.position == 2
    assert all(set(r) == {"prompt", "answer", "index"} for r in batch)
    batch[0]["prompt"] = "mutated"  # callers get copies
    assert "mutated" not in {r["prompt"] for r in ds.records}
    with pytest.raises(ValueError, match="n must be >= 1"):
        ds.next_batch(0)


def test_resume_continues_with_the_same_prompts():
    ds = PromptDataset(_records(13), seed=3)
    ds.next_batch(5)
    ds.next_batch(12)  # into epoch 1
    state = json.loads(json.dumps(ds.state_dict()))  # survives a JSON checkpoint
    expected = ds.next_batch(30)

    resumed = PromptDataset(_records(13), seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(30) == expected


def test_resume_refuses_other_data_or_seed():
    state = PromptDataset(_records(13), seed=3).state_dict()
    with pytest.raises(ValueError, match="seed=3 but this dataset .* has seed=4"):
        PromptDataset(_records(13), seed=4).load_state_dict(state)
    changed = _records(13)
    changed[5] = {"prompt": "9+9=", "answer": "18"}
    with pytest.raises(ValueError, match="fingerprint"):
        PromptDataset(changed, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        PromptDataset(_records(13), seed=3).load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="position=99"):
        PromptDataset(_records(13), seed=3).load_state_dict({**state, "position": 99})


def test_task_config_defaults_and_validation(tmp_path):
    cfg = TaskConfig()
    assert cfg.name == "arithmetic" and cfg.resolved_train_path.name == "train.jsonl"
    with pytest.raises(TypeError):
        TaskConfig("arithmetic")  # keyword-only
    with pytest.raises(ValueError, match="TaskConfig.name is empty"):
        TaskConfig(name="")
    with pytest.raises(ValueError, match="TaskConfig.train_path='x.csv'"):
        TaskConfig(train_path="x.csv")
    with pytest.raises(ValueError, match="TaskConfig.max_response_len=1"):
        TaskConfig(max_response_len=1)
    with pytest.raises(ValueError, match="TaskConfig.answer_field"):
        TaskConfig(answer_field="")

    path = _write(tmp_path / "mine.jsonl", ['{"q": "1+1=", "a": "2"}'])
    train, val, dropped = build_datasets(
        TaskConfig(train_path=str(path), val_path=str(path), prompt_field="q", answer_field="a"),
        load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None),
    )
    assert dropped == {"train": 0, "val": 0}
    assert train.next_batch(1)[0]["answer"] == "2" and val[0]["prompt"] == "1+1="
    assert train.shuffle and not val.shuffle


def test_prompt_file_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes('{"prompt": "é+1=", "answer": "2"}\n'.encode() + b'{"prompt": "\xe9"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not UTF-8 text \(byte 0xe9 at byte 13 of "):
        load_records(path)
    path.write_bytes(bytes(range(128, 256)) * 4)  # binary junk
    with pytest.raises(DataError, match=r"p\.jsonl:1: not UTF-8 text"):
        load_records(path)
    # A byte-order mark is not an encoding problem.
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+2=", "answer": "3"}\n')
    assert _core(load_records(path)) == [{"prompt": "1+2=", "answer": "3"}]


@pytest.mark.parametrize(
    "content, why",
    [(b"", "Parquet file size is 0 bytes"), (b"not parquet at all\n" * 4, "magic bytes")],
)
def test_file_that_is_not_parquet_is_a_data_error(tmp_path, content, why):
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        load_records(path)
    message = str(e.value)
    assert message.startswith(f"prompt file {str(path)!r} is not a readable Parquet file (")
    assert why in message and "\n" not in message and message.count(str(path)) == 1


def test_prompt_path_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "p.jsonl").mkdir()
    with pytest.raises(DataError, match=r"p\.jsonl' is a directory"):
        load_records(tmp_path / "p.jsonl")
