"""The target forwards of tree speculation: the batched prefill and ONE verification forward per round.

Each forward asks the target for its logits at every fed position and only for the hidden states the draft reads
(`feature_request`): the post-final-norm features (``output_hidden_states=-1``), or the draft's ``feature_layers``
(``output_hidden_states=[i, ...]``). transformers 5 keeps only the selected hidden states: its ``hidden_states``
tuple keeps its full length (``num_hidden_layers + 1``, indexed as without a selection) with None in the places not
asked for, so no other layer's hidden states are held. The draft's features are the selected states concatenated in
``feature_layers`` order, `[B, q, k*H]` (`read_features`).

A chain (every row's tree a single path) goes through the plain causal path (2D mask, transformers builds its own
causal mask) where that is exact; any other tree gets explicit 4D tree masks.
"""

from __future__ import annotations

import torch

from .._transformers_compat import attn_implementation, supports_logits_to_keep
from ..quantization.exact_attention import EXACT_ATTENTION
from ..speculation.masks import BatchLayout, batched_attention_mask, tree_verification_mask
from ..speculation.tree import BatchedTree, DraftTree

FEATURE_LAYER = -1  # the post-final-norm hidden state (the lm_head input)


def feature_request(feature_layers: list[int] | None) -> int | list[int]:
    """``output_hidden_states`` for a draft reading ``feature_layers`` (None: the post-norm state only)."""
    return FEATURE_LAYER if feature_layers is None else list(feature_layers)


def read_features(hidden_states: tuple, feature_layers: list[int] | None) -> torch.Tensor:
    """The draft's target features from a selected ``hidden_states`` tuple: `[B, q, H]` post-norm, or the
    ``feature_layers`` states concatenated in that order, `[B, q, k*H]`."""
    if feature_layers is None:
        return hidden_states[FEATURE_LAYER]
    states = [hidden_states[i] for i in feature_layers]
    return states[0] if len(states) == 1 else torch.cat(states, dim=-1)


def mask_dtype(model) -> torch.dtype | None:
    """None (boolean masks) for attention that takes them as they are, else the model's dtype (additive masks)."""
    return None if attn_implementation(model.config) in ("sdpa", EXACT_ATTENTION) else model.dtype


def _to_device(masks, device):
    if masks is None:
        return None
    return {k: v.to(device) for k, v in masks.items()} if isinstance(masks, dict) else masks.to(device)


def forward(model, input_ids, masks, position_ids, cache, logits_to_keep: int, feature_layers=None):
    """One target forward: logits `[B, q', V]` (``logits_to_keep`` as transformers reads it) and the draft's
    features `[B, q, k*H]` (k = 1, the post-norm state, without ``feature_layers``)."""
    device = model.device
    kwargs = {"logits_to_keep": logits_to_keep} if supports_logits_to_keep(model) else {}
    out = model(input_ids=input_ids.to(device), attention_mask=_to_device(masks, device),
                position_ids=position_ids.to(device), cache=cache, use_cache=True,
                output_hidden_states=feature_request(feature_layers), return_dict=True, **kwargs)  # fmt: skip
    return out.logits, read_features(out.hidden_states, feature_layers)


def chain_attention_mask(num_nodes: int, context_mask: torch.BoolTensor | None) -> torch.LongTensor | None:
    """The 2D mask of a chain verified on the plain causal path: the context mask then ones, `[1, past + n]`
    (None without padding). transformers builds the causal / sliding-window mask from it as in plain decoding."""
    if context_mask is None:
        return None
    return torch.cat([context_mask.long(), context_mask.new_ones(num_nodes, dtype=torch.long)])[None]


def verify_tree(model, tree: DraftTree, cache, root_position: int, context_mask, feature_layers=None):
    """ONE target forward over a single row's tree nodes: logits `[n, vocab]` and the draft's features `[n, k*H]`."""
    if tree.is_chain:
        mask = chain_attention_mask(tree.num_nodes, context_mask)
    else:
        mask = tree_verification_mask(
            cache, model.config.get_text_config(), tree.tree_mask, tree.depths, context_mask, mask_dtype(model)
        )
    logits, features = forward(model, tree.tokens[None], mask, (tree.depths + root_position)[None], cache, 0,
                               feature_layers)  # fmt: skip
    return logits[0], features[0]


def causal_path_ok(config) -> bool:
    """Whether transformers' own causal mask is right on the batched cache: full attention only (a sliding window
    is applied by cache column there, and columns are not positions once the cache has holes)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:  # no per-layer types: transformers applies a configured window to every layer
        return getattr(config, "sliding_window", None) is None
    return all(layer_type == "full_attention" for layer_type in layer_types)


def verify_batch(model, tree: BatchedTree, layout: BatchLayout, cache, feature_layers=None):
    """ONE target forward over every row's tree: logits `[B, n, V]` and the draft's features `[B, n, k*H]`."""
    positions = layout.root_positions[:, None] + tree.depths
    config = model.config.get_text_config()
    if tree.is_chain and causal_path_ok(config):
        masks = torch.cat([layout.valid, layout.valid.new_ones(tree.tokens.shape)], dim=1).long()
    else:
        masks = batched_attention_mask(config, layout, tree.tree_mask, positions, mask_dtype(model))
    return forward(model, tree.tokens, masks, positions, cache, 0, feature_layers)


def prefill_batch(model, input_ids, layout: BatchLayout, cache, feature_layers=None):
    """Prompt forward of a left-padded batch: last-position logits `[B, V]` and every prompt column's features
    `[B, T, k*H]`."""
    length = input_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    block = (causal[None] & layout.valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=input_ids.device)
    empty = BatchLayout(layout.valid[:, :0], layout.positions[:, :0])
    masks = batched_attention_mask(model.config.get_text_config(), empty, block, layout.positions, mask_dtype(model))
    logits, features = forward(model, input_ids, masks, layout.positions, cache, 1, feature_layers)
    return logits[:, -1], features
