"""``attn_implementation="poss_exact"``: attention whose result for a query does not depend on the other queries.

Speculation is lossless only if the target's logits for a token are the same whether it is decoded alone or
verified beside other tree nodes. Float attention kernels change their summation order with the number of queries
and keys, which moves results by about 1e-7; a float32 model shrugs that off, but a model with int8 activations
(see `quantize.Int8Linear`) rounds every activation and turns such a difference into a different token now and then.

This attention computes scores, softmax and the weighted sum in float64 and rounds the result to the query's dtype,
so two computations of the same query agree exactly unless a float64 error (~1e-16) straddles a float32 rounding
boundary. Masks are the ones transformers builds for sdpa (boolean, with the same causal / sliding-window /
padding rules) or a given 4D tree mask. Its cost is small next to the linears of a decode step on a CPU.
"""

from __future__ import annotations

import torch

EXACT_ATTENTION = "poss_exact"


QUERY_CHUNK_BYTES = 64 * 2**20  # float64 scores of one chunk of queries stay below this (long prompts)


def exact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`[B, Hq, q, d]` queries, `[B, Hkv, k, d]` keys/values, a bool or additive `[B, 1|Hq, q, k]` mask (or None
    for plain causal attention) -> `([B, q, Hq, d], None)`.

    Query heads sharing a key/value head are stacked (`[B, Hkv, G * q, d]`), so keys and values are not repeated.
    Long prompts run in chunks of queries, so the float64 scores take at most ``QUERY_CHUNK_BYTES`` (each query's
    result does not depend on the chunk it is in).
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='poss_exact' does not support attention logit soft-capping.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else head_dim**-0.5
    keys_t, values = key.double().transpose(-1, -2), value.double()
    mask = None if attention_mask is None else attention_mask[..., :k_len]
    chunk = max(1, QUERY_CHUNK_BYTES // (8 * batch * q_heads * k_len))
    if q_len <= chunk:
        out = _attend(query, keys_t, values, mask, scale, k_len - q_len)
    else:
        out = torch.cat([
            _attend(query[:, :, i : i + chunk], keys_t, values, None if mask is None else mask[:, :, i : i + chunk],
                    scale, k_len - q_len + i)
            for i in range(0, q_len, chunk)
        ], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _attend(query, keys_t, values, mask, scale: float, offset: int) -> torch.Tensor:
    """Float64 attention of `[B, Hq, q, d]` queries whose first sits at key index ``offset`` (for the causal rule
    when ``mask`` is None) -> `[B, Hq, q, d]` in the query's dtype."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = keys_t.shape[1], keys_t.shape[3]
    groups = q_heads // kv_heads
    q = query.double().mul_(scale).reshape(batch, kv_heads, groups * q_len, head_dim)
    scores = torch.matmul(q, keys_t).view(batch, kv_heads, groups, q_len, k_len)
    lowest = torch.finfo(scores.dtype).min  # finite, so a fully masked (padding) row stays finite
    if mask is None:
        if q_len > 1 or offset < k_len - 1:  # causal, query i at key index offset + i
            rows = torch.arange(q_len, device=scores.device)[:, None] + offset
            scores.masked_fill_(torch.arange(k_len, device=scores.device)[None, :] > rows, lowest)
    else:
        mask = mask.view(batch, kv_heads, groups, q_len, k_len) if mask.shape[1] == q_heads else mask[:, :, None]
        if mask.dtype == torch.bool:
            scores = torch.where(mask, scores, lowest)
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * q_len, k_len)
    return torch.matmul(weights, values).to(query.dtype).view(batch, q_heads, q_len, head_dim)


def register_exact_attention() -> None:
    """Register ``"poss_exact"`` with transformers' attention and mask interfaces (idempotent; done on import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EXACT_ATTENTION, sdpa_mask)


def use_exact_attention(model) -> None:
    """Switch ``model`` (and its sub-configs) to ``attn_implementation="poss_exact"``."""
    register_exact_attention()
    model.set_attn_implementation(EXACT_ATTENTION)
