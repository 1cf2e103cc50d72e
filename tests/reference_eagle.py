"""Straightforward reference computations of EAGLE(-2) and EAGLE-3 draft layers from raw weights (plain torch ops,
written from the published architectures, independent of the package's modules), so tests check weight mappings
instead of assuming them. Causal attention over one sequence, default RoPE, positions 0..T-1."""

import torch


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, theta):
    """Rotary embedding of `[T, heads, D]` at positions 0..T-1 (rotate-half convention, as Llama)."""
    length, _, dim = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * cos + rotated * sin


def attention(q_in, w, heads, kv_heads, theta):
    """Causal multi-head attention of one sequence `[T, in]` with weights ``w[q|k|v|o]``; returns `[T, H]`."""
    length = q_in.shape[0]
    dim = w["q"].shape[0] // heads
    q = rope((q_in @ w["q"].T).view(length, heads, dim), theta)
    k = rope((q_in @ w["k"].T).view(length, kv_heads, dim), theta)
    v = (q_in @ w["v"].T).view(length, kv_heads, dim)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * dim)
    return out @ w["o"].T


def mlp(x, state, prefix):
    gate = x @ state[f"{prefix}mlp.gate_proj.weight"].T
    up = x @ state[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ state[f"{prefix}mlp.down_proj.weight"].T


def _attn_weights(state, prefix):
    return {n: state[f"{prefix}self_attn.{n}_proj.weight"] for n in "qkvo"}


def eagle2_layer(state, prefix, embeds, features, heads, kv_heads, theta, eps):
    """EAGLE-2 draft over one sequence: ``fc(cat(embeds, features))`` `[T, H]`, attention without input norm, MLP
    after ``post_attention_layernorm``. ``state`` holds ``fc.weight`` (and optional ``fc.bias``) and the layer at
    ``prefix``."""
    x = torch.cat([embeds, features], -1) @ state["fc.weight"].T
    if state.get("fc.bias") is not None:
        x = x + state["fc.bias"]
    h = x + attention(x, _attn_weights(state, prefix), heads, kv_heads, theta)
    return h + mlp(rms_norm(h, state[f"{prefix}post_attention_layernorm.weight"], eps), state, prefix)


def eagle3_midlayer(state, prefix, embeds, features, heads, kv_heads, theta, eps):
    """EAGLE-3 midlayer over one sequence: `[T, H]` embeddings and `[T, H]` (fused) features -> `[T, H]` output
    before the final norm (residual = the feature)."""
    q_in = torch.cat([rms_norm(embeds, state[f"{prefix}input_layernorm.weight"], eps),
                      rms_norm(features, state[f"{prefix}hidden_norm.weight"], eps)], -1)
    h = features + attention(q_in, _attn_weights(state, prefix), heads, kv_heads, theta)
    return h + mlp(rms_norm(h, state[f"{prefix}post_attention_layernorm.weight"], eps), state, prefix)


def eagle3_logits(state, embeds, target_features, heads, kv_heads, theta, eps):
    """EAGLE-3 checkpoint (keys ``fc``, ``midlayer.*``, ``norm``, ``lm_head``) over one sequence: `[T, k*H]` target
    features -> draft-vocabulary logits `[T, V']` of the step over the context."""
    fused = target_features @ state["fc.weight"].T
    out = eagle3_midlayer(state, "midlayer.", embeds, fused, heads, kv_heads, theta, eps)
    return rms_norm(out, state["norm.weight"], eps) @ state["lm_head.weight"].T
