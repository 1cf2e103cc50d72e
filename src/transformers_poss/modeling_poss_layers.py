"""Building blocks of the PosS draft: masks, attention over explicit keys/values, the MLP and the two specialist
layer styles.

Read top-down: helpers -> attention -> MLP -> layers. Every specialist layer, whatever its style, has the same
interface, which the drafter (``speculation.drafter``) and the training objective call:

- ``layer.project_kv(fused, position_embeddings)`` -> keys, values `[B, kv_heads, T, head_dim]`;
- ``layer(fused, position_embeddings, keys, values, mask)`` -> predicted features `[B, T, H]`,

where ``fused`` `[B, T, config.fused_size]` is what [`PosSDraftModel.fuse`] makes of a pair (token, H-wide feature)
and ``mask`` a bool mask or a [`BlockCausalMask`].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .configuration_poss import PosSDraftConfig


# ---------------------------------------------------------------------------------------------------- helpers
def causal_mask(query_length: int, past_length: int, device) -> torch.BoolTensor:
    """Bool mask `[1, 1, q, past + q]`: query ``i`` (at position ``past + i``) sees keys ``0 .. past + i``."""
    keys = torch.arange(past_length + query_length, device=device)
    queries = torch.arange(query_length, device=device) + past_length
    return (keys[None, :] <= queries[:, None])[None, None]


def as_bool_mask(attention_mask: torch.Tensor, query_length: int, past_length: int) -> torch.BoolTensor:
    """Turn a user mask into a bool `[B|1, 1, q, past + q]` mask (True = attend).

    Accepts a 2D padding mask `[B, past + q]` (combined with causality), or a 4D bool / additive float mask.
    """
    if attention_mask.dim() == 2:
        padding = attention_mask.bool()[:, None, None, :]
        return padding & causal_mask(query_length, past_length, attention_mask.device)
    if attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return attention_mask
        return attention_mask == 0
    raise ValueError(f"attention_mask must be 2D [batch, keys] or 4D [batch, 1, queries, keys], got {attention_mask.dim()}D.")


@dataclass(frozen=True)
class BlockCausalMask:
    """The ``mask`` of keys that are the queries' own sequence, query t seeing keys 0..t, computed by
    [`block_causal_attention`] in blocks of ``block_size`` queries instead of by SDPA with an explicit mask."""

    block_size: int = 128


def block_causal_attention(queries, keys, values, scale: float, block_size: int) -> torch.Tensor:
    """Causal attention of `[B, heads, T, D]` queries over their own `[B, kv_heads, T, D]` keys and values.

    Each block of ``block_size`` queries is a product with its key prefix only (about half the products of a full
    mask), and the query heads that share a key/value head are stacked into one product. The softmax runs in the
    scores' dtype (CPU kernels accumulate bf16 in float32). On CPUs this is 2-3x faster than SDPA's kernel with a
    mask, forward and backward, at training lengths (300-800 tokens); it is used in training on CPUs. Returns
    `[B, heads, T, D]`.
    """
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = (queries * scale).view(batch, kv_heads, group, length, dim)
    positions = torch.arange(length, device=queries.device)
    outputs = []
    for start in range(0, length, block_size):
        end = min(length, start + block_size)
        rows = grouped[:, :, :, start:end].reshape(batch, kv_heads, group * (end - start), dim)
        scores = torch.matmul(rows, keys[:, :, :end].transpose(-1, -2)).view(batch, kv_heads, group, end - start, end)
        hidden = positions[None, :end] > positions[start:end, None]  # [queries, keys]: keys after the query
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out = torch.matmul(probs.view(batch, kv_heads, group * (end - start), end), values[:, :, :end])
        outputs.append(out.view(batch, kv_heads, group, end - start, dim))
    return torch.cat(outputs, dim=3).view(batch, heads, length, dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------------------------------------- attention
class PosSAttention(nn.Module):
    """Llama-style multi-head attention (GQA, RoPE, no biases) that attends over explicitly given keys/values.

    Keys/values of a pair depend only on the pair, so they are computed once (``project_kv``) and reused: by the
    context cache, by tree ancestors, and by the multi-step training objective.

    Args:
        config: the draft config.
        input_size (`int`, *optional*): width of the q/k/v inputs; default ``hidden_size`` (2H in the EAGLE-3 layer).
    """

    def __init__(self, config: PosSDraftConfig, input_size: int | None = None):
        super().__init__()
        input_size = input_size or config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `[B, T, input_size]` inputs: two `[B, kv_heads, T, head_dim]` tensors, RoPE applied to
        keys."""
        cos, sin = position_embeddings
        keys = self._heads(self.k_proj(hidden_states), self.num_kv_heads)
        values = self._heads(self.v_proj(hidden_states), self.num_kv_heads)
        keys = keys * cos.unsqueeze(1) + _rotate_half(keys) * sin.unsqueeze(1)
        return keys, values

    def forward(self, hidden_states, position_embeddings, keys, values, attention_mask) -> torch.Tensor:
        """Queries from `[B, T, input_size]` attend over `keys`/`values` `[B, kv_heads, K, head_dim]` with a bool
        `[B|1, 1, T, K]` mask, or causally over their own keys (K = T) with a [`BlockCausalMask`].
        Returns `[B, T, H]`."""
        cos, sin = position_embeddings
        queries = self._heads(self.q_proj(hidden_states), self.num_heads)
        queries = queries * cos.unsqueeze(1) + _rotate_half(queries) * sin.unsqueeze(1)
        if isinstance(attention_mask, BlockCausalMask):
            out = block_causal_attention(queries, keys, values, self.scaling, attention_mask.block_size)
        else:  # query heads share their key/value head inside the kernel (no repeated copy of the keys and values)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attention_mask, scale=self.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class PosSMLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, config: PosSDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------------- layers
