"""A pretrained start's inputs, checked before any compute: the model section read from
config.json, the tokenizer and its chat template, EOS ids, chat-format datasets, and the one-line
errors for each bad input."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_fp8.config import load_config
from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.data import (
    DataError,
    TaskConfig,
    TokenizerConfig,
    build_datasets,
    load_prompt_encoder,
)
from megatron_rl_fp8.data.prompts import check_vocab
from megatron_rl_fp8.data.tiny_hf import write_chat_task


@pytest.fixture
def hf(tiny_hf_model):
    return tiny_hf_model


def _cfg(hf_dir, *overrides, base=None):
    return load_config(base, [f"model.hf_checkpoint={hf_dir}", *overrides])


def test_model_section_is_read_from_config_json(hf, tmp_path):
    base = tmp_path / "empty.yaml"
    base.write_text("train:\n  steps: 1\n")
    cfg = _cfg(hf["dir"], base=base)
    m = cfg.model
    assert (m.arch, m.num_layers, m.hidden_size, m.ffn_hidden_size) == ("qwen3", 2, 64, 128)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (4, 2, 16)
    assert m.vocab_size == 384 and m.max_position_embeddings == 256
    assert m.params_dtype == "auto"  # the run picks the dtype, not the checkpoint's storage
    assert cfg.sft.steps == 0  # no SFT from a pretrained start unless asked for
    assert _cfg(hf["dir"], "sft.steps=5", base=base).sft.steps == 5
    assert load_config(base).sft.steps == 300  # random init: the warm start is on
    # Agreeing fields are fine; lowering the context is fine.
    _cfg(hf["dir"], "model.hidden_size=64", "model.max_position_embeddings=64", base=base)


def test_disagreeing_model_field_names_both_values(hf, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.hidden_size=128 disagrees with .*config.json "
        r"\(hidden_size -> 64\)",
    ):
        _cfg(hf["dir"])  # tiny_cpu.yaml sets hidden_size: 128
    with pytest.raises(ConfigError, match="max_position_embeddings=512 exceeds"):
        _cfg(hf["dir"], "model.max_position_embeddings=512", base=_empty(tmp_path))


def test_a_moe_checkpoint_fills_the_expert_fields(tmp_path):
    """A Qwen3-MoE folder (scripts/make_tiny_hf_model.py --experts 4) fills the MoE fields; the
    load-balancing coefficient is the release's but free to change, the shape is not."""
    from megatron_rl_fp8.data.tiny_hf import make_hf_model

    moe = make_hf_model(tmp_path / "moe", experts=4)["dir"]
    m = _cfg(moe, base=_empty(tmp_path)).model
    assert (m.num_experts, m.moe_topk, m.moe_ffn_hidden_size) == (4, 2, 48)
    assert m.moe_aux_loss_coeff == 0.0
    assert _cfg(
        moe, "model.moe_aux_loss_coeff=0.01", base=_empty(tmp_path)
    ).model.moe_aux_loss_coeff
    with pytest.raises(ConfigError, match=r"model.num_experts=8 disagrees with .*num_experts -> 4"):
        _cfg(moe, "model.num_experts=8", base=_empty(tmp_path))


