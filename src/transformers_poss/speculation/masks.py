"""Attention masks of a verification forward, and the layout of a batch in the target cache.

Single row (`tree_verification_mask`): the cache holds the row's context without holes; full-attention and
sliding-window cache layers see different key ranges, so one mask per layer type is built from each layer's own
sizes.

B > 1 rows (`batched_attention_mask`): every row shares one cache length ``L``; a `BatchLayout` says per row which of
the ``L`` columns hold a token of that row (``valid``) and at which position (``positions``). Rows start left-padded
(padding = holes on the left); each round appends ``m = max_b(accepted_b + 1)`` columns, right-aligned, so the last
column is valid for every row and a row's root position is ``positions[b, -1] + 1``. `relayout_index` removes holes
shared by all rows (a per-row re-left-padding). Sliding windows are applied here, by position, on a cache of full
layers (`target_cache.full_layer_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from .target_cache import UnsupportedCacheError

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class BatchLayout:
    """Which cache columns belong to each row, and where.

    Attributes:
        valid (`torch.BoolTensor` of shape `[B, L]`): column ``j`` holds a token of row ``b``.
        positions (`torch.LongTensor` of shape `[B, L]`): position id of that token (meaningless at holes).
    """

    valid: torch.BoolTensor
    positions: torch.LongTensor

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> "BatchLayout":
        """Layout of a left-padded prompt batch (`[B, T]` 0/1 mask); refuses right padding and empty rows."""
        valid = attention_mask.bool()
        empty = (~valid.any(dim=1)).nonzero().flatten().tolist() if valid.numel() else list(range(valid.shape[0]))
        if empty:
            raise ValueError(
                f"Row(s) {empty} of the batch are empty (attention_mask all 0: no prompt token); give every row at "
                "least one token or leave those rows out."
            )
        if not bool(valid[:, -1].all()) or not bool((valid[:, 1:] >= valid[:, :-1]).all()):
            raise ValueError(
                "Batched tree speculation needs left-padded prompts (tokenizer.padding_side = 'left'): every row's "
                "attention_mask must be 0...0 1...1."
            )
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        return cls(valid, positions)

    @property
    def root_positions(self) -> torch.LongTensor:
        """`[B]` position of each row's next token (the root of its next tree)."""
        return self.positions[:, -1] + 1

    def append(self, counts: torch.LongTensor, width: int) -> "BatchLayout":
        """Add ``width`` right-aligned columns holding ``counts[b]`` (`[B]`) new tokens of row ``b``."""
        column = torch.arange(width, device=counts.device)[None]
        first = width - counts[:, None]  # first valid new column of each row
        valid = column >= first
        positions = self.root_positions[:, None] + column - first
        return BatchLayout(torch.cat([self.valid, valid], 1), torch.cat([self.positions, positions], 1))

    def select_rows(self, rows: torch.LongTensor) -> "BatchLayout":
        return BatchLayout(self.valid[rows], self.positions[rows])

    def gather(self, index: torch.LongTensor) -> "BatchLayout":
        return BatchLayout(self.valid.gather(1, index), self.positions.gather(1, index))


def relayout_index(valid: torch.BoolTensor, min_holes: int = 8, min_fraction: float = 0.125):
    """Column index `[B, L']` that drops the holes all rows can lose, or None when not worthwhile.

    Every row has at least ``h = min_b holes_b`` holes; keeping, per row, its holes first then its tokens in order and
    dropping the first ``h`` columns re-left-pads each row with ``L' = L - h`` columns. Done when ``h >= min_holes``
    and ``h >= min_fraction * L`` (a full copy of the cache, so not every round).
    """
    length = valid.shape[1]
    holes = int((length - valid.sum(dim=1)).min().item()) if valid.shape[0] else 0
    if holes == 0 or holes < min_holes or holes < min_fraction * length:
        return None
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # holes first, tokens in column order
    return order[:, holes:]


def _mask_sizes(layer, query_length: int) -> tuple[int, int, int | None]:
    """(kv_length, kv_offset, window) of ``layer`` for a forward of ``query_length`` new rows."""
    kv_length, kv_offset = layer.get_mask_sizes(query_length)
    window = layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
    return kv_length, kv_offset, window


def _layer_mask(
    tree_mask: torch.BoolTensor,
    depths: torch.LongTensor,
    past_length: int,
    kv_length: int,
    kv_offset: int,
    window: int | None,
    context_mask: torch.BoolTensor | None,
) -> torch.BoolTensor:
    """Boolean `[n, kv_length]` mask for one layer: visible context rows, then the tree block."""
    n = tree_mask.shape[0]
    num_context = kv_length - n
    device = tree_mask.device
    context = torch.ones(n, num_context, dtype=torch.bool, device=device)
    if context_mask is not None:
        context = context & context_mask[kv_offset : kv_offset + num_context].to(device)[None, :]
    tree = tree_mask
    if window is not None:
        query_index = past_length + depths  # [n] the node's index in the sequence
        key_index = torch.arange(kv_offset, kv_offset + num_context, device=device)
        context = context & (key_index[None, :] > query_index[:, None] - window)
        tree = tree & ((depths[:, None] - depths[None, :]) < window)
    return torch.cat([context, tree], dim=1)


