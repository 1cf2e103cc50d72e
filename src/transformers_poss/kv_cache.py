"""The target's KV cache during tree verification.

A verification forward appends all ``n`` tree nodes to the target's `DynamicCache`; only the root and the accepted
path are kept afterwards. The accepted rows are not contiguous in the tree block, so they are gathered into place
right after the prefix and the rest is cropped.

Supported layers: `DynamicLayer` and `DynamicSlidingWindowLayer` (Gemma 3, Mistral-style sliding windows). A
sliding-window layer keeps only its last ``window - 1`` rows, so a tree forward would evict context rows still
needed when only part of the tree is accepted: its past recording is switched on (see `prepare_cache_for_tree`), so
that it keeps every row until the compaction crops it back to the window.

Static, quantized, offloaded and encoder-decoder caches, and linear-attention or indexed layers, are refused with a
clear error.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


SUPPORTED_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)


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


def compact_cache(cache: DynamicCache, num_nodes: int, keep: torch.LongTensor) -> None:
    """Keep only the tree nodes ``keep`` among the last ``num_nodes`` cached rows, in place.

    Args:
        cache: the target cache right after a verification forward over ``num_nodes`` tree nodes.
        num_nodes: tree nodes appended by that forward.
        keep (`torch.LongTensor` of shape `[a]`): node indices to keep, increasing (root and accepted path).
    """
    num_keep = int(keep.shape[0])
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if isinstance(layer, DynamicSlidingWindowLayer) and not layer.record_past:
            raise RuntimeError("call prepare_cache_for_tree before verifying a tree on a sliding-window layer")
        rows_before = layer.keys.shape[-2] - num_nodes
        src = keep.to(layer.keys.device) + rows_before
        dst = torch.arange(rows_before, rows_before + num_keep, device=layer.keys.device)
        if not torch.equal(src, dst):
            layer.keys.index_copy_(-2, dst, layer.keys.index_select(-2, src))
            layer.values.index_copy_(-2, dst, layer.values.index_select(-2, src))
        # crop also trims sliding-window layers back to their window and fixes their cumulative length
        layer.crop(-(num_nodes - num_keep))


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


def _to_4d(mask: torch.BoolTensor, dtype: torch.dtype | None) -> torch.Tensor:
    mask = mask[None, None]
    if dtype is None:
        return mask
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


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
        return _to_4d(_layer_mask(tree_mask, depths, past_length, *sizes[0], context_mask), dtype)
    if layer_types is None or len(layer_types) != len(sizes):
        raise UnsupportedCacheError(
            "The target's cache layers see different key ranges but its config has no `layer_types` to name one "
            "mask per layer type; tree verification cannot build its attention masks."
        )
    masks = {}
    for layer_type, size in zip(layer_types, sizes):
        if layer_type in masks:
            continue
        masks[layer_type] = _to_4d(_layer_mask(tree_mask, depths, past_length, *size, context_mask), dtype)
    return masks