class PosSDecoderLayer(nn.Module):
    """One specialist of ``layer_style="eagle2"``: attention + SwiGLU MLP over the ``fc``-fused pair `[B, T, H]`,
    with ``post_attention_layernorm`` but no input norm."""

    def __init__(self, config: PosSDraftConfig):
        super().__init__()
        self.self_attn = PosSAttention(config)
        self.mlp = PosSMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def project_kv(self, hidden_states, position_embeddings):
        """Keys/values `[B, kv_heads, T, head_dim]` of `[B, T, H]` fused pairs (see [`PosSAttention.project_kv`])."""
        return self.self_attn.project_kv(hidden_states, position_embeddings)

    def forward(self, hidden_states, position_embeddings, keys, values, attention_mask) -> torch.Tensor:
        """`[B, T, H]` fused pairs -> `[B, T, H]` predicted features."""
        hidden_states = hidden_states + self.self_attn(hidden_states, position_embeddings, keys, values, attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PosSEagle3DecoderLayer(nn.Module):
    """One specialist of ``layer_style="eagle3"`` (EAGLE-3's ``midlayer``).

    Its input is the unfused pair ``cat(embed(x_{t+1}), f_t)`` `[B, T, 2H]`: ``input_layernorm`` normalises the
    token embedding, ``hidden_norm`` the feature, q/k/v read the concatenation of both (2H -> heads), the residual is
    the un-normalised feature, then ``post_attention_layernorm`` + MLP as usual. The output `[B, T, H]` is the
    predicted feature before the draft's final ``norm`` (which [`PosSDraftModel.compute_logits`] applies).
    """

    def __init__(self, config: PosSDraftConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = PosSAttention(config, input_size=2 * config.hidden_size)
        self.mlp = PosSMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention_input(self, pairs: torch.Tensor) -> torch.Tensor:
        """`[B, T, 2H]` pairs -> `[B, T, 2H]` ``cat(input_layernorm(embedding), hidden_norm(feature))``."""
        embeds, features = pairs[..., : self.hidden_size], pairs[..., self.hidden_size :]
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)

    def project_kv(self, pairs, position_embeddings):
        """Keys/values `[B, kv_heads, T, head_dim]` of `[B, T, 2H]` pairs."""
        return self.self_attn.project_kv(self.attention_input(pairs), position_embeddings)

    def forward(self, pairs, position_embeddings, keys, values, attention_mask) -> torch.Tensor:
        """`[B, T, 2H]` pairs -> `[B, T, H]` predicted features (before the final norm)."""
        residual = pairs[..., self.hidden_size :]
        attended = self.self_attn(self.attention_input(pairs), position_embeddings, keys, values, attention_mask)
        hidden_states = residual + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


LAYER_CLASSES = {"eagle2": PosSDecoderLayer, "eagle3": PosSEagle3DecoderLayer}