def as_4d(mask: torch.BoolTensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`[B, q, k]` bool -> `[B, 1, q, k]`: bool (True = attend) with ``dtype`` None, else additive (0 / finfo.min)."""
    mask = mask[:, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def tree_verification_mask(
    cache: DynamicCache,
    config,
    tree_mask: torch.BoolTensor,
    depths: torch.LongTensor,
    context_mask: torch.BoolTensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) for one verification forward of ``n`` tree nodes on top of ``cache``.

    Args:
        cache: the target cache before the forward.
        config: the target's (text) config; its ``layer_types`` name the masks when layers differ.
        tree_mask (`torch.BoolTensor` of shape `[n, n]`): ancestor-or-self relation of the tree.
        depths (`torch.LongTensor` of shape `[n]`): node depths (root 0).
        context_mask (`torch.BoolTensor` of shape `[past_length]`, *optional*): False at padded context positions.
        dtype: None for boolean masks (sdpa), a float dtype for additive masks (eager).

    Returns:
        A `[1, 1, n, kv_length]` mask when every layer sees the same keys, else a dict from layer type
        (``"full_attention"``, ``"sliding_attention"``) to such masks, as the models' mask mappings expect.
    """
    n = tree_mask.shape[0]
    past_length = cache.get_seq_length()
    layer_types = getattr(config, "layer_types", None)
    sizes = [_mask_sizes(layer, n) for layer in cache.layers]
    if not sizes:  # empty cache object: every layer is a plain full-attention layer
        sizes = [(past_length + n, 0, None)]
    if len(set(sizes)) == 1:
        return as_4d(_layer_mask(tree_mask, depths, past_length, *sizes[0], context_mask)[None], dtype)
    if layer_types is None or len(layer_types) != len(sizes):
        raise UnsupportedCacheError(
            "The target's cache layers see different key ranges but its config has no `layer_types` to name one "
            "mask per layer type; tree verification cannot build its attention masks."
        )
    masks = {}
    for layer_type, size in zip(layer_types, sizes):
        if layer_type in masks:
            continue
        masks[layer_type] = as_4d(_layer_mask(tree_mask, depths, past_length, *size, context_mask)[None], dtype)
    return masks


def _windows(config) -> dict[str, int | None]:
    """Attention window per layer type of the target (None = full attention).

    A config with ``sliding_window`` set and no ``layer_types`` (Mistral, Phi-3, Mixtral, Starcoder2) slides in every
    layer: those models build one sliding-window mask for all layers, so the single mask carries the window.
    """
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"full_attention": getattr(config, "sliding_window", None)}
    windows = {}
    for layer_type in layer_types:
        if layer_type not in KNOWN_LAYER_TYPES:
            raise UnsupportedCacheError(
                f"Batched tree speculation supports full and sliding-window attention layers, not {layer_type!r}."
            )
        windows[layer_type] = getattr(config, "sliding_window", None) if layer_type == "sliding_attention" else None
    return windows


def batched_attention_mask(
    config,
    layout: BatchLayout,
    block: torch.BoolTensor,
    query_positions: torch.LongTensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Masks for a forward of ``q`` new columns per row on top of a cache laid out as ``layout``.

    Args:
        config: the target's text config (``layer_types`` and ``sliding_window`` choose one mask per layer type).
        layout: the cached columns (`[B, L]`); may have ``L = 0`` (prefill).
        block (`torch.BoolTensor` of shape `[B, q, q]`): which new columns each new column sees (tree ancestry,
            causal among prompt tokens); must include the diagonal so that no query is fully masked.
        query_positions (`torch.LongTensor` of shape `[B, q]`): position ids of the new columns.
        dtype: None for boolean masks (sdpa), a float dtype for additive masks (eager).

    Returns:
        A `[B, 1, q, L + q]` mask, or a dict from layer type to such masks when the target mixes layer types.
    """
    batch, queries = query_positions.shape
    seen = torch.cat([layout.valid[:, None, :].expand(batch, queries, -1), block], dim=2)
    key_positions = torch.cat([layout.positions, query_positions], dim=1)
    masks = {}
    for layer_type, window in _windows(config).items():
        mask = seen
        if window is not None:
            mask = mask & (key_positions[:, None, :] > query_positions[:, :, None] - window)
        masks[layer_type] = as_4d(mask, dtype)
    return next(iter(masks.values())) if len(masks) == 1 else masks
