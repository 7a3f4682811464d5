"""How a dataset prompt becomes the token ids a model is conditioned on, and where answers end.

The ``tokenizer`` section picks the tokenizer (by default the start checkpoint's own, else the
shipped character tokenizer) and how prompts are laid out:

* **Chat prompts** (a list of ``{"role", "content"}`` messages, or a plain string when
  ``chat_template`` is on, which becomes one user message) go through the tokenizer's chat
  template with the assistant turn opened (``add_generation_prompt=True``), then are encoded
  without adding special tokens: exactly what ``tokenizer.apply_chat_template(..., tokenize=True)``
  produces. The template writes any BOS it wants itself. ``system_prompt`` is put first unless the
  record brings its own system message.
* **Plain prompts** (chat template off): ``[bos] + encode(text)``, with the BOS only where the
  tokenizer defines one (Llama does, Qwen does not).
* **End of an answer**: every id in ``generation_config.json``'s ``eos_token_id`` (Qwen's chat
  models list ``<|im_end|>`` and ``<|endoftext|>``) plus the tokenizer's own EOS. Both rollout
  engines stop on any of them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl_fp8.config_utils import ConfigError, field
from megatron_rl_fp8.data.tokenizer import load_tokenizer

Prompt = str | list[dict[str, str]]
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer, and how prompts are laid out for it."""

    path: str | None = field(
        None,
        help="HF tokenizer folder; null = model.hf_checkpoint when set, else the shipped "
        "character tokenizer of the tiny task.",
    )
    chat_template: bool | None = field(
        None,
        help="Apply the tokenizer's chat template to prompts (plain-string prompts become one "
        "user message); null = when the tokenizer has a template. Chat-format (message list) "
        "prompts need it.",
    )
    system_prompt: str | None = field(
        None,
        help="System message put before each chat prompt that has none (chat template only).",
    )

    def __post_init__(self) -> None:
        if self.path == "":
            raise ValueError("tokenizer.path is empty; give a folder or leave it out (null)")
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError(
                "tokenizer.system_prompt is set but tokenizer.chat_template=false; a system "
                "message needs the chat template (set chat_template: true, or drop system_prompt)"
            )


def resolve_tokenizer_path(tok: TokenizerConfig, *, hf_checkpoint: str | None) -> Path | None:
    """The folder to load (None = the shipped character tokenizer)."""
    if tok.path is not None:
        return Path(tok.path).expanduser()
    if hf_checkpoint is not None:
        return Path(hf_checkpoint).expanduser()
    return None


def generation_eos_ids(folder: Path | None) -> list[int]:
    """``eos_token_id`` of ``folder/generation_config.json`` as a list ([] when absent)."""
    if folder is None:
        return []
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or delete it") from None
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


