"""A `DynamicCache` whose full-attention layers grow in place: appending a token copies that token only.

transformers' `DynamicLayer` appends with ``torch.cat``, which copies the whole cache of the layer at every step:
``2 x layers x kv_heads x head_dim x 4`` bytes per cached position and row (46 KB for SmolLM2-135M), so a batch of
32 rows at 400 positions copies about 590 MB per decoding step. On a CPU that copy is most of a step (measured:
260 ms of copies in a 340 ms step at batch 32 with one thread). [`GrowingLayer`] keeps the keys and values in a
buffer whose capacity doubles when full and returns views of its filled part, so a step writes only its new columns.

Meant for plain batched decoding (self-distillation in `training.distill`): a crop followed by an update writes the
cropped columns again in place, which a caller still holding the longer views would see.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_CAPACITY = 64  # columns allocated at first use


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose ``keys`` / ``values`` (`[B, kv_heads, L, head_dim]`) are views of buffers of capacity
    ``>= L``; the capacity doubles when an update does not fit. Same values as `DynamicLayer`, column by column."""

    _storage: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        needed = length + key_states.shape[-2]
        storage = self._storage if self._owns(self.keys, key_states) else None
        if storage is None or needed > storage[0].shape[-2]:
            capacity = max(needed, MIN_CAPACITY, 2 * (storage[0].shape[-2] if storage is not None else 0))
            storage = tuple(new.new_empty(*new.shape[:-2], capacity, new.shape[-1]) for new in (key_states, value_states))
            if length:  # keys / values replaced by other code (e.g. a row selection) are copied in once
                storage[0][..., :length, :] = self.keys
                storage[1][..., :length, :] = self.values
            self._storage = storage
        storage[0][..., length:needed, :] = key_states
        storage[1][..., length:needed, :] = value_states
        self.keys, self.values = storage[0][..., :needed, :], storage[1][..., :needed, :]
        return self.keys, self.values

    def _owns(self, keys: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether ``keys`` still is the filled part of this layer's buffer, with the rows / heads / dtype of ``new``."""
        storage = self._storage
        if storage is None:
            return False
        buffer = storage[0]
        same_layout = buffer.shape[:-2] == new.shape[:-2] and buffer.dtype == new.dtype and buffer.device == new.device
        return same_layout and (keys.numel() == 0 or keys.data_ptr() == buffer.data_ptr())

    def reset(self) -> None:
        self._storage = None
        super().reset()


def growing_cache(model) -> DynamicCache:
    """A `DynamicCache` for ``model`` whose full-attention layers are [`GrowingLayer`]s (sliding-window layers and
    others keep transformers' own class)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
