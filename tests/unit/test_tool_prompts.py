"""A real model's tool use (issue 46): the prompt lists the tools' schemas through the chat
template (``env.tool_schemas``, or the calculator's own under ``env.tool_format: hermes``), and a
hermes trajectory, built token in and token out, reads exactly as the template renders the whole
conversation (the assistant's call, the tool's answer, the next assistant turn). The tokenizer
is the tiny Hugging Face one (``data/tiny_hf.py``), whose template lays calls and answers out as
Qwen3's does."""

import json

import pytest

from megatron_rl_fp8.config_utils import ConfigError
from megatron_rl_fp8.data.prompts import TokenizerConfig, load_prompt_encoder
from megatron_rl_fp8.data.tiny_hf import make_tokenizer
from megatron_rl_fp8.rollout.environment import CALCULATOR_SCHEMA, EnvConfig, tool_schemas
from megatron_rl_fp8.rollout.turns import TurnLoop
from tests.unit.test_turns import ScriptedEngine

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "437*86"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return folder


def hermes(**kw) -> EnvConfig:
    return EnvConfig(tools="calculator", tool_format="hermes", num_workers=0, **kw)


def encoder(folder, env: EnvConfig):
    tok = TokenizerConfig(path=str(folder), system_prompt="Use the calculator.")
    return load_prompt_encoder(tok, hf_checkpoint=None, tools=tool_schemas(env))


def test_a_hermes_trajectory_reads_as_the_template_renders_the_conversation(tokenizer_dir):
    env = hermes()
    enc = encoder(tokenizer_dir, env)
    prompt = enc.encode("What is 437*86?")
    assert json.dumps(CALCULATOR_SCHEMA) in enc.text("What is 437*86?")

    def policy(text: str) -> str:
        return "The product is 37582." if "<tool_response>" in text else CALL

    engine = ScriptedEngine(
        policy,
        encode=lambda t: enc.tokenizer.encode(t, add_special_tokens=False),
        decode=lambda ids: enc.tokenizer.decode(ids),
        eos=enc.eos_token_id,
    )
    turns = TurnLoop(env, encode=enc.encode_inserted, decode=enc.decode_response)
    [c] = turns.generate(engine, [prompt], [{}], n=1, max_new_tokens=200, temperature=1.0)
    assert c.end == "answered" and c.turns == 2 and c.tool_calls == 1

    conversation = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 437*86?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "437*86"}}}
            ],
        },
        {"role": "tool", "content": "37582"},
        {"role": "assistant", "content": "The product is 37582."},
    ]  # fmt: skip
    rendered = enc.tokenizer.apply_chat_template(conversation, tools=enc.tools, tokenize=False)
    # The trajectory ends at the sampled <|im_end|>; the template adds a newline after it.
    assert enc.tokenizer.decode(prompt + c.response_ids) + "\n" == rendered
    # Exactly the tool's answer, from the newline after the call's <|im_end|> to the next
    # assistant header, is out of the loss.
    inserted = [t for t, m in zip(c.response_ids, c.response_mask) if m == 0]
    assert enc.tokenizer.decode(inserted) == (
        "\n<|im_start|>user\n<tool_response>\n37582\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_calc_calls_list_no_json_schema_and_a_plugin_lists_its_file(tmp_path, tokenizer_dir):
    assert tool_schemas(EnvConfig(tools="calculator", num_workers=0)) is None
    schema = {"type": "function", "function": {"name": "search", "parameters": {}}}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([schema]))
    env = hermes(tool_schemas=str(path))
    assert tool_schemas(env) == [schema]
    assert '"name": "search"' in encoder(tokenizer_dir, env).text("q")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("{not json", "is not JSON"),
        ('{"type": "function"}', "non-empty JSON list"),
        ("[]", "non-empty JSON list"),
        ('[{"type": "function", "function": {}}]', "entry 0 needs"),
    ],
)
def test_a_bad_schema_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        tool_schemas(hermes(tool_schemas=str(path)))
    assert str(e.value).startswith("env.tool_schemas=") and "\n" not in str(e.value)


def test_schemas_without_tools_and_a_template_that_cannot_list_them_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="env.tools is not set"):
        EnvConfig(tool_schemas="tools.json")
    plain = tmp_path / "plain"
    tok = make_tokenizer(plain)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(str(plain))
    with pytest.raises(ConfigError, match="does not list tools"):
        encoder(plain, hermes())
