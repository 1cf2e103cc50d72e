"""The draft's own key/value cache: one entry per specialist layer (each specialist has its own projections)."""

from __future__ import annotations

import torch

from .kv_storage import write_columns


class PosSDraftCache:
    """Keys/values of the accepted context, one entry per specialist.

    ``keys[s]`` / ``values[s]``: `[B, kv_heads, L_s, head_dim]` or None; specialists may lag behind each other (a
    specialist catches up on the context pairs it has not seen when it is next used). They are the first ``L_s``
    columns of a larger storage that later appends write into (after column ``L_s``, never before it); tensors
    assigned to them from outside are taken as the context as they are.
    """

    def __init__(self, num_specialists: int):
        self.keys: list[torch.Tensor | None] = [None] * num_specialists
        self.values: list[torch.Tensor | None] = [None] * num_specialists
        # per specialist, the (keys, values) storage `[B, kv, capacity, D]` that ``keys[s]`` / ``values[s]`` are the
        # first ``L_s`` columns of: appends write into it instead of copying the whole context every round
        self._stores: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_specialists

    def get_seq_length(self, specialist: int = 0) -> int:
        keys = self.keys[specialist]
        return 0 if keys is None else keys.shape[-2]

    def update(self, specialist: int, keys: torch.Tensor, values: torch.Tensor):
        """Append `[B, kv, T, D]` keys/values; return the full keys/values of that specialist."""
        length = self.get_seq_length(specialist)
        self.keys[specialist], self.values[specialist] = self._write(specialist, length, keys, values)
        return self.keys[specialist], self.values[specialist]

    def with_tail(self, specialist: int, start: int, keys: torch.Tensor, values: torch.Tensor):
        """The context's keys/values followed by temporary rows, without adding those rows to the context.

        Writes `[B, kv, T, D]` ``keys`` / ``values`` at tail rows ``start .. start + T - 1`` (tail row 0 follows the
        context's last column; rows before ``start`` must have been written by earlier calls since the last
        `update`) and returns `[B, kv, L + start + T, D]` views: context then tail. The next `update` overwrites
        the tail. A draft round keeps its tree rows there, so no level copies the context.
        """
        return self._write(specialist, self.get_seq_length(specialist) + start, keys, values)

    def _write(self, specialist: int, at: int, keys: torch.Tensor, values: torch.Tensor):
        """Write keys/values at column ``at`` of the specialist's storage (`kv_storage.write_columns`; columns before
        ``at`` kept) and return views of its columns ``0 .. at + T - 1``; the context stays the first ``L_s``."""
        current = self.keys[specialist]
        held = None if current is None else (current, self.values[specialist])
        storage, keys, values = write_columns(self._stores[specialist], held, at, keys, values)
        if storage is not self._stores[specialist]:
            self._stores[specialist] = storage
            if current is not None:  # the context now lives in the new storage
                length = current.shape[-2]
                self.keys[specialist] = storage[0][..., :length, :]
                self.values[specialist] = storage[1][..., :length, :]
        return keys, values

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows ``rows`` (`[B']`) of every specialist."""
        for s, keys in enumerate(self.keys):
            if keys is not None:
                self.keys[s], self.values[s] = keys[rows], self.values[s][rows]
            self._stores[s] = None

    def gather_columns(self, specialist: int, index: torch.LongTensor) -> None:
        """Row ``b`` of ``specialist`` keeps columns ``index[b]`` (`[B, L']`), in that order."""
        keys, values = self.keys[specialist], self.values[specialist]
        gather = index[:, None, :, None].expand(keys.shape[0], keys.shape[1], index.shape[1], keys.shape[3])
        self.keys[specialist], self.values[specialist] = keys.gather(2, gather), values.gather(2, gather)
        self._stores[specialist] = None
