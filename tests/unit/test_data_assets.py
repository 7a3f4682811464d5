"""The shipped task files: shape, size, disjoint splits, and byte-exact regeneration."""

import json

from megatron_rl_fp8.data import (
    DEFAULT_TOKENIZER_DIR,
    DEFAULT_TRAIN_PATH,
    DEFAULT_VAL_PATH,
    TaskConfig,
    TokenizerConfig,
    build_datasets,
    load_prompt_encoder,
    load_tokenizer,
    sft_examples,
    write_task_files,
    write_tokenizer_files,
)


def _datasets(cfg=None):
    encoder = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)
    train, val, dropped = build_datasets(cfg or TaskConfig(), encoder)
    assert dropped == {"train": 0, "val": 0}
    return train, val


def test_shipped_files_are_small_and_well_formed():
    assert DEFAULT_TRAIN_PATH.stat().st_size + DEFAULT_VAL_PATH.stat().st_size < 1_000_000
    train, val = _datasets()
    assert len(train) == 20_000 and len(val) == 256
    for r in train.records + val.records:
        a, op, b = (
            r["prompt"][:-1].partition("+")
            if "+" in r["prompt"]
            else r["prompt"][:-1].partition("-")
        )
        assert r["prompt"].endswith("=") and op in "+-"
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert max(len(a), len(b)) <= 3


def test_train_and_val_are_disjoint():
    train, val = _datasets()
    train_prompts = {r["prompt"] for r in train.records}
    val_prompts = [r["prompt"] for r in val.records]
    assert len(set(val_prompts)) == len(val_prompts)  # each held-out prompt counts once
    assert not train_prompts & set(val_prompts)
    assert len(train_prompts) > 12_000  # repeats come from the small 1- and 2-digit spaces


def test_mix_has_easy_and_hard_problems():
    train, _ = _datasets()
    prompts = [r["prompt"] for r in train.records]
    three_digit = sum(
        any(len(x) == 3 for x in p[:-1].replace("-", "+").split("+")) for p in prompts
    )
    negative = sum(r["answer"].startswith("-") for r in train.records)
    assert 0.3 < three_digit / len(prompts) < 0.42  # 1 - 0.8**2 = 0.36 expected
    assert 0.05 < negative / len(prompts) < 0.3


def test_default_lengths_fit_the_task_config():
    cfg = TaskConfig()
    tok = load_tokenizer()
    train, val = _datasets(cfg)
    # Raises if any prompt or answer overflows the default limits.
    examples = sft_examples(
        tok,
        train.records + val.records,
        max_prompt_len=cfg.max_prompt_len,
        max_response_len=cfg.max_response_len,
    )
    assert max(len(e.input_ids) for e in examples) <= 9 + 5


def test_regeneration_is_byte_exact(tmp_path):
    # The shipped assets are exactly what scripts/make_tiny_task.py writes with its defaults.
    train, val = write_task_files(tmp_path / "arithmetic")
    assert train.read_bytes() == DEFAULT_TRAIN_PATH.read_bytes()
    assert val.read_bytes() == DEFAULT_VAL_PATH.read_bytes()
    tok_dir = write_tokenizer_files(tmp_path / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).read_bytes() == (DEFAULT_TOKENIZER_DIR / name).read_bytes(), name
    assert json.loads(val.read_text().splitlines()[0]).keys() == {"prompt", "answer"}


def test_make_tiny_task_script(tmp_path):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_task.py"
    argv = sys.argv
    sys.argv = [str(script), "--out-dir", str(tmp_path), "--num-train", "50", "--num-val", "10"]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    assert len((tmp_path / "arithmetic" / "train.jsonl").read_text().splitlines()) == 50
    assert load_tokenizer(tmp_path / "tokenizer").decode([4, 5]) == "01"
