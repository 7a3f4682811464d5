"""Where a decoded response's answer is: the text before the first end marker.

Whether the special tokens were kept in the decoded text depends on the rollout
(``skip_special_tokens``), so every verifier cuts the text at the first ``<eos>`` or ``<pad>``
itself and never relies on either being present.

The two markers are spelled out here rather than imported from ``megatron_rl_fp8.data.tokenizer``:
importing ``megatron_rl_fp8.data`` imports torch, and this module is imported by every reward
worker process, which would then spend seconds and hundreds of MB loading a library it never
uses. ``tests/unit/test_reward_verifiers.py`` checks they equal the tokenizer's tokens.
"""

from __future__ import annotations

END_MARKERS = ("<eos>", "<pad>")
"""``EOS_TOKEN`` and ``PAD_TOKEN`` of :mod:`megatron_rl_fp8.data.tokenizer`."""


def answer_region(response_text: str) -> str:
    """The response up to its first end marker, with surrounding whitespace removed."""
    end = len(response_text)
    for marker in END_MARKERS:
        i = response_text.find(marker)
        if i != -1:
            end = min(end, i)
    return response_text[:end].strip()
