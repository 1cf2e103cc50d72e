"""Keys/values kept as views of a storage that grows by doubling: appends write their new columns only.

Used by the target's cache during speculation (`target_cache.GrowingLayer`) and by the draft's per-specialist cache
(`draft_cache.PosSDraftCache`), which also keeps a round's tree rows after the context there.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # columns allocated at first use

Storage = tuple[torch.Tensor, torch.Tensor]


def write_columns(storage: Storage | None, held: Storage | None, at: int, keys: torch.Tensor, values: torch.Tensor):
    """Write `[..., T, D]` ``keys`` / ``values`` at column ``at`` and return ``(storage, keys, values)``: the storage
    (`[..., capacity, D]` each) and views of its columns ``0 .. at + T - 1``.

    Args:
        storage: the current storage, or None.
        held: the keys/values the caller holds (None when it holds none). When they are no longer views of
            ``storage`` (replaced by other code: a row selection, a gather), they are the columns ``0 .. at - 1``
            to keep, copied once into a new storage; otherwise those columns are read from ``storage``.
        at: the first column written; columns before it are kept, columns after ``at + T`` are not read.

    The storage is replaced (capacity doubled past what is needed) when it does not fit, or when its rows, heads,
    dtype or device differ from ``keys``.
    """
    end = at + keys.shape[-2]
    owned = storage is not None and storage[0].shape[:-2] == keys.shape[:-2] and storage[0].dtype == keys.dtype \
        and storage[0].device == keys.device \
        and (held is None or held[0].numel() == 0 or held[0].data_ptr() == storage[0].data_ptr())
    if not owned or storage[0].shape[-2] < end:
        capacity = max(MIN_CAPACITY, 2 * end)
        grown = tuple(new.new_empty(*new.shape[:-2], capacity, new.shape[-1]) for new in (keys, values))
        if at:
            source = storage if owned else held
            grown[0][..., :at, :] = source[0][..., :at, :]
            grown[1][..., :at, :] = source[1][..., :at, :]
        storage = grown
    storage[0][..., at:end, :] = keys
    storage[1][..., at:end, :] = values
    return storage, storage[0][..., :end, :], storage[1][..., :end, :]
