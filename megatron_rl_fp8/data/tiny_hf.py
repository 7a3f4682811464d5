"""A small but real Hugging Face model folder, made offline, to try the pretrained-start path
(``model.hf_checkpoint``) on a CPU: a Qwen3 built with transformers, a byte-level BPE tokenizer
trained with ``tokenizers`` on generated text, a ChatML chat template, and a generation config that
ends answers on two ids (as Qwen's chat models do), plus a chat-format math task in verl's layout.

Its weights are random: it exercises loading, templating, EOS handling and rewards exactly as a
real checkpoint would, but it knows no arithmetic (rewards stay near 0). ``make_hf_model(dir)``
writes it (deterministic for a seed); tests and ``scripts/make_tiny_hf_model.py`` use it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen's ChatML layout: no BOS, each turn is <|im_start|>role\ncontent<|im_end|>\n. With ``tools``
# it lists their schemas in a system turn and writes calls and their answers as the Hermes-style
# templates of Qwen2.5 / Qwen3 lay them out: an assistant's calls as <tool_call> JSON after its
# text, a run of ``tool`` messages as one user turn of <tool_response> blocks.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nWrite each call as a JSON object with the name and the arguments '"
    "+ 'between <tool_call> and </tool_call>.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MODEL_VOCAB = 384  # > the tokenizer's size, as real checkpoints pad theirs


def _corpus(n: int = 3000, seed: int = 0):
    rng = random.Random(seed)
    words = "what is the sum of and minus plus answer question solve think step final box".split()
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        yield f"{' '.join(rng.choices(words, k=4))} {a} + {b} = {a + b}. \\boxed{{{a + b}}} #### {b}"


def make_tokenizer(out_dir: Path, vocab_size: int = 360):
    """Train and save the tokenizer; returns the transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def make_hf_model(
    out_dir: str | Path, *, seed: int = 0, tie: bool = False, experts: int | None = None
) -> dict:
    """Write a tiny Qwen3 + tokenizer folder; returns {"dir", "eos_ids", "vocab_size", ...}.
    ``experts``: a Qwen3-MoE instead, every layer's MLP that many experts (top-2, each 48 wide,
    the router renormalising its top-k as Qwen3-MoE's releases do)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    family, moe = transformers.Qwen3Config, {}
    if experts is not None:
        family = transformers.Qwen3MoeConfig
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            router_aux_loss_coef=0.0,
        )
    config = family(
        **moe,
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[1],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # non-trivial norms, so their mapping is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    # Qwen's chat models end on either id; the trainer must stop on both.
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_ids, "pad_token_id": eos_ids[1]}, indent=1) + "\n"
    )
    return {"dir": out, "eos_ids": eos_ids, "vocab_size": MODEL_VOCAB, "tokenizer_len": len(tok)}


def write_chat_task(path: Path, n: int = 16, seed: int = 0) -> Path:
    """A chat-format JSONL math task in verl's layout (answer at reward_model.ground_truth)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": f"what is {a} + {b}?"}],
                    "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path
