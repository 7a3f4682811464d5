"""Model shapes for the step-time model and the scaling tables (``scripts/scaling_model.py``), from
the public Hugging Face ``config.json`` of each model (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
tie_word_embeddings). These are shapes to plan with, not runs: a run is a file in ``examples/``
(Qwen3-8B and Qwen3-32B there state the same shapes; a unit test keeps them equal).
"""

from __future__ import annotations

from megatron_rl_fp8.config_utils import ConfigError

PRESETS = {
    # huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": dict(
        arch="qwen3",
        num_layers=36,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # huggingface.co/Qwen/Qwen3-14B/blob/main/config.json
    "qwen3-14b": dict(
        arch="qwen3",
        num_layers=40,
        hidden_size=5120,
        ffn_hidden_size=17408,
        num_attention_heads=40,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json (QKV bias: arch qwen2; head_dim is
    # hidden / heads = 128)
    "qwen2.5-32b": dict(
        arch="qwen2",
        num_layers=64,
        hidden_size=5120,
        ffn_hidden_size=27648,
        num_attention_heads=40,
        num_query_groups=8,
        head_dim=128,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # huggingface.co/Qwen/Qwen3-32B/blob/main/config.json
    "qwen3-32b": dict(
        arch="qwen3",
        num_layers=64,
        hidden_size=5120,
        ffn_hidden_size=25600,
        num_attention_heads=64,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}

# The actor shape measured on the H200 (benchmarks/bench_actor.py's default, the step-time model's
# reference point): the Qwen3-1.7B block (huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json)
# with an untied output layer, 2.03B parameters.
BENCH_ACTOR_2B = dict(
    arch="qwen3",
    num_layers=28,
    hidden_size=2048,
    ffn_hidden_size=6144,
    num_attention_heads=16,
    num_query_groups=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
)


def preset_overrides(name: str) -> list[str]:
    """``model.key=value`` overrides that give a config the preset's shape."""
    shape = PRESETS.get(name.lower())
    if shape is None:
        raise ConfigError(f"--model={name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items()]
