"""The project's own character-level tokenizer, shipped as an HF tokenizer folder.

Why a home-made tokenizer: the CPU pipeline must run with no model hub, so everything the tiny
model needs is made by the project and shipped in ``data/assets/tokenizer/``. One character is one
token, which keeps the vocabulary tiny (< 64 ids) and makes arithmetic answers trivially aligned
with digits.

How it is built (with the ``tokenizers`` library, so transformers and SGLang both load it):

- model: ``WordLevel`` over single characters, unknown characters map to ``<unk>``;
- pre-tokenizer: ``Split(Regex("[\\s\\S]"), "isolated")`` cuts the text into single characters
  (``[\\s\\S]`` rather than ``.`` because ``.`` would not match a newline);
- decoder: ``Fuse`` concatenates tokens, so decoding inserts no spaces between characters and
  ``decode(encode(text)) == text`` for any text made of vocabulary characters;
- no post-processor: ``encode`` adds no ``<bos>``. The project prepends ``<bos>`` itself
  (:func:`prompt_token_ids`, the SFT helpers) so that plain encode/decode round-trips exactly.
  A rollout engine must therefore be given token ids (or text starting with the literal
  ``"<bos>"``, which the tokenizer reads as the special token).

Special ids are fixed: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3.
``scripts/make_tiny_task.py`` regenerates the folder byte for byte from :func:`write_tokenizer_files`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported at the point of use only
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# Ordinary characters, after the four special tokens, in id order. Digits first so that digit d has
# id 4 + d (handy when reading raw id dumps). Lowercase letters are there for prompt formats such as
# "what is 3+4?"; the shipped arithmetic task uses only digits, '+', '-' and '='.
CHARACTERS: tuple[str, ...] = tuple(
    "0123456789" + "+-*/=(),.?:" + " \n" + "abcdefghijklmnopqrstuvwxyz"
)
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + CHARACTERS
VOCAB_SIZE = len(VOCAB)

# Longest sequence the tiny model is meant to see (prompt + response is ~25 tokens on the shipped
# task). transformers only warns beyond this; the model's own context length is set elsewhere.
MODEL_MAX_LENGTH = 128

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"


def build_tokenizer() -> Any:
    """Build the character tokenizer as a ``tokenizers.Tokenizer`` (the raw fast tokenizer)."""
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    # Registering the specials as added tokens makes "<eos>" in text one token (not five
    # characters) and lets decode(..., skip_special_tokens=True) drop them. They keep their ids.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, single_word=False) for t in SPECIAL_TOKENS]
    )
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        # The project adds <bos>/<eos> explicitly; no hidden special tokens in encode().
        "add_bos_token": False,
        "add_eos_token": False,
        # Must be False: the default clean-up would delete the space in "1 ," etc.
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
        "model_max_length": MODEL_MAX_LENGTH,
    }


def _special_tokens_map() -> dict[str, str]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
    }


def write_tokenizer_files(out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``.

    The output is deterministic (same bytes on every call), which is what lets a test compare a
    fresh build with the shipped folder.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"), pretty=True)
    for name, payload in (
        ("tokenizer_config.json", _tokenizer_config()),
        ("special_tokens_map.json", _special_tokens_map()),
    ):
        (out / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return out


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder offline with ``transformers.AutoTokenizer``.

    ``path=None`` loads the shipped character tokenizer and checks that its special ids are the
    module constants (``PAD_ID``, ``BOS_ID``, ``EOS_ID``). Any other folder is loaded as is: BOS and
    pad are optional, and where answers end is decided with its generation config
    (``data.prompts.PromptEncoder``).
    """
    from transformers import AutoTokenizer  # lazy: transformers (~1.5 s), not for config loading

    folder = DEFAULT_TOKENIZER_DIR if path is None else Path(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"tokenizer folder {str(folder)!r} has no tokenizer.json or tokenizer_config.json; "
            "pass an HF tokenizer folder, or None for the shipped one "
            "(regenerate it with `python scripts/make_tiny_task.py`)"
        )
    # local_files_only: never reach for a model hub, even if `path` looks like a hub repo id.
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if path is None:
        got = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok))
        want = (PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE)
        if got != want:
            raise RuntimeError(
                f"shipped tokenizer has (pad, bos, eos, vocab size) = {got}, expected {want}; "
                "the assets are stale: run `python scripts/make_tiny_task.py`"
            )
    return tok


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode ``text`` without special tokens, refusing characters outside the vocabulary.

    A silent ``<unk>`` in a prompt or answer would train and reward the model on text it never
    sees correctly, so it is an error here.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        # A literal "<unk>" in the data counts too: it is never a meaningful prompt character.
        bad = sorted({c for c in text if tokenizer.convert_tokens_to_ids(c) == unk})
        bad = bad or [UNK_TOKEN]
        raise ValueError(
            f"text {text!r} has characters outside the tokenizer vocabulary: {bad}; "
            "change the data or add them to CHARACTERS in megatron_rl_fp8/data/tokenizer.py "
            "and rerun scripts/make_tiny_task.py"
        )
    return ids


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: str, *, max_prompt_len: int | None = None
) -> list[int]:
    """Token ids a model is conditioned on for ``prompt``: ``[bos] + prompt``.

    The same layout is used by the SFT helpers, so rollout and warm start agree. Raises if the
    result is longer than ``max_prompt_len`` (counted including ``<bos>``).
    """
    ids = [tokenizer.bos_token_id, *encode_text(tokenizer, prompt)]
    if max_prompt_len is not None and len(ids) > max_prompt_len:
        raise ValueError(
            f"prompt {prompt!r} is {len(ids)} tokens with <bos>, over max_prompt_len="
            f"{max_prompt_len}; raise TaskConfig.max_prompt_len or shorten the prompt"
        )
    return ids
