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

import threading

import torch

from .._transformers_compat import register_attention
from .int8_kernels import version_of

EXACT_ATTENTION = "poss_exact"


QUERY_CHUNK_BYTES = 64 * 2**20  # float64 scores of one chunk of queries stay below this (long prompts)
BIAS_CACHE_BYTES = 16 * 2**20  # an additive mask up to this size is built once per forward, for all its layers

_last_bias = threading.local()


def exact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`[B, Hq, q, d]` queries, `[B, Hkv, k, d]` keys/values, a bool or additive `[B, 1|Hq, q, k]` mask (or None
    for plain causal attention) -> `([B, q, Hq, d], None)`.

    Query heads sharing a key/value head are stacked (`[B, Hkv, G * q, d]`), so keys and values are not repeated.
    The mask becomes an additive float64 bias (`_score_bias`), built once for all the layers of a forward (they get
    the same mask object) and added to the scores in place. Long prompts run in chunks of queries, so the float64
    scores take at most ``QUERY_CHUNK_BYTES`` (each query's result does not depend on the chunk it is in).
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='poss_exact' does not support attention logit soft-capping.")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    keys_t, values = key.double().transpose(-1, -2), value.double()
    chunk = max(1, QUERY_CHUNK_BYTES // (8 * batch * q_heads * k_len))
    if q_len <= chunk:
        bias = _cached_bias(attention_mask, groups, q_len, k_len, query.device)
        return _attend(query, keys_t, values, bias, scale), None
    mask = None if attention_mask is None else attention_mask[..., :k_len]
    out = torch.cat([
        _attend(query[:, :, i : i + chunk], keys_t, values,
                _score_bias(None if mask is None else mask[:, :, i : i + chunk], groups, min(chunk, q_len - i), k_len,
                            k_len - q_len + i, query.device), scale)
        for i in range(0, q_len, chunk)
    ], dim=1)  # fmt: skip
    return out, None


def _attend(query, keys_t, values, bias, scale: float) -> torch.Tensor:
    """Float64 attention of `[B, Hq, q, d]` queries on `[B, Hkv, d, k]` keys and `[B, Hkv, k, d]` values, with an
    additive float64 `[B, 1|Hkv, G * q, k]` ``bias`` (None: every key seen) -> `[B, q, Hq, d]` in the query's
    dtype. Batched products over `B * Hkv` (3D views: no broadcasting wrapper per layer)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = keys_t.shape[1], keys_t.shape[3]
    rows = q_heads // kv_heads * q_len
    q = query.double().mul_(scale).reshape(batch * kv_heads, rows, head_dim)
    scores = torch.bmm(q, keys_t.reshape(batch * kv_heads, head_dim, k_len))  # [B * Hkv, G * q, k]
    if bias is not None:
        scores.view(batch, kv_heads, rows, k_len).add_(bias)
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, values.reshape(batch * kv_heads, k_len, head_dim))
    return out.to(query.dtype).view(batch, q_heads, q_len, head_dim).transpose(1, 2).contiguous()


def _score_bias(mask, groups: int, q_len: int, k_len: int, offset: int, device=None) -> torch.Tensor | None:
    """The additive float64 bias `[B, 1|Hkv, G * q, k]` of a bool or additive `[B, 1|Hq, q, k]` ``mask`` (None:
    causal, query i at key index ``offset + i``), rows in the stacked order of `_attend`; None when every query sees
    every key. A key not seen gets the lowest finite float64: added to a score it gives that value again (a score is
    far below its spacing), so the scores are the same bits as selecting it where the mask is False, and a fully
    masked (padding) row stays finite."""
    lowest = torch.finfo(torch.float64).min
    if mask is None:
        if q_len == 1 and offset == k_len - 1:
            return None
        rows = torch.arange(q_len, device=device)[:, None] + offset
        seen = torch.arange(k_len, device=device)[None, :] <= rows
        bias = torch.zeros(q_len, k_len, dtype=torch.float64, device=device).masked_fill_(~seen, lowest)
        bias = bias[None, None]
    elif mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill_(~mask, lowest)
    else:
        bias = mask.double()
    batch, heads = bias.shape[:2]
    if heads == 1:  # one mask for all heads: the same rows for each of the G stacked query heads
        return bias[:, :, None].expand(batch, 1, groups, q_len, k_len).reshape(batch, 1, groups * q_len, k_len)
    return bias.reshape(batch, heads // groups, groups * q_len, k_len)


def _cached_bias(attention_mask, groups: int, q_len: int, k_len: int, device) -> torch.Tensor | None:
    """`_score_bias` of a forward's whole mask, reused while the same, unmodified mask object comes again (the next
    layers of the forward). Only small biases are kept (``BIAS_CACHE_BYTES``); a reference to the mask is held, so
    identity is safe."""
    key = (version_of(attention_mask) if attention_mask is not None else None, groups, q_len, k_len, device)
    cached = getattr(_last_bias, "entry", None)
    if cached is not None and cached[0] is attention_mask and cached[1] == key:
        return cached[2]
    mask = None if attention_mask is None else attention_mask[..., :k_len]
    bias = _score_bias(mask, groups, q_len, k_len, k_len - q_len, device)
    if bias is not None and bias.numel() * 8 <= BIAS_CACHE_BYTES:
        _last_bias.entry = (attention_mask, key, bias)
    return bias


def register_exact_attention() -> None:
    """Register ``"poss_exact"`` with transformers' attention and mask interfaces (idempotent; done on import)."""
    register_attention(EXACT_ATTENTION, exact_attention_forward)


def use_exact_attention(model) -> None:
    """Switch ``model`` (and its sub-configs) to ``attn_implementation="poss_exact"``."""
    register_exact_attention()
    model.set_attn_implementation(EXACT_ATTENTION)
