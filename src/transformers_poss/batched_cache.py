"""The target's KV cache and attention masks when B > 1 rows are verified together.

Layout: every row shares one cache length ``L``; a `BatchLayout` says per row which of the ``L`` columns hold a token
of that row (``valid``) and at which position (``positions``). Rows start left-padded (padding = holes on the left);
each round appends ``m = max_b(accepted_b + 1)`` columns, right-aligned: row ``b``'s root and accepted nodes sit in the
last ``accepted_b + 1`` columns, holes before them. So the last column is valid for every row, and a row's root
position is ``positions[b, -1] + 1``. `relayout_index` removes holes shared by all rows (a per-row re-left-padding);
rows that finished are dropped with `select_rows`.

Holes break the "column index = position" assumption of sliding-window layers, so the batched loop runs on a
`DynamicCache` of plain full layers (`full_layer_cache`) and applies each window in the masks, by position. Sliding
layers then keep their whole context (more memory, same outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from .kv_cache import UnsupportedCacheError

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


def full_layer_cache() -> DynamicCache:
    """A `DynamicCache` whose layers are all plain (full) `DynamicLayer`s, created lazily by the first forward."""
    return DynamicCache()


def _gather_columns(tensor: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`[B, h, L, d]` -> `[B, h, L', d]`, column ``index[b, j]`` (`[B, L']`) of row ``b``."""
    batch, heads, _, dim = tensor.shape
    return tensor.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], dim))


def keep_accepted(cache: DynamicCache, num_nodes: int, index: torch.LongTensor) -> None:
    """After a verification forward of ``num_nodes`` nodes per row: keep node ``index[b, j]`` (`[B, m]`, right-aligned
    accepted nodes) of row ``b`` in new column ``L + j``, drop the rest."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        base = layer.keys.shape[-2] - num_nodes
        columns = index.to(layer.keys.device) + base
        width = index.shape[1]
        layer.keys[:, :, base : base + width] = _gather_columns(layer.keys, columns)
        layer.values[:, :, base : base + width] = _gather_columns(layer.values, columns)
        layer.keys = layer.keys[:, :, : base + width]
        layer.values = layer.values[:, :, : base + width]


def gather_cache_columns(cache: DynamicCache, index: torch.LongTensor) -> None:
    """Re-lay every layer's columns: row ``b`` keeps columns ``index[b]`` (`[B, L']`), in that order."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = _gather_columns(layer.keys, index.to(layer.keys.device))
            layer.values = _gather_columns(layer.values, index.to(layer.values.device))


def select_cache_rows(cache: DynamicCache, rows: torch.LongTensor) -> None:
    """Keep only batch rows ``rows`` (`[B']`) of every layer."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys[rows.to(layer.keys.device)]
            layer.values = layer.values[rows.to(layer.values.device)]


def _windows(config) -> dict[str, int | None]:
    """Attention window per layer type of the target (None = full attention)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
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
        masks[layer_type] = _as_4d(mask, dtype)
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _as_4d(mask: torch.BoolTensor, dtype: torch.dtype | None) -> torch.Tensor:
    mask = mask[:, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
