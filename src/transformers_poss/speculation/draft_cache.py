"""The draft's own key/value cache: one entry per specialist layer (each specialist has its own projections)."""

from __future__ import annotations

import torch


class PosSDraftCache:
    """Keys/values of the accepted context, one entry per specialist.

    ``keys[s]`` / ``values[s]``: `[B, kv_heads, L_s, head_dim]` or None; specialists may lag behind each other (a
    specialist catches up on the context pairs it has not seen when it is next used).
    """

    def __init__(self, num_specialists: int):
        self.keys: list[torch.Tensor | None] = [None] * num_specialists
        self.values: list[torch.Tensor | None] = [None] * num_specialists

    def get_seq_length(self, specialist: int = 0) -> int:
        keys = self.keys[specialist]
        return 0 if keys is None else keys.shape[-2]

    def update(self, specialist: int, keys: torch.Tensor, values: torch.Tensor):
        """Append `[B, kv, T, D]` keys/values; return the full keys/values of that specialist."""
        if self.keys[specialist] is not None:
            keys = torch.cat([self.keys[specialist], keys], dim=-2)
            values = torch.cat([self.values[specialist], values], dim=-2)
        self.keys[specialist], self.values[specialist] = keys, values
        return keys, values

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep only batch rows ``rows`` (`[B']`) of every specialist."""
        for s, keys in enumerate(self.keys):
            if keys is not None:
                self.keys[s], self.values[s] = keys[rows], self.values[s][rows]

    def gather_columns(self, specialist: int, index: torch.LongTensor) -> None:
        """Row ``b`` of ``specialist`` keeps columns ``index[b]`` (`[B, L']`), in that order."""
        keys, values = self.keys[specialist], self.values[specialist]
        gather = index[:, None, :, None].expand(keys.shape[0], keys.shape[1], index.shape[1], keys.shape[3])
        self.keys[specialist], self.values[specialist] = keys.gather(2, gather), values.gather(2, gather)
