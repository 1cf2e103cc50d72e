"""``attn_implementation="poss_block_causal"``: the target's causal attention in query blocks, for its feature pass.

The target's forward that computes training features (`feature_inputs.TargetFeatures`) runs whole right-padded
sequences without a cache: plain causal attention over the batch's own keys. SDPA's CPU kernel does it with the
padding mask at about half the speed of products over key prefixes ([`block_causal_attention`], forward only:
16.2 -> 8.1 ms at 8 x 323 tokens, 61 -> 32-36 ms at 8 x 768, SmolLM2's 9 query and 3 key/value heads). With right
padding, causal attention gives every real position exactly what the padding mask gives it (padded positions see
only real keys before them, and their features are dropped), so the mask is not needed.

Anything else goes to transformers' SDPA function unchanged: a sliding window, soft-capping, a position bias,
dropout, queries that are not the keys' own sequence (a cache), a non-causal module.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .._transformers_compat import attn_implementation, register_attention, set_attn_implementation
from ..modeling_poss_layers import block_causal_attention

BLOCK_CAUSAL = "poss_block_causal"
QUERY_BLOCK = 64  # queries per product: 64-128 measured fastest at 300-800 tokens on a 2-core CPU


def block_causal_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: `[B, Hq, q, d]` queries over `[B, Hkv, k, d]` keys/values ->
    ``([B, q, Hq, d], None)``; block-causal when the call is plain causal self-attention (see the module docstring),
    else SDPA with ``attention_mask``."""
    special = any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "position_bias"))
    if special or dropout or kwargs.get("output_attentions") or query.shape[2] != key.shape[2] \
            or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = block_causal_attention(query, key, value, scale, QUERY_BLOCK)
    return out.transpose(1, 2).contiguous(), None


def right_padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether a `[B, L]` padding mask has its padding only at the end of each row (or there is no mask)."""
    if attention_mask is None:
        return True
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


@contextlib.contextmanager
def block_causal_features(decoder, tokens: torch.Tensor, attention_mask: torch.Tensor | None):
    """Within: ``decoder`` (a target's decoder, switched for the call only) attends block-causally, when that gives
    the same features: on CPUs, for right-padded batches, where it would use SDPA. Elsewhere nothing changes."""
    config = decoder.config
    if tokens.device.type != "cpu" or attn_implementation(config) != "sdpa" or not right_padded(attention_mask):
        yield
        return
    register_attention(BLOCK_CAUSAL, block_causal_forward)
    set_attn_implementation(config, BLOCK_CAUSAL)
    try:
        yield
    finally:
        set_attn_implementation(config, "sdpa")
