"""Garbled rollouts: responses a policy in trouble produces before its reward or entropy shows it.

Three independent signs, each a pure function of one response, and their union:

* **undecodable**: the decoded text holds U+FFFD, the replacement character a byte-level BPE
  tokenizer emits when the sampled tokens do not form valid UTF-8 (a healthy policy almost never
  splits a multi-byte character wrongly; a collapsing one does it constantly).
* **repetitive**: the response is mostly repeats of itself: fewer than ``max_distinct_share`` of
  its token n-grams are distinct (the degenerate loops of a policy whose distribution narrowed,
  or of FP8 rollout logits that went wrong). Responses shorter than ``2 * n`` tokens are never
  called repetitive: too few n-grams to tell a loop from a short answer.
* **no answer**: the task's format check finds no answer in it (``reward/verifiers.FORMAT_CHECKS``;
  a task without a format check, or a user reward function, reports no such share).

The shares are over all sampled responses of a step (dynamic-sampling refills included), as
``rollout/garbled_frac`` and one ``rollout/<sign>_frac`` per sign; the stability guard
(``guard.max_garbled_frac``) reads the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


def is_undecodable(text: str) -> bool:
    return REPLACEMENT_CHAR in text


def is_repetitive(token_ids: Sequence[int], *, n: int = 3, max_distinct_share: float = 0.5) -> bool:
    """Whether fewer than ``max_distinct_share`` of the response's token ``n``-grams are distinct."""
    count = len(token_ids) - n + 1
    if len(token_ids) < 2 * n:
        return False
    distinct = len({tuple(token_ids[i : i + n]) for i in range(count)})
    return distinct < max_distinct_share * count


def garbled_stats(
    texts: Sequence[str],
    token_ids: Sequence[Sequence[int]],
    format_check: Callable[[str], float] | None = None,
) -> dict[str, float]:
    """``rollout/`` shares of undecodable, repetitive and answerless responses, and their union.

    ``texts[i]`` is ``token_ids[i]`` decoded; ``format_check(text) -> 1.0`` when the text holds an
    answer in the task's format (None: no ``no_answer`` share).
    """
    if len(texts) != len(token_ids):
        raise ValueError(f"{len(texts)} texts for {len(token_ids)} token sequences")
    if not texts:
        return {}
    flags = {
        "undecodable": [is_undecodable(t) for t in texts],
        "repetitive": [is_repetitive(ids) for ids in token_ids],
    }
    if format_check is not None:
        flags["no_answer"] = [format_check(t) < 1.0 for t in texts]
    n = len(texts)
    stats = {f"rollout/{name}_frac": sum(f) / n for name, f in flags.items()}
    stats["rollout/garbled_frac"] = sum(any(fs) for fs in zip(*flags.values())) / n
    return stats
