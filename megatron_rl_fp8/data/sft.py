"""Supervised warm start: (prompt, answer) pairs as token ids with a loss mask.

Layout of one example (same prompt layout as rollout, see ``prompt_token_ids``)::

    input_ids  = <bos> p r o m p t  a n s w e r <eos>
    loss_mask  =   0   0 0 0 0 0 0  1 1 1 1 1 1   1

``loss_mask[t] == 1`` means token ``input_ids[t]`` is a target: the model is trained to predict it
from positions ``< t``. With next-token logits ``logits[:, :-1]`` the matching targets are
``input_ids[:, 1:]`` and the mask is ``loss_mask[:, 1:]``. The ``<eos>`` is a target so the model
learns to stop; that is what makes RL rollouts end after the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl_fp8.data.tokenizer import PAD_ID, encode_text, prompt_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl_fp8.data.prompts import PromptEncoder


@dataclass(frozen=True)
class SFTExample:
    """One tokenized example: ids and a 0/1 target mask of the same length."""

    input_ids: list[int]
    loss_mask: list[float]


def sft_example(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    answer: str,
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
) -> SFTExample:
    """Tokenize ``bos + prompt + answer + eos`` with the loss on ``answer + eos``.

    ``max_prompt_len`` counts ``<bos>``, ``max_response_len`` counts ``<eos>`` (the rollout budget
    for the same answer); going over either raises, since such an example teaches a length the
    RL stage can never generate.
    """
    prompt_ids = prompt_token_ids(tokenizer, prompt, max_prompt_len=max_prompt_len)
    response_ids = [*encode_text(tokenizer, answer), tokenizer.eos_token_id]
    if max_response_len is not None and len(response_ids) > max_response_len:
        raise ValueError(
            f"answer {answer!r} is {len(response_ids)} tokens with <eos>, over "
            f"max_response_len={max_response_len}; raise TaskConfig.max_response_len"
        )
    return SFTExample(
        input_ids=prompt_ids + response_ids,
        loss_mask=[0.0] * len(prompt_ids) + [1.0] * len(response_ids),
    )


def sft_examples(
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Mapping[str, str]],
    *,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
) -> list[SFTExample]:
    """:func:`sft_example` over records with ``prompt`` and ``answer`` keys (dataset records)."""
    return [
        sft_example(
            tokenizer,
            r["prompt"],
            r["answer"],
            max_prompt_len=max_prompt_len,
            max_response_len=max_response_len,
        )
        for r in records
    ]


def sft_examples_from_records(
    encoder: PromptEncoder, records: Iterable[Mapping]
) -> list[SFTExample]:
    """Examples from dataset records (already encoded: ``prompt_ids``), with the loss on
    ``answer + eos`` as :func:`sft_example` lays it out; any tokenizer, any prompt format.

    A record whose file gives ``sft_turns`` (a list of texts: the policy's turns and the texts an
    environment inserts between them, in turn, starting and ending with a policy turn) is a
    multi-turn trace instead: each policy turn + eos is a target, each inserted text is read
    but not trained on, as ``rollout/turns.py`` lays out the same trajectory."""
    out = []
    for r in records:
        prompt_ids = list(r["prompt_ids"])
        turns = r.get("record", {}).get("sft_turns")
        if turns is None:
            response_ids = encoder.encode_answer(r["answer"])
            mask = [1.0] * len(response_ids)
        else:
            response_ids, mask = _trace(encoder, turns, r.get("where", "a record"))
        out.append(
            SFTExample(
                input_ids=prompt_ids + response_ids, loss_mask=[0.0] * len(prompt_ids) + mask
            )
        )
    return out


def _trace(encoder: PromptEncoder, turns, where: str) -> tuple[list[int], list[float]]:
    if (
        not isinstance(turns, list)
        or len(turns) % 2 == 0
        or not all(isinstance(t, str) for t in turns)
    ):
        raise ValueError(
            f"{where}: sft_turns must be a list of strings of odd length (policy turn, inserted "
            "text, policy turn, ...)"
        )
    ids: list[int] = []
    mask: list[float] = []
    for i, text in enumerate(turns):
        part = encoder.encode_answer(text) if i % 2 == 0 else encoder.encode_inserted(text)
        ids += part
        mask += [1.0 if i % 2 == 0 else 0.0] * len(part)
    return ids, mask


def collate(examples: list[SFTExample], *, pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example.

    Returns ``input_ids`` [B, T] int64 (padding = ``pad_id``), ``loss_mask`` [B, T] float32
    (0 on padding) and ``attention_mask`` [B, T] int64 (1 on real tokens). Right padding keeps
    every sequence starting at position 0, so positions match the unpadded sequence.
    """
    if not examples:
        raise ValueError("collate() got no examples")
    length = max(len(e.input_ids) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.float32)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, e in enumerate(examples):
        if len(e.input_ids) != len(e.loss_mask):
            raise ValueError(
                f"example {i} has {len(e.input_ids)} ids but {len(e.loss_mask)} mask entries"
            )
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        loss_mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