def _empty(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("{}\n")
    return path


def test_bad_checkpoint_folders(hf, tmp_path):
    with pytest.raises(ConfigError, match="model.hf_checkpoint='/nope' is not a folder"):
        _cfg("/nope", base=_empty(tmp_path))
    (tmp_path / "no_config").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        _cfg(tmp_path / "no_config", base=_empty(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"DeepseekV3ForCausalLM.*not supported; supported"):
        _cfg(other, base=_empty(tmp_path))
    # Qwen3-MoE maps (docs/convert.md), but not a router Megatron does not compute the same way.
    moe = tmp_path / "moe"
    moe.mkdir()
    config = json.loads((hf["dir"] / "config.json").read_text())
    config |= {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "norm_topk_prob": False}
    config |= {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"norm_topk_prob=false is not supported"):
        _cfg(moe, base=_empty(tmp_path))


def test_model_load_reads_the_conversion_record(hf, tmp_path):
    ckpt = tmp_path / "converted" / "iter_0000000"
    ckpt.mkdir(parents=True)
    (tmp_path / "converted" / "latest").write_text("iter_0000000\n")
    record = {
        "step": 0,
        "model": {**load_config(_empty(tmp_path)).model.__dict__, "hidden_size": 64},
        "padded_vocab_size": 128,
        "tensor_model_parallel_size": 1,
    }
    record["model"].update(hf_checkpoint=None, load=None, params_dtype="bfloat16")
    (ckpt / "trainer_state.json").write_text(json.dumps(record))
    cfg = load_config(_empty(tmp_path), [f"model.load={tmp_path / 'converted'}"])
    assert cfg.model.hidden_size == 64 and cfg.model.params_dtype == "auto"
    cfg.validate(1)
    with pytest.raises(ConfigError, match=r"vocab padded to 128 rows .* needs 256"):
        load_config(
            _empty(tmp_path),
            [f"model.load={tmp_path / 'converted'}", "parallel.tensor_model_parallel_size=2"],
        ).validate(2)
    with pytest.raises(ConfigError, match="model.load=.* no checkpoint there"):
        load_config(_empty(tmp_path), [f"model.load={tmp_path}"])


def test_chat_template_eos_ids_and_bos(hf):
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=str(hf["dir"]))
    assert enc.chat_template and enc.bos_token_id is None  # Qwen-style: no BOS anywhere
    assert enc.eos_token_ids == tuple(hf["eos_ids"])  # both generation_config ids
    tok = enc.tokenizer
    for prompt in (
        [{"role": "user", "content": "what is 3 + 4?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 1"}],
        "a plain string prompt",
    ):
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert enc.encode(prompt) == want
    with_system = load_prompt_encoder(
        TokenizerConfig(system_prompt="think"), hf_checkpoint=str(hf["dir"])
    )
    assert with_system.text("hi").startswith("<|im_start|>system\nthink<|im_end|>")
    plain = load_prompt_encoder(TokenizerConfig(chat_template=False), hf_checkpoint=str(hf["dir"]))
    assert plain.encode("1 + 1") == tok.encode("1 + 1", add_special_tokens=False)  # no BOS
    assert (
        enc.decode_response([*tok.encode("42", add_special_tokens=False), hf["eos_ids"][0]]) == "42"
    )


def test_shipped_tokenizer_keeps_its_bos_layout():
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)
    assert not enc.chat_template and enc.encode("1+2=")[0] == enc.bos_token_id == 1
    with pytest.raises(ConfigError, match="has no chat template"):
        load_prompt_encoder(TokenizerConfig(chat_template=True), hf_checkpoint=None)


def test_tokenizer_larger_than_the_model_is_refused(hf):
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=str(hf["dir"]))
    check_vocab(enc, 384)
    with pytest.raises(ConfigError, match=r"tokenizer has 360 tokens but model.vocab_size=53"):
        check_vocab(enc, 53)


def test_chat_datasets_with_dotted_fields(hf, tmp_path):
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=str(hf["dir"]))
    path = write_chat_task(tmp_path / "t.jsonl", 6)
    cfg = TaskConfig(
        train_path=str(path),
        val_path=str(path),
        answer_field="reward_model.ground_truth",
        max_prompt_len=40,
    )
    train, val, dropped = build_datasets(cfg, enc)
    first = json.loads(path.read_text().splitlines()[0])
    assert val[0]["answer"] == first["reward_model"]["ground_truth"]
    assert val[0]["prompt_ids"] == enc.encode(first["prompt"]) and dropped["val"] == 0
    assert val[0]["record"] == first  # user reward functions get the whole record
    # Over-long prompts are dropped and counted, not fatal.
    short = TaskConfig(**{**cfg.__dict__, "max_prompt_len": len(val[0]["prompt_ids"])})
    _, val2, dropped2 = build_datasets(short, enc)
    assert len(val2) + dropped2["val"] == 6 and len(val2) >= 1


@pytest.mark.parametrize(
    "record, pattern",
    [
        (
            {"prompt": [{"role": "user", "content": "x"}]},
            r"t.jsonl:2: missing field "
            r"'reward_model.ground_truth' \(record has \['prompt'\]\)",
        ),
        (
            {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}},
            r"t.jsonl:2: missing field 'reward_model.ground_truth' \(reward_model has \['style'\]\)",
        ),
        (
            {"prompt": [{"role": "robot", "content": "x"}], "reward_model": {"ground_truth": "1"}},
            r"t.jsonl:2: field 'prompt': message 0 has role 'robot'",
        ),
        (
            {"prompt": [], "reward_model": {"ground_truth": "1"}},
            r"t.jsonl:2: field 'prompt': expected a non-empty list",
        ),
    ],
)
def test_malformed_chat_records_are_one_line_errors(hf, tmp_path, record, pattern):
    path = write_chat_task(tmp_path / "t.jsonl", 1)
    path.write_text(path.read_text() + json.dumps(record) + "\n")
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=str(hf["dir"]))
    cfg = TaskConfig(
        train_path=str(path), val_path=str(path), answer_field="reward_model.ground_truth"
    )
    with pytest.raises(DataError, match=pattern) as info:
        build_datasets(cfg, enc)
    assert "\n" not in str(info.value)


