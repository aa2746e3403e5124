"""A core attention for megatron-core's local layer spec computed by torch's
`scaled_dot_product_attention` (`trainer.attention_backend: sdpa`).

megatron-core 0.19's local spec (`get_gpt_layer_local_spec`, what runs without Transformer Engine,
e.g. on CPU) computes attention as `baddbmm` -> masked fp32 softmax -> `bmm` with the scores
materialised and the key/value heads repeated for GQA (`DotProductAttention`). On CPU torch's SDPA
kernel does the same product fused (one pass, GQA without the repeat): 10.4 -> 7.7 ms forward +
backward for the tiny model's shapes on one core (`benchmarks/README.md`, "Where megatron-rl's
step goes"). Same mathematics, float32 rounding differs (~1e-6 on the attention output), so
recorded references of the local spec do not carry over bit for bit, hence opt-in.

Semantics kept from `DotProductAttention` (and `FusedScaleMaskSoftmax.forward_torch_softmax`):
- `attention_mask` is megatron's boolean mask, True = masked; it is applied as an additive
  -10000 (megatron fills -10000 rather than -inf), so a row with every key masked (padding of a
  packed row) gets finite, loss-masked values, never NaN;
- without a mask and with a causal `attn_mask_type` (the module's, as megatron's softmax uses it)
  the causal mask is SDPA's `is_causal` (query and key lengths equal; one query token is not masked);
- the scale is `softmax_scale` (1/sqrt(head dim) unless given), times the layer number with
  `apply_query_key_layer_scaling` as in megatron.

Falls back to megatron's own forward (same results as without this module) for what it does not
cover: attention dropout in training, sliding windows, a softmax type other than vanilla. Packed
sequence params (THD) and attention bias are refused as by megatron's class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = ["SDPADotProductAttention", "MASKED_SCORE"]

MASKED_SCORE = -10000.0
"""What a masked score becomes (megatron-core's `attention_mask_func` fills this value)."""


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's `DotProductAttention` with the product computed by
    `torch.nn.functional.scaled_dot_product_attention` (module docstring).

    Shapes (megatron's): query [sq, b, np, hn], key / value [sk, b, ng, hn] (ng query groups, np a
    multiple of ng), attention_mask None or bool broadcastable to [b, np, sq, sk] (True = masked);
    returns the context [sq, b, np * hn].

    Raises:
        AssertionError: packed_seq_params or attention_bias given (as megatron's class).
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """The context [sq, b, np * hn] (class docstring)."""
        assert packed_seq_params is None, "packed sequences (THD) need Transformer Engine's attention"
        assert attention_bias is None, "attention bias is not supported by the local core attention"
        window = is_layer_window_attention(self.config.window_size, self.config.window_attn_skip_freq,
                                           self.layer_number)
        dropout = self.attention_dropout.p if self.training else 0.0
        if window or dropout > 0.0 or self.softmax_offset is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b, heads, hn = query.shape
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask, causal = None, False
        if attention_mask is not None:
            mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(attention_mask, MASKED_SCORE)
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            assert sq == key.shape[0], "causal mask is only for self attention"
            causal = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=heads != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)
