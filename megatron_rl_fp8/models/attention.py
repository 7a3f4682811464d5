"""Core attention of the local spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local spec (no Transformer Engine) computes attention unfused (``DotProductAttention``:
``baddbmm`` into a [b * heads, s, s] buffer, softmax, ``bmm``) and keeps the s^2 probabilities for
the backward. On a GPU without TE that is most of the step outside the GEMMs and, at long
sequences, most of the activation memory. :class:`SDPAttention` takes the same slot
(``self_attention.submodules.core_attention``) and the same inputs, and calls torch's fused
attention: FlashAttention-2 / memory-efficient kernels on CUDA, a flash kernel on the CPU. It
keeps O(s) statistics (the fp32 log-sum-exp per query and head) instead of the scores.

    query, key, value  [s, b, heads or groups, head_dim]   (this TP rank's heads)
    -> [b, heads, s, head_dim], keys and values repeated to every query head (GQA, as Megatron
       does: every SDPA kernel takes them so)
    -> softmax(q k^T * scale + causal mask) v  ->  [s, b, heads * head_dim]

``model.attention_backend`` picks it (``auto``: on GPUs, where the local spec is used; the CPU
keeps Megatron's unfused attention, which the layout and planner checks were built on). Same
scale as Megatron's (``1/sqrt(head_dim)``; its query-key layer scaling cancels in an fp32
softmax), causal masking when no mask is given, no context parallelism (as the local spec).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType


def _tp_size(pg_collection) -> int:
    if pg_collection is not None:
        return pg_collection.tp.size()
    return parallel_state.get_tensor_model_parallel_world_size()


class SDPAttention(torch.nn.Module):
    """Drop-in for Megatron's ``DotProductAttention`` (constructor and forward signatures)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(
                "model.attention_backend=sdpa has no context parallelism; use "
                "parallel.context_parallel_size=1 or Transformer Engine's spec"
            )
        self.config = config
        tp = _tp_size(pg_collection)
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.attn_mask_type = attn_mask_type
        self._causal = AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``attention_mask``: Megatron's (True where attention is masked out), or None for the
        causal mask of a causal layer."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes neither packed sequences nor an attention bias")
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        if self.heads > self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = attention_mask is None and mask_type == self._causal
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