def test_chat_prompt_without_template_names_the_line(tmp_path):
    path = write_chat_task(tmp_path / "t.jsonl", 2)
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=None)  # character tokenizer
    cfg = TaskConfig(
        train_path=str(path), val_path=str(path), answer_field="reward_model.ground_truth"
    )
    with pytest.raises(DataError, match=r"t.jsonl:1: field 'prompt': .*chat_template"):
        build_datasets(cfg, enc)


def test_unknown_task_name_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"task.name='nope' has no verifier; known: .*'math'"):
        load_config(None, ["task.name=nope"]).validate(1)


@pytest.mark.parametrize("eos_index", [0, 1])
def test_local_engine_stops_on_each_eos_id(hf, eos_index):
    """Weights that make one token the argmax everywhere: greedy generation emits it first."""
    import transformers

    from megatron_rl_fp8.rollout.local import LocalEngine

    config = transformers.AutoConfig.from_pretrained(str(hf["dir"]))
    engine = LocalEngine(config, pad_token_id=0, eos_token_id=hf["eos_ids"])
    model = engine.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Blocks add nothing to the residual stream; every embedding is the ones vector, so
            # the final hidden state is the final norm's weight (ones) and logits = row sums.
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()

        def argmax_token(t):
            model.lm_head.weight.zero_()
            model.lm_head.weight[t] = 1.0

        target = hf["eos_ids"][eos_index]
        argmax_token(target)
        done = engine.generate([[5, 6, 7]], n=2, max_new_tokens=6, temperature=1.0, greedy=True)
        assert all(c.response_ids == [target] and c.finished for c in done)
        argmax_token(7)  # not an end id: runs to the budget
        more = engine.generate([[5, 6, 7]], n=1, max_new_tokens=6, temperature=1.0, greedy=True)
        assert more[0].response_ids == [7] * 6 and not more[0].finished


def test_sglang_requests_stop_on_every_eos_id():
    from megatron_rl_fp8.rollout.sglang.http import generate_request, parse_completion

    req = generate_request(
        [[1, 2]],
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        greedy=False,
        seed=0,
        eos_token_id=[2, 0],
    )
    assert req["sampling_params"][0]["stop_token_ids"] == [2, 0]
    answer = {
        "output_ids": [9, 0],
        "meta_info": {"weight_version": "1", "output_token_logprobs": [[-0.1, 9], [-0.2, 0]]},
    }
    assert parse_completion([1], answer, eos_token_id=[2, 0], expected_version="1").finished


def test_cli_bad_inputs_are_one_line_errors_before_compute(hf, tmp_path, capsys):
    """Through `megatron-rl-fp8 train`: exit code 2 and one stderr line, before any weight."""
    from megatron_rl_fp8.cli import main

    bad_data = write_chat_task(tmp_path / "t.jsonl", 3)  # answers live at reward_model.*
    out = [f"train.output_dir={tmp_path / 'run'}", f"train.cache_dir={tmp_path / 'cache'}"]
    cases = [
        (["model.hf_checkpoint=/no/such/folder"], "config error: model.hf_checkpoint="),
        ([f"tokenizer.path={hf['dir']}"], "config error: the tokenizer has 360 tokens"),
        (
            [f"task.train_path={bad_data}", f"task.val_path={bad_data}"],
            "data error: " + str(bad_data) + ":1: missing field 'answer'",
        ),
        (
            ["reward.function=no_such_module:fn"],
            "config error: reward.function='no_such_module:fn'",
        ),
    ]
    for overrides, start in cases:
        assert main(["train", "examples/tiny_cpu.yaml", *overrides, *out]) == 2, overrides
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
        assert not list((tmp_path / "run").glob("checkpoints/iter_*"))  # nothing was trained


def test_verl_parquet_with_nested_fields(hf, tmp_path):
    """verl's preprocessed parquet: a message-list prompt and reward_model.ground_truth, stored
    as Arrow lists and structs."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        json.loads(line)
        for line in write_chat_task(tmp_path / "t.jsonl", 5).read_text().splitlines()
    ]
    for i, r in enumerate(rows):
        r.update(data_source="openai/gsm8k", extra_info={"index": i, "split": "train"})
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    enc = load_prompt_encoder(TokenizerConfig(), hf_checkpoint=str(hf["dir"]))
    cfg = TaskConfig(
        train_path=str(path), val_path=str(path), answer_field="reward_model.ground_truth",
        max_prompt_len=40,
    )  # fmt: skip
    _, val, _ = build_datasets(cfg, enc)
    assert [r["answer"] for r in val.records] == [r["reward_model"]["ground_truth"] for r in rows]
    assert val[2]["prompt_ids"] == enc.encode(rows[2]["prompt"])
    assert val[2]["record"]["extra_info"] == {"index": 2, "split": "train"}