class PromptEncoder:
    """A loaded tokenizer plus the layout rules above; the one place prompts become ids."""

    def __init__(
        self,
        tokenizer,
        *,
        chat_template: bool,
        system_prompt: str | None = None,
        eos_token_ids: Sequence[int] = (),
        tools: list[dict] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.tools = tools  # the tool schemas the chat template lists (multi-turn runs)
        ids = [*eos_token_ids, tokenizer.eos_token_id]
        # Order kept (generation_config's first id is the model's "main" EOS), duplicates dropped.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        if not self.eos_token_ids:
            raise ConfigError(
                "the tokenizer defines no eos token and generation_config.json lists none; set "
                "eos_token in tokenizer_config.json"
            )
        # Padding ids only fill the right of rows the loss masks out; EOS is the usual stand-in
        # for tokenizers without a pad token (Llama).
        self.pad_token_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.bos_token_id: int | None = tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int:
        """The main end id (what an SFT target ends with)."""
        return self.eos_token_ids[0]

    def __len__(self) -> int:
        return len(self.tokenizer)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat messages for ``prompt`` (a string becomes one user turn)."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def text(self, prompt: Prompt) -> str:
        """The prompt as the text the model reads (the template applied when on)."""
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise ValueError(
                    "prompt is a chat message list but tokenizer.chat_template is off; set "
                    "tokenizer.chat_template: true"
                )
            return prompt
        return self.tokenizer.apply_chat_template(
            self.messages(prompt), tools=self.tools, tokenize=False, add_generation_prompt=True
        )

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` (see the module docstring for the layout)."""
        ids = self.tokenizer.encode(self.text(prompt), add_special_tokens=False)
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            # A silent <unk> would train and reward the model on text it never sees correctly.
            raise ValueError(
                f"prompt {self.text(prompt)[:60]!r} has text the tokenizer maps to "
                f"{self.tokenizer.unk_token!r}; fix the data or use a tokenizer that covers it"
            )
        if not self.chat_template and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_inserted(self, text: str) -> list[int]:
        """Ids of ``text`` an environment inserts between turns (a tool's answer, chat markup
        included: special tokens in it are read as such), tokenized once, no <bos>."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_answer(self, answer: str) -> list[int]:
        """``answer`` + the main EOS, as an SFT target."""
        return [*self.tokenizer.encode(answer, add_special_tokens=False), self.eos_token_id]

    def decode_response(self, ids: Sequence[int]) -> str:
        """A response's text without its end ids (verifiers read this)."""
        return self.tokenizer.decode([t for t in ids if t not in self.eos_token_ids])


def load_prompt_encoder(
    tok: TokenizerConfig, *, hf_checkpoint: str | None, tools: list[dict] | None = None
) -> PromptEncoder:
    """Load the tokenizer the config names and wrap it; errors are one line (ConfigError).
    ``tools``: tool schemas for the chat template to list (``rollout/environment.py:
    tool_schemas``); without a chat template they are not rendered."""
    folder = resolve_tokenizer_path(tok, hf_checkpoint=hf_checkpoint)
    source = "tokenizer.path" if tok.path is not None else "model.hf_checkpoint"
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"{source}={str(folder)!r} is not a folder; give an HF tokenizer folder")
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = has_template if tok.chat_template is None else tok.chat_template
    if chat and not has_template:
        raise ConfigError(
            f"tokenizer.chat_template=true but the tokenizer at {str(folder)!r} has no chat "
            "template; set tokenizer.chat_template: false or add chat_template.jinja"
        )
    if tok.system_prompt is not None and not chat:
        raise ConfigError(
            "tokenizer.system_prompt is set but the tokenizer has no chat template to put it in"
        )
    if tools and chat:
        probe = [{"role": "user", "content": "?"}]
        listed = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
        if listed == tokenizer.apply_chat_template(probe, tokenize=False):
            raise ConfigError(
                f"the chat template of the tokenizer at {str(folder)!r} does not list tools, "
                "so the prompts would not show the env tools' schemas: use a template that "
                "renders `tools` (Qwen3's, Hermes'), or describe the tools in "
                "tokenizer.system_prompt and set env.tool_format to one the model knows"
            )
    eos = generation_eos_ids(folder)
    if hf_checkpoint is not None and folder != Path(hf_checkpoint).expanduser():
        eos += generation_eos_ids(Path(hf_checkpoint).expanduser())
    return PromptEncoder(
        tokenizer,
        chat_template=chat,
        system_prompt=tok.system_prompt,
        eos_token_ids=eos,
        tools=tools if chat else None,
    )


def check_vocab(encoder: PromptEncoder, vocab_size: int) -> None:
    """The model must have an embedding row for every token id the tokenizer can produce."""
    if len(encoder) > vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(encoder)} tokens but model.vocab_size={vocab_size}; a "
            "model cannot embed ids past its vocabulary: use the model's own tokenizer "
            "(tokenizer.path) or a model with a larger vocab"
        )


def check_messages(value: Any) -> str | None:
    """Why ``value`` is not a chat message list (None when it is one)."""
    if not isinstance(value, list) or not value:
        return "expected a non-empty list of {'role', 'content'} messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {i} is not a {{'role', 'content'}} mapping: {m!r}"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}; expected one of {ROLES}"
        if not isinstance(m["content"], str):
            return f"message {i} content must be a string, got {type(m['content']).__name__}"
    return None
