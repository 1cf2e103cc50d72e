"""The target's KV cache during tree verification, for B >= 1 rows.

A verification forward appends all ``n`` tree nodes of every row to the target's `DynamicCache`; only each row's root
and accepted path are kept afterwards (`keep_accepted`). The accepted rows are not contiguous in the tree block, so
they are gathered into place right after the prefix and the rest is cropped. With B > 1 rows the rows accept
different numbers of nodes: each row's kept nodes are right-aligned in ``m = max_b(accepted_b + 1)`` new columns and
the columns before them are holes, masked out by the layout (`masks.BatchLayout`); a single row has no holes.

Supported layers: `DynamicLayer` and `DynamicSlidingWindowLayer` (Gemma 3, Mistral-style sliding windows). A
sliding-window layer keeps only its last ``window - 1`` rows, so a tree forward would evict context rows still
needed when only part of the tree is accepted: its past recording is switched on (see `prepare_cache_for_tree`), so
that it keeps every row until the compaction crops it back to the window.

Static, quantized, offloaded and encoder-decoder caches, and linear-attention or indexed layers, are refused with a
clear error.

[`GrowingLayer`] / [`growing_cache`]: transformers' `DynamicLayer` appends with ``torch.cat``, copying the layer's
whole cache at every forward (``2 x layers x kv_heads x head_dim x 4`` bytes per cached position and row: 46 KB for
SmolLM2-135M, so 18 MB per forward at 400 positions, and 590 MB per step for a batch of 32). A growing layer keeps
its keys and values in a buffer whose capacity doubles when full and hands out views of the filled part, so a forward
writes its new columns only; crops and the in-place compaction above keep working on the views. The tree loop's own
cache and batched self-distillation (`training.distill`) use it. A crop followed by an update writes the cropped
columns again in place, which a caller still holding the longer views would see.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .kv_storage import MIN_CAPACITY, write_columns


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose ``keys`` / ``values`` (`[B, kv_heads, L, head_dim]`) are views of buffers of capacity
    ``>= L``; the capacity doubles when an update does not fit. Same values as `DynamicLayer`, column by column."""

    _storage: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        held = (self.keys, self.values) if length else None
        self._storage, self.keys, self.values = write_columns(self._storage, held, length, key_states, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self._storage = None
        super().reset()


def use_growing_layers(cache: DynamicCache) -> DynamicCache:
    """Turn ``cache``'s plain full-attention layers into [`GrowingLayer`]s, in place (sliding-window layers and
    others keep their class); columns already cached move into a buffer at the next update. Returns ``cache``."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
    return cache


def growing_cache(model) -> DynamicCache:
    """A `DynamicCache` for ``model`` whose full-attention layers are [`GrowingLayer`]s."""
    return use_growing_layers(DynamicCache(config=model.config.get_text_config(decoder=True)))


SUPPORTED_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer)


class UnsupportedCacheError(ValueError):
    """The target's cache cannot hold a tree verification (static, quantized, offloaded, ...)."""


def check_cache_supported(cache: Cache | None) -> None:
    """Raise `UnsupportedCacheError` unless ``cache`` is a plain `DynamicCache` with full or sliding-window layers."""
    if cache is None:
        return
    name = type(cache).__name__
    if type(cache) is not DynamicCache:
        kind = "static" if "Static" in name else "quantized" if "Quantized" in name else name
        raise UnsupportedCacheError(
            f"Tree speculative decoding needs a DynamicCache on the target, got a {kind} cache ({name}). "
            "Drop `cache_implementation` (or pass `cache=DynamicCache(config=model.config)`)."
        )
    if getattr(cache, "offloading", False):
        raise UnsupportedCacheError(
            "Tree speculative decoding does not support offloaded caches (cache_implementation='offloaded'): the "
            "accepted rows are gathered in place after every round. Use the default dynamic cache."
        )
    for index, layer in enumerate(cache.layers):
        if type(layer) not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedCacheError(
                f"Tree speculative decoding supports full-attention and sliding-window cache layers only; layer "
                f"{index} of the target's cache is a {type(layer).__name__}."
            )


def prepare_cache_for_tree(cache: DynamicCache) -> None:
    """Make the sliding-window layers keep their rows until `compact_cache` crops them (call after the prefill)."""
    check_cache_supported(cache)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()


def finish_cache_after_tree(cache: DynamicCache) -> None:
    """Switch past recording off again (the crops already trimmed every sliding-window layer to its window)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.record_past = False


def keep_accepted(cache: DynamicCache, num_nodes: int, index: torch.LongTensor) -> None:
    """After a verification forward of ``num_nodes`` nodes per row, keep node ``index[b, j]`` of row ``b`` in the new
    column ``L + j`` and drop the rest, in place.

    Args:
        cache: the target cache right after the forward (``L`` columns before it).
        num_nodes: tree nodes per row appended by that forward.
        index (`torch.LongTensor` of shape `[B, m]`): per row, the root and accepted nodes in increasing order,
            right-aligned (earlier columns repeat the root; they become holes). One row: its path, `[1, a + 1]`.
    """
    width = int(index.shape[1])
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if isinstance(layer, DynamicSlidingWindowLayer) and not layer.record_past:
            raise RuntimeError("call prepare_cache_for_tree before verifying a tree on a sliding-window layer")
        base = layer.keys.shape[-2] - num_nodes
        columns = index.to(layer.keys.device) + base
        if not bool((columns == torch.arange(base, base + width, device=columns.device)).all()):
            layer.keys[:, :, base : base + width] = _gather_columns(layer.keys, columns)
            layer.values[:, :, base : base + width] = _gather_columns(layer.values, columns)
        # crop also trims sliding-window layers back to their window and fixes their cumulative length
        layer.crop(-(num_nodes - width))


def compact_cache(cache: DynamicCache, num_nodes: int, keep: torch.LongTensor) -> None:
    """`keep_accepted` for a single row: keep the tree nodes ``keep`` (`[a]`, increasing) of the last ``num_nodes``."""
    keep_accepted(cache, num_nodes, keep[None])


def _gather_columns(tensor: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """`[B, h, L, d]` -> `[B, h, L', d]`, column ``index[b, j]`` (`[B, L']`) of row ``b``."""
    batch, heads, _, dim = tensor.shape
    return tensor.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], dim))


def gather_cache_columns(cache: DynamicCache, index: torch.LongTensor) -> None:
    """Re-lay every layer's columns: row ``b`` keeps columns ``index[b]`` (`[B, L']`), in that order (full-attention
    layers only: the batched loop's cache)."""
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


def full_layer_cache() -> DynamicCache:
    """A `DynamicCache` whose layers are all plain (full) `DynamicLayer`s, created lazily by the first forward.

    Holes break the "column index = position" assumption of sliding-window layers, so the batched loop runs on such
    a cache and applies each window in the masks, by position (more memory, same outputs).
    """
    return DynamicCache()
